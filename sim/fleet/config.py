"""The fleet's configuration and what a run of it reports: `FleetConfig` (the accelerators and
the serving policies, sim/fleet/engine.py's switches), a `SessionRecord` per session and the
run's `FleetRun` (counts, KV occupancy over time, per-replica work)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Annotated, Final

import msgspec
from msgspec import Meta

from prototype.config import WebSocketConfig
from sim.fleet.compute import ENGINES, StepCost
from sim.model.config import HOSTED_MODEL, ModelConfig

__all__ = ["HOLD_POLICIES", "PAUSE_CHOICES", "READ_LEAVES", "ROUTERS", "FleetConfig", "FleetRun", "SessionRecord"]

# The leaves of the nested `model` and `websocket` the fleet reads (the rest are the simulator's and the
# server's own: a capacity run does not offer them).
READ_LEAVES: Final = {
    "model": (
        "tps",
        "model_latency_s",
        "prefill_tok_per_s",
        "prefill_s_per_token_ctx",
        "concurrency_slowdown",
        "cache_generated",
        "decode_slots",
    ),
    "websocket": ("lifetime_s",),
}

HOLD_POLICIES: Final = ("hold", "ttl", "release", "offload", "minwaste")
PAUSE_CHOICES: Final = ("preserve", "discard", "swap")  # `minwaste`: InferCept's three ways to treat a paused context


ROUTERS: Final = ("affinity", "prefix", "least", "random", "hash")


COMPUTE: Final = ("priced", "free")


ADMISSIONS: Final = ("plan", "greedy")


QUEUE_ORDERS: Final = ("turn", "program")


TTL_RULES: Final = ("fixed", "reload")


RUNNING_KV: Final = ("reserve", "grow")


class FleetConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The accelerators and the serving policies: everything but the sessions and the API path.

    `model` is the comparison's model stand-in, nested whole (one leaf, one meaning, one default):
    the fleet reads its decode rate (`tps`), first-token latency, prefill rate (the free-compute
    rates; 0: free), `concurrency_slowdown`, `cache_generated` and `decode_slots` (turns running at
    once per replica, vLLM's max_num_seqs; None: unlimited). `websocket` is the server's: a
    WebSocket session reconnects at its `lifetime_s`. The fleet's own `kv_budget_tokens` is not the
    simulator's `kv_capacity_tokens`: it also holds the running turns' KV."""

    model: ModelConfig = HOSTED_MODEL
    websocket: WebSocketConfig = WebSocketConfig()

    replicas: Annotated[int, Meta(ge=1)] = 1
    compute: Annotated[
        str, Meta(description="priced: engine steps with a shared token budget; free: each turn at its own rates")
    ] = "priced"
    engine: Annotated[
        str | StepCost,
        Meta(description="priced compute: a step-cost set by name (sim/fleet/compute.py), or its values"),
    ] = "h100x8-70b"
    token_budget: Annotated[int, Meta(ge=0, description="priced: tokens a step (0 = the engine's)")] = 0
    kv_budget_tokens: Annotated[int, Meta(ge=0, description="KV capacity per replica in tokens (0 = unlimited)")] = 0
    cache_ttl_s: Annotated[float, Meta(ge=0, description="prefix-cache idle time-to-live (0 = until evicted)")] = 0.0
    prefix_ttl_s: Annotated[
        float,
        Meta(
            ge=0,
            description="the shared instructions' own prefix-cache idle time-to-live, as a breakpoint of its own on "
            "the system prefix (a 12 h breakpoint beside 30 min ones on the turns); 0: kept for the whole run",
        ),
    ] = 0.0
    hold_policy: str = "hold"
    hold_ttl_s: Annotated[float, Meta(ge=0)] = 10.0
    offload_gb_per_s: Annotated[
        float, Meta(gt=0, description="offload: the host link's bandwidth a replica, one transfer at a time (FIFO)")
    ] = 25.0
    offload_host_gb: Annotated[
        float,
        Meta(
            ge=0,
            description="offload: host memory for offloaded KV a replica (0 = unlimited); full, the least recently "
            "offloaded contexts are dropped (their sessions prefill again), or the new one is released if that "
            "cannot make room",
        ),
    ] = 0.0
    pause_mean_s: Annotated[
        float,
        Meta(ge=0, description="minwaste: the expected tool time of a pause (0: the sessions' mean tool time)"),
    ] = 0.0
    kv_bytes_per_token: Annotated[int, Meta(ge=1)] = 327_680  # 80 layers × 8 KV heads × 128 × (K, V) × 2 bytes
    preempt_held: bool = True
    held_slot: Annotated[
        bool,
        Meta(
            description="a paused response held in KV keeps its decode slot until it resumes, as a llama.cpp slot "
            "pins its sequence (docs/engine.md); off: the slot frees at the turn's end, as vLLM's does"
        ),
    ] = False
    slot_cache: Annotated[
        bool,
        Meta(
            description="a replica keeps the KV of at most decode_slots sequences, running, held or cached (a "
            "llama.cpp slot is one sequence: a turn taking a slot overwrites the last one's KV, the shared prefix "
            "aside); off: cached KV is bounded by the KV budget only (vLLM)"
        ),
    ] = False
    slot_host_cache_tokens: Annotated[
        int,
        Meta(
            ge=0,
            description="slot_cache: llama.cpp's host-RAM prompt cache (--cache-ram), in tokens, oldest save "
            "evicted first: a slot's sequence that keeps less than half its prompt for the turn taking the slot "
            "is saved there, and that turn gets its own saved context back; 0: none",
        ),
    ] = 0
    admission: Annotated[
        str, Meta(description="plan: evict only if the planned victims make room (vLLM); greedy: evict, then check")
    ] = "plan"
    evict_tail: Annotated[
        bool,
        Meta(
            description="evict by block in vLLM's free-queue order (least recently freed context first, its last "
            "block first), keeping a victim's prefix cached; off: whole entries, and a preempted context dropped"
        ),
    ] = True
    queue_order: Annotated[
        str, Meta(description="admission queue: turn (first come) or program (oldest session first, Continuum)")
    ] = "turn"
    running_kv: Annotated[
        str,
        Meta(
            description="priced: reserve a running turn's output KV at admission, or grow it at its first token "
            "and preempt the newest running turn when short (vLLM's recompute)"
        ),
    ] = "reserve"
    ttl_rule: Annotated[
        str, Meta(description="ttl policy: fixed hold_ttl_s, or reload (ski rental on the context's reload cost)")
    ] = "fixed"
    router: str = "affinity"
    prefix_load_cap: Annotated[float, Meta(ge=1)] = 1.5

    def __post_init__(self) -> None:
        if self.hold_policy not in HOLD_POLICIES:
            raise ValueError(f"hold_policy: one of {', '.join(HOLD_POLICIES)}, got {self.hold_policy!r}")
        if self.router not in ROUTERS:
            raise ValueError(f"router: one of {', '.join(ROUTERS)}, got {self.router!r}")
        for name, allowed in (
            ("compute", COMPUTE),
            ("admission", ADMISSIONS),
            ("queue_order", QUEUE_ORDERS),
            ("ttl_rule", TTL_RULES),
            ("running_kv", RUNNING_KV),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}: one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        if self.prefix_ttl_s and self.cache_ttl_s > self.prefix_ttl_s:
            raise ValueError(
                "prefix_ttl_s: the turns' entries extend the shared prefix, so they expire first: give "
                f"cache_ttl_s at most prefix_ttl_s, got {self.cache_ttl_s:g} > {self.prefix_ttl_s:g}"
            )
        if self.compute == "free" and not self.model.tps > 0:
            raise ValueError("model.tps: free compute paces each turn at its own rate, > 0")
        if self.slot_host_cache_tokens and not self.slot_cache:
            raise ValueError("slot_host_cache_tokens: a host cache of slots' prompts needs slot_cache")
        if self.slot_cache and self.model.decode_slots is None:
            raise ValueError("slot_cache: the sequences a replica keeps are its decode slots (model.decode_slots)")
        if self.running_kv == "grow" and self.compute == "free":
            raise ValueError("running_kv: grow needs priced compute (engine steps)")
        if isinstance(self.engine, str) and self.engine not in ENGINES:
            raise ValueError(f"engine: one of {', '.join(ENGINES)} or a StepCost, got {self.engine!r}")

    def step_cost(self) -> StepCost:
        """The engine's step costs, with this config's token budget if set."""
        cost = ENGINES[self.engine] if isinstance(self.engine, str) else self.engine
        return msgspec.structs.replace(cost, token_budget=self.token_budget) if self.token_budget else cost


@dataclass(slots=True)
class SessionRecord:
    index: int
    arrived_at: float = math.nan
    finished_at: float = math.nan
    ttft_s: list[float] = field(default_factory=list)
    e2e_s: list[float] = field(default_factory=list)
    admission_wait_s: list[float] = field(default_factory=list)
    model_s: float = 0.0  # time its turns spent on a replica: admission to last token
    reprefill_tokens: int = 0

    @property
    def done(self) -> bool:
        return not math.isnan(self.finished_at)


@dataclass(slots=True)
class FleetRun:
    mode: str
    sessions: list[SessionRecord]  # every session that arrived, in arrival order
    end_s: float = 0.0
    turns: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    prefilled_tokens: int = 0
    reprefill_tokens: int = 0
    preemptions: int = 0
    evicted_tokens: int = 0  # prefix-cache tokens evicted to make room (not expired ones)
    running_preemptions: int = 0  # running turns preempted for KV (`running_kv="grow"`), recomputed
    ttl_releases: int = 0
    reconnects: int = 0
    offload_bytes: int = 0
    offload_refused: int = 0  # offloads the host memory could not take: released to the prefix cache instead
    host_drops: int = 0  # offloaded contexts dropped from host memory for a newer one, prefilled again
    host_peak_bytes: int = 0  # the largest host memory holding offloaded KV on one replica
    replica_link_busy_s: list[float] = field(default_factory=list)  # time each replica's host link transferred KV
    pause_choices: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PAUSE_CHOICES, 0))  # `minwaste`
    overflow_tokens: int = 0
    kv_budget_tokens: int = 0
    kv_peak_tokens: int = 0
    kv_token_s: dict[str, float] = field(default_factory=lambda: {"active": 0.0, "held": 0.0, "cached": 0.0})
    kv_series: list[tuple[float, int, int, int]] = field(default_factory=list)  # (t, active, held, cached)
    replica_prefill_tokens: list[int] = field(default_factory=list)
    replica_busy_s: list[float] = field(default_factory=list)  # priced compute: time a replica ran steps
    replica_steps: list[int] = field(default_factory=list)  # priced compute: steps with prefill, decode segments

    def prefill_tok_per_s(self) -> list[float]:
        """Each replica's prefilled tokens over the run's length."""
        return [t / self.end_s if self.end_s > 0 else 0.0 for t in self.replica_prefill_tokens]

    def busy_share(self) -> list[float]:
        """Each replica's share of the run spent running steps (priced compute; NaN with free compute)."""
        if not self.replica_busy_s:
            return [math.nan] * len(self.replica_prefill_tokens)
        return [b / self.end_s if self.end_s > 0 else 0.0 for b in self.replica_busy_s]

    @property
    def arrived(self) -> int:
        return len(self.sessions)

    @property
    def completed(self) -> int:
        return sum(1 for s in self.sessions if s.done)
