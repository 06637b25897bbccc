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

The stage-cost table
--------------------
`STAGE_COSTS` is the one statement of which modeled wait a turn pays: per row, the stage that
waits, the `CostProfile` field, the count it multiplies (`Count`: once, the request's bytes, the
tokens rendered or classified, ...), the occasion that pays it (`Occasion`: every upload, a new
request, a store load, the response's end, a compaction) and the `Optimization` that lets a
WebSocket connection skip it. `DESIGNS` says, per design (the harness's modes), which path each
turn takes (`TurnPath`), and `pays` reads a row against a path. The live path waits per stage
with `CostProfile.stage_s` (its control flow is the occasions: a resume never reaches routing),
and the two models of the turn that have no server to run, the fleet's per-turn formula
(sim/fleet/costs.py) and calibration's design matrix (sim/analysis/calibrate.py), sum the rows a
path pays, so a fitted coefficient and a profile field mean one thing. A new design declares its
`Design` here; its rows follow.
"""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal

import msgspec

from .wire.schemas import StageReport

__all__ = [
    "StageReport",
    "ALL_OPTIMIZATIONS",
    "AFTER_FIRST_TOKEN",
    "DESIGNS",
    "MODEL_COSTS",
    "PROFILES",
    "STAGE_COSTS",
    "STAGE_ROWS",
    "STAGE_SWITCH",
    "CostProfile",
    "Count",
    "Design",
    "FitProfile",
    "Occasion",
    "Optimization",
    "Stage",
    "StageCost",
    "TurnPath",
    "design_paths",
    "load_profile",
    "pays",
    "profile_gaps",
    "turn_s",
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
# What a cached context saves: the switches an Agents API session's runner uses for its own copy
# of the last turn's context (docs/agents-api.md); auth, routing and billing stay per request.
CONTEXT_CACHE: Final = frozenset({Optimization.STATE_CACHE, Optimization.TOKEN_CACHE, Optimization.INCREMENTAL_SAFETY})


class Count(enum.StrEnum):
    """What a stage-cost row's field multiplies (a rate's field divides it)."""

    ONCE = "once"
    BYTES = "bytes"  # the request's (or the resume's) body bytes
    TOKENS_RENDERED = "tokens_rendered"  # tokens the API rendered for the turn
    TOKENS_CLASSIFIED = "tokens_classified"  # tokens the safety classifier read for the turn
    TOKENS_COMPACTED = "tokens_compacted"  # the prompt a compaction call reads
    TOKENS_SUMMARISED = "tokens_summarised"  # the summary it writes
    TOKENS_PREFILLED = "tokens_prefilled"  # prompt tokens the model prefilled (not cached, not held)
    # Each prefilled token times the context it attends to: uncached × (cached + uncached / 2).
    PREFILL_CONTEXT = "prefill_context"
    TOKENS_AFTER_FIRST = "tokens_after_first"  # output tokens decoded after the first


class Occasion(enum.StrEnum):
    """When a turn pays a row."""

    UPLOAD = "upload"  # every request, and every resume of a held response
    REQUEST = "request"  # a new response (not a held response's resume)
    STORE_LOAD = "store_load"  # a request continuing a previous response by its id
    RESPONSE_END = "response_end"  # the response's end (a held response's: its last turn)
    COMPACTION = "compaction"  # a compaction of the context


@dataclass(frozen=True, slots=True)
class StageCost:
    """One modeled wait: `stage` waits `field` × `count` (`count` / `field` for a rate), on each
    `occasion`; on a WebSocket connection with `switch` on it is not on the critical path
    (reuse_routing: after the connection's first request; state_cache: the connection's cache
    holds the previous turn; async_billing: overlapped with the client's next request)."""

    stage: Stage
    field: str  # a CostProfile field
    count: Count
    occasion: Occasion
    switch: Optimization | None = None
    rate: bool = False


STAGE_COSTS: Final[tuple[StageCost, ...]] = (
    StageCost(Stage.NETWORK, "rtt_s", Count.ONCE, Occasion.UPLOAD),
    StageCost(Stage.NETWORK, "uplink_bytes_per_s", Count.BYTES, Occasion.UPLOAD, rate=True),
    StageCost(Stage.LOAD_STATE, "state_load_s", Count.ONCE, Occasion.STORE_LOAD, Optimization.STATE_CACHE),
    StageCost(Stage.RENDER, "validate_s_per_token", Count.TOKENS_RENDERED, Occasion.UPLOAD),
    StageCost(Stage.SAFETY, "safety_call_s", Count.ONCE, Occasion.UPLOAD),
    StageCost(Stage.SAFETY, "safety_s_per_token", Count.TOKENS_CLASSIFIED, Occasion.UPLOAD),
    StageCost(Stage.ROUTING, "auth_s", Count.ONCE, Occasion.REQUEST, Optimization.REUSE_ROUTING),
    StageCost(Stage.ROUTING, "routing_s", Count.ONCE, Occasion.REQUEST, Optimization.REUSE_ROUTING),
    StageCost(Stage.INFERENCE_HOP, "inference_hop_s", Count.ONCE, Occasion.REQUEST),
    StageCost(Stage.POST, "billing_s", Count.ONCE, Occasion.RESPONSE_END, Optimization.ASYNC_BILLING),
    StageCost(Stage.COMPACTION, "compaction_call_s", Count.ONCE, Occasion.COMPACTION),
    StageCost(Stage.COMPACTION, "compaction_s_per_token_read", Count.TOKENS_COMPACTED, Occasion.COMPACTION),
    StageCost(Stage.COMPACTION, "compaction_s_per_token_written", Count.TOKENS_SUMMARISED, Occasion.COMPACTION),
)
# The model's own costs in the same shape (fields of the model stand-in's config,
# sim/model/config.py), paid by every model segment: a request's and a held response's resume.
MODEL_COSTS: Final[tuple[StageCost, ...]] = (
    StageCost(Stage.PREFILL, "model_latency_s", Count.ONCE, Occasion.UPLOAD),
    StageCost(Stage.PREFILL, "prefill_tok_per_s", Count.TOKENS_PREFILLED, Occasion.UPLOAD, rate=True),
    StageCost(Stage.PREFILL, "prefill_s_per_token_ctx", Count.PREFILL_CONTEXT, Occasion.UPLOAD),
    StageCost(Stage.DECODE, "tps", Count.TOKENS_AFTER_FIRST, Occasion.UPLOAD, rate=True),
)
# The switch that lets a WebSocket connection skip a stage's waits (one per stage: a test checks).
STAGE_SWITCH: Final[dict[Stage, Optimization]] = {r.stage: r.switch for r in STAGE_COSTS if r.switch is not None}
# Each stage's rows of STAGE_COSTS, in the table's order (what `CostProfile.stage_s` sums).
STAGE_ROWS: Final[dict[Stage, tuple[StageCost, ...]]] = {
    stage: tuple(r for r in STAGE_COSTS if r.stage is stage) for stage in Stage
}
# Stages after the first token; the rest of a turn's waits come before it.
AFTER_FIRST_TOKEN: Final = frozenset({Stage.DECODE, Stage.POST})


@dataclass(frozen=True, slots=True)
class TurnPath:
    """What one model turn is to the API: over which transport, whether it resumes a held
    response, continues a previous one by its id, is on a connection that has routed before,
    and ends its response."""

    transport: Literal["http", "ws"]
    resumed: bool
    continued: bool
    routed: bool
    ends: bool

    @property
    def whole_context(self) -> bool:
        """The turn renders and classifies the whole context: over HTTP, or a connection's first request."""
        return not self.routed


@dataclass(frozen=True, slots=True)
class Design:
    """How a design's turns reach the API: the transport, and how turn k > 0 carries its history
    (`full`: the whole history again; `previous`: previous_response_id; `held`: the same
    response, paused at the tool call and resumed)."""

    transport: Literal["http", "ws"]
    history: Literal["full", "previous", "held"]

    def path(self, k: int, *, fresh: bool = False, last: bool = False) -> TurnPath:
        """Turn `k`'s path; `fresh`: a WebSocket design's first request on a new connection (a
        reconnect), which carries the whole history as a first turn does; `last`: the rollout's
        last turn (a held response ends there)."""
        first = k == 0 or (fresh and self.transport == "ws")
        return TurnPath(
            transport=self.transport,
            resumed=self.history == "held" and not first,
            continued=self.history == "previous" and not first,
            routed=(self.transport == "ws" or self.history == "held") and not first,
            ends=self.history != "held" or last,
        )


DESIGNS: Final[dict[str, Design]] = {
    "http": Design("http", "full"),
    "http_prev": Design("http", "previous"),
    "ws": Design("ws", "previous"),
    "append": Design("ws", "held"),
    "inject": Design("ws", "held"),
    "async": Design("ws", "held"),
    "steer": Design("ws", "held"),
    # The Agents API (docs/agents-api.md): a session's turn is one held response; each tool result
    # is a POST, so the response's end is billed on the path as over HTTP.
    "agents": Design("http", "held"),
}


def pays(row: StageCost, path: TurnPath, optimizations: frozenset[Optimization] = ALL_OPTIMIZATIONS) -> bool:
    """Whether a turn on `path` pays `row` on its critical path (a compaction is its own occasion:
    never part of a turn's rule)."""
    skip = path.transport == "ws" and row.switch is not None and row.switch in optimizations
    match row.occasion:
        case Occasion.UPLOAD:
            return True
        case Occasion.REQUEST:
            return not path.resumed and not (skip and path.routed)
        case Occasion.STORE_LOAD:
            return path.continued and not skip
        case Occasion.RESPONSE_END:
            return path.ends and not skip
        case Occasion.COMPACTION:
            return False


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

    def row_s(self, row: StageCost, counts: Mapping[Count, float]) -> float:
        """One row's wait for `counts` (ONCE needs no count)."""
        n = 1.0 if row.count is Count.ONCE else counts.get(row.count)
        if n is None:
            raise ValueError(f"{row.stage}: {row.field} needs the count {row.count}")
        value = float(getattr(self, row.field))
        return n / value if row.rate else value * n

    def stage_s(self, stage: Stage, counts: Mapping[Count, float] | None = None) -> float:
        """The stage's modeled wait: the sum of its rows for `counts` (a row paid once is taken
        from the profile's table, `_stage_terms`)."""
        last = _last_terms  # the table of the profile asked before, found by identity (no hash of the profile)
        terms = last[1] if last[0] is self else _stage_terms(self)
        total = 0.0
        for row, once in terms[stage]:
            total += self.row_s(row, counts or {}) if once is None else once
        return total

    def compaction_s(self, tokens_read: int, tokens_written: int) -> float:
        counts = {Count.TOKENS_COMPACTED: float(tokens_read), Count.TOKENS_SUMMARISED: float(tokens_written)}
        return self.stage_s(Stage.COMPACTION, counts)

    def upload_s(self, body_bytes: int) -> float:
        return self.stage_s(Stage.NETWORK, {Count.BYTES: float(body_bytes)})


_StageTerms = dict[Stage, tuple[tuple[StageCost, float | None], ...]]
_last_terms: tuple[CostProfile | None, _StageTerms] = (None, {})


def _stage_terms(profile: CostProfile) -> _StageTerms:
    """Each stage's rows, in `STAGE_ROWS` order, with the wait of a row paid once (`row_s` of no
    count: it depends on the profile alone), None for a row that needs its count; kept as the
    last profile's table (a process serves one profile at a time)."""
    global _last_terms
    terms = {
        stage: tuple((row, profile.row_s(row, {}) if row.count is Count.ONCE else None) for row in rows)
        for stage, rows in STAGE_ROWS.items()
    }
    _last_terms = (profile, terms)
    return terms


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


def turn_s(
    profile: CostProfile,
    path: TurnPath,
    counts: Mapping[Count, float],
    optimizations: frozenset[Optimization] = ALL_OPTIMIZATIONS,
) -> tuple[float, float]:
    """A turn's modeled waits on `path`: before its first token, and after its last (blocking
    billing), from the rows it pays (`pays`)."""
    pre = post = 0.0
    for row in STAGE_COSTS:
        if pays(row, path, optimizations):
            if row.stage in AFTER_FIRST_TOKEN:
                post += profile.row_s(row, counts)
            else:
                pre += profile.row_s(row, counts)
    return pre, post


def design_paths(designs: Iterable[str]) -> list[TurnPath]:
    """Every path a turn of these designs can take (first, later, last, after a reconnect)."""
    out: list[TurnPath] = []
    for name in designs:
        if name not in DESIGNS:
            raise ValueError(f"unknown design {name!r}; the stage-cost table knows {', '.join(DESIGNS)}")
        d = DESIGNS[name]
        out += [d.path(k, fresh=fresh, last=last) for k in (0, 1) for fresh in (False, True) for last in (False, True)]
    return out


def profile_gaps(
    unidentified: Iterable[str],
    sums: Iterable[Sequence[str]],
    designs: Iterable[str],
    *,
    compaction: bool = False,
    optimizations: frozenset[Optimization] = ALL_OPTIMIZATIONS,
) -> list[str]:
    """What a fitted profile leaves open that a run of `designs` needs: an unidentified field one
    of their paths pays (a compaction's, when the run compacts), or a sum of fields identified
    only together whose split the designs pay differently (some paths pay part of it). Empty:
    the fit is usable for that run."""
    paths = design_paths(designs)
    rows = {r.field: r for r in (*STAGE_COSTS, *MODEL_COSTS)}
    needed = {
        r.field
        for r in rows.values()
        if any(pays(r, p, optimizations) for p in paths) or (compaction and r.occasion is Occasion.COMPACTION)
    }
    gaps = [f"{f} is not identified and the run pays it" for f in unidentified if f in needed]
    for group in sums:
        paid = {frozenset(f for f in group if pays(rows[f], p, optimizations)) for p in paths}
        if len(paid - {frozenset(), frozenset(group)}) > 0:
            gaps.append(f"{'+'.join(group)} is identified only as a sum and the run pays parts of it apart")
    return gaps


class FitProfile(msgspec.Struct, frozen=True, kw_only=True):
    """What `load_profile` reads of a calibration's fit file (sim/analysis/calibrate.py `FitFile`)."""

    cost_profile: dict[str, object]
    unidentified: list[str] = []
    sums: list[list[str]] = []


def load_profile(spec: str, designs: Iterable[str] | None = None, *, compaction: bool = False) -> CostProfile:
    """A built-in profile by name, a JSON file of `CostProfile` fields, or a calibration's fit file.
    A fit is refused when it is not a usable profile for a run of `designs` (every design when
    None): one that identified no wait at all, or leaves open what the run pays (`profile_gaps`)."""
    if spec in PROFILES:
        return PROFILES[spec]
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"unknown cost profile {spec!r}: use {', '.join(PROFILES)} or a JSON file")
    try:
        # Python's reader: a fit file writes an unbounded rate (no per-byte cost found) as Infinity.
        data = json.loads(path.read_bytes())
        if isinstance(data, dict) and "cost_profile" in data:  # a fit (`python -m sim calibrate --out`)
            fitted = msgspec.convert(data, type=FitProfile)
            profile = msgspec.convert(fitted.cost_profile, type=CostProfile)
        else:
            return msgspec.convert(data, type=CostProfile)
    except (msgspec.ValidationError, ValueError) as exc:  # json.JSONDecodeError is a ValueError
        raise ValueError(f"{spec}: {exc}") from None
    waits = [profile.row_s(r, {c: 1.0 for c in Count}) for r in STAGE_COSTS]
    if not any(w > 0 for w in waits):
        raise ValueError(f"{spec}: the fit identified no API wait (every one zero): not a usable profile")
    gaps = profile_gaps(fitted.unidentified, fitted.sums, designs or DESIGNS, compaction=compaction)
    if gaps:
        raise ValueError(f"{spec}: not a usable profile for this run: " + "; ".join(gaps))
    return profile
