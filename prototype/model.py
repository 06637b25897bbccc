"""The seam between the API service and the (simulated) accelerator.

The service renders a conversation to model-visible token ids and hands a
`ModelRequest` to a `TokenModel`; the model streams back `ModelEvent`s. The
service never learns how the model decides what to say or how fast it says it:
the simulator in `sim/` implements this protocol, and the composition root
(`prototype/server.py`) wires it in. Nothing here does I/O.

Invariants a `TokenModel` must keep (the stream core relies on them):

* Events come as one ``Prefilled`` (how the prompt was served before the first
  token), then ``ItemStarted (TokensSampled)* ItemFinished`` groups, zero or
  more groups, then exactly one ``SamplingFinished``.
* The ``text`` of the `TokensSampled` events of one item concatenate to the
  item's full text (message text, or function-call arguments JSON). A token
  whose bytes end mid UTF-8 character carries the empty string; the completed
  character is carried by the token that completes it.
* For one ``(seed, ModelRequest)`` the token ids are identical on every run and
  independent of how the request reached the service (the "same tokens in every
  mode" invariant). The model may depend only on the fields below.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

__all__ = [
    "CacheBreakpoint",
    "FunctionTool",
    "ImplicitCacheOnly",
    "ItemFinished",
    "ItemStarted",
    "ModelEvent",
    "ModelRequest",
    "DecidesAsync",
    "ContextWindowExceeded",
    "Prefilled",
    "SamplingFinished",
    "TokenModel",
    "TokensSampled",
]

TokenArray = npt.NDArray[np.uint32]


@dataclass(frozen=True, slots=True)
class FunctionTool:
    """A client-owned function tool as the model sees it."""

    name: str
    description: str | None
    parameters_json: bytes  # the JSON Schema, verbatim from the request
    strict: bool | None = None
    is_async: bool = False  # beta `async: true`: the response need not wait for its output (docs/beta.md)


@dataclass(frozen=True, slots=True)
class CacheBreakpoint:
    """An explicit prompt-cache breakpoint (a content part's `prompt_cache_breakpoint`): the exact
    end of a reusable prompt prefix, not rounded to a KV block (docs/protocol.md#prompt-caching)."""

    tokens: int  # prompt tokens before the boundary
    ttl_s: float  # its lifetime once written: its own `ttl`, else the request's


@dataclass(frozen=True, slots=True)
class ModelRequest:
    """Everything the model may condition on for one sampled turn."""

    prompt: tuple[TokenArray, ...]  # rendered context in chunks; concatenated = model-visible prompt
    prompt_tokens: int  # sum of chunk lengths
    resident_tokens: int  # leading prompt tokens whose KV this conversation holds (append mode: kept across a pause)
    turn_index: int  # model turns already in the context (assistant messages + function calls)
    conversation_key: int  # stable per conversation (hash of its first user message): seeds the policy
    tools: tuple[FunctionTool, ...] = ()
    tool_choice: str = "auto"  # "auto" | "none" | "required" | a function name
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = None
    model: str = ""
    conversation_id: str = ""  # opaque KV-ownership handle (e.g. the response chain); not model-visible
    hold_kv: bool = False  # keep this conversation's KV pinned after the turn, until `release`
    # `prompt_cache_options.mode`: "implicit" (the model's own prefix cache, plus up to the latest
    # three breakpoints written) or "explicit" (only breakpoints: up to the latest four written,
    # none is no prompt caching). `breakpoints`: the latest 80 of the prompt, in prompt order.
    cache_mode: Literal["implicit", "explicit"] = "implicit"
    breakpoints: tuple[CacheBreakpoint, ...] = ()
    extra: dict[str, str] = field(default_factory=dict)  # reserved for simulator knobs; not model-visible


@dataclass(frozen=True, slots=True)
class Prefilled:
    """First event of a turn: how the prompt was served before the first token."""

    cached_tokens: int  # prompt tokens whose KV was reused (prefix cache or held KV), never the whole prompt
    queued_s: float = 0.0  # waited for a decode slot
    prefill_s: float = 0.0  # fixed model latency + uncached tokens / prefill rate


@dataclass(frozen=True, slots=True)
class ItemStarted:
    kind: Literal["message", "function_call"]
    name: str = ""  # function name for function calls


@dataclass(frozen=True, slots=True)
class TokensSampled:
    token_ids: tuple[int, ...]
    text: str


@dataclass(frozen=True, slots=True)
class ItemFinished:
    pass


@dataclass(frozen=True, slots=True)
class SamplingFinished:
    reason: Literal["stop", "max_output_tokens"] = "stop"


class ContextWindowExceeded(Exception):
    """Raised by a `TokenModel` before its first event when the prompt and the turn's output do
    not fit the model's context (a real engine's own limit): the response fails with
    `context_length_exceeded`, not `server_error`."""


ModelEvent = Prefilled | ItemStarted | TokensSampled | ItemFinished | SamplingFinished


class TokenModel(Protocol):
    """A token-generating model. `sample` is an async generator of `ModelEvent`; the service
    closes it (`aclose`) when it stops early, so cleanup in its `finally` runs at once."""

    def sample(self, request: ModelRequest) -> AsyncGenerator[ModelEvent, None]: ...

    def release(self, conversation_id: str) -> None:
        """Unpin KV held with `hold_kv` (it stays cached, evictable). Unknown ids are ignored."""
        ...


@runtime_checkable
class ImplicitCacheOnly(Protocol):
    """A `TokenModel` whose prompt cache cannot follow explicit breakpoints (a real engine's
    slots, sim/engine): the service refuses `prompt_cache_options.mode: "explicit"` and any
    `prompt_cache_breakpoint` before the response starts, rather than report cached tokens
    that do not follow them."""

    cache_name: str  # what its cache is, for the refusal's message (e.g. "llama.cpp's slot cache")


@runtime_checkable
class DecidesAsync(Protocol):
    """A `TokenModel` that decides whether it decodes on past its async tool calls (the beta's
    async tools, docs/beta.md#async-tools-that-overlap-decoding). A model without this method
    always waits for their outputs."""

    def decodes_on(self, request: ModelRequest, outstanding: tuple[int, ...]) -> bool:
        """Whether the turn `request` describes may be sampled now, while the outputs of async
        calls made at the turns `outstanding` (their `turn_index`, one entry per turn) are not in
        its context yet. False: the service waits for every one of them first. Must be False when
        the turn is the final answer (a turn without a function call), and must not change the
        turn's tokens: those still depend only on the fields `sample` may read."""
        ...
