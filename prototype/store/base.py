"""Persistent response stores: where `store=true` responses live so that a later
request can read them back (`GET /v1/responses/{id}`, `previous_response_id`).

The interface is a byte-value key-value store. Callers serialise records with
msgspec and hand the store opaque `bytes`; no store ever interprets a value.
That keeps the record schema in one place (the server) and lets every backend
be tested with the same contract suite.

Three backends:

* `MemoryStore` -- an LRU bounded by entry count *and* total bytes. It exists
  because an unbounded dict is a leak: vLLM's in-memory response store grew
  forever ("we never remove responses").
* `SqliteStore` -- a single file (WAL mode), durable across process restarts.
* `RedisStore` -- shared between server processes, optional TTL.

`open_store(spec)` builds one from a command-line string.

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

import asyncio
import functools
import sqlite3
import time
import urllib.parse
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import ParamSpec, Protocol, TypeVar, runtime_checkable

import redis.asyncio
import redis.exceptions
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

__all__ = [
    "MemoryStore",
    "RedisStore",
    "ResponseStore",
    "SqliteStore",
    "StoreStatistics",
    "StoreUnavailable",
    "open_store",
]


_T = TypeVar("_T")
_P = ParamSpec("_P")


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
class _Counters:
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

    async def delete(self, response_id: str) -> bool:
        """Remove `response_id`; True if something was deleted."""
        ...

    async def close(self) -> None:
        """Release resources. Idempotent. Further get/put/delete raise RuntimeError."""
        ...

    def statistics(self) -> StoreStatistics:
        """A consistent snapshot of the counters (see `StoreStatistics`)."""
        ...


def _closed_error(store: object) -> RuntimeError:
    return RuntimeError(f"{type(store).__name__} is closed")


# --------------------------------------------------------------------------- memory

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
        self._counts = _Counters()
        self._closed = False

    async def get(self, response_id: str) -> bytes | None:
        if self._closed:
            raise _closed_error(self)
        self._counts.gets += 1
        value = self._entries.get(response_id)
        if value is not None:
            self._counts.hits += 1
            self._entries.move_to_end(response_id)
        return value

    async def put(self, response_id: str, value: bytes) -> None:
        if self._closed:
            raise _closed_error(self)
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

    async def delete(self, response_id: str) -> bool:
        if self._closed:
            raise _closed_error(self)
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


# --------------------------------------------------------------------------- sqlite

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
        self._counts = _Counters()
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

    def _put(self, response_id: str, value: bytes, now: float) -> None:
        conn = self._connection()
        conn.execute("BEGIN IMMEDIATE")
        try:
            old = conn.execute("SELECT length(value) FROM responses WHERE id = ?", (response_id,)).fetchone()
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
            raise _closed_error(self)
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))
        except sqlite3.OperationalError as exc:
            raise StoreUnavailable(f"sqlite store {self.path!r}: {exc}") from exc

    async def get(self, response_id: str) -> bytes | None:
        return await self._call(self._get, response_id)

    async def put(self, response_id: str, value: bytes) -> None:
        await self._call(self._put, response_id, value, time.time())

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


# --------------------------------------------------------------------------- redis

DEFAULT_REDIS_KEY_PREFIX = "longrun:resp:"
"""Namespaces our keys so the redis database can be shared with other data."""

REDIS_RETRIES = 2
"""Retries per command after a connection error or timeout. One retry is what
lets the first command through after redis restarted: it hits a pooled
connection the old server closed, and the retry reconnects. The second covers a
restart racing with that retry. More would only delay the 503 while redis is
down (redis-py's own default is 10 retries with up to 1 s jittered backoff)."""

REDIS_BACKOFF_BASE_S = 0.01
REDIS_BACKOFF_CAP_S = 0.1
"""Backoff between those retries: long enough not to spin on a refused port,
short enough that an outage is reported within a fraction of a second."""

REDIS_SOCKET_TIMEOUT_S = 2.0
"""Per read/write socket timeout. A reachable redis answers in well under a
millisecond and moves several MiB in milliseconds, so 2 s means wedged or
partitioned, and the request should get a 503 rather than hang."""

REDIS_CONNECT_TIMEOUT_S = 1.0
"""TCP connect timeout. A refused port fails at once; this bounds the
blackholed-host case, where worst-case latency to StoreUnavailable is about
(REDIS_RETRIES + 1) x this."""

# Everything that means "cannot talk to redis". redis-py wraps socket errors in
# its own ConnectionError/TimeoutError, but OSError (which includes the builtin
# and asyncio TimeoutError) can still escape from the connect path.
_REDIS_UNAVAILABLE: tuple[type[BaseException], ...] = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    OSError,
)


class RedisStore:
    """A store in redis, shared by every server process that uses the same URL.

    Keys are `key_prefix + response_id`; values are stored verbatim. With
    `ttl_s`, every put (including an overwrite) sets the key to expire `ttl_s`
    seconds later; expiry is redis's business and is not counted as an
    eviction. `statistics()` reports `entries`/`bytes` as None: the keyspace is
    shared and expires on its own, and counting it would need a SCAN.

    Any connection error or timeout (after `REDIS_RETRIES` quick retries)
    becomes `StoreUnavailable` with the redis error chained. The same object
    recovers by itself once redis is back: the connection pool reconnects on
    the next command. Other redis errors (e.g. OOM, READONLY replica) are
    replies from a reachable server and propagate unchanged.

    The client is created lazily on first use, so construction needs no event
    loop; from then on the store is bound to that loop (redis connections are),
    and use from another loop raises RuntimeError."""

    def __init__(
        self,
        url: str,
        ttl_s: float | None = None,
        key_prefix: str = DEFAULT_REDIS_KEY_PREFIX,
        *,
        socket_timeout_s: float = REDIS_SOCKET_TIMEOUT_S,
        connect_timeout_s: float = REDIS_CONNECT_TIMEOUT_S,
        retries: int = REDIS_RETRIES,
    ) -> None:
        if ttl_s is not None and not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0 or None, got {ttl_s}")
        if retries < 0:
            raise ValueError(f"retries must be >= 0, got {retries}")
        self.url = url
        self.ttl_s = ttl_s
        self.key_prefix = key_prefix
        # Milliseconds (PX) rather than seconds (EX) so fractional TTLs are honoured;
        # at least 1 ms, because PX 0 is an error in redis.
        self._ttl_ms = None if ttl_s is None else max(1, round(ttl_s * 1000))
        self._socket_timeout_s = socket_timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._retries = retries
        self._where = _redact_redis_url(url)
        self._client: redis.asyncio.Redis | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._counts = _Counters()

    def _redis(self) -> redis.asyncio.Redis:
        if self._closed:
            raise _closed_error(self)
        loop = asyncio.get_running_loop()
        if self._client is None:
            self._client = redis.asyncio.Redis.from_url(
                self.url,
                socket_timeout=self._socket_timeout_s,
                socket_connect_timeout=self._connect_timeout_s,
                retry=Retry(ExponentialBackoff(cap=REDIS_BACKOFF_CAP_S, base=REDIS_BACKOFF_BASE_S), self._retries),
                decode_responses=False,
            )
            self._loop = loop
        elif loop is not self._loop:
            raise RuntimeError("RedisStore is bound to the event loop of its first use")
        return self._client

    def _unavailable(self, exc: BaseException) -> StoreUnavailable:
        return StoreUnavailable(f"redis store at {self._where} is unavailable: {type(exc).__name__}: {exc}")

    async def get(self, response_id: str) -> bytes | None:
        client = self._redis()
        try:
            value = await client.get(self.key_prefix + response_id)
        except _REDIS_UNAVAILABLE as exc:
            raise self._unavailable(exc) from exc
        self._counts.gets += 1
        if value is None:
            return None
        # decode_responses=False: redis-py hands back the stored bytes unchanged.
        if not isinstance(value, bytes):
            raise TypeError(f"redis returned {type(value).__name__}, expected bytes")
        self._counts.hits += 1
        return value

    async def put(self, response_id: str, value: bytes) -> None:
        client = self._redis()
        try:
            await client.set(self.key_prefix + response_id, value, px=self._ttl_ms)
        except _REDIS_UNAVAILABLE as exc:
            raise self._unavailable(exc) from exc
        self._counts.puts += 1

    async def delete(self, response_id: str) -> bool:
        client = self._redis()
        try:
            removed = int(await client.delete(self.key_prefix + response_id))
        except _REDIS_UNAVAILABLE as exc:
            raise self._unavailable(exc) from exc
        if removed == 0:
            return False
        self._counts.deletes += 1
        return True

    async def close(self) -> None:
        self._closed = True
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    def statistics(self) -> StoreStatistics:
        return self._counts.snapshot(None, None)


def _redact_redis_url(url: str) -> str:
    """`url` without credentials, for error messages and logs."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or "?"
    try:
        port = parts.port
    except ValueError:
        port = None
    return f"{parts.scheme}://{host}:{port if port is not None else '?'}{parts.path}"


# --------------------------------------------------------------------------- open_store

_ACCEPTED_SPECS = "'memory', 'sqlite:PATH', 'redis://HOST:PORT[/DB]'"


def _bad_spec(spec: str, why: str) -> ValueError:
    return ValueError(f"invalid store spec {spec!r}: {why}; accepted forms are {_ACCEPTED_SPECS}")


def open_store(spec: str) -> ResponseStore:
    """Build a store from a command-line spec.

    * `memory` -- `MemoryStore()` with default bounds;
    * `sqlite:PATH` -- `SqliteStore(PATH)`, PATH taken verbatim (relative paths
      are relative to the working directory); the file is opened now;
    * `redis://HOST:PORT[/DB]` -- `RedisStore(url)`; credentials
      (`redis://:PASSWORD@HOST:PORT`) are allowed, query options are not (the
      store sets its own timeouts and retries). No connection is made yet.

    Anything else raises `ValueError` naming the accepted forms."""
    if spec == "memory":
        return MemoryStore()
    if spec.startswith("sqlite:"):
        path = spec.removeprefix("sqlite:")
        if not path:
            raise _bad_spec(spec, "sqlite needs a file path")
        return SqliteStore(path)
    if spec.startswith("redis://"):
        parts = urllib.parse.urlsplit(spec)
        try:
            port = parts.port
        except ValueError as exc:
            raise _bad_spec(spec, f"bad port ({exc})") from exc
        if not parts.hostname:
            raise _bad_spec(spec, "redis needs a host")
        if port is None:
            raise _bad_spec(spec, "redis needs a port")
        db = parts.path.removeprefix("/")
        if db and not db.isdecimal():
            raise _bad_spec(spec, f"redis database must be a number, got {db!r}")
        if parts.query or parts.fragment:
            raise _bad_spec(spec, "query options and fragments are not supported")
        return RedisStore(spec)
    raise _bad_spec(spec, "unrecognised store kind")
