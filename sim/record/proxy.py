"""The recording reverse proxy: aiohttp in front of a Responses API (`python -m sim record`).

Every request is forwarded to `--upstream` as it came (its path and query as the client encoded
them, its headers, repeated ones too, and its body; the hop-by-hop headers and `Accept-Encoding`
aside, so the upstream answers uncompressed), and every
response is written back chunk by chunk as it arrives, never re-encoded; WebSocket frames are
relayed one by one in each direction. `POST …/responses` and each `response.create` on a
WebSocket become a capture line (sim/record/capture.py) written and flushed when the response
ends, and each completed turn a line of `workload.jsonl` (sim/record/workload.py) written when
its conversation's next request begins (the last turns at shutdown). Authorization passes
through and is written nowhere.

Silent connections (`--idle-timeout-s S`, a what-if: what a load balancer in front of the API
does, prototype/serve/wallclock.py's `IdleWatch`): a WebSocket, or an HTTP request and its
response, that carries no frame either way for S seconds is dropped: the client's connection is
closed under it (a WebSocket client sees the abnormal closure, 1006; an SSE reader a truncated
body), the upstream's closed, and the line failed `idle timeout`. The upstream's pings count as
frames: the proxy answers them and passes each on to the client (its pong stays with the proxy).

Faults: an upstream that cannot be reached gives the client a 502 in the API's shape
(`{"error": {...}}`); one that closes a stream midway gives an SSE client an `error` event (a
WebSocket client an `error` frame) and a failed line; a client that goes away mid-stream closes
the upstream response (cancelling it) and its line is marked failed.

Parts: `Recorder` is the proxy (the upstream session, the HTTP relay, the WebSocket handshake),
`WebSocketRelay` one relayed WebSocket, `CaptureLog` the recording's files.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import signal
import sys
import time
from collections import deque
from collections.abc import Callable, Coroutine, Mapping
from pathlib import Path
from typing import IO, Any, Final, Literal

import aiohttp
import msgspec
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from prototype.serve.wallclock import IdleCut, IdleWatch
from prototype.wire.errors import ProtocolError, http_error_body, ws_error_event
from prototype.wire.schemas import ErrorEvent, encode
from prototype.wire.sse import encode_event
from sim.record.capture import Capture, Pending, SSEData

__all__ = [
    "CaptureLog",
    "Recorder",
    "WebSocketRelay",
    "make_recorder_app",
    "record_main",
    "record_options",
    "serve_recorder",
]

# Not forwarded: hop-by-hop headers (RFC 9110 §7.6.1), the ones aiohttp sets itself, and the
# encoding (the upstream answers uncompressed, so the recorder reads what it relays).
_HOP: Final = frozenset(
    h.lower()
    for h in (
        "Connection",
        "Keep-Alive",
        "Proxy-Authenticate",
        "Proxy-Authorization",
        "TE",
        "Trailer",
        "Transfer-Encoding",
        "Upgrade",
        "Host",
        "Content-Length",
        "Accept-Encoding",
    )
)
_WS_HANDSHAKE: Final = ("sec-websocket-",)


class _Peek(msgspec.Struct):
    type: str | None = None
    stream_id: str | None = None


_peek = msgspec.json.Decoder(_Peek)


def _forwarded(headers: Mapping[str, str], *, websocket: bool = False) -> CIMultiDict[str]:
    """The end-to-end headers, each repeated one kept (a dict would keep only its last value)."""
    out: CIMultiDict[str] = CIMultiDict()
    for k, v in headers.items():
        low = k.lower()
        if low in _HOP or (websocket and low.startswith(_WS_HANDSHAKE)):
            continue
        out.add(k, v)
    return out


def _target(upstream: str, request: web.Request) -> URL:
    """The upstream URL of a request: its path and query as the client encoded them (`raw_path`),
    never decoded and encoded again."""
    return URL(upstream + request.raw_path, encoded=True)


def _upstream_error(message: str, *, code: str = "upstream_unavailable") -> ProtocolError:
    return ProtocolError(message, code=code, status=502, type="server_error")


class CaptureLog:
    """The recording's files in its folder: `capture.jsonl` (a line per response, written and
    flushed whole when it ends), `workload.jsonl` (a line per completed turn, written when its
    conversation's next request begins; the last turns at `close`) and `summary.json`."""

    def __init__(self, out: Path, capture: Capture, clock: Callable[[], float]) -> None:
        self.out = out
        self.capture = capture
        self.clock = clock
        self._file: IO[bytes] | None = None
        self._workload: IO[bytes] | None = None

    def open(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        self._file = (self.out / "capture.jsonl").open("ab")
        self._workload = (self.out / "workload.jsonl").open("ab")

    def close(self) -> dict[str, object]:
        """Close the files; the summary, also written to `summary.json`."""
        if self._file is not None:
            self._file.close()
        if self._workload is not None:
            self._workload.write(self.capture.workload.close())
            self._workload.close()
        summary = self.capture.summary()
        (self.out / "summary.json").write_bytes(msgspec.json.format(msgspec.json.encode(summary)) + b"\n")
        return summary

    def begin(self, mode: str, request: bytes, at: float, connection: int | None = None) -> Pending:
        """A request's pending line; the workload line of its conversation's previous turn, now
        that its tool time is known, written and flushed whole."""
        p = self.capture.begin(mode, request, at)
        p.connection = connection
        line = self.capture.workload.began(p.conversation, at, tool_output=p.content[2])
        if line is not None:
            assert self._workload is not None
            self._workload.write(line)
            self._workload.flush()
        return p

    def write(self, p: Pending) -> None:
        """The request's line, written and flushed whole."""
        if p.finished:
            return
        if p.done_at is None:
            p.fail("no terminal event", self.clock())
        line = self.capture.finish(p)
        assert self._file is not None
        self._file.write(line)
        self._file.flush()


class Recorder:
    """The proxy: its upstream and client session, the HTTP relay and the WebSocket handshake,
    feeding the recording's files (`CaptureLog`); each WebSocket is a `WebSocketRelay`."""

    def __init__(
        self,
        upstream: str,
        out: Path,
        *,
        clock: Callable[[], float] = time.monotonic,
        keep_content: bool = False,
        idle_timeout_s: float = 0.0,
    ) -> None:
        self.upstream = upstream.rstrip("/")
        self.idle_timeout_s = idle_timeout_s  # 0: no idle timeout
        self.cuts: list[IdleCut] = []  # connections dropped for silence
        self.clock = clock
        self.capture = Capture(keep_content=keep_content)
        self.log = CaptureLog(out, self.capture, clock)
        self.session: aiohttp.ClientSession | None = None
        self._connections = 0  # WebSocket connections seen: each one's number goes on its lines

    async def start(self) -> None:
        self.log.open()
        self.session = aiohttp.ClientSession(auto_decompress=False, timeout=aiohttp.ClientTimeout(total=None))

    async def stop(self) -> dict[str, object]:
        if self.session is not None:
            await self.session.close()
        return self.log.close()

    def watch(self, request: web.Request, kind: Literal["websocket", "sse"], mode: str) -> IdleWatch | None:
        """The idle timer on a client's connection, if there is a timeout: at the cut, the
        connection is closed under the client (its handler's reads and writes then fail)."""
        if not self.idle_timeout_s:
            return None

        def cut(record: IdleCut) -> None:
            self.cuts.append(record)
            if request.transport is not None:
                request.transport.close()

        return IdleWatch(self.idle_timeout_s, cut, kind=kind, mode=mode)

    # ------------------------------------------------------------------------------------- HTTP

    async def handle(self, request: web.Request) -> web.StreamResponse:
        arrived = self.clock()
        if request.headers.get("Upgrade", "").lower() == "websocket":
            return await self.websocket(request, arrived)
        body = await request.read()
        watch = self.watch(request, "sse", "http")  # the request's body was its last frame
        pending = None
        if request.method == "POST" and request.path.rstrip("/").endswith("/responses"):
            pending = self.log.begin("http", body, arrived)
        assert self.session is not None
        url = _target(self.upstream, request)
        try:
            if pending is not None:
                pending.forwarded(self.clock())
            upstream = await self.session.request(
                request.method, url, headers=_forwarded(request.headers), data=body, allow_redirects=False
            )
        except (aiohttp.ClientError, OSError) as exc:
            if watch is not None:
                watch.stop()
            err = _upstream_error(f"The upstream {self.upstream} could not be reached: {type(exc).__name__}")
            if pending is not None:
                pending.fail("upstream unreachable", self.clock())
                self.log.write(pending)
            return web.Response(status=502, body=http_error_body(err), content_type="application/json")
        try:
            return await self._relay(request, upstream, pending, watch)
        finally:
            if watch is not None:
                watch.stop()
            upstream.release()
            if pending is not None:
                self.log.write(pending)

    async def _relay(
        self,
        request: web.Request,
        upstream: aiohttp.ClientResponse,
        pending: Pending | None,
        watch: IdleWatch | None = None,
    ) -> web.StreamResponse:
        headers = _forwarded(upstream.headers)
        streamed = upstream.content_type == "text/event-stream"
        if not streamed and upstream.content_length is not None:
            headers["Content-Length"] = str(upstream.content_length)
        response = web.StreamResponse(status=upstream.status, reason=upstream.reason, headers=headers)
        if pending is not None and upstream.status >= 400:
            pending.failed = f"http {upstream.status}"
        decoder = SSEData() if streamed else None
        body = bytearray()
        try:
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                received = self.clock()
                if watch is not None:
                    if watch.cut is not None:
                        raise ConnectionResetError("idle timeout")
                    watch.frame()
                await response.write(chunk)
                if pending is None:
                    continue
                pending.first_byte(received, self.clock())
                if decoder is not None:
                    for data in decoder.feed(chunk):
                        pending.event(data, received)
                else:
                    body += chunk
        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            # The upstream closed midway: an SSE client gets an `error` event in the API's shape.
            if pending is not None:
                pending.fail(f"upstream closed mid-stream: {type(exc).__name__}", self.clock())
            if streamed:
                err = _upstream_error("The upstream closed the stream before it ended.").body()
                error_event = ErrorEvent(
                    code=err.code,
                    message=err.message,
                    param=err.param,
                    error=err,
                    sequence_number=(pending.last_sequence + 1) if pending and pending.last_sequence is not None else 0,
                )
                with contextlib.suppress(ConnectionError, RuntimeError):
                    await response.write(encode_event(encode(error_event), event="error"))
            elif request.transport is not None:
                request.transport.close()  # a body shorter than its Content-Length: the client sees it cut
            return response
        except (ConnectionError, asyncio.CancelledError):
            # The client went away (or was cut off): closing the upstream response cancels it there.
            upstream.close()
            if pending is not None:
                cut = watch is not None and watch.cut is not None
                pending.fail("idle timeout" if cut else "client disconnected", self.clock())
            raise
        if pending is not None:
            if decoder is not None and not pending.terminal:
                pending.fail("stream ended without a terminal event", self.clock())
            elif decoder is None:
                if pending.failed is None:
                    pending.body(bytes(body), self.clock())
                else:
                    pending.fail(pending.failed, self.clock())
        with contextlib.suppress(ConnectionError):
            await response.write_eof()
        return response

    # -------------------------------------------------------------------------------- WebSocket

    async def websocket(self, request: web.Request, arrived: float) -> web.StreamResponse:
        assert self.session is not None
        target = _target(self.upstream, request)
        url = target.with_scheme("wss" if target.scheme == "https" else "ws")
        protocols = [p.strip() for p in request.headers.get("Sec-WebSocket-Protocol", "").split(",") if p.strip()]
        try:
            up = await self.session.ws_connect(
                url,
                headers=_forwarded(request.headers, websocket=True),
                protocols=protocols,
                max_msg_size=0,
                autoping=not self.idle_timeout_s,  # with a timeout, the upstream's pings are relayed
            )
        except aiohttp.WSServerHandshakeError as exc:
            err = ProtocolError(f"The upstream refused the WebSocket: {exc.message}", code=None, status=exc.status)
            return web.Response(status=exc.status, body=http_error_body(err), content_type="application/json")
        except (aiohttp.ClientError, OSError) as exc:
            err = _upstream_error(f"The upstream {self.upstream} could not be reached: {type(exc).__name__}")
            return web.Response(status=502, body=http_error_body(err), content_type="application/json")
        down = web.WebSocketResponse(
            protocols=[up.protocol] if up.protocol else (), max_msg_size=0, compress=False, autoping=True
        )
        self._connections += 1
        watch: IdleWatch | None = None
        try:
            await down.prepare(request)
            watch = self.watch(request, "websocket", "ws")
            await WebSocketRelay(self.log, down, up, self._connections, watch).run()
        finally:  # each side's close code passed to the other
            if watch is not None:
                watch.stop()
            await up.close(code=down.close_code or aiohttp.WSCloseCode.OK)
            await down.close(code=up.close_code or aiohttp.WSCloseCode.OK)
        return down


class WebSocketRelay:
    """One relayed WebSocket: frames passed one by one each way; each `response.create` a pending
    line in its lane (the frame's `stream_id`), written when its response ends, or failed with
    the reason the connection ended before it did."""

    def __init__(
        self,
        log: CaptureLog,
        down: web.WebSocketResponse,
        up: aiohttp.ClientWebSocketResponse,
        connection: int,
        watch: IdleWatch | None,
    ) -> None:
        self.log = log
        self.down, self.up = down, up
        self.connection = connection  # the connection's number, on each of its lines
        self.watch = watch
        self.lanes: dict[str | None, deque[Pending]] = {}

    async def run(self) -> None:
        """Relay until either side ends; then fail the lines still in flight."""
        down, watch, clock = self.down, self.watch, self.log.clock
        to_up = asyncio.ensure_future(self._client_frames())
        to_down = asyncio.ensure_future(self._server_frames())
        done, _ = await asyncio.wait((to_up, to_down), return_when=asyncio.FIRST_COMPLETED)
        upstream_ended = to_down in done
        for task in (to_up, to_down):
            task.cancel()
        await asyncio.gather(to_up, to_down, return_exceptions=True)
        in_flight = [p for q in self.lanes.values() for p in q if not p.finished]
        if upstream_ended and in_flight and not down.closed:
            err = _upstream_error("The upstream closed the connection before the response ended.")
            with contextlib.suppress(ConnectionError, RuntimeError):
                await down.send_str(ws_error_event(err).decode())
        reason = "upstream closed mid-response" if upstream_ended else "client disconnected"
        if watch is not None and watch.cut is not None:
            reason = "idle timeout"
        for p in in_flight:
            p.fail(reason, clock())
            self.log.write(p)

    async def _client_frames(self) -> None:
        """The client's frames, upstream; each `response.create` a pending line in its lane."""
        down, up, lanes, watch, clock = self.down, self.up, self.lanes, self.watch, self.log.clock
        async for msg in down:
            at = clock()
            if watch is not None:
                watch.frame()
            if msg.type is aiohttp.WSMsgType.TEXT:
                data: str = msg.data
                pending = None
                if '"response.create"' in data:
                    raw = data.encode()
                    try:
                        kind = _peek.decode(raw).type
                    except msgspec.DecodeError:
                        kind = None
                    if kind == "response.create":
                        pending = self.log.begin("ws", raw, at, self.connection)
                        lanes.setdefault(pending.lane, deque()).append(pending)
                await up.send_str(data)
                if pending is not None:
                    pending.forwarded(at)  # the frame is handed upstream as it is read
                    pending.proxy_request_ms = (clock() - at) * 1000
            elif msg.type is aiohttp.WSMsgType.BINARY:
                await up.send_bytes(msg.data)
            else:
                break

    async def _server_frames(self) -> None:
        """The upstream's frames, to the client; a lane's line written when its response ends."""
        up, down, lanes, watch, clock = self.up, self.down, self.lanes, self.watch, self.log.clock
        async for msg in up:
            received = clock()
            if watch is not None:
                watch.frame()
            if msg.type is aiohttp.WSMsgType.PING:  # only with a timeout (autoping off): passed on
                await up.pong(msg.data)
                await down.ping(msg.data)
            elif msg.type is aiohttp.WSMsgType.PONG:
                continue
            elif msg.type is aiohttp.WSMsgType.TEXT:
                data: str = msg.data
                await down.send_str(data)
                written = clock()
                try:
                    lane = _peek.decode(data).stream_id
                except msgspec.DecodeError:
                    continue
                queue = lanes.get(lane if isinstance(lane, str) else None)
                if not queue:
                    continue
                pending = queue[0]
                pending.first_byte(received, written)
                if pending.event(data, received):
                    queue.popleft()
                    self.log.write(pending)
            elif msg.type is aiohttp.WSMsgType.BINARY:
                await down.send_bytes(msg.data)
            else:
                break


def make_recorder_app(recorder: Recorder) -> web.Application:
    app = web.Application(client_max_size=0)

    async def on_startup(_: web.Application) -> None:
        await recorder.start()

    async def on_cleanup(_: web.Application) -> None:
        await recorder.stop()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    app.router.add_route("*", "/{tail:.*}", recorder.handle)
    return app


async def serve_recorder(
    upstream: str, host: str, port: int, out: Path, *, keep_content: bool = False, idle_timeout_s: float = 0.0
) -> dict[str, object]:
    """Record until SIGINT or SIGTERM; the summary (also in `out/summary.json`)."""
    recorder = Recorder(upstream, out, keep_content=keep_content, idle_timeout_s=idle_timeout_s)
    runner = web.AppRunner(make_recorder_app(recorder), handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(f"recording {upstream} on http://{host}:{port} (base URL http://{host}:{port}/v1) into {out}/", flush=True)
    await stop.wait()
    await runner.cleanup()
    return recorder.capture.summary()


def record_options(sub: argparse._SubParsersAction[Any]) -> None:
    rec = sub.add_parser(
        "record",
        help="a recording reverse proxy for the Responses API: writes DIR/capture.jsonl for calibrate "
        "(docs/calibration.md, 'Recording a capture')",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    rec.add_argument("--upstream", required=True, metavar="URL", help="the API's origin, e.g. https://api.openai.com")
    rec.add_argument("--listen", default="127.0.0.1:8089", metavar="HOST:PORT", help="where clients connect")
    rec.add_argument(
        "--out", required=True, metavar="DIR", help="writes capture.jsonl, workload.jsonl and summary.json here"
    )
    rec.add_argument(
        "--idle-timeout-s",
        type=float,
        default=0.0,
        metavar="S",
        help="what-if: drop a WebSocket or an HTTP exchange that carries no frame either way for S seconds, as a "
        "load balancer would (0 = never; docs/protocol.md#silent-sockets)",
    )
    rec.add_argument(
        "--keep-content",
        action="store_true",
        help="workload.jsonl keeps the task, instructions, each turn's output and each tool's output (never a key)",
    )


def record_main(
    args: argparse.Namespace, run: Callable[[Coroutine[Any, Any, dict[str, object]]], dict[str, object]]
) -> int:
    """Record until interrupted (on the entry point's `run`), then print the summary (the proxy's added latency)."""
    host, _, port = args.listen.rpartition(":")
    if not host or not port.isdigit():
        print(f"error: --listen {args.listen!r}: want HOST:PORT", file=sys.stderr)
        return 2
    if not (args.idle_timeout_s >= 0 and math.isfinite(args.idle_timeout_s)):
        print(f"error: --idle-timeout-s {args.idle_timeout_s!r}: want seconds >= 0 (0 = never)", file=sys.stderr)
        return 2
    summary = run(
        serve_recorder(
            args.upstream,
            host,
            int(port),
            Path(args.out),
            keep_content=args.keep_content,
            idle_timeout_s=args.idle_timeout_s,
        )
    )
    print(msgspec.json.format(msgspec.json.encode(summary)).decode())
    return 0
