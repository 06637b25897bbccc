"""The composition of a real engine: started (or attached to), wrapped as a `TokenModel`, stopped.

`engine_model` is what the server's and the comparison's composition roots call when
``engine_kind`` is not ``none``; `engine_limits` is the API's view of the engine's context, so an
oversized prompt gets the API's 400 before it reaches the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Final

import aiohttp

from prototype.clock import Clock
from prototype.config import ModelLimits
from sim.model.accelerator import SimulatedModel

from .completions import CompletionsDialect, served_model
from .config import EngineConfig
from .llamacpp import LLAMACPP
from .model import Dialect, EngineModel
from .process import LlamaServer, binary_path, model_path

__all__ = [
    "CTX_STEP",
    "ENGINE_MAX_OUTPUT_TOKENS",
    "KV_BYTES_PER_TOKEN",
    "MODEL_CONTEXT",
    "check_installed",
    "ctx_for",
    "engine_limits",
    "engine_model",
    "prompt_limit",
    "slot_kv_bytes",
    "slot_limits",
]

ENGINE_MAX_OUTPUT_TOKENS = 2048  # kept free in a slot's context for the turn's output
MODEL_CONTEXT: Final = 32_768  # Gemma 3 270M's trained context: no slot reads more
# Gemma 3 270M's KV per token in llama.cpp's default f16 cache: 18 layers x (K, V) x 1 KV head of 256
# dimensions x 2 bytes = 18 KiB.
KV_BYTES_PER_TOKEN: Final = 18 * 2 * 256 * 2
CTX_STEP: Final = 256  # slot contexts are sized in steps of this many tokens


def check_installed(config: EngineConfig) -> None:
    """Raise `EngineNotInstalled` (one line naming the extra) unless the engine can be started."""
    if config.engine_kind == "llamacpp" and config.engine_url is None:
        binary_path()
        model_path()


def slot_limits(ctx_per_slot: int) -> ModelLimits:
    """The API's context limits for a slot of `ctx_per_slot` tokens (the engine's BOS takes one)."""
    window = ctx_per_slot - 1
    return ModelLimits(context_window=window, max_output_tokens=min(ENGINE_MAX_OUTPUT_TOKENS, window // 4))


def engine_limits(config: EngineConfig) -> ModelLimits:
    """The API's context limits for a slot of `config`'s engine."""
    return slot_limits(config.ctx_per_slot)


def prompt_limit(ctx_per_slot: int) -> int:
    """The longest prompt the API passes to a slot of `ctx_per_slot` tokens: its window less the
    output room it keeps free."""
    limits = slot_limits(ctx_per_slot)
    assert limits.context_window is not None and limits.max_output_tokens is not None
    return limits.context_window - limits.max_output_tokens


def ctx_for(prompt_tokens: int) -> int:
    """The smallest slot context, a multiple of `CTX_STEP`, whose prompt limit takes `prompt_tokens`."""
    ctx = CTX_STEP
    while prompt_limit(ctx) < prompt_tokens:
        ctx += CTX_STEP
    return ctx


def slot_kv_bytes(ctx_per_slot: int) -> int:
    """The KV cache of one slot of `ctx_per_slot` tokens, with `--swa-full` (every layer keeps
    every token; without it Gemma's sliding-window layers keep less)."""
    return ctx_per_slot * KV_BYTES_PER_TOKEN


@contextlib.asynccontextmanager
async def engine_model(config: EngineConfig, *, planner: SimulatedModel, clock: Clock) -> AsyncIterator[EngineModel]:
    """An `EngineModel` for the block: the llama.cpp server started (or attached to at
    ``engine_url``), and stopped by PID after; an OpenAI-compatible server is attached to."""
    server: LlamaServer | None = None
    url = config.engine_url
    if url is None:
        server = LlamaServer(config)
        await asyncio.to_thread(server.start)
        url = server.url
    url = url.rstrip("/")
    dialect: Dialect = LLAMACPP
    if config.engine_kind == "openai":
        async with aiohttp.ClientSession() as session:
            name = config.engine_model_name or await served_model(session, url)
        dialect = CompletionsDialect(name, config.engine_reset)
    model = EngineModel(planner=planner, url=url, config=config, clock=clock, dialect=dialect)
    model.server = server
    try:
        yield model
    finally:
        await model.aclose()
        if server is not None:
            await asyncio.to_thread(server.stop)
