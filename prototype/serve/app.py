"""aiohttp adapter: routes, auth, and byte movement. No protocol logic lives here.

`make_app` serves the service `compose.py` composes from injected parts (model, store,
clock), the same the in-process transport serves, so tests run it in process over loopback
and the entry point (`server.py`) wires in the simulator. Every handler translates errors in one place (`errors.py`); an
unexpected exception becomes a generic `server_error` with details only in the
log.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Final

from aiohttp import WSCloseCode, WSMsgType, web
from aiohttp.web_protocol import RequestHandler

from ..clock import Clock
from ..config import ServerConfig
from ..model import TokenModel
from ..response.compact import compact
from ..response.engine import Engine
from ..store.base import ResponseStore
from ..wire.errors import (
    INTERNAL_ERROR,
    ProtocolError,
)
from ..wire.schemas import DeletedResponse, ServerEvent, encode
from ..wire.sse import DONE_FRAME, SSE_HEADERS, encode_event
from .admission import Slots, admit_websocket, authorize
from .agents_api import AgentsAPI, StreamReply
from .compose import Service, compose
from .exchange import HTTPExchange, JSONReply, http_compact, request_too_large
from .session import (
    BATCH_BYTES,
    TOKEN_DELTAS,
    BatchedFrames,
    TextSender,
    WebSocketSession,
)
from .wallclock import SSE_COMMENT, Keepalive

__all__ = [
    "ENGINE",
    "LIVE_IDLE_TIMEOUT",
    "ApiRunner",
    "BatchedFrames",
    "WebSocketSession",
    "make_app",
]

log = logging.getLogger("longrun.server")


class _Socket(web.WebSocketResponse):
    """aiohttp closes on an oversize frame (1009) or invalid UTF-8 (1007) by itself, with an
    empty reason; this fills in a clear one for those codes."""

    def __init__(self, *, max_msg_size: int, heartbeat: float | None = None) -> None:
        super().__init__(max_msg_size=max_msg_size, compress=True, autoping=True, heartbeat=heartbeat)
        self._reasons: dict[int, bytes] = {
            WSCloseCode.MESSAGE_TOO_BIG: f"message larger than {max_msg_size} bytes".encode(),
            WSCloseCode.INVALID_TEXT: b"text frame is not valid UTF-8",
        }

    async def close(self, *, code: int = WSCloseCode.OK, message: bytes = b"", drain: bool = True) -> bool:
        return await super().close(code=code, message=message or self._reasons.get(code, b""), drain=drain)


# The live server has no intermediary in front of it: the idle timeout is the in-process transport's
# and the recording proxy's (prototype/serve/wallclock.py).
LIVE_IDLE_TIMEOUT: Final = (
    "--idle-timeout-s is an intermediary's, not the server's: the in-process transport models it, and live, "
    "`python -m sim record --idle-timeout-s S --upstream URL` puts it in front of the server"
)

ENGINE: Final = web.AppKey("engine", Engine)
CONFIG: Final = web.AppKey("config", ServerConfig)
SOCKETS: Final = web.AppKey[set[web.WebSocketResponse]]("sockets")
SLOTS: Final = web.AppKey("slots", Slots)
SERVICE: Final = web.AppKey("service", Service)
AGENTS: Final = web.AppKey("agents", AgentsAPI)


def make_app(
    *,
    model: TokenModel,
    store: ResponseStore,
    clock: Clock,
    config: ServerConfig | None = None,
    seed: int | None = None,
) -> web.Application:
    config = config or ServerConfig()
    if config.idle_timeout_s:
        raise ValueError(LIVE_IDLE_TIMEOUT)
    app = web.Application(client_max_size=config.max_message_bytes, middlewares=[_auth_middleware])
    app[CONFIG] = config
    service = compose(config, model=model, store=store, clock=clock, seed=seed)
    app[SERVICE] = service
    app[ENGINE] = service.engine
    app[AGENTS] = service.agents
    app[SLOTS] = service.slots
    sockets: set[web.WebSocketResponse] = set()
    app[SOCKETS] = sockets
    app.router.add_post("/v1/responses", create_response)
    app.router.add_post("/v1/responses/compact", compact_response)
    app.router.add_get("/v1/responses", websocket_or_405)
    app.router.add_get("/v1/responses/{response_id}", get_response)
    app.router.add_delete("/v1/responses/{response_id}", delete_response)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", prometheus_metrics)
    sessions = "/v1/agents/sessions"
    app.router.add_post(sessions, agents_create)
    app.router.add_get(sessions, agents_list)
    app.router.add_get(sessions + "/{session_id}", agents_retrieve)
    app.router.add_delete(sessions + "/{session_id}", agents_delete)
    app.router.add_post(sessions + "/{session_id}", agents_update)
    app.router.add_post(sessions + "/{session_id}/events", agents_post_events)
    app.router.add_get(sessions + "/{session_id}/events", agents_stream)
    app.router.add_get(sessions + "/{session_id}/turns", agents_turns)
    app.router.add_get(sessions + "/{session_id}/turns/{turn_id}", agents_turn)
    app.router.add_get(sessions + "/{session_id}/items", agents_items)
    app.router.add_get(sessions + "/{session_id}/turns/{turn_id}/items", agents_items)
    app.on_shutdown.append(_close_sockets)
    app.on_shutdown.append(_close_agents)
    app.on_cleanup.append(_close_service)
    return app


async def _close_sockets(app: web.Application) -> None:
    sockets = app[SOCKETS]
    for ws in list(sockets):
        await ws.close(code=WSCloseCode.GOING_AWAY, message=b"server shutdown")


async def _close_agents(app: web.Application) -> None:
    await app[AGENTS].close()


async def _close_service(app: web.Application) -> None:
    await app[SERVICE].close()  # the render threads and the store (the agents are closed already)


def _json_error(err: ProtocolError, *, headers: dict[str, str] | None = None) -> web.Response:
    return _json_reply(JSONReply.error(err), headers=headers)


def _json_reply(reply: JSONReply, *, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=reply.status, body=reply.body, content_type="application/json", headers=headers)


def _allow_header(exc: web.HTTPException) -> dict[str, str] | None:
    allow = exc.headers.get("Allow")
    return {"Allow": allow} if allow is not None else None


def _http_error(exc: web.HTTPException, request: web.Request) -> ProtocolError:
    """An error aiohttp raised before a handler ran (routing, the body limit), in the API's shape."""
    if exc.status == 404:  # the real API's answer to an unknown path: type and message, code null
        return ProtocolError(
            f"Invalid URL ({request.method} {request.path}).", code=None, status=404, type="invalid_request_error"
        )
    if exc.status == 405:
        return ProtocolError(
            f"Method {request.method} is not allowed on {request.path}.", code="method_not_allowed", status=405
        )
    if exc.status == 413:
        return request_too_large(request.app[CONFIG].max_message_bytes)
    if exc.status >= 500:
        log.error("aiohttp raised %s serving %s %s", exc.status, request.method, request.path)
        return INTERNAL_ERROR
    return ProtocolError(f"Invalid request: {exc.reason}.", code="invalid_request", status=exc.status)


def _unparsable(status: int) -> ProtocolError:
    return ProtocolError(
        "Invalid HTTP request: its request line, a header or its body is malformed, cut short, or longer "
        "than the server accepts.",
        code="invalid_http_request",
        status=status,
    )


class _ApiRequestHandler(RequestHandler):
    """aiohttp's connection handler, answering a request it cannot parse (a request line or a
    header past its limits, a malformed message) in the API's JSON shape, logged without a
    traceback: it is the client's fault. A server error (500) keeps aiohttp's handling."""

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if status >= 500:
            return super().handle_error(request, status, exc, message)
        log.debug("unparsable HTTP request from %s: %s", request.remote, type(exc).__name__ if exc else status)
        if request.writer.output_size > 0:  # as aiohttp: a reply already begun cannot be replaced
            raise ConnectionError("Response is sent already, cannot send another response with the error message")
        resp = _json_error(_unparsable(status))
        resp.force_close()
        return resp


class _ApiServer(web.Server):
    def __call__(self) -> RequestHandler:
        return _ApiRequestHandler(self, loop=self._loop, **self._kwargs)


class ApiRunner(web.AppRunner):
    """`web.AppRunner` whose connections answer unparsable requests in the API's JSON error shape
    (aiohttp's own answer is plain text, its log a traceback). Serve `make_app`'s app with it."""

    async def _make_server(self) -> web.Server:
        # aiohttp (3.14) answers a parse error in `RequestHandler.handle_error`, outside every
        # middleware, and offers no public hook for the handler class: the app's server is
        # rebuilt with the same arguments around a handler that overrides it.
        server = await super()._make_server()
        return _ApiServer(
            server.request_handler,
            request_factory=server.request_factory,
            handler_cancellation=server.handler_cancellation,
            loop=server._loop,
            **server._kwargs,
        )


@web.middleware
async def _auth_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Bearer auth on every /v1 route, checked before a WebSocket upgrade is accepted."""
    try:
        authorize(request.app[CONFIG], request.path, request.headers.get("Authorization"))
    except ProtocolError as err:
        return _json_error(err)
    try:
        return await handler(request)
    except web.HTTPException as exc:  # aiohttp's routing (404, 405) or body limit (413)
        if exc.status < 400:
            raise
        return _json_error(_http_error(exc, request), headers=_allow_header(exc))
    except ProtocolError as err:
        return _json_error(err)
    except ConnectionResetError:  # the client went away mid-body: its doing, answered to no one
        log.debug("client left during %s %s", request.method, request.path)
        return _json_error(_unparsable(400))
    except Exception:  # a bug, never the input's fault: the JSON 500, details only in the log
        log.exception("unexpected error serving %s %s", request.method, request.path)
        return _json_error(INTERNAL_ERROR)


async def healthz(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def prometheus_metrics(request: web.Request) -> web.Response:
    return web.Response(text=request.app[ENGINE].prometheus(), content_type="text/plain", charset="utf-8")


# -- HTTP ------------------------------------------------------------------------------------------


async def create_response(request: web.Request) -> web.StreamResponse:
    """Carries one `HTTPExchange` (session.py decides what goes back); this only moves bytes."""
    engine, config = request.app[ENGINE], request.app[CONFIG]
    try:
        body = await request.read()
    except web.HTTPRequestEntityTooLarge:
        return _json_error(request_too_large(config.max_message_bytes))
    exchange = HTTPExchange(body, engine, config)  # ProtocolError → middleware → JSON error body
    if not exchange.stream:
        reply = await exchange.run()
        assert reply is not None
        return _json_reply(reply)

    resp = web.StreamResponse(status=200, headers=SSE_HEADERS)
    writer: BatchedSSE | None = None

    async def emit(events: list[ServerEvent]) -> None:
        nonlocal writer
        if writer is None:
            await resp.prepare(request)
            writer = BatchedSSE(resp, keepalive_s=config.sse_keepalive_s)
        data = b"".join(encode_event(encode(ev), event=ev.__struct_config__.tag) for ev in events)  # type: ignore[arg-type]
        await writer.send(data, urgent=not events or type(events[-1]) not in TOKEN_DELTAS)

    try:
        reply = await exchange.run(emit)
        if reply is not None:
            return _json_reply(reply)
        if writer is not None:
            await writer.flush()
        if exchange.done_frame:
            await resp.write(DONE_FRAME)
        await resp.write_eof()
    except ConnectionResetError:
        pass  # the client went away mid-stream: the engine stopped sampling and freed the turn
    finally:
        if writer is not None:
            writer.cancel()
    return resp


async def compact_response(request: web.Request) -> web.Response:
    """`POST /v1/responses/compact` (docs/compaction.md); errors go through the middleware."""
    engine, config = request.app[ENGINE], request.app[CONFIG]
    try:
        body = await request.read()
    except web.HTTPRequestEntityTooLarge:
        return _json_error(request_too_large(config.max_message_bytes))
    params, arrival = http_compact(body, engine, config)
    compacted = await compact(engine, params, arrival)
    return web.Response(body=encode(compacted), content_type="application/json")


async def get_response(request: web.Request) -> web.Response:
    response = await request.app[ENGINE].get_stored(request.match_info["response_id"])
    return web.Response(body=encode(response), content_type="application/json")


async def delete_response(request: web.Request) -> web.Response:
    response_id = request.match_info["response_id"]
    await request.app[ENGINE].delete_stored(response_id)
    return web.Response(body=encode(DeletedResponse(id=response_id)), content_type="application/json")


# -- Agents API (agents_api.py has each route's plan) ---------------------------------------------


def _agents(request: web.Request) -> AgentsAPI:
    api = request.app[AGENTS]
    api.check_beta(request.headers)
    return api


async def _agents_body(request: web.Request) -> bytes:
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise request_too_large(request.app[CONFIG].max_message_bytes) from None


async def _agents_reply(request: web.Request, reply: JSONReply | StreamReply) -> web.StreamResponse:
    if isinstance(reply, JSONReply):
        return _json_reply(reply)
    resp = web.StreamResponse(status=200, headers=SSE_HEADERS)
    comments: _Comments | None = None
    try:
        writer = await resp.prepare(request)
        assert writer is not None
        if (every := request.app[CONFIG].sse_keepalive_s) is not None:
            comments = _Comments(resp, every)
        # One batch at a time, each waiting for the socket: the frames stay in the feed (bounded,
        # feeds.py) until the client reads, not in the transport's unbounded buffer.
        while (chunk := await reply.feed.get()) is not None:
            if comments is not None:
                comments.keepalive.heard()
            await resp.write(chunk)
            await writer.drain()
        if comments is not None:
            await comments.end()
        await resp.write_eof()
    except ConnectionResetError:
        pass  # the subscriber went away; the session runs on
    finally:
        if comments is not None:
            await comments.end()
        reply.runner.unsubscribe(reply.feed)
    return resp


class _Comments:
    """SSE keepalive comments on a stream whose handler waits for events: each written by a task
    of its own (one chunk, one transport write, never inside another chunk), none after `end`."""

    def __init__(self, resp: web.StreamResponse, every_s: float) -> None:
        self.resp = resp
        self.ended = False
        self.tasks: set[asyncio.Task[None]] = set()
        self.keepalive = Keepalive(every_s, self._send)

    def _send(self) -> None:
        task = asyncio.get_running_loop().create_task(self._write())
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _write(self) -> None:
        if not self.ended:
            with contextlib.suppress(ConnectionResetError):
                await self.resp.write(SSE_COMMENT)

    async def end(self) -> None:
        """No more comments; those being written are written."""
        self.ended = True
        self.keepalive.stop()
        if self.tasks:
            await asyncio.gather(*self.tasks)


async def agents_create(request: web.Request) -> web.StreamResponse:
    api = _agents(request)
    return await _agents_reply(request, await api.create(await _agents_body(request)))


async def agents_list(request: web.Request) -> web.Response:
    return _json_reply(await _agents(request).list_sessions(request.query))


async def agents_retrieve(request: web.Request) -> web.Response:
    return _json_reply(await _agents(request).retrieve(request.match_info["session_id"]))


async def agents_update(request: web.Request) -> web.Response:
    return _json_reply(await _agents(request).update(request.match_info["session_id"]))


async def agents_delete(request: web.Request) -> web.Response:
    return _json_reply(await _agents(request).delete(request.match_info["session_id"]))


async def agents_post_events(request: web.Request) -> web.Response:
    api = _agents(request)
    body = await _agents_body(request)
    key = request.headers.get("Idempotency-Key")
    return _json_reply(await api.post_events(request.match_info["session_id"], body, key))


async def agents_stream(request: web.Request) -> web.StreamResponse:
    api = _agents(request)
    return await _agents_reply(request, await api.stream_events(request.match_info["session_id"]))


async def agents_turns(request: web.Request) -> web.Response:
    return _json_reply(await _agents(request).list_turns(request.match_info["session_id"], request.query))


async def agents_turn(request: web.Request) -> web.Response:
    info = request.match_info
    return _json_reply(await _agents(request).get_turn(info["session_id"], info["turn_id"]))


async def agents_items(request: web.Request) -> web.Response:
    info = request.match_info
    return _json_reply(await _agents(request).list_items(info["session_id"], request.query, info.get("turn_id")))


# -- WebSocket -------------------------------------------------------------------------------------


async def websocket_or_405(request: web.Request) -> web.StreamResponse:
    if request.headers.get("Upgrade", "").lower() != "websocket":
        return _json_error(
            ProtocolError(
                "Method GET is not allowed on /v1/responses without a WebSocket upgrade.",
                code="method_not_allowed",
                status=405,
            )
        )
    config = request.app[CONFIG]
    slots = request.app[SLOTS]
    terms = admit_websocket(config, request.headers, request.query, slots)  # a refusal is the middleware's JSON
    try:
        ws = _Socket(max_msg_size=config.max_message_bytes, heartbeat=config.websocket.ping_interval_s)
        await ws.prepare(request)
        request.app[SOCKETS].add(ws)
        transport = request.transport
        socket = _AiohttpSocket(ws)
        writer: TextSender = socket
        if not ws.compress and transport is not None:
            writer = BatchedFrames(transport, request.writer.drain)
        try:
            await WebSocketSession(
                request.app[ENGINE],
                config,
                socket,
                terms=terms,
                writer=writer,
            ).serve()
        finally:
            request.app[SOCKETS].discard(ws)
    finally:
        slots.release()
    return ws


class _AiohttpSocket:
    """An aiohttp server socket as a `SessionSocket` and `TextSender` (text frames as `str`,
    binary frames as `bytes`; pings, pongs and closes stay with aiohttp)."""

    __slots__ = ("ws",)

    def __init__(self, ws: web.WebSocketResponse) -> None:
        self.ws = ws

    @property
    def closed(self) -> bool:
        return self.ws.closed

    async def __aiter__(self) -> AsyncIterator[str | bytes]:
        async for msg in self.ws:
            if msg.type is WSMsgType.TEXT:
                yield msg.data
            elif msg.type is WSMsgType.BINARY:
                yield msg.data

    async def close(self, *, code: int, message: bytes) -> bool:
        return await self.ws.close(code=code, message=message)

    async def send_text(self, message: bytes) -> None:
        await self.ws.send_frame(message, WSMsgType.TEXT)


class BatchedSSE:
    """The SSE frames of one streaming response, written with one `resp.write` per
    event-loop wake-up (the `BatchedFrames` idea over aiohttp's public API).

    `send` appends; a writer task takes everything appended before it runs and writes
    it, so the frames of one wake-up (all the tokens a paced model releases at once, or
    an unpaced turn's run of deltas) become one write and one chunk. Token deltas
    return at once unless `BATCH_BYTES` are waiting (flow control: they wait for the
    write, which waits for the transport to drain); every other event (`urgent`) waits
    until it is written. Order is kept: there is one writer.
    """

    def __init__(self, resp: web.StreamResponse, *, keepalive_s: float | None = None) -> None:
        self.resp = resp
        self.parts: list[bytes] = []
        self.size = 0
        self.written = 0  # batches written
        self.queued = 0  # batches taken or waiting
        self.error: BaseException | None = None
        self.wake = asyncio.Event()
        self.progress = asyncio.Event()
        self.task = asyncio.get_running_loop().create_task(self._write_loop())
        # A stream silent for `keepalive_s` gets a comment in the next batch (ServerConfig.sse_keepalive_s).
        self.keepalive = None if keepalive_s is None else Keepalive(keepalive_s, self._comment)

    def _comment(self) -> None:
        if self.error is None:
            self._append(SSE_COMMENT)

    async def send(self, data: bytes, *, urgent: bool) -> None:
        if self.error is not None:
            raise ConnectionResetError("the SSE stream is broken") from self.error
        if self.keepalive is not None:
            self.keepalive.heard()
        self._append(data)
        if urgent or self.size > BATCH_BYTES:
            await self._until_written(self.queued)

    def _append(self, data: bytes) -> None:
        if not self.parts:
            self.queued += 1  # a new batch
        self.parts.append(data)
        self.size += len(data)
        self.wake.set()

    async def flush(self) -> None:
        """The stream's end: no more keepalives; return once everything sent so far is written."""
        if self.keepalive is not None:
            self.keepalive.stop()
        await self._until_written(self.queued)

    def cancel(self) -> None:
        """Stop the writer (whatever it has not written is dropped) and its keepalive."""
        if self.keepalive is not None:
            self.keepalive.stop()
        self.task.cancel()

    async def _until_written(self, batch: int) -> None:
        while self.written < batch:
            if self.error is not None:
                raise ConnectionResetError("the SSE stream is broken") from self.error
            self.progress.clear()
            await self.progress.wait()

    async def _write_loop(self) -> None:
        try:
            while True:
                await self.wake.wait()
                self.wake.clear()
                if not self.parts:
                    continue
                data = b"".join(self.parts)
                self.parts.clear()
                self.size = 0
                batch = self.queued
                await self.resp.write(data)
                self.written = batch
                self.progress.set()
        except Exception as exc:  # a reset peer, or anything else: senders must not hang
            self.error = exc
            self.progress.set()
