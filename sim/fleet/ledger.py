"""The fleet's KV ledger: what each replica's KV budget holds (running turns' *active* KV,
paused responses' *held* KV, the prefix cache's *cached* entries), the fleet's totals of each
integrated over time, and the evictions that make room for a turn: cache entries least recently
freed first (tail blocks only with `evict_tail`: vLLM's free-block queue order,
docs/capacity.md#eviction-by-block), then other sessions' held KV, oldest pause first, each a
counted preemption (sim/fleet/engine.py's theory of operation: the KV budget and the prefix
cache). The ledger changes counts and returns what it freed; it pushes no event."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final

from sim.fleet.config import FleetConfig, FleetRun
from sim.fleet.loop import EventLoop
from sim.fleet.state import CacheEntry, Replica, SessionState
from sim.model.kv import DEFAULT_BLOCK_TOKENS

__all__ = ["BLOCK", "KVLedger", "KVTotals", "floor_blocks"]

BLOCK: Final = DEFAULT_BLOCK_TOKENS  # vLLM's default KV block size; a run's is its model's `prefix_block_tokens`


def floor_blocks(tokens: int, block: int = BLOCK) -> int:
    """`tokens` rounded down to whole KV blocks of `block` tokens."""
    return tokens // block * block


@dataclass(slots=True)
class KVTotals:
    """Fleet-wide KV tokens by use (the shared instructions' blocks count as cached)."""

    active: int = 0
    held: int = 0
    cached: int = 0


class KVLedger:
    """Fleet-wide totals, the run's peak and eviction counts, per-replica occupancy and prefix
    cache. `account` integrates the totals up to an event's time (expiring idle cache entries
    at their timeout on the way)."""

    def __init__(
        self,
        config: FleetConfig,
        run: FleetRun,
        loop: EventLoop,
        replicas: list[Replica],
        states: list[SessionState],
        series_every_s: float = 0.0,
    ) -> None:
        self.config = config
        self.budget = config.kv_budget_tokens or (1 << 62)
        self.block = config.model.prefix_block_tokens  # the prefix cache's granularity
        self.run = run
        self.loop = loop
        self.replicas = replicas
        self.states = states
        self.totals = KVTotals()
        self.integrated_to = 0.0
        self.series_every_s = series_every_s
        self.next_sample = 0.0

    # -- the counters ------------------------------------------------------------------------

    def add_active(self, r: Replica, tokens: int) -> None:
        r.active += tokens
        self.totals.active += tokens
        if tokens > 0:
            self._peak(r)

    def add_held(self, r: Replica, tokens: int) -> None:
        r.held += tokens
        self.totals.held += tokens
        if tokens > 0:
            self._peak(r)

    def add_cached(self, r: Replica, tokens: int) -> None:
        r.cached += tokens
        self.totals.cached += tokens
        if tokens > 0:
            self._peak(r)

    def add_shared(self, r: Replica, tokens: int) -> None:
        """The instructions' blocks, cached once on `r` (`r.shared` is set by the caller)."""
        self.totals.cached += tokens
        self.run.kv_peak_tokens = max(self.run.kv_peak_tokens, r.used())

    def _peak(self, r: Replica) -> None:
        used = r.used()
        if used > self.run.kv_peak_tokens:
            self.run.kv_peak_tokens = used

    def account(self, t: float) -> None:
        """The KV totals integrated up to `t`; with a cache time-to-live each entry leaves them
        (and the cache) at its timeout, replicas' entries in time order (a replica's cache is in
        idle order). With `prefix_ttl_s` the shared instructions leave a replica too, once nothing
        of a session is there and no turn has ended there for that long (their entries, which
        extend them, have expired first: `cache_ttl_s` is at most `prefix_ttl_s`; without a
        `cache_ttl_s` they stay until evicted, and the instructions at least as long)."""
        ttl = self.config.cache_ttl_s
        prefix_ttl = self.config.prefix_ttl_s
        while ttl > 0 or prefix_ttl > 0:
            oldest = None  # the replica whose cache's head has been idle longest (the first such)
            last = math.inf
            for r in self.replicas:
                if r.cache:
                    head = next(iter(r.cache.values())).last_use
                    if head < last:
                        oldest, last = r, head
            idle, at = None, math.inf  # the replica whose idle instructions are due first
            if prefix_ttl > 0:
                for r in self.replicas:
                    if r.shared and not (r.cache or r.running or r.holders or r.queue):
                        due = r.shared_used + prefix_ttl
                        if due < at and t > due:
                            idle, at = r, due
            entry_due = ttl > 0 and oldest is not None and t - last > ttl
            if idle is not None and not (entry_due and last + ttl <= at):
                self.integrate(at)
                self.drop_shared(idle)
                continue
            if not entry_due:
                break
            assert oldest is not None
            self.integrate(last + ttl)
            self.drop_entry(oldest, next(iter(oldest.cache)))
        self.integrate(t)

    def drop_shared(self, r: Replica) -> None:
        """The shared instructions leave `r`'s cache: the next turn here prefills them again."""
        self.totals.cached -= r.shared
        r.shared, r.shared_at = 0, math.inf

    def integrate(self, t: float) -> None:
        dt = t - self.integrated_to
        totals = self.totals
        if dt > 0:
            kv = self.run.kv_token_s
            kv["active"] += totals.active * dt
            kv["held"] += totals.held * dt
            kv["cached"] += totals.cached * dt
            self.integrated_to = t
        if self.series_every_s > 0 and t >= self.next_sample:
            self.run.kv_series.append((t, totals.active, totals.held, totals.cached))
            self.next_sample = t + self.series_every_s

    # -- the prefix cache and held KV --------------------------------------------------------

    def drop_entry(self, r: Replica, s: int) -> int:
        entry = r.cache.pop(s, None)
        if entry is None:
            return 0
        self.add_cached(r, -entry.tokens)
        return entry.tokens

    def to_cache(self, r: Replica, s: int, tokens: int) -> None:
        """Session `s`'s context of `tokens` into `r`'s prefix cache (its full blocks)."""
        self.drop_entry(r, s)
        unique = floor_blocks(tokens, self.block) - r.shared
        if unique > 0:
            r.cache[s] = CacheEntry(unique, self.loop.now)
            self.add_cached(r, unique)

    def release_held(self, r: Replica, s: int, *, to_cache: bool) -> None:
        st = self.states[s]
        tokens = r.holders.pop(s)
        self.add_held(r, -tokens)
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
        cut = -(-deficit // self.block) * self.block
        if self.config.evict_tail and entry.tokens > cut:
            entry.tokens -= cut
            self.add_cached(r, -cut)
            self.run.evicted_tokens += cut
        else:
            self.run.evicted_tokens += self.drop_entry(r, s)

    def keep_sequences(self, r: Replica, me: int) -> None:
        """`slot_cache`: session `me` takes a slot on `r`; the slot's last sequence goes, least
        recently used cache entry first, so that running, held and cached sequences number at
        most the replica's decode slots (the shared prefix stays: every slot's prompt has it).
        With a host cache (`slot_host_cache_tokens`), llama.cpp's rule when a slot changes hands:
        a last sequence that keeps less than half its prompt for the new turn (past the shared
        prefix, more than that prefix again) is saved there, and the new turn's own saved context,
        if any, comes back into the slot."""
        limit = self.config.model.decode_slots or 0
        count = r.running + len(r.holders) + len(r.cache) + (0 if me in r.cache or me in r.holders else 1)
        host = self.config.slot_host_cache_tokens > 0
        for s in list(r.cache):
            if count <= limit:
                break
            if s != me:
                dropped = self.drop_entry(r, s)
                count -= 1
                if host and dropped > r.shared:
                    self._save_host(r, s, dropped)
                    if me in r.host:
                        self._restore_host(r, me)
                else:
                    self.run.evicted_tokens += dropped

    def _save_host(self, r: Replica, s: int, tokens: int) -> None:
        """Session `s`'s context past the shared prefix into `r`'s host cache (replacing its older
        save), the oldest saves evicted past the cache's tokens, the newest always kept."""
        self._drop_host(r, s)
        r.host[s] = tokens
        r.host_tokens += tokens + r.shared
        while r.host_tokens > self.config.slot_host_cache_tokens and len(r.host) > 1:
            oldest = next(iter(r.host))
            self.run.evicted_tokens += r.host[oldest]
            self._drop_host(r, oldest)

    def _drop_host(self, r: Replica, s: int) -> None:
        tokens = r.host.pop(s, None)
        if tokens is not None:
            r.host_tokens -= tokens + r.shared

    def _restore_host(self, r: Replica, s: int) -> None:
        """Session `s`'s saved context back into the slot it takes (out of the host cache)."""
        tokens = r.host[s]
        self._drop_host(r, s)
        r.cache[s] = CacheEntry(tokens, self.loop.now)
        self.add_cached(r, tokens)

    def make_room(self, r: Replica, extra: int, me: int, *, preempt: bool, force: bool = False) -> bool:
        """Free `extra` tokens on `r` for session `me`: cache entries least recently used first,
        then (with `preempt`) other sessions' held KV, oldest pause first, each a preemption.
        With `admission="plan"` nothing is evicted unless the victims would make the room (as
        vLLM's scheduler allocates a request's blocks only when they fit); `force` evicts all
        the same (a turn over the whole budget runs alone)."""
        free = self.budget - r.used()
        if free >= extra:
            return True
        if self.config.admission == "plan" and not force:
            mine = r.cache.get(me)
            room = free + r.cached - (mine.tokens if mine is not None else 0)
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
                    self.run.preemptions += 1
                    self.release_held(r, s, to_cache=self.config.evict_tail)
                    free = self.budget - r.used()
                    if free < extra and s in r.cache:
                        self.evict_entry(r, s, extra - free)
                        free = self.budget - r.used()
                    if free >= extra:
                        return True
        return False
