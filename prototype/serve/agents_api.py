"""The Agents API's sessions, without aiohttp types: each route's plan, and the runner that
carries out a session core's outputs (agents.py) with the engine.

`AgentsAPI` answers every route of `/v1/agents/sessions` with a `JSONReply` (a resource, an
error in the API's shape, or the empty 202 of an input POST) or an `EventFeed` (server-sent
events). The live server (`app.py`) and the in-process transport (`sim.runtime.inprocess`) both
call it, so they answer alike. A `SessionRunner` owns one session: its core, its subscribers,
and the task of its running turn, which is one `Engine.run` in the `append` pause dialect (the
runner is the run's `Channel`): the turn pauses at each function call holding its KV, and
resumes with the tool results the core hands over.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

import msgspec
from msgspec import Raw

from ..agents import wire as w
from ..agents.events import (
    MAX_TOOLS_BYTES,
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
from ..agents.machine import (
    SessionCore,
    output_item,
)
from ..config import ServerConfig
from ..context.cache import CacheEntry
from ..context.conversation import Item, parse_item
from ..ids import IdFactory
from ..response.engine import Engine
from ..response.run import Aborted, Inbox, Resumed
from ..response.services import Arrival
from ..wire.contract import from_validation_error
from ..wire.errors import INTERNAL_ERROR, ProtocolError
from ..wire.schemas import RequiredInput, ServerEvent, SteerRef, decode_text, encode
from ..wire.sse import encode_event
from .exchange import JSONReply, http_create, request_too_large
from .feeds import EventFeed, let_subscribers_read, too_slow_frame

__all__ = ["AgentsAPI", "SessionRunner", "DEFAULT_MODEL"]

log = logging.getLogger("longrun.agents")

DEFAULT_MODEL: Final = "gpt-5.5"  # a session created without `agent.model` runs this model name
LIST_LIMIT_MAX: Final = 100
ACCEPTED: Final = JSONReply(202, b"")


def beta_missing() -> ProtocolError:
    return ProtocolError(
        "The Agents API is in beta: send the header 'OpenAI-Beta: agents=v1'.",
        code="missing_beta_header",
        param="OpenAI-Beta",
    )


def not_found(what: str, ident: str, param: str) -> ProtocolError:
    return ProtocolError(f"No {what} found with id '{ident}'.", code="not_found", status=404, param=param)


@dataclass(frozen=True, slots=True)
class StreamReply:
    """A route that answers with server-sent events (`feed` until it ends)."""

    feed: EventFeed
    runner: SessionRunner


class SessionRunner:
    """One session: carries out its core's outputs (events to the subscribers, the turn's task,
    its resume and cancel). The running turn's `Channel` (`response/run.py`)."""

    def __init__(self, api: AgentsAPI, core: SessionCore, tools: list[dict[str, Any]]) -> None:
        self.api = api
        self.dialect = "append"  # the engine's pause dialect: pause at each call, resume on its outputs
        self.core = core
        self.tools = tools  # the turn request's tools, in the Responses shape
        self.feeds: list[EventFeed] = []
        self.inbox = Inbox()
        self.task: asyncio.Task[None] | None = None
        self.cached: CacheEntry | None = None  # the last turn's context, continued by the next turn
        self.cancelling = False
        # The POST being applied (when it arrived, its size): what a turn it starts or resumes was
        # uploaded as; None between POSTs (a turn started by queued messages arrived with nothing).
        self.posted: tuple[float, int] | None = None
        self.pause_timer: asyncio.Task[None] | None = None

    # -- the routes' side --------------------------------------------------------------------------

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
        self.disarm()
        self.core.receive(DeleteReceived(), at=self.api.engine.clock.time())
        self.flush()
        for feed in self.feeds:
            feed.put(None)
        self.feeds.clear()

    # -- carrying out the core's outputs -----------------------------------------------------------

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
                    self.task = asyncio.get_running_loop().create_task(self._run(out, self._arrival()))
                case ResumeTurn(items=items):
                    self.disarm()
                    parsed = tuple(parse_item(data, i) for i, data in enumerate(items))
                    self.inbox.decide(Resumed(parsed, dataclasses.replace(self._arrival(), routed=True)))
                case CancelTurn():
                    self.disarm()
                    if self.task is not None:
                        self.cancelling = True
                        self.task.cancel()

    def _arrival(self) -> Arrival:
        """How the input that starts or resumes a turn arrived: the POST being applied, else now."""
        at, size = self.posted if self.posted is not None else (self.api.engine.clock.now(), 0)
        return Arrival(at, size, "http")

    async def _run(self, start: StartTurn, arrival: Arrival) -> None:
        engine, core = self.api.engine, self.core
        ended: TurnEnded
        try:
            body = turn_body(core.agent, self.tools, start.items, start.previous_response_id)
            _, create, _ = http_create(body, engine, self.api.config)
            cached = (
                self.cached
                if self.cached is not None and self.cached.response_id == start.previous_response_id
                else None
            )

            async def emit(events: list[ServerEvent]) -> None:
                core.response_events(events)
                self.flush()
                await let_subscribers_read(self.feeds)

            outcome = await engine.run(create, cached, emit, arrival=arrival, channel=self)
            response = outcome.response
            if outcome.entry is not None:
                self.cached = outcome.entry
            if outcome.error is not None:
                ended = TurnEnded("failed", reason=outcome.error.code, message=outcome.error.message)
            else:
                reason = response.incomplete_details.reason if response.incomplete_details is not None else None
                if response.error is not None:
                    reason = response.error.code
                stored = outcome.entry is not None
                usage = response.usage
                ended = TurnEnded(response.status, response.id, usage, reason, stored=stored, response=response)
        except asyncio.CancelledError:
            if not self.cancelling:
                raise
            ended = TurnEnded("cancelled")
        except ProtocolError as err:
            ended = TurnEnded("failed", reason=err.code, message=err.message)
        except Exception:
            log.exception("session %s: turn %s failed", core.id, start.turn_id)
            ended = TurnEnded("failed", reason="server_error", message=INTERNAL_ERROR.message)
        self.disarm()
        self.cancelling = False
        self.task = None
        core.receive(ended, at=engine.clock.time())
        self.flush()

    # -- Channel -----------------------------------------------------------------------------------

    def called(self, call: RequiredInput) -> None:
        raise AssertionError("the append dialect reports no calls mid-turn")

    def turn_ended(self) -> tuple[Item, ...]:
        raise AssertionError("the append dialect has no turn-end hand-over")

    def steers(self) -> tuple[SteerRef, ...]:
        return ()  # a message posted during a turn is the session core's (committed at a step boundary)

    def paused(self, required: tuple[RequiredInput, ...]) -> None:
        self.core.receive(TurnPaused(required), at=self.api.engine.clock.time())
        self.flush()
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


def turn_body(agent: w.AgentOut, tools: list[dict[str, Any]], items: tuple[bytes, ...], previous: str | None) -> bytes:
    """The Responses create a turn runs as (stored, streamed, continuing the previous turn)."""
    body: dict[str, Any] = {"model": agent.model, "input": [Raw(item) for item in items], "store": True, "stream": True}
    if agent.instructions is not None:
        body["instructions"] = agent.instructions
    if tools:
        body["tools"] = tools
    if previous is not None:
        body["previous_response_id"] = previous
    return encode(body)


class AgentsAPI:
    """Every session of one server, and the plan of each `/v1/agents/sessions` route."""

    def __init__(self, engine: Engine, config: ServerConfig, *, seed: int | None = None) -> None:
        self.engine = engine
        self.config = config
        # Its own ids: the engine's stay the same sequence in every mode for a seed.
        self.ids = IdFactory((seed or 0) ^ 0xA6E)
        self.sessions: dict[str, SessionRunner] = {}

    # -- decoding ----------------------------------------------------------------------------------

    def decoded(self, body: bytes, decode: Any) -> Any:
        if len(body) > self.config.max_message_bytes:
            raise request_too_large(self.config.max_message_bytes)
        try:
            return decode(decode_text(body))
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise from_validation_error(exc) from None

    def messages(self, value: str | list[w.MessageIn], param: str) -> tuple[bytes, ...]:
        """Input messages as Responses items, each validated by the Responses item parser."""
        if isinstance(value, str):
            if not value:
                raise ProtocolError("'input' must not be empty.", code="invalid_value", param=param)
            value = [w.MessageIn(role="user", content=[Raw(encode({"type": "input_text", "text": value}))])]
        if not value:
            raise ProtocolError("'input' must not be empty.", code="invalid_value", param=param)
        out: list[bytes] = []
        for index, message in enumerate(value):
            data = encode(message)
            try:
                parse_item(data, index)
            except ProtocolError as err:
                raise ProtocolError(err.message, code=err.code, param=f"{param}[{index}]") from None
            out.append(data)
        return tuple(out)

    # -- routes ------------------------------------------------------------------------------------

    def check_beta(self, headers: Mapping[str, str]) -> None:
        values = [v.strip() for v in headers.get("OpenAI-Beta", "").split(",")]
        if w.AGENTS_BETA not in values:
            raise beta_missing()

    def update(self, session_id: str) -> JSONReply:
        """`POST .../sessions/{id}` (session updates) is not served: refused in the API's shape."""
        self.runner(session_id)
        raise ProtocolError(
            "Session updates are not supported by longrun's Agents API subset.",
            code="unsupported_operation",
            param=None,
        )

    def create(self, body: bytes) -> JSONReply | StreamReply:
        params: w.SessionCreateBody = self.decoded(body, w.decode_session_create)
        agent, tools = self._agent(params)
        if params.input is None:
            raise ProtocolError(
                "Missing required parameter: 'input' (required when 'environment.type' is 'none').",
                code="missing_required_parameter",
                param="input",
            )
        messages = self.messages(params.input, "input")
        # The first turn's request, validated now: a bad tool or message is the create's 400.
        http_create(turn_body(agent, tools, messages, None), self.engine, self.config)
        now = self.engine.clock.time()
        core = SessionCore(
            self.ids.new("sess"),
            agent,
            ids=self.ids,
            now=now,
            metadata=params.metadata,
            prompt_cache_ttl=params.prompt_cache_options.ttl if params.prompt_cache_options else None,
        )
        runner = self.sessions[core.id] = SessionRunner(self, core, tools)
        feed = runner.subscribe(until_idle=True) if params.stream else None
        core.announce()
        runner.posted = (self.engine.clock.now(), len(body))
        core.receive(MessageReceived(messages), at=now)
        snapshot = core.snapshot()
        try:
            runner.flush()
        finally:
            runner.posted = None
        if feed is not None:
            return StreamReply(feed, runner)
        return JSONReply(200, encode(snapshot))

    def runner(self, session_id: str) -> SessionRunner:
        runner = self.sessions.get(session_id)
        if runner is None:
            raise not_found("session", session_id, "session_id")
        return runner

    def retrieve(self, session_id: str) -> JSONReply:
        return JSONReply(200, encode(self.runner(session_id).core.snapshot()))

    def delete(self, session_id: str) -> JSONReply:
        runner = self.runner(session_id)
        runner.delete()
        del self.sessions[session_id]
        return JSONReply(200, encode(w.DeletedSession(id=session_id)))

    def list_sessions(self, query: Mapping[str, str]) -> JSONReply:
        views = [(r.core.id, r.core.snapshot()) for r in self.sessions.values()]
        return JSONReply(200, encode(page(views, query)))

    def post_events(self, session_id: str, body: bytes, key: str | None) -> JSONReply:
        self.runner(session_id).submit(body, key)
        return ACCEPTED

    def stream_events(self, session_id: str) -> StreamReply:
        runner = self.runner(session_id)
        return StreamReply(runner.subscribe(), runner)

    def list_turns(self, session_id: str, query: Mapping[str, str]) -> JSONReply:
        core = self.runner(session_id).core
        return JSONReply(200, encode(page([(t.id, core.turn_view(t)) for t in core.turns], query)))

    def get_turn(self, session_id: str, turn_id: str) -> JSONReply:
        core = self.runner(session_id).core
        for turn in core.turns:
            if turn.id == turn_id:
                return JSONReply(200, encode(core.turn_view(turn)))
        raise not_found("turn", turn_id, "turn_id")

    def list_items(self, session_id: str, query: Mapping[str, str], turn_id: str | None = None) -> JSONReply:
        core = self.runner(session_id).core
        if turn_id is not None and all(t.id != turn_id for t in core.turns):
            raise not_found("turn", turn_id, "turn_id")
        items = [(_item_id(item), item) for tid, item in core.items if turn_id is None or tid == turn_id]
        return JSONReply(200, encode(page(items, query)))

    async def close(self) -> None:
        """End every event stream and cancel every running turn (server shutdown)."""
        for runner in self.sessions.values():
            for feed in runner.feeds:
                feed.put(None)
            runner.feeds.clear()
        for runner in self.sessions.values():
            runner.disarm()
        tasks = [r.task for r in self.sessions.values() if r.task is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # -- helpers -----------------------------------------------------------------------------------

    def _agent(self, params: w.SessionCreateBody) -> tuple[w.AgentOut, list[dict[str, Any]]]:
        env_type = params.environment.get("type")
        if env_type != "none":
            raise ProtocolError(
                f"Unsupported environment type {env_type!r}: longrun runs sessions with "
                "'environment': {'type': 'none'} only.",
                code="unsupported_value",
                param="environment.type",
            )
        if params.agent_id is not None:
            raise not_found("agent", params.agent_id, "agent_id")
        agent = params.agent or w.AgentIn()
        if agent.multi_agent and agent.multi_agent.get("enabled"):
            raise ProtocolError(
                "Subagents are not supported by longrun.", code="unsupported_value", param="agent.multi_agent.enabled"
            )
        tools_out: list[w.FunctionToolOut] = []
        tools: list[dict[str, Any]] = []
        total = 2
        for index, raw in enumerate(agent.tools or []):
            data = msgspec.json.decode(raw)
            kind = data.get("type") if isinstance(data, dict) else None
            if kind != "function":
                raise ProtocolError(
                    f"Unsupported tool type {kind!r}: longrun's sessions run function tools only.",
                    code="unsupported_value",
                    param=f"agent.tools[{index}].type",
                )
            total += len(encode(data)) + 1
            try:
                tool = msgspec.json.decode(raw, type=_FunctionToolIn)
            except msgspec.ValidationError as exc:
                err = from_validation_error(exc)
                raise ProtocolError(err.message, code=err.code, param=f"agent.tools[{index}]") from None
            tools_out.append(
                w.FunctionToolOut(
                    name=tool.name,
                    description=tool.description,
                    parameters=tool.parameters,
                    defer_loading=tool.defer_loading,
                )
            )
            tools.append(
                {
                    "type": "function",
                    "name": tool.name,
                    "description": tool.description,
                    "parameters": tool.parameters,
                    "strict": False,
                }
            )
        if total > MAX_TOOLS_BYTES:
            raise ProtocolError(
                f"The agent's tools take {total} bytes of JSON; at most {MAX_TOOLS_BYTES} (8 MiB) are allowed.",
                code="invalid_value",
                param="agent.tools",
            )
        out = w.AgentOut(
            id=self.ids.new("agent"),
            instructions=agent.instructions,
            model=agent.model or DEFAULT_MODEL,
            tools=tools_out,
        )
        return out, tools


class _FunctionToolIn(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, rename={"is_async": "async"}):
    type: Literal["function"]
    name: str
    description: str
    parameters: dict[str, Any]
    defer_loading: bool = False
    is_async: bool = False


def _item_id(item: w.SessionItem) -> str:
    return item.id or ""


def page(rows: list[tuple[str, Any]], query: Mapping[str, str]) -> w.ListPage:
    """A cursor page (`after`, `limit` 1-100 default 20, `order` default `desc`), as the SDK's
    `CursorPage` reads it."""
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise ProtocolError(
            f"Invalid 'order': {order!r}; expected 'asc' or 'desc'.", code="invalid_value", param="order"
        )
    try:
        limit = int(query.get("limit", "20"))
    except ValueError:
        raise ProtocolError("Invalid 'limit': expected an integer.", code="invalid_type", param="limit") from None
    if not 1 <= limit <= LIST_LIMIT_MAX:
        raise ProtocolError(
            f"Invalid 'limit': {limit}; expected a value between 1 and {LIST_LIMIT_MAX}.",
            code="invalid_value",
            param="limit",
        )
    ordered = rows if order == "asc" else rows[::-1]
    after = query.get("after")
    if after is not None:
        ids = [ident for ident, _ in ordered]
        if after not in ids:
            raise not_found("resource", after, "after")
        ordered = ordered[ids.index(after) + 1 :]
    chosen = ordered[:limit]
    return w.ListPage(
        data=[view for _, view in chosen],
        first_id=chosen[0][0] if chosen else None,
        last_id=chosen[-1][0] if chosen else None,
        has_more=len(ordered) > limit,
    )
