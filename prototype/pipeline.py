"""The API service's stages of a turn, and what each one costs.

Theory of operation
-------------------
OpenAI's post names the work a turn pays outside inference: parse and validate
the request, load the conversation state, render and tokenize it, run safety
classifiers, resolve the model and route, hop to the inference service, and,
after inference, usage/billing and the store write. A WebSocket connection cache
lets validation, classifiers and the tokenizer touch only new input, reuses
routing, and overlaps billing with the next request; append mode does the
pre-inference work once per rollout and the post-inference work once at its end.

Each stage is named (`Stage`) and timed on the injected clock. Where the real API
does CPU work we do it for real (JSON decode and validation, rendering with the
o200k_base vocabulary, the hashed n-gram safety classifier); where it waits on
something we lack (a classifier accelerator, a routing service, billing, a network
hop) the wait is a named, configurable latency of a `CostProfile`, awaited on the
clock — never a hidden sleep.

Profiles:

* `local`: real CPU work only, every modeled wait zero.
* `hosted`: calibrated (docs/pipeline.md) so that per-turn overhead is
  ≈250 ms fixed + 10 µs per context token over HTTP, and ≈70 ms + 10 µs per *new*
  token over WebSocket with the connection cache, plus a 40 ms RTT and a 20 Mbps
  uplink. The split of the fixed part between stages is our own (OpenAI publishes
  percentages, not milliseconds): HTTP auth 30 + safety call 50 + routing 80 +
  inference hop 20 + billing 70 ms; WebSocket keeps only safety 50 + hop 20.
* a JSON file with any subset of the fields (unknown fields are an error), or a fit that
  `python -m sim calibrate --out` wrote (its `cost_profile`; docs/calibration.md).

`Optimizations` are the connection-cache switches, each on its own, so a
researcher can ask "what if only the token cache existed?".
"""

from __future__ import annotations

import enum
import math
from pathlib import Path
from typing import Final

import msgspec

from .schemas import StageReport

__all__ = [
    "StageReport",
    "ALL_OPTIMIZATIONS",
    "PROFILES",
    "CostProfile",
    "Optimization",
    "Stage",
    "load_profile",
]


class Stage(enum.StrEnum):
    NETWORK = "network"  # request upload + round trip (modeled)
    PARSE = "parse_validate"  # JSON decode and validation (real) + per-token service work (modeled)
    LOAD_STATE = "load_state"  # connection cache hit, or store load (real) + store round trip (modeled)
    RENDER = "render"  # chat template + BPE over the items not yet rendered (real)
    SAFETY = "safety"  # classifier over the tokens not yet classified (real) + classifier service (modeled)
    ROUTING = "routing"  # auth, model resolution and routing (modeled); reused on a WebSocket connection
    INFERENCE_HOP = "inference_hop"  # API → inference service (modeled)
    QUEUE = "queue"  # waiting for a decode slot (simulator)
    PREFILL = "prefill"  # fixed model latency + uncached tokens / prefill rate (simulator)
    DECODE = "decode"  # first token to last token, streaming included
    POST = "post_inference"  # usage/billing (modeled) + store write (real), on the critical path
    COMPACTION = "compaction"  # summarising the history (modeled call) + building the compaction item (real)


class Optimization(enum.StrEnum):
    """What the WebSocket connection cache (and append mode) may skip, each a switch."""

    # Continue from the connection cache instead of the store; a resent tool list is not re-validated.
    STATE_CACHE = "state_cache"
    TOKEN_CACHE = "token_cache"  # reuse rendered tokens; render only new items
    INCREMENTAL_SAFETY = "incremental_safety"  # classify only new tokens
    REUSE_ROUTING = "reuse_routing"  # auth and routing once per connection
    ASYNC_BILLING = "async_billing"  # billing off the critical path, overlapped with the next request


ALL_OPTIMIZATIONS: Final = frozenset(Optimization)


class CostProfile(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Modeled waits of the API service, in seconds (per token where named so)."""

    name: str = "custom"
    rtt_s: float = 0.0  # client ↔ API round trip, paid by every request and every append
    uplink_bytes_per_s: float = math.inf  # request upload
    auth_s: float = 0.0  # authentication and model configuration (per request; per connection if reused)
    routing_s: float = 0.0  # model resolution and routing (per request; per connection if reused)
    validate_s_per_token: float = 0.0  # service work per validated/rendered token beyond our real CPU work
    state_load_s: float = 0.0  # one store round trip (HTTP previous_response_id, hydration)
    safety_call_s: float = 0.0  # one call to the classifier service
    safety_s_per_token: float = 0.0  # classifier accelerator time per token classified
    inference_hop_s: float = 0.0  # API → inference service
    billing_s: float = 0.0  # usage accounting and billing after inference
    # Compaction (docs/compaction.md): a summarisation call that reads the prompt and writes the
    # summary; the summary keeps `compaction_ratio` of the dropped history's tokens.
    compaction_call_s: float = 0.0  # one summarisation call: its fixed latency
    compaction_s_per_token_read: float = 0.0  # the call's prefill of the prompt it compacts
    compaction_s_per_token_written: float = 0.0  # the call's decode of the summary
    compaction_ratio: float = 0.28  # summary tokens / dropped history tokens

    def compaction_s(self, tokens_read: int, tokens_written: int) -> float:
        return (
            self.compaction_call_s
            + self.compaction_s_per_token_read * tokens_read
            + self.compaction_s_per_token_written * tokens_written
        )

    def upload_s(self, body_bytes: int) -> float:
        return self.rtt_s + body_bytes / self.uplink_bytes_per_s


PROFILES: Final[dict[str, CostProfile]] = {
    "local": CostProfile(name="local"),
    "hosted": CostProfile(
        name="hosted",
        rtt_s=0.040,
        uplink_bytes_per_s=20e6 / 8,  # 20 Mbps
        auth_s=0.030,
        routing_s=0.080,
        validate_s_per_token=2e-6,
        state_load_s=0.020,
        safety_call_s=0.050,
        safety_s_per_token=8e-6,
        inference_hop_s=0.020,
        billing_s=0.070,
        compaction_call_s=0.050,
        compaction_s_per_token_read=5e-5,  # 20,000 tokens/s, the simulator's prefill rate in `sim compare`
        compaction_s_per_token_written=1e-3,  # 1,000 tokens/s, the default decode speed
        compaction_ratio=0.28,  # the spec's CompactResource example: 12,000 tokens out of 42,897
    ),
}


def load_profile(spec: str) -> CostProfile:
    """A built-in profile by name, a JSON file of `CostProfile` fields, or a calibration's fit file."""
    if spec in PROFILES:
        return PROFILES[spec]
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"unknown cost profile {spec!r}: use {', '.join(PROFILES)} or a JSON file")
    try:
        data = msgspec.json.decode(path.read_bytes())
        if isinstance(data, dict) and "cost_profile" in data:  # a fit (`python -m sim calibrate --out`)
            data = data["cost_profile"]
        return msgspec.convert(data, type=CostProfile)
    except msgspec.DecodeError as exc:  # ValidationError included
        raise ValueError(f"{spec}: {exc}") from None
