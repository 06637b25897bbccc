"""The response store's interface: where `store=true` responses live so that a later request can read
them back (`GET /v1/responses/{id}`, `previous_response_id`).

The interface is a byte-value key-value store. Callers serialise records with msgspec and hand the
store opaque `bytes`; no store ever interprets a value. That keeps the record schema in one place
(the server) and lets every backend be tested with the same contract suite.

Three backends, a module each: `memory.MemoryStore` (an LRU bounded by entry count *and* total bytes;
it exists because an unbounded dict is a leak: vLLM's in-memory response store grew forever),
`sqlite.SqliteStore` (a single file in WAL mode, durable across restarts) and `redis.RedisStore`
(shared between server processes, optional TTL). `spec.open_store(spec)` builds one from a
command-line string.

Contracts shared by all stores:

* Operations are coroutines; none blocks the event loop for longer than a
  dictionary operation (sqlite runs on a worker thread, redis is async I/O).
* `StoreUnavailable` means the backing service cannot be reached or cannot do
  I/O right now; the server answers 503 (`server_error`). Any other exception
  is a bug or a misuse.
* Using a store after `close()` raises `RuntimeError`; `close()` itself is
  idempotent.
* `statistics()` counters count operations that completed (an operation that
  raised is not counted).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

__all__ = ["Counters", "ResponseStore", "StoreStatistics", "StoreUnavailable", "closed_error"]


class StoreUnavailable(Exception):
    """The backing service cannot be reached; callers answer 5xx (server_error / 503).

    The original error is chained as `__cause__`."""


@dataclass(frozen=True, slots=True)
class StoreStatistics:
    """A snapshot of a store's counters.

    `entries` and `bytes` (total value bytes; keys and per-entry overhead are
    not counted) are `None` when the store cannot know them cheaply (redis: the
    keyspace is shared with other processes and expires on its own).
    `puts`, `gets`, `deletes` count completed calls; `hits` counts gets that
    found a value; `deletes` counts only calls that removed an entry;
    `evictions` counts entries this store object removed to stay within its
    bounds (redis TTL expiry is done by the server and is not seen here)."""

    entries: int | None
    bytes: int | None
    puts: int
    gets: int
    hits: int
    deletes: int
    evictions: int


@dataclass(slots=True)
class Counters:
    """The live counters behind `StoreStatistics`, shared by every store."""

    puts: int = 0
    gets: int = 0
    hits: int = 0
    deletes: int = 0
    evictions: int = 0

    def snapshot(self, entries: int | None, bytes: int | None) -> StoreStatistics:
        return StoreStatistics(entries, bytes, self.puts, self.gets, self.hits, self.deletes, self.evictions)


@runtime_checkable
class ResponseStore(Protocol):
    async def get(self, response_id: str) -> bytes | None:
        """The value last put under `response_id`, or None if there is none
        (never stored, deleted, evicted or expired)."""
        ...

    async def put(self, response_id: str, value: bytes) -> None:
        """Store `value` under `response_id`, replacing any previous value.
        When this returns, a subsequent `get` on this store sees the value."""
        ...

    async def swap(self, key: str, expected: bytes | None, value: bytes) -> bool:
        """Store `value` under `key` only if the value there now is `expected` (None: no value);
        True if it was stored. Compare and set are one step, across processes sharing the store."""
        ...

    async def scan(self, prefix: str) -> list[str]:
        """Every key that starts with `prefix`, in no promised order."""
        ...

    async def delete(self, response_id: str) -> bool:
        """Remove `response_id`; True if something was deleted."""
        ...

    async def close(self) -> None:
        """Release resources. Idempotent. Further get/put/delete raise RuntimeError."""
        ...

    def statistics(self) -> StoreStatistics:
        """A consistent snapshot of the counters (see `StoreStatistics`)."""
        ...


def closed_error(store: object) -> RuntimeError:
    return RuntimeError(f"{type(store).__name__} is closed")
