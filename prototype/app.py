"""aiohttp adapter: routes, auth, and byte movement. No protocol logic lives here.

`make_app` builds the application from injected parts (model, store, clock), so
tests run it in process over loopback and the entry point (`server.py`) wires in
the simulator. Every handler translates errors in one place (`errors.py`); an
unexpected exception becomes a generic `server_error` with details only in the
log.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import logging
import os
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Final, Protocol

import msgspec
from aiohttp import WSCloseCode, WSMsgType, web

from .cache import stream_prefix, tag_stream
from .clock import Clock
from .connection import (
    AbortPause,
    ArmPauseTimer,
    CancelJob,
    CloseSocket,
    Connection,
    Job,
    ResumeJob,
    SendFrame,
    StartJob,
)
from .conversation import ItemParser, normalize_create, parse_items
from .engine import Aborted, Arrival, Emit, Engine, RenderedItems, Resumed
from .errors import INTERNAL_ERROR, ProtocolError, from_validation_error, http_error_body
from .ids import IdFactory
from .model import TokenModel
from .pipeline import ALL_OPTIMIZATIONS, PROFILES, CostProfile, Optimization
from .safety import SafetyClassifier
from .schemas import (
    DeletedResponse,
    FunctionCallArgumentsDelta,
    OutputTextDelta,
    RequiredInput,
    ServerEvent,
    decode_create_params,
    decode_text,
    encode,
)
from .sse import DONE_FRAME, SSE_HEADERS, encode_event
from .store import ResponseStore
from .tokenizer import Tokenizer, get_tokenizer

__all__ = ["ENGINE", "ServerConfig", "Slots", "WebSocketSession", "make_app", "make_engine"]

log = logging.getLogger("longrun.server")

# Full-history replays and Codex's ~17k-character prompt plus tool schemas arrive
# in one frame or body; 64 MiB covers a 10M-character history with room to spare.
MAX_MESSAGE_BYTES: Final = 64 * 1024 * 1024
# Append mode is opted into per connection (docs/protocol.md): the historical V1 beta header
# value, or `?mode=append` on the upgrade URL (openai-python can pass it with `extra_query`).
APPEND_BETA: Final = "responses_websockets=2026-02-04"
# Per-connection and per-server limits (ServerConfig; None = unlimited). Codex never queues
# more than one create; a cache entry of a 10M-character history is about 20 MiB.
MAX_QUEUED_CREATES: Final = 64
MAX_CACHE_BYTES: Final = 256 * 1024 * 1024
MAX_CONNECTIONS: Final = 1024
RENDER_NICE: Final = 19  # the render threads' nice value (the event loop's stays as started)


@dataclass(frozen=True, slots=True)
class ServerConfig:
    api_key: str | None = None
    connection_lifetime_s: float = 3600.0  # the Guide: "Connection duration is limited to 60 minutes."
    reject_concurrent: bool = False  # 409 instead of FIFO queueing
    refuse_websocket: bool = False  # answer the upgrade with 426 (Codex then falls back to HTTP)
    sse_done: bool = False  # end SSE streams with `data: [DONE]`
    # A paused append-mode response holds KV while it waits; 300 s is within the retention of idle
    # prompt caches (cleared after 5 to 10 minutes of inactivity, OpenAI's prompt-caching guide).
    append_timeout_s: float = 300.0
    profile: CostProfile = PROFILES["local"]  # modeled waits of the API stages (pipeline.py)
    optimizations: frozenset[Optimization] = ALL_OPTIMIZATIONS  # connection-cache switches, WebSocket only
    max_message_bytes: int = MAX_MESSAGE_BYTES  # larger frames close the socket with 1009, larger bodies get 413
    max_queued_creates: int | None = MAX_QUEUED_CREATES  # per connection, behind the one in flight: 429 beyond
    max_cache_bytes: int | None = MAX_CACHE_BYTES  # per connection: a larger entry is not cached
    max_connections: int | None = MAX_CONNECTIONS  # open WebSocket connections: 503 before the upgrade beyond
    # Threads that tokenize long texts (>= engine.OFFLOAD_CHARS) off the event loop; 0: inline.
    render_threads: int = 1


class Slots:
    """Open WebSocket connections against `ServerConfig.max_connections`. A slot is taken
    before the upgrade, so concurrent upgrades cannot overshoot the limit."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.taken = 0

    def acquire(self) -> bool:
        if self.limit is not None and self.taken >= self.limit:
            return False
        self.taken += 1
        return True

    def release(self) -> None:
        self.taken -= 1


class _Socket(web.WebSocketResponse):
    """aiohttp closes on an oversize frame (1009) or invalid UTF-8 (1007) by itself, with an
    empty reason; this fills in a clear one for those codes."""

    def __init__(self, *, max_msg_size: int) -> None:
        super().__init__(max_msg_size=max_msg_size, compress=True, autoping=True)
        self._reasons: dict[int, bytes] = {
            WSCloseCode.MESSAGE_TOO_BIG: f"message larger than {max_msg_size} bytes".encode(),
            WSCloseCode.INVALID_TEXT: b"text frame is not valid UTF-8",
        }

    async def close(self, *, code: int = WSCloseCode.OK, message: bytes = b"", drain: bool = True) -> bool:
        return await super().close(code=code, message=message or self._reasons.get(code, b""), drain=drain)


ENGINE: Final = web.AppKey("engine", Engine)
CONFIG: Final = web.AppKey("config", ServerConfig)
SOCKETS: Final = web.AppKey[set[web.WebSocketResponse]]("sockets")
SLOTS: Final = web.AppKey("slots", Slots)


def make_engine(
    *,
    model: TokenModel,
    store: ResponseStore,
    clock: Clock,
    config: ServerConfig,
    seed: int | None = None,
    tokenizer: Tokenizer | None = None,
    classifier: SafetyClassifier | None = None,
    render_executor: Executor | None = None,
    item_parser: ItemParser = parse_items,
    rendered: RenderedItems | None = None,
) -> Engine:
    """The service behind every transport (the aiohttp app, or `sim.inprocess` without sockets).
    `tokenizer`, `classifier`, `item_parser` and `rendered` replace the defaults (the simulator's
    memoizing ones, `sim.memo`).
    Without `render_executor` every text is tokenized on the event loop (virtual time, where the
    loop charges that CPU to the clock)."""
    return Engine(
        model=model,
        store=store,
        clock=clock,
        tokenizer=tokenizer or get_tokenizer(),
        ids=IdFactory(seed),
        profile=config.profile,
        optimizations=config.optimizations,
        classifier=classifier,
        render_executor=render_executor,
        item_parser=item_parser,
        rendered=rendered,
    )


def make_app(
    *,
    model: TokenModel,
    store: ResponseStore,
    clock: Clock,
    config: ServerConfig | None = None,
    seed: int | None = None,
) -> web.Application:
    config = config or ServerConfig()
    app = web.Application(client_max_size=config.max_message_bytes, middlewares=[_auth_middleware])
    app[CONFIG] = config
    executor = None
    if config.render_threads > 0:
        executor = ThreadPoolExecutor(
            config.render_threads, thread_name_prefix="longrun-render", initializer=_background_thread
        )
        app.on_cleanup.append(functools.partial(_stop_executor, executor))
    app[ENGINE] = make_engine(model=model, store=store, clock=clock, config=config, seed=seed, render_executor=executor)
    sockets: set[web.WebSocketResponse] = set()
    app[SOCKETS] = sockets
    app[SLOTS] = Slots(config.max_connections)
    app.router.add_post("/v1/responses", create_response)
    app.router.add_get("/v1/responses", websocket_or_405)
    app.router.add_get("/v1/responses/{response_id}", get_response)
    app.router.add_delete("/v1/responses/{response_id}", delete_response)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", prometheus_metrics)
    app.on_shutdown.append(_close_sockets)
    app.on_cleanup.append(_close_store)
    return app


async def _close_sockets(app: web.Application) -> None:
    sockets = app[SOCKETS]
    for ws in list(sockets):
        await ws.close(code=WSCloseCode.GOING_AWAY, message=b"server shutdown")


def _background_thread() -> None:
    """Tokenizer threads yield the CPU to the event loop: nice 19 (Linux: per thread), so
    a burst of long renders on a busy core does not delay the streams' paced tokens."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), RENDER_NICE)


async def _stop_executor(executor: Executor, app: web.Application) -> None:
    executor.shutdown(wait=True, cancel_futures=True)  # a render in flight is short: let it end


async def _close_store(app: web.Application) -> None:
    await app[ENGINE].store.close()


def _json_error(err: ProtocolError) -> web.Response:
    return web.Response(status=err.status, body=http_error_body(err), content_type="application/json")


@web.middleware
async def _auth_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Bearer auth on every /v1 route, checked before a WebSocket upgrade is accepted."""
    key = request.app[CONFIG].api_key
    if key is not None and request.path.startswith("/v1/"):
        given = request.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            return _json_error(
                ProtocolError(
                    "Incorrect API key provided. You can find your API key in your server's configuration.",
                    code="invalid_api_key",
                    status=401,
                    type="invalid_request_error",
                )
            )
    try:
        return await handler(request)
    except web.HTTPException:
        raise
    except ProtocolError as err:
        return _json_error(err)


async def healthz(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def prometheus_metrics(request: web.Request) -> web.Response:
    return web.Response(text=request.app[ENGINE].prometheus(), content_type="text/plain", charset="utf-8")


# -- HTTP ------------------------------------------------------------------------------------------


async def create_response(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    try:
        body = await request.read()
    except web.HTTPRequestEntityTooLarge:
        limit = request.app[CONFIG].max_message_bytes
        return _json_error(
            ProtocolError(f"The request body is larger than {limit} bytes.", code="request_too_large", status=413)
        )
    arrival = Arrival(engine.clock.now(), len(body), "http")
    try:
        params = decode_create_params(decode_text(body))
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        return _json_error(from_validation_error(exc))
    # ProtocolError → middleware → JSON error body
    create = normalize_create(params, websocket=False, parse=engine.item_parser)
    if not params.stream:
        outcome = await engine.run(create, None, _discard, arrival=arrival)
        if outcome.error is not None:
            return _json_error(outcome.error)
        if outcome.response.status == "failed":
            return _json_error(outcome.failure or INTERNAL_ERROR)
        return web.Response(body=encode(outcome.response), content_type="application/json")

    resp = web.StreamResponse(status=200, headers=SSE_HEADERS)
    writer: BatchedSSE | None = None

    async def emit(events: list[ServerEvent]) -> None:
        nonlocal writer
        if writer is None:
            await resp.prepare(request)
            writer = BatchedSSE(resp)
        data = b"".join(encode_event(encode(ev), event=ev.__struct_config__.tag) for ev in events)  # type: ignore[arg-type]
        await writer.send(data, urgent=not events or type(events[-1]) not in TOKEN_DELTAS)

    try:
        outcome = await engine.run(create, None, emit, arrival=arrival)
        if outcome.error is not None:  # request errors come before the first event: a plain JSON error
            return _json_error(outcome.error)
        if writer is not None:
            await writer.flush()
        if request.app[CONFIG].sse_done:
            await resp.write(DONE_FRAME)
        await resp.write_eof()
    except ConnectionResetError:
        pass  # the client went away mid-stream: the engine stopped sampling and freed the turn
    finally:
        if writer is not None:
            writer.cancel()
    return resp


async def _discard(events: list[ServerEvent]) -> None:
    return None


async def get_response(request: web.Request) -> web.Response:
    response = await request.app[ENGINE].get_stored(request.match_info["response_id"])
    return web.Response(body=encode(response), content_type="application/json")


async def delete_response(request: web.Request) -> web.Response:
    response_id = request.match_info["response_id"]
    await request.app[ENGINE].delete_stored(response_id)
    return web.Response(body=encode(DeletedResponse(id=response_id)), content_type="application/json")


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
    if config.refuse_websocket:
        return _json_error(
            ProtocolError("WebSocket mode is disabled on this server; use HTTP.", code="upgrade_required", status=426)
        )
    slots = request.app[SLOTS]
    if not slots.acquire():
        return _json_error(
            ProtocolError(
                f"Too many open WebSocket connections on this server (at most {slots.limit}). "
                "Retry later, or use HTTP.",
                code="too_many_connections",
                status=503,
            )
        )
    try:
        append_mode = request.query.get("mode") == "append" or APPEND_BETA in request.headers.get("OpenAI-Beta", "")
        ws = _Socket(max_msg_size=config.max_message_bytes)
        await ws.prepare(request)
        request.app[SOCKETS].add(ws)
        transport = request.transport
        writer: FrameSender = ws
        if not ws.compress and transport is not None:
            writer = BatchedFrames(transport, request.writer.drain)
        try:
            await WebSocketSession(request.app[ENGINE], config, ws, append_mode=append_mode, writer=writer).serve()
        finally:
            request.app[SOCKETS].discard(ws)
    finally:
        slots.release()
    return ws


class FrameSender(Protocol):
    """Where a session's text frames go: the socket itself (aiohttp, one write per frame) or a
    `BatchedFrames` in front of its transport."""

    async def send_frame(self, message: bytes, opcode: WSMsgType, compress: int | None = None) -> None: ...


TOKEN_DELTAS: Final = (OutputTextDelta, FunctionCallArgumentsDelta)
# Frames gathered before a write is forced mid wake-up (an unpaced turn never yields on its own).
BATCH_BYTES: Final = 64 * 1024


_TEXT_HEADS: Final = [bytes((0x81, n)) for n in range(126)]  # FIN + text opcode, 7-bit length


def _text_head(n: int) -> bytes:
    return bytes((0x81, 126)) + n.to_bytes(2) if n < 65536 else bytes((0x81, 127)) + n.to_bytes(8)


class BatchedFrames:
    """Text frames of an uncompressed socket, written in one go per event-loop wake-up.

    Every frame due at a wake-up (all the tokens a paced model releases at once) is
    framed here (RFC 6455 5.2: FIN, opcode, payload length; server frames are not
    masked) and appended to one buffer; a callback scheduled with the first frame writes
    the buffer with one `transport.write` once the sending task yields. Past
    `BATCH_BYTES` the buffer is written at once and the sender waits for the
    transport to drain (flow control), as it does at the start of each batch. A session
    writes every frame through here and calls `flush` before closing, so frames keep their order.
    """

    def __init__(self, transport: asyncio.Transport, drain: Callable[[], Awaitable[None]]) -> None:
        self.transport = transport
        self.drain = drain
        self.parts: list[bytes] = []
        self.size = 0

    async def send_frame(self, message: bytes, opcode: WSMsgType = WSMsgType.TEXT, compress: int | None = None) -> None:
        """A text frame (the only kind a session sends), as `web.WebSocketResponse.send_frame`."""
        if self.push(message):
            await self.drain()

    def push(self, message: bytes) -> bool:
        """Add one text frame; True when the caller should `await drain()` (flow control)."""
        if self.transport.is_closing():
            raise ConnectionResetError("Cannot write to closing transport")
        parts = self.parts
        wait = False
        if not parts:  # the first frame of this wake-up
            asyncio.get_running_loop().call_soon(self.flush)
            wait = self.transport.get_write_buffer_size() > BATCH_BYTES
        n = len(message)
        parts.append(_TEXT_HEADS[n] if n < 126 else _text_head(n))
        parts.append(message)
        self.size += n
        if self.size > BATCH_BYTES:
            self.flush()
            return True
        return wait

    def flush(self) -> None:
        """Write what is gathered (nothing if a write already took it)."""
        if self.parts:
            data = b"".join(self.parts)
            self.parts.clear()
            self.size = 0
            if not self.transport.is_closing():
                self.transport.write(data)


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

    def __init__(self, resp: web.StreamResponse) -> None:
        self.resp = resp
        self.parts: list[bytes] = []
        self.size = 0
        self.written = 0  # batches written
        self.queued = 0  # batches taken or waiting
        self.error: BaseException | None = None
        self.wake = asyncio.Event()
        self.progress = asyncio.Event()
        self.task = asyncio.get_running_loop().create_task(self._write_loop())

    async def send(self, data: bytes, *, urgent: bool) -> None:
        if self.error is not None:
            raise ConnectionResetError("the SSE stream is broken") from self.error
        if not self.parts:
            self.queued += 1  # a new batch
        self.parts.append(data)
        self.size += len(data)
        self.wake.set()
        if urgent or self.size > BATCH_BYTES:
            await self._until_written(self.queued)

    async def flush(self) -> None:
        """Return once everything sent so far is written."""
        await self._until_written(self.queued)

    def cancel(self) -> None:
        """Stop the writer (whatever it has not written is dropped)."""
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


class WebSocketSession:
    """Owns one socket: one reader (this coroutine), one task per response in flight (one per
    lane at most), one lifetime timer and one pause timer per paused response, both on the
    engine's clock. Everything it starts it also cancels and awaits."""

    def __init__(
        self,
        engine: Engine,
        config: ServerConfig,
        ws: web.WebSocketResponse,
        *,
        append_mode: bool = False,
        writer: FrameSender | None = None,
    ) -> None:
        self.engine = engine
        self.ws = ws
        self.writer = writer or ws  # frames go here (`BatchedFrames` on a live uncompressed socket)
        self.append_timeout_s = config.append_timeout_s
        self.conn = Connection(
            lifetime_s=config.connection_lifetime_s,
            reject_concurrent=config.reject_concurrent,
            append_mode=append_mode,
            ids=engine.ids,
            max_queued=config.max_queued_creates,
            max_cache_bytes=config.max_cache_bytes,
            reuse_tools=Optimization.STATE_CACHE in config.optimizations,
        )
        self.jobs: dict[int, asyncio.Task[None]] = {}  # by job number
        self.pause_timers: dict[int, asyncio.Task[None]] = {}
        self.resumptions: dict[int, asyncio.Future[Resumed | Aborted]] = {}
        self.frame = Arrival(0.0, 0, "ws")  # the frame being handled
        self.routed = False  # auth and routing done once on this connection

    async def serve(self) -> None:
        clock = self.engine.clock
        timer = asyncio.get_running_loop().create_task(self._limit_at(clock.now() + self.conn.lifetime_s))
        try:
            async for msg in self.ws:
                if msg.type is WSMsgType.TEXT:
                    now = self.engine.clock.now()
                    self.frame = Arrival(now, len(msg.data), "ws", routed=True)
                    self.conn.receive_text(msg.data, at=now)
                    await self._flush()
                elif msg.type is WSMsgType.BINARY:
                    # Binary frames are a protocol violation; a binary *server* frame is a hard error for Codex.
                    self._flush_frames()
                    await self.ws.close(code=WSCloseCode.UNSUPPORTED_DATA, message=b"binary frames are not supported")
                    break
        finally:
            timer.cancel()
            self.conn.disconnected()
            await self._flush()
            for number in list(self.pause_timers):
                self._disarm_pause(number)
            tasks = [timer, *self.pause_timers.values(), *self.jobs.values()]
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def _limit_at(self, deadline: float) -> None:
        """The lifetime timer: the core decides what the limit means, this only arms it."""
        await self.engine.clock.sleep_until(deadline)
        if not self.ws.closed:
            self.conn.limit_reached()
            await self._flush()

    async def _flush(self) -> None:
        for out in self.conn.outputs_to_send():
            match out:
                case SendFrame(data=data):
                    if not self.ws.closed:
                        await self.writer.send_frame(data, WSMsgType.TEXT)
                case StartJob(job=job):
                    self.jobs[job.number] = asyncio.get_running_loop().create_task(self._run(job))
                case CancelJob(job=job):
                    task = self.jobs.get(job.number)
                    if task is not None:
                        task.cancel()
                case CloseSocket(code=code, reason=reason):
                    self._flush_frames()
                    await self.ws.close(code=code, message=reason.encode())
                case ArmPauseTimer(job=job):
                    self.pause_timers[job.number] = asyncio.get_running_loop().create_task(self._pause_timeout(job))
                case ResumeJob(job=job, items=items):
                    self._decide(job, Resumed(items, self.frame))
                case AbortPause(job=job, reason=reason):
                    self._decide(job, Aborted(reason))

    def _flush_frames(self) -> None:
        if isinstance(self.writer, BatchedFrames):
            self.writer.flush()

    def _decide(self, job: Job, decision: Resumed | Aborted) -> None:
        self._disarm_pause(job.number)
        resumption = self.resumptions.get(job.number)
        if resumption is not None and not resumption.done():
            resumption.set_result(decision)

    def _disarm_pause(self, number: int) -> None:
        timer = self.pause_timers.pop(number, None)
        if timer is not None and timer is not asyncio.current_task():
            timer.cancel()

    async def _pause_timeout(self, job: Job) -> None:
        clock = self.engine.clock
        await clock.sleep_until(clock.now() + self.append_timeout_s)
        self.conn.pause_timed_out(job)
        await self._flush()

    async def wait_resume(self, job: Job, required: tuple[RequiredInput, ...]) -> Resumed | Aborted:
        """`PauseChannel` for `job`: tell the core, then wait for its decision."""
        resumption: asyncio.Future[Resumed | Aborted] = asyncio.get_running_loop().create_future()
        self.resumptions[job.number] = resumption
        self.conn.response_paused(job, required)
        await self._flush()
        try:
            return await resumption
        finally:
            del self.resumptions[job.number]

    async def _run(self, job: Job) -> None:
        try:
            await self._serve_job(job)
        finally:
            self.jobs.pop(job.number, None)

    async def _serve_job(self, job: Job) -> None:
        writer = self.writer
        prefix = stream_prefix(job.stream_id)
        emit: Emit
        if isinstance(writer, BatchedFrames):
            push, drain, flush = writer.push, writer.drain, writer.flush

            async def emit(events: list[ServerEvent]) -> None:
                for ev in events:
                    if push(tag_stream(encode(ev), prefix)):  # text frames straight from the encoder's bytes
                        await drain()
                if events and type(events[-1]) not in TOKEN_DELTAS:
                    flush()  # token deltas wait for the wake-up's end; other events go now

        else:
            send = writer.send_frame

            async def emit(events: list[ServerEvent]) -> None:
                for ev in events:
                    await send(tag_stream(encode(ev), prefix), WSMsgType.TEXT)

        try:
            arrival = Arrival(job.arrived_at, job.body_bytes, "ws", routed=self.routed)
            self.routed = True
            outcome = await self.engine.run(
                job.request,
                job.cached,
                emit,
                arrival=arrival,
                response_id=job.response_id,
                counter=job.counter,
                pauses=_JobPauses(self, job) if self.conn.append_mode else None,
                fork=not job.exclusive,
            )
        except ConnectionResetError:
            return  # the peer is gone; the reader sees the close and frees everything
        except Exception:
            log.exception("job %d failed", job.number)
            self.conn.response_ended(job, None, INTERNAL_ERROR)
        else:
            self.conn.response_ended(job, outcome.entry, outcome.error)
        await self._flush()


class _JobPauses:
    """The `PauseChannel` of one response of a session."""

    __slots__ = ("job", "session")

    def __init__(self, session: WebSocketSession, job: Job) -> None:
        self.session = session
        self.job = job

    async def wait_resume(self, required: tuple[RequiredInput, ...]) -> Resumed | Aborted:
        return await self.session.wait_resume(self.job, required)
