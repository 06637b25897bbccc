"""The fleet simulation's mutable state: per replica its slots, KV occupancy (active, held,
cached, the shared instructions), prefix cache, admission queue and step loop; per session its
placement, held KV and the running turn's progress. sim/fleet/engine.py's events change it."""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

from sim.fleet.config import SessionRecord
from sim.fleet.sessions import SessionTokens

__all__ = ["Replica", "SessionState"]


class Replica:
    __slots__ = (
        "active",
        "busy",
        "cache",
        "cached",
        "ctx_sum",
        "decoding",
        "dheap",
        "free_slots",
        "held",
        "holders",
        "in_step",
        "index",
        "phase",
        "plan",
        "pos",
        "prefilled",
        "prefilling",
        "queue",
        "runners",
        "running",
        "seg_t",
        "shared",
        "shared_at",
        "steps",
        "tau",
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
        self.decoding: dict[int, tuple[float, float]] = {}  # free compute: running session → (first token, slot free)
        self.cache: OrderedDict[int, list[float]] = OrderedDict()  # session → [unique tokens, last use], LRU first
        self.holders: OrderedDict[int, int] = OrderedDict()  # paused session → held unique tokens, oldest first
        self.queue: list[tuple[float, int, int, int, float]] = []  # heap of (priority, seq, session, turn, ready at)
        self.prefilled = 0
        self.runners: dict[int, int] = {}  # priced compute: running session → its turn, oldest admission first
        # Priced compute: the step loop's state (see _Fleet.schedule).
        self.prefilling: list[list[float]] = []  # FCFS: [session, turn, tokens left, s per token, run id]
        self.dheap: list[tuple[float, int, int, int]] = []  # decoding: (position of its last token, seq, session, turn)
        self.pos = 0.0  # decode steps run so far (fractional inside a decode-only segment)
        self.ctx_sum = 0.0  # decoding sequences' contexts (their KV reads)
        self.phase = 0  # 0 idle, 1 a step with prefill in flight, 2 a decode-only segment
        self.plan: list[tuple[list[float], float]] = []  # the step in flight: (prefill entry, chunk)
        self.tau = 0.0  # the step's (or the segment's per-step) time
        self.seg_t = 0.0  # the segment's start
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
    dctx: float = 0.0  # priced compute: the decoding turn's mean context
