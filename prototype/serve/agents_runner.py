"""One Agents API session in the process that runs it (`SessionRunner`): its core, its event
subscribers, its turns' tasks, its copy of the last context, and its record in the store.

The runner carries out its core's outputs (`prototype/agents/machine.py`) with the engine: a turn
is one response (`Engine.start`, then its `ResponseRun.run`) in the `append` pause dialect, the
runner being the run's `Channel`, so the turn pauses at each function call holding its KV and
resumes with the tool results the core hands over. It writes the session's record
(`prototype/agents/record.py`) by compare-and-set over the bytes it last read or wrote: the routes'
changes before they answer, the engine's in the background, and while a turn runs, a renewal of
its lease every third of `AgentsConfig.lease_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from typing import Any, Protocol

from msgspec import Raw

from ..agents import wire as w
from ..agents.events import (
    SS,
    CancelReceived,
    CancelTurn,
    DeleteReceived,
    MessageReceived,
    Publish,
    ResumeTurn,
    StartTurn,
    ToolResultReceived,
    TurnEnded,
    TurnPaused,
)
from ..agents.machine import SessionCore, output_item
from ..agents.record import encode_record, record_of, session_key
from ..config import ServerConfig
from ..context.cache import CacheEntry
from ..context.conversation import Item, parse_item
from ..ids import IdFactory
from ..response.dialect import AppendResponse, ResponseDialect
from ..response.engine import Engine, store_errors
from ..response.finish import Outcome
from ..response.run import Aborted, Inbox, Resumed
from ..response.services import Arrival
from ..store.base import ResponseStore
from ..wire.errors import INTERNAL_ERROR, ProtocolError
from ..wire.schemas import RequiredInput, ServerEvent, SteerRef, encode
from ..wire.sse import encode_event
from .exchange import http_create
from .feeds import EventFeed, let_subscribers_read, too_slow_frame


class SessionHost(Protocol):
    """What a runner needs of the API that keeps it (`agents_api.AgentsAPI`)."""

    engine: Engine
    config: ServerConfig
    store: ResponseStore
    ids: IdFactory
    instance: str  # this process, as the owner of the turns it runs
    lease_s: float

    def decoded(self, body: bytes, decode: Any) -> Any: ...

    def messages(self, value: str | list[w.MessageIn], param: str) -> tuple[bytes, ...]: ...


__all__ = ["SessionHost", "SessionRunner", "conflict", "tools_of", "turn_body"]

log = logging.getLogger("longrun.agents")


def conflict(session_id: str) -> ProtocolError:
    """The session's record changed under this process (another process wrote it): retry."""
    return ProtocolError(
        f"Session '{session_id}' was changed by another request at the same time; retry.",
        code="conflict",
        status=409,
        param="session_id",
    )


def tools_of(agent: w.AgentOut) -> list[dict[str, Any]]:
    """The agent's tools in the Responses shape, as each turn's request carries them."""
    return [
        {"type": "function", "name": t.name, "description": t.description, "parameters": t.parameters, "strict": False}
        for t in agent.tools
    ]


def turn_body(agent: w.AgentOut, items: tuple[bytes, ...], previous: str | None) -> bytes:
    """The Responses create a turn runs as (stored, streamed, continuing the previous turn)."""
    body: dict[str, Any] = {"model": agent.model, "input": [Raw(item) for item in items], "store": True, "stream": True}
    if agent.instructions is not None:
        body["instructions"] = agent.instructions
    if agent.tools:
        body["tools"] = tools_of(agent)
    if previous is not None:
        body["previous_response_id"] = previous
    return encode(body)


class SessionRunner:
    """One session: carries out its core's outputs (events to the subscribers, the turn's task,
    its resume and cancel) and keeps its record. The running turn's `Channel` (`response/run.py`)."""

    def __init__(self, api: SessionHost, core: SessionCore, saved: bytes | None) -> None:
        self.api = api
        # The engine's pause dialect: pause at each call, resume on its outputs.
        self.dialect: type[ResponseDialect] = AppendResponse
        self.core = core
        self.feeds: list[EventFeed] = []
        self.inbox = Inbox()
        self.tasks: dict[str, asyncio.Task[None]] = {}  # turn id -> its run (a cancelled one may wind down)
        self.cached: CacheEntry | None = None  # the last turn's context, continued by the next turn
        # The POST being applied (when it arrived, its size): what a turn it starts or resumes was
        # uploaded as; None between POSTs (a turn started by queued messages arrived with nothing).
        self.posted: tuple[float, int] | None = None
        self.pause_timer: asyncio.Task[None] | None = None
        self.saved = saved  # the record's bytes as this runner last read or wrote them
        self.saved_revision = core.revision
        self.lock = asyncio.Lock()  # one write of the record at a time
        self.saver: asyncio.Task[None] | None = None
        self.renewer: asyncio.Task[None] | None = None
        self.gone = False  # deleted, or lost from the store: nothing more is written

    @property
    def busy(self) -> bool:
        """Kept in memory whatever the idle-session bound: a turn runs, or someone listens."""
        return self.core.active is not None or bool(self.feeds) or bool(self.tasks)

    # -- the record ----------------------------------------------------------------------------------

    async def save(self) -> None:
        """Write the record over the bytes last read or written here; a record changed meanwhile by
        another process is a 409 `conflict`, a store outage a 503."""
        async with self.lock:
            if self.gone:
                return
            api, core = self.api, self.core
            revision = core.revision
            data = encode_record(record_of(core, owner=api.instance, lease_until=api.engine.clock.time() + api.lease_s))
            with store_errors(f"saving session {core.id}"):
                swapped = await api.store.swap(session_key(core.id), self.saved, data)
            if not swapped:
                raise conflict(core.id)
            self.saved, self.saved_revision = data, revision

    def mark(self) -> None:
        """The engine changed the session (a pause, a turn's end): write it in the background, then
        publish and act on what the change gave, so a client that reads the session from any
        process after the event reads what the event said."""
        if self.saver is None and not self.gone:
            self.saver = asyncio.get_running_loop().create_task(self._save_changes())

    async def _save_changes(self) -> None:
        try:
            await self.settle()
        except ProtocolError as err:  # an outage or a conflict: the next save (or read) retries it
            log.warning("session %s: the record was not saved: %s", self.core.id, err.message)
        finally:
            self.saver = None
        self.flush()

    async def settle(self) -> None:
        """Every change so far in the store when it returns, so a read answers only what is stored:
        a change made while a save was in flight (the turn ended meanwhile) is saved too."""
        while not self.gone and self.core.revision != self.saved_revision:
            await self.save()

    async def _renew(self) -> None:
        """While a turn runs, renew its lease every third of it (a write of the record)."""
        clock = self.api.engine.clock
        try:
            while self.core.active is not None and not self.gone:
                await clock.sleep_until(clock.now() + self.api.lease_s / 3)
                if self.core.active is not None:
                    with contextlib.suppress(ProtocolError):  # logged; the next renewal retries
                        await self.save()
        finally:
            if self.renewer is asyncio.current_task():
                self.renewer = None

    # -- the routes' side ------------------------------------------------------------------------------

    def subscribe(self, *, until_idle: bool = False) -> EventFeed:
        """A new event stream, bounded by `max_subscriber_bytes`; past `max_subscribers` open
        streams, a 429 (docs/agents-api.md#limits)."""
        config = self.api.config
        if config.max_subscribers is not None and len(self.feeds) >= config.max_subscribers:
            raise ProtocolError(
                f"Session '{self.core.id}' has {len(self.feeds)} open event streams; "
                f"at most {config.max_subscribers} are allowed.",
                code="too_many_subscribers",
                status=429,
                param=None,
            )
        session_id, ids = self.core.id, self.api.ids
        feed = EventFeed(
            limit=config.max_subscriber_bytes,
            dropped_frame=lambda limit: too_slow_frame(session_id, ids.new("event"), limit),
            until_idle=until_idle,
        )
        self.feeds.append(feed)
        return feed

    def unsubscribe(self, feed: EventFeed) -> None:
        with contextlib.suppress(ValueError):
            self.feeds.remove(feed)

    def submit(self, body: bytes, key: str | None) -> None:
        """`POST .../events`: the whole batch applied, or a `ProtocolError` and nothing applied."""
        core = self.core
        at = self.api.engine.clock.now()
        parsed = self.api.decoded(body, w.decode_events_body)
        if core.replayed(key, body):
            return
        messages = [
            self.api.messages(event.input, f"events[{i}].input") if isinstance(event, w.InputMessage) else ()
            for i, event in enumerate(parsed.events)
        ]
        core.check(parsed.events)
        for index, event in enumerate(parsed.events):
            if isinstance(event, w.InputToolResult):  # what the result becomes in the context, validated now
                try:
                    parse_item(output_item(event.call_id, event), index)
                except ProtocolError as err:
                    raise ProtocolError(err.message, code=err.code, param=f"events[{index}].output") from None
        self.posted = (at, len(body))
        inputs: list[MessageReceived | ToolResultReceived | CancelReceived] = []
        for event, items in zip(parsed.events, messages, strict=True):
            if isinstance(event, w.InputMessage):
                inputs.append(MessageReceived(items))
            elif isinstance(event, w.InputToolResult):
                inputs.append(ToolResultReceived(event))
            else:
                inputs.append(CancelReceived())
        core.apply(inputs, at=self.api.engine.clock.time())
        core.remember(key, body)
        try:
            self.flush()
        finally:
            self.posted = None

    def delete(self) -> None:
        """`DELETE`: cancel any active turn, end every stream; nothing more is written."""
        self.core.receive(DeleteReceived(), at=self.api.engine.clock.time())
        self.flush()
        self.close()

    def stop(self, message: str) -> None:
        """End the active turn `failed` with `message`: nothing in this process runs it (it was
        restored from the store) or will run it (the server stops)."""
        turn = self.core.active
        if turn is not None:
            ended = TurnEnded("failed", reason="server_error", message=message, turn_id=turn.id)
            self.core.receive(ended, at=self.api.engine.clock.time())
            self.flush()

    def close(self) -> None:
        """End every event stream, stop the timers and cancel every turn's task (the session is
        deleted, lost from the store, or the server stops)."""
        self.gone = True
        self.disarm()
        for feed in self.feeds:
            feed.put(None)
        self.feeds.clear()
        for task in (self.renewer, self.saver, *self.tasks.values()):
            if task is not None and task is not asyncio.current_task():
                task.cancel()

    async def wait_closed(self) -> None:
        tasks = [t for t in (self.renewer, self.saver, *self.tasks.values()) if t is not None]
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # -- carrying out the core's outputs -------------------------------------------------------------

    def flush(self) -> None:
        for out in self.core.outputs_to_send():
            match out:
                case Publish(event=event):
                    frame = encode_event(encode(event), event=event.__struct_config__.tag)  # type: ignore[arg-type]
                    idle = isinstance(event, w.SessionIdle)
                    for feed in list(self.feeds):
                        feed.put(frame)
                        if idle and feed.until_idle:
                            feed.put(None)
                            self.unsubscribe(feed)
                case StartTurn():
                    self.inbox = Inbox()
                    loop = asyncio.get_running_loop()
                    self.tasks[out.turn_id] = loop.create_task(self._run(out, self._arrival()))
                    if self.renewer is None:
                        self.renewer = loop.create_task(self._renew())
                case ResumeTurn(items=items):
                    self.disarm()
                    parsed = tuple(parse_item(data, i) for i, data in enumerate(items))
                    self.inbox.decide(Resumed(parsed, dataclasses.replace(self._arrival(), routed=True)))
                case CancelTurn(turn_id=turn_id):
                    self.disarm()
                    task = self.tasks.pop(turn_id, None)
                    if task is not None:
                        task.cancel()  # the core has ended the turn: nothing the task says counts

    def _arrival(self) -> Arrival:
        """How the input that starts or resumes a turn arrived: the POST being applied, else now.
        The runner keeps the session's last context, so its turns are served from that copy."""
        at, size = self.posted if self.posted is not None else (self.api.engine.clock.now(), 0)
        return Arrival(at, size, "http", session=True)

    async def _run(self, start: StartTurn, arrival: Arrival) -> None:
        engine, core, turn_id = self.api.engine, self.core, start.turn_id
        ended: TurnEnded
        try:
            body = turn_body(core.agent, start.items, start.previous_response_id)
            _, create, _ = http_create(body, engine, self.api.config)
            cached = (
                self.cached
                if self.cached is not None and self.cached.response_id == start.previous_response_id
                else None
            )

            async def emit(events: list[ServerEvent]) -> None:
                core.response_events(turn_id, events)
                self.flush()
                await let_subscribers_read(self.feeds)

            started = await engine.start(create, cached, emit, arrival=arrival, channel=self)
            # The response's life awaited here: this frame sits right over its every event.
            outcome = started if isinstance(started, Outcome) else await started.run()
            response = outcome.response
            if outcome.entry is not None:
                self.cached = outcome.entry
            if outcome.error is not None:
                ended = TurnEnded("failed", reason=outcome.error.code, message=outcome.error.message, turn_id=turn_id)
            else:
                reason = response.incomplete_details.reason if response.incomplete_details is not None else None
                message = None
                if response.error is not None:
                    reason, message = response.error.code, response.error.message
                stored = outcome.entry is not None
                ended = TurnEnded(
                    response.status,
                    response.id,
                    response.usage,
                    reason,
                    message,
                    stored=stored,
                    response=response,
                    turn_id=turn_id,
                )
        except asyncio.CancelledError:
            if core.active is not None and core.active.id == turn_id and not self.gone:
                raise  # not the core's cancel: the server is stopping
            return  # the core ended the turn when it asked for the cancel
        except ProtocolError as err:
            ended = TurnEnded("failed", reason=err.code, message=err.message, turn_id=turn_id)
        except Exception:
            log.exception("session %s: turn %s failed", core.id, turn_id)
            ended = TurnEnded("failed", reason="server_error", message=INTERNAL_ERROR.message, turn_id=turn_id)
        finally:
            if self.tasks.get(turn_id) is asyncio.current_task():
                del self.tasks[turn_id]
        self.disarm()
        core.receive(ended, at=engine.clock.time())
        self.mark()
        if core.active is None and self.renewer is not None:  # no turn runs: nothing to renew
            self.renewer.cancel()
            self.renewer = None

    # -- Channel ---------------------------------------------------------------------------------------

    def called(self, call: RequiredInput) -> None:
        raise AssertionError("the append dialect reports no calls mid-turn")

    def turn_ended(self) -> tuple[Item, ...]:
        raise AssertionError("the append dialect has no turn-end hand-over")

    def steers(self) -> tuple[SteerRef, ...]:
        return ()  # a message posted during a turn is the session core's (committed at a step boundary)

    def paused(self, required: tuple[RequiredInput, ...]) -> None:
        self.core.receive(TurnPaused(required), at=self.api.engine.clock.time())
        self.mark()
        if self.core.state is SS.REQUIRES_ACTION:  # it waits (it did not resume at once)
            self.pause_timer = asyncio.get_running_loop().create_task(self._pause_timeout())

    async def _pause_timeout(self) -> None:
        """The server decides how long a waiting turn holds its KV: past the pause timeout
        (`WebSocketConfig.append_timeout_s`, append mode's) its response ends `incomplete`."""
        clock = self.api.engine.clock
        await clock.sleep_until(clock.now() + self.api.config.websocket.append_timeout_s)
        self.pause_timer = None
        self.inbox.decide(Aborted("append_timeout"))

    def disarm(self) -> None:
        timer, self.pause_timer = self.pause_timer, None
        if timer is not None and timer is not asyncio.current_task():
            timer.cancel()
