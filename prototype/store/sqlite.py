"""`SqliteStore`: a response store in one sqlite file (WAL mode), durable across process restarts."""

from __future__ import annotations

import asyncio
import functools
import sqlite3
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Final, ParamSpec, TypeVar

from .base import Counters, StoreStatistics, StoreUnavailable, closed_error

__all__ = ["SQLITE_BUSY_TIMEOUT_S", "SqliteStore"]

_T = TypeVar("_T")
_P = ParamSpec("_P")


SQLITE_BUSY_TIMEOUT_S = 5.0
"""How long sqlite waits on a lock held by another connection (another server
process on the same file) before failing with "database is locked", which we
report as StoreUnavailable. Long enough to ride out a checkpoint, short enough
that a wedged writer surfaces as a 503 rather than a hung request."""

_SQLITE_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id      TEXT PRIMARY KEY,
    value   BLOB NOT NULL,
    created REAL NOT NULL
)
"""


_ANY: Final = object()  # `_put` without a compare: overwrite whatever is there


class SqliteStore:
    """A store in one sqlite file, durable across process restarts.

    The database runs in WAL mode with `synchronous=NORMAL`: a put that has
    returned survives the process dying (crash, kill -9); only an OS crash or
    power loss can lose the last few transactions. That is the right trade for
    a response cache -- `FULL` would fsync on every put.

    sqlite connections are thread-bound, so the connection is created on, and
    only ever used from, a single worker thread; every call runs there, in
    submission order. Construction opens the file synchronously (fail fast on
    a bad path, no event loop needed) and counts existing rows, which is a
    full scan -- fine at prototype scale.

    `max_entries` (optional) bounds the row count: after a put, the oldest rows
    by first insertion are deleted. Overwriting keeps a row's age (and its
    `created` stamp): a response re-stored on completion is not "new".

    `sqlite3.OperationalError` (locked, disk I/O error, disk full, read-only
    file) becomes `StoreUnavailable`; the SQL itself is fixed and tested, so an
    OperationalError at run time is environmental. A write lock held by another
    connection is waited on for `busy_timeout_s` first.

    `statistics().entries`/`bytes` are counted at open and then tracked from
    this object's own writes; rows written by another process sharing the file
    are not seen until the next open."""

    def __init__(
        self, path: str, max_entries: int | None = None, *, busy_timeout_s: float = SQLITE_BUSY_TIMEOUT_S
    ) -> None:
        if max_entries is not None and max_entries < 1:
            raise ValueError(f"max_entries must be >= 1 or None, got {max_entries}")
        if busy_timeout_s < 0:
            raise ValueError(f"busy_timeout_s must be >= 0, got {busy_timeout_s}")
        self.path = path
        self.max_entries = max_entries
        self.busy_timeout_s = busy_timeout_s
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sqlite-store")
        self._conn: sqlite3.Connection | None = None  # touched only on the worker thread
        self._closed = False
        # Counters are mutated only on the worker thread; each operation then
        # publishes a fresh frozen snapshot, and a reference assignment is
        # atomic, so `statistics()` on the loop thread never sees a torn state.
        # Counting on the worker (not after the await) also keeps the counts
        # right when the awaiting coroutine is cancelled mid-operation.
        self._entries = self._bytes = 0
        self._counts = Counters()
        self._snapshot = self._make_snapshot()
        try:
            self._executor.submit(self._open).result()
        except sqlite3.OperationalError as exc:
            self._executor.shutdown(wait=False)
            # sqlite's own message ("unable to open database file") omits the path.
            raise StoreUnavailable(f"sqlite store {path!r}: {exc}") from exc
        except BaseException:
            self._executor.shutdown(wait=False)
            raise

    # -- worker-thread side -------------------------------------------------

    def _make_snapshot(self) -> StoreStatistics:
        return self._counts.snapshot(self._entries, self._bytes)

    def _open(self) -> None:
        # isolation_level=None: autocommit; multi-statement writes use explicit BEGIN.
        conn = sqlite3.connect(self.path, timeout=self.busy_timeout_s, isolation_level=None)
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute(_SQLITE_SCHEMA)
            entries, size = conn.execute("SELECT count(*), coalesce(sum(length(value)), 0) FROM responses").fetchone()
        except BaseException:
            conn.close()
            raise
        self._conn = conn
        self._entries, self._bytes = int(entries), int(size)
        self._snapshot = self._make_snapshot()

    def _connection(self) -> sqlite3.Connection:
        assert self._conn is not None, "used before _open or after _close"
        return self._conn

    def _get(self, response_id: str) -> bytes | None:
        row = self._connection().execute("SELECT value FROM responses WHERE id = ?", (response_id,)).fetchone()
        self._counts.gets += 1
        value: bytes | None = None if row is None else bytes(row[0])
        if value is not None:
            self._counts.hits += 1
        self._snapshot = self._make_snapshot()
        return value

    def _put(self, response_id: str, value: bytes, now: float, expected: bytes | None | object = _ANY) -> bool:
        conn = self._connection()
        conn.execute("BEGIN IMMEDIATE")
        try:
            old = conn.execute("SELECT length(value), value FROM responses WHERE id = ?", (response_id,)).fetchone()
            if expected is not _ANY and (None if old is None else bytes(old[1])) != expected:
                conn.execute("ROLLBACK")
                return False
            conn.execute(
                "INSERT INTO responses (id, value, created) VALUES (?, ?, ?)"
                " ON CONFLICT(id) DO UPDATE SET value = excluded.value",
                (response_id, value, now),
            )
            entries = self._entries + (0 if old is not None else 1)
            size = self._bytes + len(value) - (int(old[0]) if old is not None else 0)
            evicted = 0
            if self.max_entries is not None and entries > self.max_entries:
                # rowid order is insertion order: a new row gets max(rowid)+1 and an
                # upsert keeps its rowid. Unlike `created` it cannot go backwards
                # when the wall clock steps, and it needs no extra index.
                excess = entries - self.max_entries
                victims = conn.execute(
                    "SELECT rowid, length(value) FROM responses ORDER BY rowid LIMIT ?", (excess,)
                ).fetchall()
                conn.executemany("DELETE FROM responses WHERE rowid = ?", [(rowid,) for rowid, _ in victims])
                evicted = len(victims)
                entries -= evicted
                size -= sum(int(length) for _, length in victims)
            conn.execute("COMMIT")
        except BaseException:
            # A failed COMMIT may already have rolled back; a second ROLLBACK
            # would raise and mask the original error.
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        # Counters change only once the transaction is committed.
        self._entries, self._bytes = entries, size
        self._counts.puts += 1
        self._counts.evictions += evicted
        self._snapshot = self._make_snapshot()
        return True

    def _scan(self, prefix: str) -> list[str]:
        rows = (
            self._connection()
            .execute("SELECT id FROM responses WHERE substr(id, 1, ?) = ? ORDER BY rowid", (len(prefix), prefix))
            .fetchall()
        )
        return [str(row[0]) for row in rows]

    def _delete(self, response_id: str) -> bool:
        conn = self._connection()
        # RETURNING (sqlite >= 3.35) gives the freed size in the same statement.
        row = conn.execute("DELETE FROM responses WHERE id = ? RETURNING length(value)", (response_id,)).fetchone()
        if row is None:
            return False
        self._entries -= 1
        self._bytes -= int(row[0])
        self._counts.deletes += 1
        self._snapshot = self._make_snapshot()
        return True

    def _close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    # -- event-loop side ----------------------------------------------------

    async def _call(self, fn: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> _T:
        """Run `fn` on the worker thread; map environmental sqlite failures."""
        if self._closed:
            raise closed_error(self)
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))
        except sqlite3.OperationalError as exc:
            raise StoreUnavailable(f"sqlite store {self.path!r}: {exc}") from exc

    async def get(self, response_id: str) -> bytes | None:
        return await self._call(self._get, response_id)

    async def put(self, response_id: str, value: bytes) -> None:
        await self._call(self._put, response_id, value, time.time())

    async def swap(self, key: str, expected: bytes | None, value: bytes) -> bool:
        return await self._call(self._put, key, value, time.time(), expected)

    async def scan(self, prefix: str) -> list[str]:
        return await self._call(self._scan, prefix)

    async def delete(self, response_id: str) -> bool:
        return await self._call(self._delete, response_id)

    async def close(self) -> None:
        """Close the connection after every already-submitted operation has run
        (the worker is FIFO), then stop the worker thread."""
        if self._closed:
            return
        self._closed = True
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._executor, self._close)
        # The queue is empty now, so the worker thread exits at once.
        self._executor.shutdown(wait=False)

    def statistics(self) -> StoreStatistics:
        return self._snapshot
