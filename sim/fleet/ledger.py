"""The fleet's KV ledger: what each replica's KV budget holds (running turns' *active* KV,
paused responses' *held* KV, the prefix cache's *cached* entries), and the evictions that make
room for a turn: cache entries least recently freed first (tail blocks only with `evict_tail`:
vLLM's free-block queue order, docs/capacity.md#eviction-by-block), then other sessions' held
KV, oldest pause first, each a counted preemption (sim/fleet/engine.py's theory of operation:
the KV budget and the prefix cache)."""

from __future__ import annotations

from typing import Final

from sim.fleet.config import FleetConfig, FleetRun
from sim.fleet.state import Replica, SessionState

__all__ = ["BLOCK", "KVLedger", "floor_blocks"]

BLOCK: Final = 16  # vLLM's default KV block size (sim/model/kv.py)


def floor_blocks(tokens: int) -> int:
    """`tokens` rounded down to whole KV blocks."""
    return tokens // BLOCK * BLOCK


class KVLedger:
    """The KV accounting the fleet's event loop (sim/fleet/engine.py) builds on: fleet-wide
    totals, the run's peak and preemption counts, per-replica occupancy and prefix cache."""

    def __init__(self, config: FleetConfig, run: FleetRun) -> None:
        self.c = config
        self.budget = config.kv_budget_tokens or (1 << 62)
        self.run_ = run
        self.states: list[SessionState] = []
        self.totals = [0, 0, 0]  # fleet-wide active, held, cached (shared blocks count as cached)
        self.now = 0.0

    def add(self, r: Replica, which: int, tokens: int) -> None:
        if which == 0:
            r.active += tokens
        elif which == 1:
            r.held += tokens
        else:
            r.cached += tokens
        self.totals[which] += tokens
        if tokens > 0:
            used = r.used()
            if used > self.run_.kv_peak_tokens:
                self.run_.kv_peak_tokens = used

    def drop_entry(self, r: Replica, s: int) -> int:
        entry = r.cache.pop(s, None)
        if entry is None:
            return 0
        self.add(r, 2, -int(entry[0]))
        return int(entry[0])

    def to_cache(self, r: Replica, s: int, tokens: int) -> None:
        """Session `s`'s context of `tokens` into `r`'s prefix cache (its full blocks)."""
        self.drop_entry(r, s)
        unique = floor_blocks(tokens) - r.shared
        if unique > 0:
            r.cache[s] = [unique, self.now]
            self.add(r, 2, unique)

    def release_held(self, r: Replica, s: int, *, to_cache: bool) -> None:
        st = self.states[s]
        tokens = r.holders.pop(s)
        self.add(r, 1, -tokens)
        st.held = 0
        if st.slot_held:  # the slot goes with the KV
            st.slot_held = False
            r.free_slots += 1
        st.epoch += 1
        if to_cache:
            self.to_cache(r, s, st.resident)
        st.resident = 0

    def evict_entry(self, r: Replica, s: int, deficit: int) -> None:
        """Free `deficit` tokens of `s`'s cache entry: its tail blocks (`evict_tail`), or all of it."""
        entry = r.cache[s]
        cut = -(-deficit // BLOCK) * BLOCK
        if self.c.evict_tail and entry[0] > cut:
            entry[0] -= cut
            self.add(r, 2, -cut)
            self.run_.evicted_tokens += cut
        else:
            self.run_.evicted_tokens += self.drop_entry(r, s)

    def keep_sequences(self, r: Replica, me: int) -> None:
        """`slot_cache`: session `me` takes a slot on `r`; the slot's last sequence goes, least
        recently used cache entry first, so that running, held and cached sequences number at
        most the replica's decode slots (the shared prefix stays: every slot's prompt has it)."""
        limit = self.c.model.decode_slots or 0
        count = r.running + len(r.holders) + len(r.cache) + (0 if me in r.cache or me in r.holders else 1)
        for s in list(r.cache):
            if count <= limit:
                break
            if s != me:
                self.run_.evicted_tokens += self.drop_entry(r, s)
                count -= 1

    def make_room(self, r: Replica, extra: int, me: int, *, preempt: bool, force: bool = False) -> bool:
        """Free `extra` tokens on `r` for session `me`: cache entries least recently used first,
        then (with `preempt`) other sessions' held KV, oldest pause first, each a preemption.
        With `admission="plan"` nothing is evicted unless the victims would make the room (as
        vLLM's scheduler allocates a request's blocks only when they fit); `force` evicts all
        the same (a turn over the whole budget runs alone)."""
        free = self.budget - r.used()
        if free >= extra:
            return True
        if self.c.admission == "plan" and not force:
            room = free + r.cached - (int(r.cache[me][0]) if me in r.cache else 0)
            if preempt:
                room += r.held - r.holders.get(me, 0)
            if room < extra:
                return False
        for s in list(r.cache):
            if s != me:
                self.evict_entry(r, s, extra - free)
                free = self.budget - r.used()
                if free >= extra:
                    return True
        if preempt:
            for s in list(r.holders):
                if s != me:
                    self.run_.preemptions += 1
                    self.release_held(r, s, to_cache=self.c.evict_tail)
                    free = self.budget - r.used()
                    if free < extra and s in r.cache:
                        self.evict_entry(r, s, extra - free)
                        free = self.budget - r.used()
                    if free >= extra:
                        return True
        return False
