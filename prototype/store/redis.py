"""`RedisStore`: a response store in redis, shared by every server process that uses the same URL."""

from __future__ import annotations

import asyncio
import urllib.parse

import redis.asyncio
import redis.exceptions
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

from .base import Counters, StoreStatistics, StoreUnavailable, closed_error

__all__ = ["DEFAULT_REDIS_KEY_PREFIX", "RedisStore", "redact_redis_url"]


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
        self._where = redact_redis_url(url)
        self._client: redis.asyncio.Redis | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._counts = Counters()

    def _redis(self) -> redis.asyncio.Redis:
        if self._closed:
            raise closed_error(self)
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

    async def swap(self, key: str, expected: bytes | None, value: bytes) -> bool:
        client = self._redis()
        ttl = b"" if self._ttl_ms is None else str(self._ttl_ms).encode()
        args = (b"0" if expected is None else b"1", expected or b"", value, ttl)
        try:
            swapped = int(await client.eval(_SWAP_SCRIPT, 1, self.key_prefix + key, *args))
        except _REDIS_UNAVAILABLE as exc:
            raise self._unavailable(exc) from exc
        if swapped:
            self._counts.puts += 1
        return bool(swapped)

    async def scan(self, prefix: str) -> list[str]:
        client = self._redis()
        pattern = _glob_escape(self.key_prefix + prefix) + b"*"
        try:
            keys = [key async for key in client.scan_iter(match=pattern, count=1000)]
        except _REDIS_UNAVAILABLE as exc:
            raise self._unavailable(exc) from exc
        cut = len(self.key_prefix.encode())
        return sorted(bytes(key)[cut:].decode() for key in keys)

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


# Compare and set in one step on the redis server: ARGV = (has expected, expected, value, ttl ms or "").
_SWAP_SCRIPT = """
local current = redis.call('GET', KEYS[1])
if ARGV[1] == '0' then
  if current then return 0 end
elseif current ~= ARGV[2] then
  return 0
end
if ARGV[4] == '' then redis.call('SET', KEYS[1], ARGV[3]) else redis.call('SET', KEYS[1], ARGV[3], 'PX', ARGV[4]) end
return 1
"""


def _glob_escape(text: str) -> bytes:
    """`text` matched literally in a redis SCAN pattern."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text).encode()


def redact_redis_url(url: str) -> str:
    """`url` without credentials, for error messages and logs."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or "?"
    try:
        port = parts.port
    except ValueError:
        port = None
    return f"{parts.scheme}://{host}:{port if port is not None else '?'}{parts.path}"
