"""Tests for the response stores (prototype/store/): one contract suite run against every backend, then
what is specific to each (LRU bounds, durability, redis outages) and `open_store`."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import sqlite3
import sys
import tracemalloc
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis.asyncio
import redis.exceptions

from prototype.store.base import ResponseStore, StoreStatistics, StoreUnavailable
from prototype.store.memory import MemoryStore
from prototype.store.redis import RedisStore
from prototype.store.spec import open_store
from prototype.store.sqlite import SqliteStore
from tests.processes import RedisProcess
from tests.support import REPO

REPO_ROOT = REPO

LARGE_VALUE_BYTES = 8 << 20
"""8 MiB: bigger than any socket or pipe buffer and sqlite's page cache, so the
value really is chunked on the way in and out, yet quick to move locally."""

MANY_KEYS = 1_000
"""Enough keys to catch key mix-ups and per-key state leaks; quick on every backend."""

CONCURRENCY = 50
"""Operations in flight at once in the many-keys test: exercises the sqlite
worker queue and the redis connection pool without opening 1000 connections."""


def payload(seed: int, size: int) -> bytes:
    """Deterministic pseudo-random bytes (all byte values occur, so nothing can
    survive by accident of text encoding)."""
    return random.Random(seed).randbytes(size)


# --------------------------------------------------------------------------- contract suite

STORE_KINDS = ["memory", "sqlite", pytest.param("redis", marks=pytest.mark.redis)]


@pytest.fixture(params=STORE_KINDS)
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[ResponseStore]:
    kind = request.param
    made: ResponseStore
    if kind == "memory":
        made = MemoryStore()
    elif kind == "sqlite":
        made = SqliteStore(str(tmp_path / "responses.sqlite3"))
    else:
        made = RedisStore(request.getfixturevalue("redis_server"))
    try:
        yield made
    finally:
        await made.close()


async def test_satisfies_protocol(store: ResponseStore) -> None:
    assert isinstance(store, ResponseStore)


async def test_round_trip(store: ResponseStore) -> None:
    value = bytes(range(256)) * 4
    await store.put("resp_1", value)
    assert await store.get("resp_1") == value


async def test_missing_key_is_none(store: ResponseStore) -> None:
    assert await store.get("resp_never_stored") is None


async def test_empty_value_is_not_missing(store: ResponseStore) -> None:
    await store.put("resp_empty", b"")
    assert await store.get("resp_empty") == b""


async def test_keys_are_opaque_strings(store: ResponseStore) -> None:
    keys = ["resp_a", "resp_A", "with space", "colon:and/slash", "ünïcødé", "'; DROP TABLE responses; --"]
    for index, key in enumerate(keys):
        await store.put(key, f"value {index}".encode())
    for index, key in enumerate(keys):
        assert await store.get(key) == f"value {index}".encode()


async def test_swap_stores_only_over_the_expected_value(store: ResponseStore) -> None:
    assert await store.swap("rec_1", None, b"v1")  # absent, expected absent
    assert not await store.swap("rec_1", None, b"lost")  # present now
    assert not await store.swap("rec_1", b"v0", b"lost")  # another value expected
    assert not await store.swap("rec_1", b"", b"lost")  # empty is not absent
    assert await store.get("rec_1") == b"v1"
    assert await store.swap("rec_1", b"v1", b"v2")
    assert await store.get("rec_1") == b"v2"
    assert not await store.swap("rec_2", b"v2", b"lost")  # absent, a value expected
    assert await store.get("rec_2") is None


async def test_concurrent_swaps_from_one_value_let_exactly_one_through(store: ResponseStore) -> None:
    await store.put("rec_race", b"start")
    won = await asyncio.gather(*(store.swap("rec_race", b"start", f"w{i}".encode()) for i in range(20)))
    assert sum(won) == 1
    assert await store.get("rec_race") == f"w{won.index(True)}".encode()


async def test_scan_lists_the_keys_under_a_prefix(store: ResponseStore) -> None:
    for key in ("agents/session/a", "agents/session/b*", "agents/sessionX", "resp_1", "agents/other/c"):
        await store.put(key, b"x")
    assert sorted(await store.scan("agents/session/")) == ["agents/session/a", "agents/session/b*"]
    assert await store.scan("nothing/") == []
    await store.delete("agents/session/a")
    assert await store.scan("agents/session/") == ["agents/session/b*"]


async def test_overwrite_replaces_value(store: ResponseStore) -> None:
    await store.put("resp_1", b"first, longer value")
    await store.put("resp_1", b"second")
    assert await store.get("resp_1") == b"second"


async def test_delete_returns_true_then_false(store: ResponseStore) -> None:
    await store.put("resp_1", b"value")
    await store.put("resp_2", b"other")
    assert await store.delete("resp_1") is True
    assert await store.get("resp_1") is None
    assert await store.delete("resp_1") is False
    assert await store.delete("resp_never_stored") is False
    assert await store.get("resp_2") == b"other", "delete must not touch other keys"


async def test_large_values(store: ResponseStore) -> None:
    first, second = payload(1, LARGE_VALUE_BYTES), payload(2, LARGE_VALUE_BYTES + 12_345)
    await store.put("resp_big_1", first)
    await store.put("resp_big_2", second)
    assert await store.get("resp_big_1") == first
    assert await store.get("resp_big_2") == second


async def test_many_keys_concurrently(store: ResponseStore) -> None:
    keys = [f"resp_{index:05d}" for index in range(MANY_KEYS)]

    def value_of(key: str) -> bytes:
        return f"{key}:".encode() * (1 + int(key[-3:]) % 7)

    for start in range(0, MANY_KEYS, CONCURRENCY):
        batch = keys[start : start + CONCURRENCY]
        await asyncio.gather(*(store.put(key, value_of(key)) for key in batch))
    for start in range(0, MANY_KEYS, CONCURRENCY):
        batch = keys[start : start + CONCURRENCY]
        values = await asyncio.gather(*(store.get(key) for key in batch))
        assert values == [value_of(key) for key in batch]
    statistics = store.statistics()
    assert statistics.puts == statistics.gets == statistics.hits == MANY_KEYS
    if statistics.entries is not None:
        assert statistics.entries == MANY_KEYS


async def test_statistics(store: ResponseStore) -> None:
    initial = store.statistics()
    assert (initial.puts, initial.gets, initial.hits, initial.deletes, initial.evictions) == (0, 0, 0, 0, 0)
    await store.put("a", b"12345")
    await store.put("b", b"xyz")
    await store.put("a", b"1")  # overwrite: a put, not a new entry
    assert await store.get("a") == b"1"  # hit
    assert await store.get("missing") is None  # miss
    assert await store.delete("b") is True
    assert await store.delete("b") is False  # not counted: nothing removed
    statistics = store.statistics()
    assert (statistics.puts, statistics.gets, statistics.hits) == (3, 2, 1)
    assert (statistics.deletes, statistics.evictions) == (1, 0)
    if isinstance(store, MemoryStore | SqliteStore):
        # These two always know their size; only redis may answer None.
        assert (statistics.entries, statistics.bytes) == (1, 1)
    else:
        assert (statistics.entries, statistics.bytes) == (None, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        statistics.puts = 0  # type: ignore[misc]
    assert store.statistics() == statistics, "reading statistics changes nothing"


async def test_closed_store_refuses_use(store: ResponseStore) -> None:
    await store.put("resp_1", b"value")
    await store.close()
    await store.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        await store.get("resp_1")
    with pytest.raises(RuntimeError, match="closed"):
        await store.put("resp_1", b"value")
    with pytest.raises(RuntimeError, match="closed"):
        await store.delete("resp_1")


def test_construction_needs_no_event_loop(tmp_path: Path, unused_redis_url: str) -> None:
    """Stores may be built at import time / before the loop starts (aiohttp FAQ)."""
    with pytest.raises(RuntimeError):
        asyncio.get_running_loop()
    stores: list[ResponseStore] = [
        MemoryStore(),
        SqliteStore(str(tmp_path / "responses.sqlite3")),
        RedisStore(unused_redis_url),  # nothing listens there: construction must not connect
    ]

    async def use_then_close() -> None:
        for made in stores[:2]:
            await made.put("resp_1", b"value")
            assert await made.get("resp_1") == b"value"
        for made in stores:
            await made.close()

    asyncio.run(use_then_close())


# --------------------------------------------------------------------------- MemoryStore


async def test_memory_evicts_least_recent_by_count() -> None:
    store = MemoryStore(max_entries=3)
    for key in "abcd":
        await store.put(key, key.encode())
    assert await store.get("a") is None
    assert [await store.get(key) for key in "bcd"] == [b"b", b"c", b"d"]
    statistics = store.statistics()
    assert (statistics.entries, statistics.bytes, statistics.evictions) == (3, 3, 1)


async def test_memory_get_refreshes_recency() -> None:
    store = MemoryStore(max_entries=3)
    for key in "abc":
        await store.put(key, key.encode())
    assert await store.get("a") == b"a"  # a is now the most recent; b the least
    await store.put("d", b"d")
    assert await store.get("b") is None
    assert await store.get("a") == b"a"


async def test_memory_overwrite_refreshes_recency() -> None:
    store = MemoryStore(max_entries=3)
    for key in "abc":
        await store.put(key, key.encode())
    await store.put("a", b"a2")
    await store.put("d", b"d")
    assert await store.get("b") is None
    assert await store.get("a") == b"a2"


async def test_memory_a_miss_does_not_refresh_anything() -> None:
    store = MemoryStore(max_entries=2)
    await store.put("a", b"a")
    await store.put("b", b"b")
    assert await store.get("zzz") is None
    await store.put("c", b"c")
    assert await store.get("a") is None


async def test_memory_evicts_least_recent_by_bytes() -> None:
    store = MemoryStore(max_bytes=10)
    await store.put("a", b"aaaa")
    await store.put("b", b"bbbb")
    await store.put("c", b"cccc")  # 12 > 10: a goes
    assert await store.get("a") is None
    assert store.statistics().bytes == 8
    await store.put("d", b"d" * 10)  # only d fits
    assert [await store.get(key) for key in "bcd"] == [None, None, b"d" * 10]
    statistics = store.statistics()
    assert (statistics.entries, statistics.bytes, statistics.evictions) == (1, 10, 3)


async def test_memory_overwrite_accounts_bytes_of_new_value() -> None:
    store = MemoryStore(max_bytes=10)
    await store.put("a", b"a" * 6)
    await store.put("b", b"b" * 4)
    await store.put("a", b"a")  # 6 -> 1 byte: shrinking frees room, nothing evicted
    assert store.statistics().bytes == 5
    await store.put("c", b"c" * 5)
    assert store.statistics().evictions == 0
    assert await store.get("b") == b"b" * 4


async def test_memory_rejects_value_larger_than_bound_without_evicting() -> None:
    store = MemoryStore(max_bytes=10)
    await store.put("a", b"aaaa")
    with pytest.raises(ValueError, match="max_bytes"):
        await store.put("huge", b"x" * 11)
    assert await store.get("a") == b"aaaa"
    assert await store.get("huge") is None
    assert store.statistics().evictions == 0


async def test_memory_delete_frees_memory() -> None:
    store = MemoryStore()
    for index in range(3):
        await store.put(f"resp_{index}", payload(index, 1000))
    assert store.statistics().bytes == 3000
    for index in range(3):
        assert await store.delete(f"resp_{index}")
    assert (store.statistics().entries, store.statistics().bytes) == (0, 0)

    # The accounting is not enough: vLLM's leak was real memory. Check the store
    # drops its reference, so the allocation is actually returned.
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        await store.put("resp_big", payload(7, LARGE_VALUE_BYTES))  # only the store holds it
        held, _ = tracemalloc.get_traced_memory()
        assert held - before >= LARGE_VALUE_BYTES
        assert await store.delete("resp_big")
        after, _ = tracemalloc.get_traced_memory()
        assert held - after >= LARGE_VALUE_BYTES
    finally:
        tracemalloc.stop()


async def test_memory_close_releases_entries() -> None:
    store = MemoryStore()
    await store.put("a", b"abc")
    await store.close()
    assert (store.statistics().entries, store.statistics().bytes) == (0, 0)


@pytest.mark.parametrize("kwargs", [{"max_entries": 0}, {"max_bytes": 0}])
def test_memory_rejects_empty_bounds(kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        MemoryStore(**kwargs)


# --------------------------------------------------------------------------- SqliteStore


async def test_sqlite_survives_close_and_reopen(tmp_path: Path) -> None:
    path = str(tmp_path / "responses.sqlite3")
    big = payload(3, LARGE_VALUE_BYTES)
    store = SqliteStore(path)
    await store.put("resp_small", b"small")
    await store.put("resp_big", big)
    await store.put("resp_gone", b"deleted before close")
    assert await store.delete("resp_gone")
    await store.close()

    reopened = SqliteStore(path)
    try:
        assert await reopened.get("resp_small") == b"small"
        assert await reopened.get("resp_big") == big
        assert await reopened.get("resp_gone") is None
        # Size is recounted from the file; the session counters start afresh.
        statistics = reopened.statistics()
        assert (statistics.entries, statistics.bytes) == (2, len(b"small") + len(big))
        assert (statistics.puts, statistics.deletes) == (0, 0)
    finally:
        await reopened.close()


async def test_sqlite_put_survives_process_death(tmp_path: Path) -> None:
    """A returned put is durable even if the process dies without close()."""
    path = str(tmp_path / "responses.sqlite3")
    child = (
        "import asyncio, os, sys\n"
        "from prototype.store.sqlite import SqliteStore\n"
        "store = SqliteStore(sys.argv[1])\n"
        "asyncio.run(store.put('resp_from_child', b'written by a process that then died'))\n"
        "os._exit(0)  # no close(), no interpreter cleanup\n"
    )
    process = await asyncio.create_subprocess_exec(sys.executable, "-c", child, path, cwd=REPO_ROOT)
    assert await process.wait() == 0
    store = SqliteStore(path)
    try:
        assert await store.get("resp_from_child") == b"written by a process that then died"
    finally:
        await store.close()


async def test_sqlite_uses_wal_and_one_table(tmp_path: Path) -> None:
    path = str(tmp_path / "responses.sqlite3")
    store = SqliteStore(path)
    await store.put("resp_1", b"value")
    await store.close()
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)
        tables = conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall()
        assert tables == [("responses",)]
        columns = [(name, kind) for _, name, kind, *_ in conn.execute("PRAGMA table_info(responses)")]
        assert columns == [("id", "TEXT"), ("value", "BLOB"), ("created", "REAL")]
    conn.close()


async def test_sqlite_max_entries_evicts_oldest_first(tmp_path: Path) -> None:
    store = SqliteStore(str(tmp_path / "responses.sqlite3"), max_entries=3)
    try:
        for key in "abc":
            await store.put(key, key.encode())
        await store.put("a", b"a2")  # overwrite keeps a's age: it is still the oldest
        assert await store.get("b") == b"b"  # reads do not refresh age either
        await store.put("d", b"d")
        assert await store.get("a") is None
        assert [await store.get(key) for key in "bcd"] == [b"b", b"c", b"d"]
        statistics = store.statistics()
        assert (statistics.entries, statistics.bytes, statistics.evictions) == (3, 3, 1)
    finally:
        await store.close()


async def test_sqlite_locked_database_is_unavailable_then_recovers(tmp_path: Path) -> None:
    path = str(tmp_path / "responses.sqlite3")
    store = SqliteStore(path, busy_timeout_s=0)  # fail at once instead of waiting on the lock
    other = sqlite3.connect(path, isolation_level=None)
    try:
        other.execute("BEGIN IMMEDIATE")  # another writer holds the write lock
        with pytest.raises(StoreUnavailable, match="locked") as caught:
            await store.put("resp_1", b"value")
        assert isinstance(caught.value.__cause__, sqlite3.OperationalError)
        assert store.statistics().puts == 0, "a failed put is not counted"
        other.execute("ROLLBACK")
        await store.put("resp_1", b"value")
        assert await store.get("resp_1") == b"value"
        assert store.statistics().entries == 1
    finally:
        other.close()
        await store.close()


def test_sqlite_unopenable_path_is_unavailable(tmp_path: Path) -> None:
    path = str(tmp_path / "no such directory" / "responses.sqlite3")
    with pytest.raises(StoreUnavailable, match="no such directory"):
        SqliteStore(path)


# --------------------------------------------------------------------------- RedisStore


@pytest.mark.redis
async def test_redis_unavailable_while_down_and_recovers_after_restart(redis_process: RedisProcess) -> None:
    store = RedisStore(redis_process.url)
    try:
        await store.put("resp_1", b"before the outage")
        assert await store.get("resp_1") == b"before the outage"

        redis_process.stop()
        with pytest.raises(StoreUnavailable, match=f"127.0.0.1:{redis_process.port}") as caught:
            await store.get("resp_1")
        assert isinstance(caught.value.__cause__, redis.exceptions.ConnectionError)
        with pytest.raises(StoreUnavailable):
            await store.put("resp_2", b"during the outage")
        with pytest.raises(StoreUnavailable):
            await store.delete("resp_1")
        assert store.statistics() == StoreStatistics(
            entries=None, bytes=None, puts=1, gets=1, hits=1, deletes=0, evictions=0
        ), "failed operations are not counted"

        # Same port, same store object: the pool reconnects by itself. The server
        # keeps nothing across restarts (--save ''), so the old key is gone.
        redis_process.start()
        assert await store.get("resp_1") is None
        await store.put("resp_2", b"after the outage")
        assert await store.get("resp_2") == b"after the outage"
        assert await store.delete("resp_2") is True
    finally:
        await store.close()


@pytest.mark.redis
async def test_redis_restart_while_idle_is_invisible(redis_process: RedisProcess) -> None:
    """The pooled connection dies with the old server; the first command after the
    restart hits it, and the store's retry reconnects instead of failing."""
    store = RedisStore(redis_process.url)
    try:
        await store.put("resp_1", b"value")
        redis_process.stop()
        redis_process.start()
        assert await store.get("resp_1") is None  # the server came back empty
    finally:
        await store.close()


async def test_redis_never_reachable_is_unavailable(unused_redis_url: str) -> None:
    store = RedisStore(unused_redis_url)
    try:
        with pytest.raises(StoreUnavailable, match="unavailable") as caught:
            await store.put("resp_1", b"value")
        assert isinstance(caught.value.__cause__, redis.exceptions.ConnectionError)
    finally:
        await store.close()


async def test_redis_error_message_hides_password(unused_redis_url: str) -> None:
    url = unused_redis_url.replace("redis://", "redis://:hunter2@")
    store = RedisStore(url)
    try:
        with pytest.raises(StoreUnavailable) as caught:
            await store.get("resp_1")
        assert "hunter2" not in str(caught.value)
        assert unused_redis_url.removeprefix("redis://") in str(caught.value)
    finally:
        await store.close()


@pytest.mark.redis
@pytest.mark.parametrize(("ttl_s", "expected_max_ms"), [(None, None), (30.0, 30_000), (1.5, 1_500)])
async def test_redis_keys_use_prefix_and_ttl(
    redis_server: str, ttl_s: float | None, expected_max_ms: int | None
) -> None:
    store = RedisStore(redis_server, ttl_s=ttl_s, key_prefix="test:")
    raw = redis.asyncio.Redis.from_url(redis_server)
    try:
        await store.put("resp_1", b"value")
        assert await raw.get("test:resp_1") == b"value"
        # PTTL, not waiting for expiry: no wall-clock sleeps in tests.
        remaining_ms = await raw.pttl("test:resp_1")
        if expected_max_ms is None:
            assert remaining_ms == -1  # no expiry
        else:
            assert 0 < remaining_ms <= expected_max_ms
    finally:
        await raw.aclose()
        await store.close()


@pytest.mark.parametrize("ttl_s", [0.0, -1.0])
def test_redis_rejects_non_positive_ttl(ttl_s: float) -> None:
    with pytest.raises(ValueError, match="ttl_s"):
        RedisStore("redis://127.0.0.1:6379/0", ttl_s=ttl_s)


# --------------------------------------------------------------------------- open_store


async def test_open_store_memory() -> None:
    store = open_store("memory")
    assert isinstance(store, MemoryStore)
    await store.close()


async def test_open_store_sqlite(tmp_path: Path) -> None:
    path = str(tmp_path / "responses.sqlite3")
    store = open_store(f"sqlite:{path}")
    assert isinstance(store, SqliteStore)
    assert store.path == path
    await store.close()
    assert Path(path).exists(), "the file is opened (created) by open_store itself"


@pytest.mark.parametrize("spec", ["redis://127.0.0.1:6379", "redis://127.0.0.1:6379/0", "redis://cache:7000/3"])
async def test_open_store_redis(spec: str) -> None:
    store = open_store(spec)  # no connection is made: nothing needs to listen
    assert isinstance(store, RedisStore)
    assert store.url == spec
    await store.close()


@pytest.mark.parametrize(
    "spec",
    [
        "",
        "Memory",
        "memory:",
        "sqlite:",
        "sqlite",
        "postgres://db:5432/x",
        "rediss://127.0.0.1:6379/0",
        "redis://",
        "redis://127.0.0.1",
        "redis://127.0.0.1:notaport/0",
        "redis://127.0.0.1:6379/zero",
        "redis://127.0.0.1:6379/0?socket_timeout=1",
    ],
)
def test_open_store_rejects_unknown_specs(spec: str) -> None:
    with pytest.raises(ValueError) as caught:
        open_store(spec)
    message = str(caught.value)
    assert repr(spec) in message
    for form in ("'memory'", "'sqlite:PATH'", "'redis://HOST:PORT[/DB]'"):
        assert form in message
