"""The WebSocket session, without aiohttp types.

`WebSocketSession` drives one connection's sans-IO core (`connection.Connection`) and the
engine: it reads text frames from a `SessionSocket`, feeds them to the core, and carries
out the core's outputs (frames to write, responses to start, resume, abort or cancel,
pause timers, a close). The live server (`app.py`, over aiohttp) and the in-process
transport (`sim.inprocess`, without sockets) both drive this one class.
(The HTTP request path is `exchange.py`'s.)
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Final, Protocol, runtime_checkable

from ..config import ServerConfig
from ..context.cache import stream_prefix
from ..context.conversation import Item
from ..pipeline import Optimization
from ..response.dialect import ResponseDialect
from ..response.engine import Engine
from ..response.finish import Outcome
from ..response.run import Aborted, Emit, Inbox, Resumed
from ..response.services import Arrival
from ..response.stream import InjectAccepted, SteerAccepted
from ..wire.errors import INTERNAL_ERROR
from ..wire.schemas import (
    FunctionCallArgumentsDelta,
    OutputTextDelta,
    RequiredInput,
    ServerEvent,
    SteerRef,
    encode,
)
from ..ws.connection import Connection
from ..ws.events import (
    AbortPause,
    AckInject,
    AckSteer,
    ArmPauseTimer,
    CancelJob,
    CloseSocket,
    Job,
    Output,
    ResumeJob,
    SendFrame,
    StartJob,
    TakeInput,
)
from ..ws.timing import TimingFrames
from .admission import PLAIN, WebSocketTerms

__all__ = [
    "BatchedFrames",
    "SessionSocket",
    "TextSender",
    "WebSocketSession",
]

log = logging.getLogger("longrun.server")

CLOSE_UNSUPPORTED_DATA: Final = 1003  # RFC 6455 7.4.1: a binary frame where only text is accepted


class TextSender(Protocol):
    """Where a session's text frames go: the socket (one write per frame) or a `BatchedFrames`
    in front of its transport."""

    async def send_text(self, message: bytes) -> None: ...


class SessionSocket(TextSender, Protocol):
    """What a session needs of a WebSocket: its client frames (text as `str`, binary as
    `bytes`), whether it is closed, a close, and a way to send text frames."""

    @property
    def closed(self) -> bool: ...

    def __aiter__(self) -> AsyncIterator[str | bytes]: ...

    async def close(self, *, code: int, message: bytes) -> object: ...


# -- WebSocket -------------------------------------------------------------------------------------

TOKEN_DELTAS: Final = (OutputTextDelta, FunctionCallArgumentsDelta)
# Frames gathered before a write is forced mid wake-up (an unpaced turn never yields on its own).
BATCH_BYTES: Final = 64 * 1024


_TEXT_HEADS: Final = [bytes((0x81, n)) for n in range(126)]  # FIN + text opcode, 7-bit length


def _text_head(n: int) -> bytes:
    return bytes((0x81, 126)) + n.to_bytes(2) if n < 65536 else bytes((0x81, 127)) + n.to_bytes(8)


@runtime_checkable
class FrameBuffer(Protocol):
    """A writer that takes a text frame without waiting: into one buffer written in one go
    (`BatchedFrames`), or handed over in memory (the in-process transport's socket). `push` says
    when the caller should `drain` (flow control); `flush` writes what is held now."""

    def push(self, message: bytes) -> bool: ...

    async def drain(self) -> None: ...

    def flush(self) -> None: ...


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

    async def send_text(self, message: bytes) -> None:
        """One text frame (the only kind a session sends)."""
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


@dataclass(frozen=True, slots=True)
class _Close:
    code: int
    reason: bytes


_END: Final = _Close(0, b"")  # the writer's last item: the session is over


class Outbox:
    """A connection's one output writer. Every frame for the socket, the core's and every
    response's, is put here in order and without waiting, so frames leave in the order they were
    put and nothing else writes the socket.

    When the writer takes a frame without waiting (a `FrameBuffer`: on a live uncompressed socket
    its `BatchedFrames`, one buffer written in one go at the end of the event-loop wake-up or at
    once past `BATCH_BYTES`; the in-process transport's socket), the frames go straight into it;
    otherwise into a deque that one task (`run`) writes out. A response waits for `room` when the
    socket is behind (flow control). A close is written by that task after the frames put before
    it; frames put after it are dropped. Once the socket fails, `broken` is set and what is put is
    dropped."""

    __slots__ = ("_frames", "_queued", "_room", "_waiting", "_wake", "batched", "broken", "closing", "writer", "ws")

    def __init__(self, ws: SessionSocket, writer: TextSender) -> None:
        self.ws = ws
        self.writer = writer
        self.batched = writer if isinstance(writer, FrameBuffer) else None
        self._frames: collections.deque[bytes | _Close] = collections.deque()
        self._queued = 0  # bytes in the deque, not yet written
        self._wake = asyncio.Event()  # something for the task to write
        self._room = asyncio.Event()  # the deque below the high-water mark again
        self._waiting = 0  # responses waiting for room
        self.broken = False
        self.closing = False

    def put(self, frame: bytes) -> bool:
        """One frame; True when the caller should wait for `room` (the socket is behind)."""
        if self.broken or self.closing:
            return False
        if self.batched is not None:
            try:
                return self.batched.push(frame)
            except ConnectionResetError:
                self.broken = True
                return False
        self._frames.append(frame)
        self._queued += len(frame)
        self._wake.set()
        return self._queued > BATCH_BYTES

    def close(self, code: int, reason: bytes) -> None:
        """Close the socket after the frames put before (later ones are dropped)."""
        if self.batched is not None:
            self.batched.flush()
        self.closing = True
        self._frames.append(_Close(code, reason))
        self._wake.set()

    def finish(self) -> None:
        """The writer task returns once what was put before is written."""
        self._frames.append(_END)
        self._wake.set()

    async def room(self) -> None:
        """Until the socket has taken what was put (the batch's transport drained, the deque
        below `BATCH_BYTES`)."""
        if self.batched is not None:
            await self.batched.drain()
            return
        while self._queued > BATCH_BYTES and not self.broken:
            self._room.clear()
            self._waiting += 1
            try:
                await self._room.wait()
            finally:
                self._waiting -= 1

    async def run(self) -> None:
        """The writer task: the deque, in order, until `finish`."""
        frames, ws, writer, wake = self._frames, self.ws, self.writer, self._wake
        try:
            while True:
                await wake.wait()
                wake.clear()
                while frames:
                    frame = frames.popleft()
                    if isinstance(frame, _Close):
                        if frame is _END:
                            return
                        await ws.close(code=frame.code, message=frame.reason)
                        continue
                    self._queued -= len(frame)
                    if not ws.closed:
                        await writer.send_text(frame)
                    if self._waiting and self._queued <= BATCH_BYTES:
                        self._room.set()
                if self.batched is not None:
                    self.batched.flush()
        except ConnectionResetError:
            pass  # the peer is gone; the reader sees the close and frees everything
        finally:
            self.broken = True
            frames.clear()
            self._room.set()


class WebSocketSession:
    """Owns one socket: one reader (this coroutine), one task per response in flight (one per
    lane at most), one lifetime timer and one pause timer per paused response, both on the
    engine's clock. Everything it starts it also cancels and awaits."""

    def __init__(
        self,
        engine: Engine,
        config: ServerConfig,
        ws: SessionSocket,
        *,
        terms: WebSocketTerms = PLAIN,
        writer: TextSender | None = None,
    ) -> None:
        """`terms`: what admission (`admission.admit_websocket`) granted the upgrade."""
        self.engine = engine
        # Timing frames before each terminal or pause event, when the upgrade asked (prototype/ws/timing.py).
        self.timing = TimingFrames() if terms.timing else None
        self.ws = ws
        # Every frame goes through here, written by one task (to `writer`: `BatchedFrames` on a live
        # uncompressed socket, else the socket itself).
        self.out = Outbox(ws, writer or ws)
        self.append_timeout_s = config.websocket.append_timeout_s
        self.conn = Connection(
            config.websocket,
            append_mode=terms.append_mode and not terms.beta,
            beta=terms.beta,
            ids=engine.ids,
            reuse_tools=Optimization.STATE_CACHE not in config.disable,
            open_responses=config.open_responses,
            item_parser=engine.item_parser,
        )
        self.jobs: dict[int, _JobHandle] = {}  # by job number, while in flight
        self.dialect = self.conn.dialect.responses  # what each response's run builds its dialect from
        self.routed = False  # auth and routing done once on this connection

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        writer = loop.create_task(self.out.run())
        timer = loop.create_task(self._limit_at(self.engine.clock.now() + self.conn.limits.lifetime_s))
        try:
            async for data in self.ws:
                if isinstance(data, str):
                    self.conn.receive_text(data, at=self.engine.clock.now())
                    self.dispatch()
                else:
                    # Binary frames are a protocol violation; a binary *server* frame is a hard error for Codex.
                    self.out.close(CLOSE_UNSUPPORTED_DATA, b"binary frames are not supported")
                    break
        finally:
            timer.cancel()
            self.conn.disconnected()
            self.dispatch()
            tasks = [timer, *(handle.task for handle in self.jobs.values() if handle.task is not None)]
            for handle in self.jobs.values():
                handle.disarm()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            self.out.finish()  # what was put before is written (or dropped, the socket being closed)
            with contextlib.suppress(asyncio.CancelledError):
                await writer

    async def _limit_at(self, deadline: float) -> None:
        """The lifetime timer: the core decides what the limit means, this only arms it."""
        await self.engine.clock.sleep_until(deadline)
        if not self.ws.closed:
            self.conn.limit_reached()
            self.dispatch()

    def dispatch(self) -> None:
        """Carry out the core's outputs, without waiting: frames and a close go to the outbox,
        a job starts as a task, everything else lands in its job's inbox."""
        for out in self.conn.outputs_to_send():
            match out:
                case SendFrame(data=data):
                    self.out.put(data)
                case StartJob(job=job):
                    handle = self.jobs[job.number] = _JobHandle(self, job, self.dialect)
                    handle.task = asyncio.get_running_loop().create_task(self._run(handle))
                case CloseSocket(code=code, reason=reason):
                    self.out.close(code, reason.encode())
                case _:
                    target = self.jobs.get(out.job.number)
                    if target is not None:  # a job that ended meanwhile has nothing left to hear
                        target.carry_out(out)

    async def pause_timeout(self, job: Job) -> None:
        """A paused response's timer: past the append timeout the core decides what it means."""
        clock = self.engine.clock
        await clock.sleep_until(clock.now() + self.append_timeout_s)
        self.conn.pause_timed_out(job)
        self.dispatch()

    async def _run(self, handle: _JobHandle) -> None:
        job, out = handle.job, self.out
        prefix = stream_prefix(job.stream_id)
        # Frames straight from the encoder's bytes; a named lane's get its `stream_id` first.
        # The default lane's path makes no extra call per event.
        frame: Callable[[ServerEvent], bytes] = encode if prefix is None else lambda ev: prefix + encode(ev)[1:]
        emit: Emit
        if out.batched is not None:  # the per-token path: straight into the one buffer, in order
            push, drain, flush = out.batched.push, out.batched.drain, out.batched.flush

            async def emit(events: list[ServerEvent]) -> None:
                if out.closing or out.broken:
                    raise ConnectionResetError("the socket is closing")
                for ev in events:
                    if push(frame(ev)):
                        await drain()
                if events and type(events[-1]) not in TOKEN_DELTAS:
                    flush()  # token deltas wait for the wake-up's end; other events go now

        else:
            put = out.put

            async def emit(events: list[ServerEvent]) -> None:
                behind = False
                for ev in events:
                    behind = put(frame(ev)) or behind
                if behind:
                    await out.room()
                if out.broken or out.closing:
                    raise ConnectionResetError("the socket is closing")

        if self.timing is not None:  # only then: the default path makes no extra call per event
            untimed, around = emit, self.timing.around

            async def emit(events: list[ServerEvent]) -> None:
                await untimed(around(events))

        try:
            arrival = Arrival(job.arrived_at, job.body_bytes, "ws", routed=self.routed)
            self.routed = True
            started = await self.engine.start(
                job.request,
                job.cached,
                emit,
                arrival=arrival,
                response_id=job.response_id,
                channel=handle,
                fork=not job.exclusive,
            )
            # The response's life awaited here: this task's frame sits right over its every event.
            outcome = started if isinstance(started, Outcome) else await started.run()
        except ConnectionResetError:
            return  # the peer is gone; the reader sees the close and frees everything
        except Exception:
            log.exception("job %d failed", job.number)
            self.conn.response_ended(job, None, INTERNAL_ERROR, at=self.engine.clock.now())
        else:
            self.conn.response_ended(job, outcome.entry, outcome.error, outcome.owed, at=self.engine.clock.now())
        finally:
            handle.disarm()
            self.jobs.pop(job.number, None)
        self.dispatch()


class _JobHandle:
    """One response in flight on a session: its task, its pause timer, and the `Channel` its
    run talks to the core through. The core's outputs for the job land in `inbox`, which only
    the run's task drains."""

    __slots__ = ("dialect", "inbox", "job", "pause_timer", "session", "task")

    def __init__(self, session: WebSocketSession, job: Job, dialect: type[ResponseDialect]) -> None:
        self.session = session
        self.job = job
        self.dialect = dialect
        self.inbox = Inbox()
        self.task: asyncio.Task[None] | None = None
        self.pause_timer: asyncio.Task[None] | None = None

    def carry_out(self, out: Output) -> None:
        """One of the core's outputs for this job."""
        match out:
            case CancelJob():
                if self.task is not None:
                    self.task.cancel()
            case ArmPauseTimer():
                self.pause_timer = asyncio.get_running_loop().create_task(self.session.pause_timeout(self.job))
            case ResumeJob(items=items, at=at, body_bytes=size):
                self.disarm()
                self.inbox.decide(Resumed(items, Arrival(at, size, "ws", routed=True)))
            case AbortPause(reason=reason):
                self.disarm()
                self.inbox.decide(Aborted(reason))
            case AckInject(refused=refused):
                self.inbox.acknowledge(refused or InjectAccepted())
            case AckSteer(steer=steer):
                self.inbox.acknowledge(SteerAccepted(steer))
            case TakeInput(items=items):
                self.inbox.hand(items)

    def disarm(self) -> None:
        timer, self.pause_timer = self.pause_timer, None
        if timer is not None and timer is not asyncio.current_task():
            timer.cancel()

    # -- Channel -----------------------------------------------------------------------------------

    def called(self, call: RequiredInput) -> None:
        self.session.conn.call_emitted(self.job, call)
        self.session.dispatch()

    def turn_ended(self) -> tuple[Item, ...]:
        self.session.conn.turn_ended(self.job)
        self.session.dispatch()  # the core hands the input over at once (`TakeInput`)
        return self.inbox.take_handed()

    def paused(self, required: tuple[RequiredInput, ...]) -> None:
        self.session.conn.response_paused(self.job, required)
        self.session.dispatch()

    def steers(self) -> tuple[SteerRef, ...]:
        return self.session.conn.queued_steers(self.job)
