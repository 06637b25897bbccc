"""The Agents API's routes without aiohttp types (`AgentsAPI`): each route's plan over the
sessions in the store and their runners in this process (`agents_runner.py`).

`AgentsAPI` answers every route of `/v1/agents/sessions` with a `JSONReply` (a resource, an
error in the API's shape, or the empty 202 of an input POST) or a `StreamReply` (server-sent
events). The live server (`app.py`) and the in-process transport (`sim.runtime.inprocess`) both
call it, so they answer alike.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

import msgspec
from msgspec import Raw

from ..agents import wire as w
from ..agents.events import MAX_TOOLS_BYTES, MessageReceived
from ..agents.machine import SessionCore
from ..agents.record import SESSION_KEY_PREFIX, SessionRecord, decode_record, restore, session_key
from ..config import ServerConfig
from ..context.conversation import parse_item
from ..ids import IdFactory
from ..response.engine import Engine, store_errors
from ..wire.contract import from_validation_error
from ..wire.errors import ProtocolError
from ..wire.schemas import decode_json, encode, guarded_decoder
from .agents_runner import SessionRunner, turn_body
from .exchange import JSONReply, decoded_body, http_create
from .feeds import EventFeed

__all__ = ["AgentsAPI", "DEFAULT_MODEL", "StreamReply"]

DEFAULT_MODEL: Final = "gpt-5.5"  # a session created without `agent.model` runs this model name
LIST_LIMIT_MAX: Final = 100
ACCEPTED: Final = JSONReply(202, b"")
# Why a turn ended `failed` without its response ending: no process runs it any more.
LOST: Final = "The server process running this turn stopped before it ended; the turn is lost."
STOPPED: Final = "The server stopped while this turn ran; the turn is lost."


def beta_missing() -> ProtocolError:
    return ProtocolError(
        "The Agents API is in beta: send the header 'OpenAI-Beta: agents=v1'.",
        code="missing_beta_header",
        param="OpenAI-Beta",
    )


def not_found(what: str, ident: str, param: str) -> ProtocolError:
    return ProtocolError(f"No {what} found with id '{ident}'.", code="not_found", status=404, param=param)


def active_elsewhere(session_id: str) -> ProtocolError:
    """A change to a session whose turn another server process runs (docs/agents-api.md)."""
    return ProtocolError(
        f"Session '{session_id}' has a turn running on another server process; send this request to "
        "that process, or retry once the turn has ended.",
        code="session_active_elsewhere",
        status=409,
        param="session_id",
    )


def _turns(found: SessionRunner | SessionRecord) -> list[w.TurnOut]:
    if isinstance(found, SessionRecord):
        return found.turns
    core = found.core
    return [core.turn_view(turn) for turn in core.turns]


@dataclass(frozen=True, slots=True)
class StreamReply:
    """A route that answers with server-sent events (`feed` until it ends)."""

    feed: EventFeed
    runner: SessionRunner


class AgentsAPI:
    """Every session of one server process, and the plan of each `/v1/agents/sessions` route.

    The store holds every session (`prototype/agents/record.py`); this process holds a runner for
    the sessions it runs a turn of, listens to, or used lately (at most
    `AgentsConfig.max_idle_sessions` idle ones). A route reads the record first: a runner whose
    bytes match it is current; a record another process changed is restored here; a record whose
    turn another process runs (its lease unexpired) is answered from the store, and a route that
    would change it gets a 409 `session_active_elsewhere`."""

    def __init__(self, engine: Engine, config: ServerConfig, *, ids: IdFactory) -> None:
        self.engine = engine
        self.config = config
        self.store = engine.store
        self.ids = ids  # the server's one id factory (random wherever the store outlives the process)
        self.lease_s = config.agents.lease_s
        self.instance = ids.new("proc")  # this process, as the owner of the turns it runs
        self.runners: collections.OrderedDict[str, SessionRunner] = collections.OrderedDict()

    # -- decoding ----------------------------------------------------------------------------------

    def decoded(self, body: bytes, decode: Any) -> Any:
        return decoded_body(body, self.config, decode)  # the Responses routes' size, UTF-8 and nesting guards

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
            except ProtocolError as err:  # named as the Responses `input[index]`: renamed to its place here
                where, here = f"input[{index}]", f"{param}[{index}]"
                path = here + (err.param or "").removeprefix(where) if (err.param or "").startswith(where) else here
                said = err.message.replace(f"'{err.param}'", f"'{path}'", 1) if err.param else err.message
                raise ProtocolError(said, code=err.code, param=path) from None
            out.append(data)
        return tuple(out)

    # -- routes ------------------------------------------------------------------------------------

    def check_beta(self, headers: Mapping[str, str]) -> None:
        values = [v.strip() for v in headers.get("OpenAI-Beta", "").split(",")]
        if w.AGENTS_BETA not in values:
            raise beta_missing()

    async def update(self, session_id: str) -> JSONReply:
        """`POST .../sessions/{id}` (session updates) is not served: refused in the API's shape."""
        await self._read(session_id)
        raise ProtocolError(
            "Session updates are not supported by longrun's Agents API subset.",
            code="unsupported_operation",
            param=None,
        )

    async def create(self, body: bytes) -> JSONReply | StreamReply:
        params: w.SessionCreateBody = self.decoded(body, w.decode_session_create)
        agent = agent_of(params, self.ids)
        if params.input is None:
            raise ProtocolError(
                "Missing required parameter: 'input' (required when 'environment.type' is 'none').",
                code="missing_required_parameter",
                param="input",
            )
        messages = self.messages(params.input, "input")
        # The first turn's request, validated now: a bad tool or message is the create's 400.
        http_create(turn_body(agent, messages, None), self.engine, self.config)
        now = self.engine.clock.time()
        core = SessionCore(
            self.ids.new("sess"),
            agent,
            ids=self.ids,
            now=now,
            metadata=params.metadata,
            prompt_cache_ttl=params.prompt_cache_options.ttl if params.prompt_cache_options else None,
        )
        runner = SessionRunner(self, core, None)
        feed = runner.subscribe(until_idle=True) if params.stream else None
        core.announce()
        runner.posted = (self.engine.clock.now(), len(body))
        core.receive(MessageReceived(messages), at=now)
        snapshot = core.snapshot()
        self._keep(runner)
        try:
            runner.flush()
        finally:
            runner.posted = None
        await self._saved(runner)
        if feed is not None:
            return StreamReply(feed, runner)
        return JSONReply(200, encode(snapshot))

    async def retrieve(self, session_id: str) -> JSONReply:
        found = await self._read(session_id)
        view = found.core.snapshot() if isinstance(found, SessionRunner) else found.session
        return JSONReply(200, encode(view))

    async def delete(self, session_id: str) -> JSONReply:
        runner = await self._open(session_id)
        runner.delete()
        self.runners.pop(session_id, None)
        with store_errors(f"deleting session {session_id}"):
            await self.store.delete(session_key(session_id))
        return JSONReply(200, encode(w.DeletedSession(id=session_id)))

    async def list_sessions(self, query: Mapping[str, str]) -> JSONReply:
        for runner in list(self.runners.values()):
            await runner.settle()
        records: list[SessionRecord] = []
        with store_errors("listing sessions"):
            for key in await self.store.scan(SESSION_KEY_PREFIX):
                data = await self.store.get(key)
                if data is not None:
                    records.append(decode_record(data))
        records.sort(key=lambda r: (r.created, r.session.id))
        return JSONReply(200, encode(page([(r.session.id, r.session) for r in records], query)))

    async def post_events(self, session_id: str, body: bytes, key: str | None) -> JSONReply:
        runner = await self._open(session_id)
        runner.submit(body, key)
        await self._saved(runner)
        return ACCEPTED

    async def stream_events(self, session_id: str) -> StreamReply:
        runner = await self._open(session_id)
        return StreamReply(runner.subscribe(), runner)

    async def list_turns(self, session_id: str, query: Mapping[str, str]) -> JSONReply:
        return JSONReply(200, encode(page([(t.id, t) for t in _turns(await self._read(session_id))], query)))

    async def get_turn(self, session_id: str, turn_id: str) -> JSONReply:
        for turn in _turns(await self._read(session_id)):
            if turn.id == turn_id:
                return JSONReply(200, encode(turn))
        raise not_found("turn", turn_id, "turn_id")

    async def list_items(self, session_id: str, query: Mapping[str, str], turn_id: str | None = None) -> JSONReply:
        found = await self._read(session_id)
        if turn_id is not None and all(t.id != turn_id for t in _turns(found)):
            raise not_found("turn", turn_id, "turn_id")
        items = found.core.items_list() if isinstance(found, SessionRunner) else found.items
        rows = [(item.id or "", item) for item in items if turn_id is None or item.turn_id == turn_id]
        return JSONReply(200, encode(page(rows, query)))

    async def close(self) -> None:
        """Server shutdown: a running turn ends `failed` in the store (no process runs it any more),
        then every event stream ends and every task is cancelled."""
        runners = list(self.runners.values())
        for runner in runners:
            runner.stop(STOPPED)
            with contextlib.suppress(ProtocolError):
                await runner.settle()
        for runner in runners:
            runner.close()
        for runner in runners:
            await runner.wait_closed()
        self.runners.clear()

    # -- the sessions in the store ---------------------------------------------------------------------

    async def _find(self, session_id: str) -> SessionRunner | SessionRecord:
        """The session as this process has it: its current runner, or the record of a session whose
        turn another process runs. A record changed by another process is restored here; a turn
        whose owner's lease ran out is ended `failed` first (no process runs it any more)."""
        self._trim()
        local = self.runners.get(session_id)
        if local is not None and local.core.active is not None:
            self.runners.move_to_end(session_id)
            return local  # this process runs its turn: its memory is the session
        key = session_key(session_id)
        async with local.lock if local is not None else contextlib.nullcontext():
            with store_errors(f"reading session {session_id}"):
                data = await self.store.get(key)
            if local is not None and data is not None and data == local.saved:
                self.runners.move_to_end(session_id)
                return local
        if data is None:
            if local is not None:  # gone from the store (deleted elsewhere, or the store lost it)
                self._drop(local)
            raise not_found("session", session_id, "session_id")
        record = decode_record(data)
        now = self.engine.clock.time()
        if record.active_turn is not None and record.owner != self.instance and record.lease_until > now:
            return record
        runner = SessionRunner(self, restore(record, ids=self.ids), data)
        if local is not None:  # changed by another process: its listeners and context carry over
            runner.feeds, runner.cached = local.feeds, local.cached
            local.feeds = []
            self._drop(local)
        self._keep(runner)
        if runner.core.active is not None:
            runner.stop(LOST)
            await self._saved(runner)
        return runner

    async def _read(self, session_id: str) -> SessionRunner | SessionRecord:
        """For a route that reads: what it answers is in the store."""
        found = await self._find(session_id)
        if isinstance(found, SessionRunner):
            await found.settle()
        return found

    async def _open(self, session_id: str) -> SessionRunner:
        """For a route that changes the session or listens to it: the runner in this process."""
        found = await self._find(session_id)
        if isinstance(found, SessionRecord):
            raise active_elsewhere(session_id)
        return found

    async def _saved(self, runner: SessionRunner) -> None:
        """The route's change in the store before it answers. A conflict means the store's record
        wins: this process's copy (and any turn it started from it) is dropped."""
        try:
            await runner.save()
        except ProtocolError as err:
            if err.code == "conflict" or runner.saved is None:  # a conflict, or a create not stored
                self._drop(runner)
            raise

    def _keep(self, runner: SessionRunner) -> None:
        self.runners[runner.core.id] = runner
        self.runners.move_to_end(runner.core.id)
        self._trim(keep=runner)

    def _trim(self, keep: SessionRunner | None = None) -> None:
        """Past the idle bound, forget the least recently used idle runners but `keep` (their
        records are in the store; what is lost is their copy of the last context)."""
        idle = [
            r for r in self.runners.values() if r is not keep and not r.busy and r.core.revision == r.saved_revision
        ]
        for old in idle[: max(0, len(idle) - self.config.agents.max_idle_sessions)]:
            self._drop(old)

    def _drop(self, runner: SessionRunner) -> None:
        if self.runners.get(runner.core.id) is runner:
            del self.runners[runner.core.id]
        runner.close()


class _FunctionToolIn(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, rename={"is_async": "async"}):
    type: Literal["function"]
    name: str
    description: str
    parameters: dict[str, Any]
    defer_loading: bool = False
    is_async: bool = False


_decode_tool: Final = guarded_decoder(msgspec.json.Decoder(_FunctionToolIn))


def agent_of(params: w.SessionCreateBody, ids: IdFactory) -> w.AgentOut:
    """The session's agent from a create's parameters (function tools only), or the 400 refusing it."""
    env_type = params.environment.get("type")
    if env_type != "none":
        raise ProtocolError(
            f"Unsupported environment type {env_type!r}: longrun runs sessions with "
            "'environment': {'type': 'none'} only.",
            code="unsupported_value",
            param="environment.type",
        )
    if params.vault_ids:
        raise ProtocolError(
            "Vaults are not supported by longrun's Agents API subset.",
            code="unsupported_value",
            param="vault_ids",
        )
    if params.agent_id is not None:
        raise not_found("agent", params.agent_id, "agent_id")
    agent = params.agent or w.AgentIn()
    if agent.multi_agent and agent.multi_agent.get("enabled"):
        raise ProtocolError(
            "Subagents are not supported by longrun.", code="unsupported_value", param="agent.multi_agent.enabled"
        )
    tools_out: list[w.FunctionToolOut] = []
    total = 2
    for index, raw in enumerate(agent.tools or []):
        data = decode_json(raw)  # already decoded once as part of the body: within the nesting limit
        kind = data.get("type") if isinstance(data, dict) else None
        if kind != "function":
            raise ProtocolError(
                f"Unsupported tool type {kind!r}: longrun's sessions run function tools only.",
                code="unsupported_value",
                param=f"agent.tools[{index}].type",
            )
        total += len(encode(data)) + 1
        try:
            tool = _decode_tool(raw)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
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
    if total > MAX_TOOLS_BYTES:
        raise ProtocolError(
            f"The agent's tools take {total} bytes of JSON; at most {MAX_TOOLS_BYTES} (8 MiB) are allowed.",
            code="invalid_value",
            param="agent.tools",
        )
    out = w.AgentOut(
        id=ids.new("agent"),
        instructions=agent.instructions,
        model=agent.model or DEFAULT_MODEL,
        tools=tools_out,
    )
    return out


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
