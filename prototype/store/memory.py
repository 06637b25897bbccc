"""`MemoryStore`: an in-process LRU response store bounded by entry count and total value bytes."""

from __future__ import annotations

from collections import OrderedDict

from .base import Counters, StoreStatistics, closed_error

__all__ = ["DEFAULT_MEMORY_MAX_BYTES", "DEFAULT_MEMORY_MAX_ENTRIES", "MemoryStore"]


DEFAULT_MEMORY_MAX_ENTRIES = 10_000
"""Responses kept by default. A typical stored response (input items plus
output) is a few KiB to a few hundred KiB, so 10k entries sits well under the
byte bound below for ordinary traffic; the count bound is what normally bites."""

DEFAULT_MEMORY_MAX_BYTES = 1 << 30
"""1 GiB of value bytes: the hard ceiling that protects the process when a few
responses are huge (long tool outputs, base64 images)."""


class MemoryStore:
    """An in-process LRU store bounded by entry count and total value bytes.

    `get` refreshes recency; `put` (including an overwrite) makes the entry the
    most recent. After each put the least recently used entries are evicted
    until both bounds hold; each counts as one eviction. `delete` drops the
    store's reference to the value, so its memory is freed as soon as no caller
    holds it. A single value larger than `max_bytes` is rejected with
    `ValueError` *before* anything is evicted (storing it would violate the
    bound; silently dropping it would lose data).

    Nothing here is bound to an event loop, so it can be built at import time."""

    def __init__(
        self, max_entries: int = DEFAULT_MEMORY_MAX_ENTRIES, max_bytes: int = DEFAULT_MEMORY_MAX_BYTES
    ) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        # Insertion order of an OrderedDict is the recency order: first = least recent.
        self._entries: OrderedDict[str, bytes] = OrderedDict()
        self._bytes = 0
        self._counts = Counters()
        self._closed = False

    async def get(self, response_id: str) -> bytes | None:
        if self._closed:
            raise closed_error(self)
        self._counts.gets += 1
        value = self._entries.get(response_id)
        if value is not None:
            self._counts.hits += 1
            self._entries.move_to_end(response_id)
        return value

    async def put(self, response_id: str, value: bytes) -> None:
        if self._closed:
            raise closed_error(self)
        size = len(value)
        if size > self.max_bytes:
            raise ValueError(f"value of {size} bytes exceeds MemoryStore max_bytes={self.max_bytes}")
        old = self._entries.pop(response_id, None)
        if old is not None:
            self._bytes -= len(old)
        self._entries[response_id] = value
        self._bytes += size
        self._counts.puts += 1
        # The new entry is the most recent, so it is evicted last; the size check
        # above guarantees the loop stops before reaching it.
        while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self._bytes -= len(evicted)
            self._counts.evictions += 1

    async def swap(self, key: str, expected: bytes | None, value: bytes) -> bool:
        if self._closed:
            raise closed_error(self)
        if self._entries.get(key) != expected:
            return False
        await self.put(key, value)
        return True

    async def scan(self, prefix: str) -> list[str]:
        if self._closed:
            raise closed_error(self)
        return [key for key in self._entries if key.startswith(prefix)]

    async def delete(self, response_id: str) -> bool:
        if self._closed:
            raise closed_error(self)
        value = self._entries.pop(response_id, None)
        if value is None:
            return False
        self._bytes -= len(value)
        self._counts.deletes += 1
        return True

    async def close(self) -> None:
        # Dropping the entries is the point of closing an in-memory store.
        self._entries.clear()
        self._bytes = 0
        self._closed = True

    def statistics(self) -> StoreStatistics:
        return self._counts.snapshot(len(self._entries), self._bytes)
