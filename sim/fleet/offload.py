"""Offloaded KV and the choice at a pause: each replica's host memory for paused contexts and the
one link their copies share (the `offload` hold policy), and InferCept's min-waste choice between
discarding, preserving and swapping a paused context (`minwaste`). The hold policies
(sim/fleet/holds.py) and the fleet's admission call them; docs/capacity.md states the rules and what they leave out.

* **The link.** A replica's copies to and from host memory run one at a time, first issued
  first served, in both directions, as they share one PCIe link: a copy starts when the link is
  free and takes its bytes over `offload_gb_per_s`. A context's GPU KV stays taken until its
  copy out ends; a resume whose context is behind other copies waits for them before its
  reload.
* **Host memory** (`offload_host_gb` a replica, 0 = unlimited). An offload that does not fit
  drops the least recently offloaded contexts until it does (LMCache's CPU backend evicts its
  least recently used chunks to store a new one); a dropped context's session prefills it
  again at its resume, counted (`host_drops`). A context being read back is pinned until its
  copy ends. If dropping every unpinned context would not make room, nothing is dropped and the
  new context is released to the prefix cache instead, as `release` does (`offload_refused`;
  LMCache's store gives up when nothing can be evicted).
* **Min waste** (InferCept, arXiv 2402.01869): at a pause, the choice with the least GPU memory
  wasted over time, in token-seconds: preserving holds the context's KV for the expected pause;
  discarding recomputes it at the resume while it and the running turns' KV wait; swapping
  copies it out and back while the same KV waits.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Sequence
from typing import Final

from sim.fleet.config import PAUSE_CHOICES, FleetConfig, FleetRun
from sim.fleet.loop import EventLoop
from sim.fleet.sessions import SessionTokens
from sim.fleet.state import Replica, SessionState

__all__ = ["POLICY_OF", "HostLedger", "HostLink", "expected_pause_s", "min_waste"]

# A min-waste choice as the hold policy that carries it out.
POLICY_OF: Final = {"preserve": "hold", "discard": "release", "swap": "offload"}
CHOICE_OF: Final = {policy: choice for choice, policy in POLICY_OF.items()}


class HostLink:
    """One replica's host memory for offloaded contexts (tokens; `math.inf`: unlimited) and its
    one transfer link. Stored contexts are kept oldest offload first; a context being read
    back is pinned until its copy ends, then its memory is free."""

    __slots__ = ("budget", "busy", "entries", "free_at", "peak", "pinned", "stored", "used")

    def __init__(self, budget_tokens: float) -> None:
        self.budget = budget_tokens
        self.entries: OrderedDict[int, int] = OrderedDict()  # session → offloaded tokens, oldest first
        self.pinned: list[tuple[float, int]] = []  # heap of (end of its read-back, tokens)
        self.stored = 0  # tokens in `entries` (the evictable part)
        self.used = 0  # stored and pinned
        self.peak = 0
        self.free_at = 0.0  # the link's last queued copy ends
        self.busy = 0.0

    def transfer(self, now: float, seconds: float) -> float:
        """A copy of `seconds` queued on the link at `now`: when it ends."""
        self.free_at = max(now, self.free_at) + seconds
        self.busy += seconds
        return self.free_at

    def settle(self, now: float) -> None:
        """Free the contexts whose read-back has ended by `now`."""
        while self.pinned and self.pinned[0][0] <= now:
            self.used -= heapq.heappop(self.pinned)[1]

    def room_for(self, tokens: int) -> list[int] | None:
        """Room for `tokens`: the sessions whose contexts are dropped for it, oldest first, or
        None (and nothing dropped) if dropping every unpinned context would not make it."""
        if tokens > self.budget - self.used + self.stored:
            return None
        dropped = []
        while self.budget - self.used < tokens:
            s, held = self.entries.popitem(last=False)
            self.stored -= held
            self.used -= held
            dropped.append(s)
        return dropped

    def put(self, s: int, tokens: int) -> None:
        self.entries[s] = tokens
        self.stored += tokens
        self.used += tokens
        self.peak = max(self.peak, self.used)

    def take(self, s: int, until: float) -> int:
        """Session `s`'s context, read back until `until` (pinned till then)."""
        tokens = self.entries.pop(s)
        self.stored -= tokens
        heapq.heappush(self.pinned, (until, tokens))
        return tokens

    def drop(self, s: int) -> None:
        tokens = self.entries.pop(s, 0)
        self.stored -= tokens
        self.used -= tokens


def min_waste(unique: int, running: int, pause_s: float, recompute_s: float, copy_s: float) -> str:
    """InferCept's choice for a paused context of `unique` tokens (its KV after the shared
    prefix) on a replica whose running turns hold `running` tokens: the least of
    preserve = unique × pause_s (held through the expected pause), discard = recompute_s ×
    (unique + running) (its recomputation, while it and the running batch's KV wait) and swap =
    2 × copy_s × (unique + running) (copied out and back, the same KV waiting each way). Ties go
    to the earlier of preserve, discard, swap."""
    batch = unique + running
    waste = {"preserve": unique * pause_s, "discard": recompute_s * batch, "swap": 2.0 * copy_s * batch}
    return min(PAUSE_CHOICES, key=waste.__getitem__)


def expected_pause_s(config: FleetConfig, sessions: Sequence[SessionTokens]) -> float:
    """`minwaste`'s expected pause: `pause_mean_s`, or the mean of the sessions' tool times
    (their distribution's mean). 0 under the other policies, which do not read it."""
    if config.hold_policy != "minwaste":
        return 0.0
    if config.pause_mean_s > 0:
        return config.pause_mean_s
    times = [t for s in sessions for t in s.tool_times_s]
    return math.fsum(times) / len(times) if times else 0.0


class HostLedger:
    """Each replica's host memory and link: offloads, reloads, and what they cost the run."""

    def __init__(self, config: FleetConfig, run: FleetRun, loop: EventLoop, states: list[SessionState]) -> None:
        self.config = config
        self.run = run
        self.loop = loop
        self.states = states
        per_token = config.kv_bytes_per_token
        budget = math.floor(config.offload_host_gb * 1e9 / per_token) if config.offload_host_gb > 0 else math.inf
        self.links = [HostLink(budget) for _ in range(config.replicas)]
        self.copy_s_per_token = per_token / (config.offload_gb_per_s * 1e9)

    def offload(self, r: Replica, s: int, unique: int) -> float | None:
        """Session `s`'s paused context (`unique` tokens) to `r`'s host memory, its copy queued on
        the link: when the copy ends, or None (nothing changed) if the host memory cannot take it."""
        link = self.links[r.index]
        link.settle(self.loop.now)
        dropped = link.room_for(unique)
        if dropped is None:
            self.run.offload_refused += 1
            return None
        for v in dropped:  # prefilled again at its resume
            victim = self.states[v]
            victim.offloaded = False
            victim.held = victim.resident = 0
            self.run.host_drops += 1
        link.put(s, unique)
        self.states[s].offloaded = True
        self.run.offload_bytes += unique * self.config.kv_bytes_per_token
        return link.transfer(self.loop.now, unique * self.copy_s_per_token)

    def reload_s(self, r: Replica, s: int) -> float:
        """Session `s`'s offloaded context read back over `r`'s link, after the copies queued
        before it: the time from now until it is in GPU memory."""
        link = self.links[r.index]
        link.settle(self.loop.now)
        tokens = link.entries[s]
        end = link.transfer(self.loop.now, tokens * self.copy_s_per_token)
        link.take(s, end)
        return end - self.loop.now

    def drop_offloaded(self, r: Replica, s: int) -> None:
        """The offloaded context is no longer wanted (its response ended with its connection)."""
        self.links[r.index].drop(s)

    def report_links(self) -> None:
        self.run.replica_link_busy_s = [link.busy for link in self.links]
        self.run.host_peak_bytes = max((link.peak for link in self.links), default=0) * self.config.kv_bytes_per_token
