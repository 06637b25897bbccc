"""The composition of a real engine: started (or attached to), wrapped as a `TokenModel`, stopped.

`engine_model` is what the server's and the comparison's composition roots call when
``engine_kind`` is not ``none``; `engine_limits` is the API's view of the engine's context, so an
oversized prompt gets the API's 400 before it reaches the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiohttp

from prototype.clock import Clock
from prototype.config import ModelLimits
from sim.model.accelerator import SimulatedModel

from .completions import CompletionsDialect, served_model
from .config import EngineConfig
from .llamacpp import LLAMACPP
from .model import Dialect, EngineModel
from .process import LlamaServer, binary_path, model_path

__all__ = ["ENGINE_MAX_OUTPUT_TOKENS", "check_installed", "engine_limits", "engine_model"]

ENGINE_MAX_OUTPUT_TOKENS = 2048  # kept free in a slot's context for the turn's output


def check_installed(config: EngineConfig) -> None:
    """Raise `EngineNotInstalled` (one line naming the extra) unless the engine can be started."""
    if config.engine_kind == "llamacpp" and config.engine_url is None:
        binary_path()
        model_path()


def engine_limits(config: EngineConfig) -> ModelLimits:
    """The API's context limits for a slot of `config`'s engine (its BOS takes one token)."""
    window = config.engine_ctx_per_slot - 1
    return ModelLimits(context_window=window, max_output_tokens=min(ENGINE_MAX_OUTPUT_TOKENS, window // 4))


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
