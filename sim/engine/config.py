"""What a run says about the real engine behind the model seam (docs/engine.md).

`EngineConfig` is a value like every other config: `python -m prototype.server` and
`python -m sim compare` generate their `--engine-*` options from it, and a comparison carries it
whole (`CompareConfig.engine`). ``engine_kind="none"`` (the default) keeps the simulator.
"""

from __future__ import annotations

from typing import Annotated, Final, Literal

import msgspec
from msgspec import Meta

from sim.model.kv import DEFAULT_BLOCK_TOKENS

from .slots import OnFull

__all__ = [
    "DEFAULT_CTX_PER_SLOT",
    "DIALECT_BLOCK_TOKENS",
    "DIALECT_PINNED_SLOTS",
    "DEFAULT_VERIFY_K",
    "ENGINE_KINDS",
    "EngineConfig",
    "EngineDecode",
    "EngineKind",
]

EngineKind = Literal["none", "llamacpp", "openai"]
EngineDecode = Literal["forced", "verified", "length"]
ENGINE_KINDS: Final[tuple[EngineKind, ...]] = ("none", "llamacpp", "openai")
DEFAULT_CTX_PER_SLOT: Final = 8192  # a slot's context when none is given and no workload sizes it
DEFAULT_VERIFY_K: Final = 64  # measured: docs/engine.md#verified-decoding
# Prefix reuse granularity by dialect: llama.cpp's slot reuses its KV to the token; vLLM caches
# whole blocks (16 tokens unless --block-size says otherwise). "none": the simulator's own blocks.
DIALECT_BLOCK_TOKENS: Final[dict[EngineKind, int]] = {"none": DEFAULT_BLOCK_TOKENS, "llamacpp": 1, "openai": 16}
# Whether a slot is one sequence and its KV, by dialect: llama.cpp's slot is (a paused response
# pins it; a create finds only what the slot it lands on last served); vLLM pages KV apart from
# its running sequences (a paused response frees its seat; the prefix cache follows the prompt).
DIALECT_PINNED_SLOTS: Final[dict[EngineKind, bool]] = {"none": False, "llamacpp": True, "openai": False}


class EngineConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    engine_kind: Annotated[
        EngineKind,
        Meta(
            description="the model behind the API: none (the simulator), llamacpp (a real llama.cpp engine, its own "
            "API), openai (an OpenAI-compatible completions server at --engine-url: vLLM, SGLang, llama.cpp's)",
            extra={"flag": "--engine"},
        ),
    ] = "none"
    engine_url: Annotated[
        str | None,
        Meta(description="attach to a running engine at this URL instead of starting one (openai: required)"),
    ] = None
    engine_model_name: Annotated[
        str | None,
        Meta(description="openai: the `model` of each completion (none: the first the server's /v1/models lists)"),
    ] = None
    engine_reset: Annotated[
        tuple[str, ...],
        Meta(
            description="openai: paths to POST to empty the engine's prefix cache before each mode (vLLM: "
            "/reset_prefix_cache, SGLang: /flush_cache, llama.cpp: /slots/N?action=erase per slot); none: refused"
        ),
    ] = ()
    engine_slots: Annotated[int, Meta(ge=1, description="llama.cpp --parallel: sequences decoding at once")] = 2
    engine_ctx_per_slot: Annotated[
        Annotated[int, Meta(ge=256)] | None,
        Meta(
            description="context tokens per slot (llama.cpp -c is this x slots); none: 8192, or in a comparison "
            "the workload's largest context plus the output room when that is more (docs/engine.md)"
        ),
    ] = None
    engine_threads: Annotated[int, Meta(ge=1, description="llama.cpp -t: CPU threads of the engine")] = 1
    engine_swa_full: Annotated[
        bool,
        Meta(
            description="--swa-full: full KV for Gemma's sliding-window layers, so prefix reuse and restore are whole"
        ),
    ] = True
    engine_cache_ram_mib: Annotated[
        int,
        Meta(
            ge=-1,
            description="llama.cpp --cache-ram in MiB, a host-RAM prompt cache shared by the slots (0: off, so a "
            "design's KV is what its slot keeps; -1: no limit)",
        ),
    ] = 0
    engine_decode: Annotated[
        EngineDecode,
        Meta(
            description="forced: a token-id grammar makes the engine decode the planned tokens exactly; "
            "verified: the planned tokens go to the slot --engine-verify-k at a time through the prompt path (every "
            "token's forward pass, batched: docs/engine.md); length: free decoding of the planned length (what-if: "
            "faster, but the KV holds other tokens)"
        ),
    ] = "forced"
    engine_verify_k: Annotated[
        int,
        Meta(
            ge=1, le=512, description="verified: planned tokens per forward pass (at most llama.cpp's 512-token batch)"
        ),
    ] = DEFAULT_VERIFY_K
    engine_affinity: Annotated[
        bool, Meta(description="a create turn takes the slot that last served its conversation when it is free")
    ] = True
    engine_on_full: Annotated[
        OnFull,
        Meta(
            description="when every slot is busy or pinned by a paused response: wait, drop its KV, or swap it to host"
        ),
    ] = "wait"
    engine_block_tokens: Annotated[
        Annotated[int, Meta(ge=1)] | None,
        Meta(
            description="the engine's prefix-cache granularity in tokens, which the simulator's prediction of the "
            "engine (sim validate, the fleet's contention check) uses; none: the dialect's (llamacpp: 1, its slots "
            "reuse token-exact; openai: 16, vLLM's default --block-size)"
        ),
    ] = None
    engine_startup_timeout_s: Annotated[float, Meta(gt=0, description="seconds to wait for the engine's /health")] = (
        120.0
    )

    @property
    def ctx_per_slot(self) -> int:
        """The slots' context in tokens: `engine_ctx_per_slot`, or the default when none is given."""
        return DEFAULT_CTX_PER_SLOT if self.engine_ctx_per_slot is None else self.engine_ctx_per_slot

    @property
    def prefix_block_tokens(self) -> int:
        """The granularity of the engine's prefix reuse: `engine_block_tokens`, or the dialect's."""
        if self.engine_block_tokens is not None:
            return self.engine_block_tokens
        return DIALECT_BLOCK_TOKENS[self.engine_kind]

    @property
    def pinned_slots(self) -> bool:
        """Whether the engine's slot is one sequence and its KV (`DIALECT_PINNED_SLOTS`)."""
        return DIALECT_PINNED_SLOTS[self.engine_kind]

    def __post_init__(self) -> None:
        if self.engine_kind == "openai" and self.engine_url is None:
            raise ValueError("engine_url: an OpenAI-compatible engine is attached to, never started (--engine-url)")
