"""The connection cache's rules: one entry per lane, a byte budget across lanes, LRU
eviction, and which cached contexts a job already took (docs/lanes.md, "The connection
cache"; rules 3 and 4 of connection.py).

The connection's accountant, in the role h2's `WindowManager` plays for flow control: the
entries live on the lanes (`Lane.cache`), and every decision about them is made here.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..context.cache import CacheEntry
from .lanes import Lane

__all__ = ["ConnectionCache"]


class ConnectionCache:
    """`lanes` is the connection's own map (read, never replaced); `max_bytes`: the budget of
    all lanes' entries together (None: unbounded)."""

    def __init__(self, lanes: Mapping[str | None, Lane], max_bytes: int | None) -> None:
        self.lanes = lanes
        self.max_bytes = max_bytes
        self.hits = 0
        self.misses = 0
        self.refused = 0  # entries over `max_bytes`, not cached
        self._ticks = 0  # cache uses: LRU order across lanes
        self._handed: set[str] = set()  # cached response ids whose context a job already took

    def take(self, response_id: str | None) -> tuple[CacheEntry | None, bool]:
        """The entry a job continuing `response_id` starts from, and whether it has that
        context to itself (False: another job took it already, so the job copies it: a fork).
        A lookup by id in every lane's entry: a new lane may fork any cached response."""
        if response_id is None:
            return None, True
        entry = self._lookup(response_id)
        if entry is None:
            self.misses += 1
            return None, True
        self.hits += 1
        exclusive = response_id not in self._handed
        self._handed.add(response_id)
        return entry, exclusive

    def _lookup(self, response_id: str) -> CacheEntry | None:
        for lane in self.lanes.values():
            if lane.cache is not None and lane.cache.response_id == response_id:
                self._ticks += 1
                lane.cache_used = self._ticks
                return lane.cache
        return None

    def store(self, lane: Lane, entry: CacheEntry) -> None:
        """The lane's new entry. Over the budget alone it is not cached (and the lane's old
        entry is gone too); else the least recently used other lanes' entries make room."""
        limit = self.max_bytes
        if limit is not None and entry.nbytes > limit:
            lane.cache = None
            self.refused += 1
            return
        lane.cache = entry
        self._ticks += 1
        lane.cache_used = self._ticks
        if limit is None:
            return
        others = sorted(
            (o for o in self.lanes.values() if o is not lane and o.cache is not None), key=lambda o: o.cache_used
        )
        total = sum(o.cache.nbytes for o in others if o.cache is not None) + entry.nbytes
        for other in others:
            if total <= limit:
                break
            assert other.cache is not None
            total -= other.cache.nbytes
            other.cache = None

    @staticmethod
    def evict(lane: Lane, response_id: str | None) -> None:
        """A failed turn evicts its parent from its own lane's entry (a failed fork keeps it)."""
        if response_id is not None and lane.cache is not None and lane.cache.response_id == response_id:
            lane.cache = None
