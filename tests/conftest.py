"""Shared fixtures and the suite's guards.

- A throwaway redis-server per test, for the response-store tests.
- Strict wire checks: every payload the server sends to a client in a test (HTTP bodies,
  SSE events, WebSocket frames; over aiohttp, the openai SDK's HTTP client or the
  `websockets` library) is validated by tests/strict.py as it is read, and a test that
  saw a rejected payload fails, even if the rejection was swallowed on the way.
- A default receive timeout on every WebSocket client read (support.RECEIVE_TIMEOUT_S),
  so a missing frame fails the test instead of hanging the run.
- With LONGRUN_REQUIRE_ALL=1 (CI, `make test`) a skipped test is a failure that names
  what is missing.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import aiohttp
import httpx2
import pytest
import websockets.asyncio.connection
import websockets.sync.connection
from aiohttp.streams import StreamReader

from . import strict, support
from .processes import RedisProcess
from .processes import free_port as _free_port
from .support import REQUIRE_ALL_ENV, require_all


@pytest.fixture
def redis_process() -> Iterator[RedisProcess]:
    """A running redis-server with start/stop control, torn down after the test."""
    executable = shutil.which("redis-server")
    if executable is None:
        pytest.skip("redis-server is not on PATH (Debian package redis-server; `make install` installs it)")
    server = RedisProcess(executable, _free_port())
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_server(redis_process: RedisProcess) -> str:
    """URL (`redis://127.0.0.1:<port>/0`) of a fresh, empty redis-server for this test."""
    return redis_process.url


@pytest.fixture
def unused_redis_url() -> str:
    """A redis URL on a local port where nothing listens: connecting is refused at once."""
    return f"redis://127.0.0.1:{_free_port()}/0"


# --------------------------------------------------------------------------- no silent skips


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """With LONGRUN_REQUIRE_ALL=1 a skip is a failure: CI must not pass without a service or
    client the suite needs. (An expected failure, `xfail`, stays what it is.)"""
    outcome = yield
    report: pytest.TestReport = outcome.get_result()  # type: ignore[attr-defined]
    if report.skipped and require_all() and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"{REQUIRE_ALL_ENV}=1 and the test was skipped: {reason}"


# --------------------------------------------------------------------------- strict wire checks

_checker = strict.Checker()
_taps: dict[int, tuple[StreamReader, strict.SSETap]] = {}  # id(reader) -> the SSE body it carries
_read_bodies: dict[int, aiohttp.ClientResponse] = {}  # responses whose JSON body is checked


def _checked_ws_text(data: str | bytes, path: str, beta: bool = False) -> None:
    if strict.is_responses_socket(path):
        kind = strict.BETA_WS_EVENT if beta else strict.WS_EVENT
        _checker.check_json(kind, data, where=f"WebSocket {path}")


_response_start = aiohttp.ClientResponse.start
_response_read = aiohttp.ClientResponse.read
_read_nowait_chunk = StreamReader._read_nowait_chunk
_ws_receive = aiohttp.ClientWebSocketResponse.receive


async def _start(self: aiohttp.ClientResponse, connection: Any) -> aiohttp.ClientResponse:
    out = await _response_start(self, connection)
    if self.content_type == "text/event-stream" and strict.route_of(self.method, self.url.path) == "create":
        _taps[id(self.content)] = (self.content, strict.SSETap(_checker, f"SSE {self.method} {self.url.path}"))
    return out


async def _read(self: aiohttp.ClientResponse) -> bytes:
    body = await _response_read(self)
    if id(self) not in _read_bodies:  # read() caches the body; check it once
        _read_bodies[id(self)] = self
        _checker.check_http_body(self.method, self.url.path, self.status, self.content_type, body)
    return body


def _chunk(self: StreamReader, n: int) -> bytes:
    data = _read_nowait_chunk(self, n)
    tap = _taps.get(id(self))
    if tap is not None and tap[0] is self:
        tap[1].feed(data)
    return data


async def _receive(self: aiohttp.ClientWebSocketResponse, timeout: float | None = None) -> aiohttp.WSMessage:
    if timeout is None and self._timeout.ws_receive is None:
        timeout = support.RECEIVE_TIMEOUT_S
    msg = await _ws_receive(self, timeout)
    if msg.type is aiohttp.WSMsgType.TEXT:
        beta = strict.is_beta_socket(
            self._response.request_info.headers.get("OpenAI-Beta", ""), self._response.url.query_string
        )
        _checked_ws_text(msg.data, self._response.url.path, beta)
    return msg


class _TappedStream(httpx2.AsyncByteStream, httpx2.SyncByteStream):
    """An httpx2 response body that passes each chunk to a check as the SDK reads it."""

    def __init__(self, inner: Any, on_chunk: Callable[[bytes], None], on_end: Callable[[], None]) -> None:
        self.inner, self.on_chunk, self.on_end = inner, on_chunk, on_end

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self.inner:
            self.on_chunk(chunk)
            yield chunk
        self.on_end()

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self.inner:
            self.on_chunk(chunk)
            yield chunk
        self.on_end()

    async def aclose(self) -> None:
        await self.inner.aclose()

    def close(self) -> None:
        self.inner.close()


def _tap_httpx(request: httpx2.Request, response: httpx2.Response) -> None:
    method, path = request.method, request.url.path
    if strict.route_of(method, path) is None:
        return
    content_type = response.headers.get("content-type", "")
    if content_type.startswith("text/event-stream"):
        sse = strict.SSETap(_checker, f"SSE {method} {path} (openai SDK)")
        response.stream = _TappedStream(response.stream, sse.feed, lambda: None)
        return
    parts: list[bytes] = []

    def end() -> None:
        _checker.check_http_body(method, path, response.status_code, content_type, b"".join(parts))

    response.stream = _TappedStream(response.stream, parts.append, end)


_async_transport = httpx2.AsyncHTTPTransport.handle_async_request
_sync_transport = httpx2.HTTPTransport.handle_request


async def _handle_async(self: httpx2.AsyncHTTPTransport, request: httpx2.Request) -> httpx2.Response:
    response = await _async_transport(self, request)
    _tap_httpx(request, response)
    return response


def _handle_sync(self: httpx2.HTTPTransport, request: httpx2.Request) -> httpx2.Response:
    response = _sync_transport(self, request)
    _tap_httpx(request, response)
    return response


_async_recv = websockets.asyncio.connection.Connection.recv
_sync_recv = websockets.sync.connection.Connection.recv


def _ws_path(conn: Any) -> str:
    request = getattr(conn, "request", None)
    return str(request.path).split("?", 1)[0] if request is not None else ""


def _ws_beta(conn: Any) -> bool:
    request = getattr(conn, "request", None)
    if request is None:
        return False
    return strict.is_beta_socket(request.headers.get("OpenAI-Beta", ""), str(request.path).partition("?")[2])


async def _recv_async(self: websockets.asyncio.connection.Connection, decode: bool | None = None) -> Any:
    async with asyncio.timeout(support.RECEIVE_TIMEOUT_S):
        data = await _async_recv(self, decode)
    _checked_ws_text(data, _ws_path(self), _ws_beta(self))  # the server sends text frames only
    return data


def _recv_sync(
    self: websockets.sync.connection.Connection, timeout: float | None = None, decode: bool | None = None
) -> Any:
    data = _sync_recv(self, support.RECEIVE_TIMEOUT_S if timeout is None else timeout, decode)
    _checked_ws_text(data, _ws_path(self), _ws_beta(self))
    return data


def pytest_configure(config: pytest.Config) -> None:
    """Install the wire checks for the whole run (class attributes of the client libraries)."""
    aiohttp.ClientResponse.start = _start  # type: ignore[method-assign]
    aiohttp.ClientResponse.read = _read  # type: ignore[method-assign]
    StreamReader._read_nowait_chunk = _chunk  # type: ignore[method-assign]
    aiohttp.ClientWebSocketResponse.receive = _receive  # type: ignore[method-assign,assignment]
    httpx2.AsyncHTTPTransport.handle_async_request = _handle_async  # type: ignore[method-assign]
    httpx2.HTTPTransport.handle_request = _handle_sync  # type: ignore[method-assign]
    websockets.asyncio.connection.Connection.recv = _recv_async  # type: ignore[method-assign]
    websockets.sync.connection.Connection.recv = _recv_sync  # type: ignore[method-assign]


@pytest.fixture
def wire() -> strict.Checker:
    """The checker of this test's wire traffic (counts per kind, violations)."""
    return _checker


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before any fixture of the test runs (a module-scoped one may start live clients)."""
    _checker.enabled = item.get_closest_marker("wire_unchecked") is None


@pytest.fixture(autouse=True)
def _runs_in_tmp(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """A job's default run folder (`python -m sim compare` without `--out`) goes to a temporary
    directory, not `runs/` of the checkout (sim/__main__.py's RUNS_ENV)."""
    monkeypatch.setenv("LONGRUN_RUNS", str(tmp_path_factory.mktemp("runs")))


@pytest.fixture(autouse=True)
def _strict_wire() -> Iterator[None]:
    """Fail the test if anything the server sent it was rejected (even if swallowed)."""
    _checker.counts.clear()
    _checker.violations.clear()
    yield
    _taps.clear()
    _read_bodies.clear()
    if _checker.violations:
        found = "\n".join(_checker.violations[:5])
        pytest.fail(f"{len(_checker.violations)} payload(s) from the server failed strict validation:\n{found}")
