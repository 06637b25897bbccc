"""The simulated accelerator's configuration, and the one place a `SimulatedModel` is built.

`ModelConfig` is what `python -m prototype.server` and a comparison (`CompareConfig.model`)
say about the model stand-in (docs/simulator.md); `build_model` turns it, with what the caller
owns (the clock, the policy, the seed, a tokenizer or prefix cache of its own), into the model.
"""

from __future__ import annotations

import math
from typing import Annotated, Final

import msgspec
from msgspec import Meta

from prototype.clock import Clock
from prototype.context.tokenizer import Tokenizer

from .accelerator import LatenessRecorder, SimulatedModel
from .kv import DEFAULT_BLOCK_TOKENS, DEFAULT_CAPACITY_TOKENS, PrefixCache
from .policy import Policy

__all__ = ["HOSTED_MODEL", "ModelConfig", "build_model"]


class ModelConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    tps: Annotated[float, Meta(ge=0, description="decode tokens/s of the simulator (0 = unpaced)")] = 1000.0
    model_latency_s: Annotated[float, Meta(ge=0, description="fixed model latency before the first token")] = 0.0
    prefill_tok_per_s: Annotated[
        float, Meta(ge=0, description="prefill tokens/s for uncached prompt tokens (0 = free)")
    ] = 0.0
    prefill_s_per_token_ctx: Annotated[
        float,
        Meta(
            ge=0,
            description="prefill seconds per uncached token per token of context it attends to (attention's share; "
            "the fleet's step cost has the same term)",
        ),
    ] = 0.0
    kv_capacity_tokens: Annotated[int, Meta(ge=1, description="the prefix cache's capacity in tokens (LRU)")] = (
        DEFAULT_CAPACITY_TOKENS
    )
    prefix_cache: Annotated[bool, Meta(description="the simulator's prefix cache (--no-prefix-cache: off)")] = True
    prefix_block_tokens: Annotated[
        int,
        Meta(
            ge=1,
            description="the prefix cache's granularity: a hit counts whole blocks of this many tokens (vLLM: 16; "
            "llama.cpp's slots: 1, token-exact)",
        ),
    ] = DEFAULT_BLOCK_TOKENS
    decode_slots: Annotated[
        Annotated[int, Meta(ge=1)] | None,
        Meta(description="turns decoding at once; more queue FIFO"),
    ] = None
    decode_jitter: Annotated[float, Meta(ge=0, description="sigma of a per-turn lognormal decode-rate factor")] = 0.0
    cache_generated: Annotated[
        bool,
        Meta(
            description="the prefix cache also keeps each turn's output as the next prompt renders it (as a real "
            "engine's KV does); --no-cache-generated: prompt blocks only"
        ),
    ] = True
    concurrency_slowdown: Annotated[
        float, Meta(ge=0, description="decode slows by 1 + this x (other turns decoding)")
    ] = 0.0
    delta_per_token: Annotated[
        bool,
        Meta(description="one delta event per token even when late (off: a late wake-up sends the tokens due in one)"),
    ] = False
    async_independent: Annotated[
        float,
        Meta(
            ge=0,
            le=1,
            description="beta async tools: share of tool-call turns whose outputs the next turn does not need, so "
            "the model decodes on while the tool runs (longrun's assumption: no public figure; docs/beta.md)",
        ),
    ] = 0.0

    def __post_init__(self) -> None:
        if self.kv_capacity_tokens < self.prefix_block_tokens:
            raise ValueError(
                f"kv_capacity_tokens {self.kv_capacity_tokens} holds no block of prefix_block_tokens "
                f"{self.prefix_block_tokens}"
            )


HOSTED_MODEL: Final = ModelConfig(model_latency_s=0.05, prefill_tok_per_s=20_000.0, async_independent=0.5)
"""The model a comparison and the fleet stand for by default: a hosted model's first-token latency and
prefill rate (docs/simulator.md), and half the beta's async tool calls independent of the next turn."""


def build_model(
    config: ModelConfig,
    *,
    clock: Clock,
    policy: Policy,
    seed: int = 0,
    tokenizer: Tokenizer | None = None,
    pace_by_turn: bool = False,
    lateness: LatenessRecorder | None = None,
    prefix_cache_type: type[PrefixCache] = PrefixCache,
) -> SimulatedModel:
    """The model `config` describes. `prefix_cache_type` is its prefix cache's class (a
    comparison memoizes it); `pace_by_turn` and `lateness` are the runtime's choices."""
    return SimulatedModel(
        clock=clock,
        policy=policy,
        tokenizer=tokenizer,
        seed=seed,
        decode_tok_per_s=config.tps if config.tps > 0 else math.inf,
        model_latency_s=config.model_latency_s,
        prefill_tok_per_s=config.prefill_tok_per_s if config.prefill_tok_per_s > 0 else math.inf,
        prefill_s_per_token_ctx=config.prefill_s_per_token_ctx,
        prefix_cache=(
            prefix_cache_type(block_tokens=config.prefix_block_tokens, capacity_tokens=config.kv_capacity_tokens)
            if config.prefix_cache
            else None
        ),
        prefix_caching=config.prefix_cache,
        decode_slots=config.decode_slots,
        concurrency_slowdown=config.concurrency_slowdown,
        decode_jitter=config.decode_jitter,
        lateness=lateness,
        pace_by_turn=pace_by_turn,
        coalesce_due=not config.delta_per_token,
        async_independent=config.async_independent,
        cache_generated=config.cache_generated,
    )
