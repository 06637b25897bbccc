"""The fleet simulation's mutable state: per replica its slots, KV occupancy (active, held,
cached, the shared instructions), prefix cache, admission queue and step loop; per session its
placement, held KV and the running turn's progress; and the records they hold, by name.
sim/fleet/engine.py's events change it."""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from enum import IntEnum

import msgspec

from sim.fleet.config import SessionRecord
from sim.fleet.sessions import SessionTokens

# The records below are msgspec Structs without GC tracking (they hold numbers only): on the
# hot path the fastest slotted records to build and read; the two heap records order field by
# field, as tuples do.

__all__ = ["CacheEntry", "Decoding", "Phase", "Prefill", "Queued", "Replica", "SessionState"]


class Phase(IntEnum):
    """A replica's step loop (priced compute)."""

    IDLE = 0
    STEP = 1  # a step with prefill in flight
    SEGMENT = 2  # a run of identical decode-only steps


class CacheEntry(msgspec.Struct, gc=False):
    """A session's context in a replica's prefix cache: its blocks past the shared prefix."""

    tokens: int
    last_use: float


class Prefill(msgspec.Struct, gc=False):
    """An admitted turn's uncached prompt in its replica's prefill queue."""

    session: int
    turn: int
    left: float  # tokens still to prefill
    s_per_token: float  # the step cost of each of its tokens
    run_id: int  # the session's admission it belongs to (an older one is stale)
    chunk: float = 0.0  # its share of the step in flight


class Queued(msgspec.Struct, order=True, frozen=True, gc=False):
    """A turn in a replica's admission queue (a heap: priority, then order of arrival)."""

    priority: float
    seq: int
    session: int
    turn: int
    ready: float


class Decoding(msgspec.Struct, order=True, frozen=True, gc=False):
    """A decoding turn in a replica's decode heap: the step position of its last token."""

    last_at: float
    seq: int
    session: int
    turn: int


class Replica:
    __slots__ = (
        "active",
        "busy",
        "cache",
        "cached",
        "context_sum",
        "decode_heap",
        "decoding",
        "free_slots",
        "held",
        "holders",
        "host",
        "host_tokens",
        "in_flight",
        "in_step",
        "index",
        "passes",
        "phase",
        "plan",
        "position",
        "prefilled",
        "prefilling",
        "queue",
        "runners",
        "running",
        "segment_at",
        "shared",
        "shared_at",
        "shared_used",
        "step_s",
        "steps",
        "version",
    )

    def __init__(self, index: int, slots: int) -> None:
        self.index = index
        self.free_slots = slots
        self.running = 0
        self.active = 0
        self.held = 0
        self.cached = 0
        self.shared = 0  # the instructions' blocks, cached once the first turn has prefilled them
        self.shared_at = math.inf  # when they are: the first turn's end of prefill
        self.shared_used = 0.0  # when a turn here last ended (the instructions' last use)
        self.decoding: dict[int, tuple[float, float]] = {}  # free compute: running session → (first token, slot free)
        self.cache: OrderedDict[int, CacheEntry] = OrderedDict()  # session → its entry, LRU first
        self.host: OrderedDict[int, int] = OrderedDict()  # slot_host_cache_tokens: session → saved tokens, oldest first
        self.host_tokens = 0  # the host cache's tokens, each saved prompt whole (its shared prefix included)
        self.holders: OrderedDict[int, int] = OrderedDict()  # paused session → held unique tokens, oldest first
        self.queue: list[Queued] = []  # a heap
        self.prefilled = 0
        self.runners: dict[int, int] = {}  # priced compute: running session → its turn, oldest admission first
        # Priced compute: the step loop's state (see sim/fleet/steps.py).
        self.prefilling: list[Prefill] = []  # first come first served
        self.decode_heap: list[Decoding] = []  # a heap: the next last token first
        self.position = 0.0  # decode steps run so far (fractional inside a decode-only segment)
        self.context_sum = 0.0  # decoding sequences' contexts (their KV reads)
        self.phase = Phase.IDLE
        self.plan: list[Prefill] = []  # the step in flight's prefill entries (each with its chunk)
        self.passes: list[Decoding] = []  # verified decoding: the step in flight's passes
        self.in_flight: set[int] = set()  # StepCost.request_round_trip: sessions whose next request is on its way
        self.step_s = 0.0  # the step's (or the segment's per-step) time
        self.segment_at = 0.0  # the segment's start
        self.version = 0  # a step event of an older version is stale
        self.in_step = False
        self.busy = 0.0
        self.steps = 0

    def used(self) -> int:
        return self.shared + self.active + self.held + self.cached

    def load(self) -> int:
        return self.running + len(self.queue)


@dataclass(slots=True)
class SessionState:
    spec: SessionTokens
    prompts: list[int]
    record: SessionRecord
    replica: int = -1
    connected_at: float = 0.0
    fresh: bool = True  # the next request is a connection's first
    held: int = 0  # unique tokens held on `replica` (or offloaded) across a pause
    resident: int = 0  # context tokens whose KV the paused response holds
    offloaded: bool = False
    slot_held: bool = False  # `held_slot`: the paused response keeps its replica's decode slot
    epoch: int = 0  # the pause's number: a TTL event of an older pause is stale
    seen: int = 0  # context tokens of the session's conversation the fleet has computed
    active: int = 0  # unique tokens the running turn holds
    running_on: int = -1  # the running turn's replica (the next turn may be routed before this one frees)
    sent_at: float = 0.0
    post_s: float = 0.0
    hint: int = 0  # prompt tokens found cached when the turn reached its replica
    admitted_at: float = 0.0
    cached_now: int = 0  # prompt tokens of the running turn found cached at admission
    run_id: int = 0  # the running turn's admission number: a prefill entry of an older one is stale
    pending_kv: int = 0  # `running_kv="grow"`: the output's KV, taken at the first token
    ready_at: float = 0.0  # the running turn's ready time (its place if it is preempted)
    requeued: bool = False  # preempted while running: its next admission continues the same turn
    first_done: bool = False  # the running turn's first token is out
    decoding: bool = False
    join_at: float = math.nan  # an offloaded turn's end of reload: when it joins the prefill queue
    prefill_s_per_token: float = 0.0  # priced compute: the running turn's prefill cost a token
    decode_context: float = 0.0  # priced compute: the decoding turn's mean context (its KV reads a step)
    decode_left: int = 0  # priced compute, verified decoding: the decoding turn's tokens still to pass
