"""A WebSocket client's life across the connection limit: rotating before it, reconnecting at it.

Scenario: a rollout longer than a connection's lifetime (60 minutes on the API, `--connection-lifetime-s`
here). The API says only that a connection lasts at most that long and that a client reconnects
(`websocket_connection_limit_reached`); what the clients do, and what this client does:

* **Rotate before the limit.** A turn that would start within `margin_s` of the socket's limit
  opens a new socket first, as clients that pool sockets retire them early (docs/experiments.md
  has the figures each uses). Only a socket with no response waiting on it rotates: a paused
  response (append, inject) lives on its socket and cannot move.
* **Reconnect at the limit.** A create refused with `websocket_connection_limit_reached`, or a
  turn whose socket the server closed, is sent again once on a new socket, as Codex retries it.
* **A paused response cut by the limit** ends `incomplete` (reason `connection_limit`): the
  client restarts its turn as a `response.create` on a new socket, with the tool outputs as
  input and the cut response as `previous_response_id`, so the model sees the same context.
  A pause that outlived the pause timeout (`append_timeout`) restarts the same way on the
  same socket (its connection cache holds the ended response).
* **Continuing on the new socket**: the create names the last response by
  `previous_response_id`. With `store: true` the server loads it from the store (a cold
  connection cache: the context is rendered and classified again); with `store: false` nothing
  holds it any more and the server answers `previous_response_not_found`, which ends the
  rollout with that error: the API's answer, not resent here as a full history.

Each reconnect is a `Reconnect` record on the client (`reconnects`), with what the first turn
on the new socket cost as the server's stage report shows it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Final

import aiohttp
import msgspec
from msgspec import Meta

from prototype.clock import Clock
from prototype.wire.schemas import ErrorEvent, ResponseInjectFailed, StageReport, decode_server_event
from sim.client.client import ResponsesClient
from sim.client.websocket import WSClient
from sim.rollout.result import ClientError, Mode, Reconnect, ReconnectReason, TurnResult

__all__ = [
    "CUT_REASONS",
    "RECONNECTING_MODES",
    "RotatingClient",
    "SessionConfig",
    "cut_error",
    "limit_error",
    "lost_input",
    "session_client",
]

RECONNECTING_MODES: Final = ("ws", "append", "inject")  # the modes `RotatingClient` keeps across the limit


class SessionConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """How the measuring client keeps a long session (a `CompareConfig`'s `session`)."""

    store_responses: Annotated[
        bool | None,
        Meta(description="store on every create (none: what the mode needs, only http_prev stores)"),
    ] = None
    reconnect: Annotated[
        bool,
        Meta(
            description="ws, append and inject rollouts (one socket each) rotate before the connection limit and "
            "reconnect at it (sim/client/reconnect.py); off: a rollout the limit cuts fails"
        ),
    ] = True
    rotate_margin_s: Annotated[
        float, Meta(ge=0, description="rotate a socket when a turn would start within this many seconds of its limit")
    ] = 300.0


LIMIT_CODE: Final = "websocket_connection_limit_reached"
MAX_MOVES: Final = 3  # attempts of one turn: a move mends a turn at most twice (a cut, then the limit)
CUT_REASONS: Final = ("connection_limit", "append_timeout")  # a paused response ended under the client


def limit_error(exc: ClientError) -> bool:
    """Whether `exc` is the connection limit's error event."""
    body = exc.body
    return isinstance(body, dict) and body.get("code") == LIMIT_CODE


def _closed(exc: ClientError) -> bool:
    return isinstance(exc.body, str) and exc.body.startswith("socket ended")


def _cut_reason(result: TurnResult) -> str | None:
    details = result.response.incomplete_details
    if result.response.status == "incomplete" and details is not None and details.reason in CUT_REASONS:
        return details.reason
    return None


@dataclass(slots=True)
class RotatingClient:
    """`client` (a solo WebSocket client of `ws`, `append` or `inject`) kept alive across the
    connection limit `lifetime_s` (see the module docstring); the `ResponsesClient` interface."""

    client: WSClient
    clock: Clock
    lifetime_s: float
    margin_s: float = 300.0
    enabled: bool = True  # off: the client does not move; a limit or a cut ends the rollout with its error
    reconnects: list[Reconnect] = field(default_factory=list)
    opened_at: float | None = None  # the current socket's opening, on the client's clock
    turns: int = 0
    _dead: bool = False  # the server ended the socket (it cut a response at the limit)
    mode: Mode = field(init=False)

    def __post_init__(self) -> None:
        if self.client.mode not in RECONNECTING_MODES or self.client.socket.lanes is not None:
            raise ValueError(f"reconnects are modeled for solo ws, append and inject clients, not {self.client.mode}")
        self.mode = self.client.mode

    async def turn(self, new_items: list[dict[str, Any]], **settings: Any) -> TurnResult:
        c = self.client
        moved: Reconnect | None = None
        if not self.enabled:
            result = await c.turn(new_items, **settings)
            if _cut_reason(result) is not None:
                raise cut_error(result)
            return result
        if c.socket.ws is not None and self._dead:
            moved = await self._reopen("cut")
        elif c.socket.ws is not None and c.paused_id is None and self._age() >= self.lifetime_s - self.margin_s:
            moved = await self._reopen("rotate")
        if c.socket.ws is None:
            self.opened_at = self.clock.now()
        for _ in range(MAX_MOVES):
            resumed = c.paused_id is not None
            try:
                result = await c.turn(new_items, **settings)
            except ClientError as exc:
                if not (limit_error(exc) or _closed(exc)):
                    raise  # not one a move mends
                moved = await self._reopen("limit" if limit_error(exc) else "closed")
                continue
            cut = _cut_reason(result)
            if cut is None or not resumed:
                break
            # The tool outputs went to a response that had ended: restart the turn as a create, on
            # this socket if it lives on (a pause timeout), else on a new one.
            if cut == "append_timeout" and await self._answered():
                c.forget_pause()
                moved = self._moved("restart", 0.0)
            else:
                moved = await self._reopen("cut")
        else:
            raise ClientError(502, f"the turn did not go through in {MAX_MOVES} moves")
        self._dead = cut == "connection_limit"  # `cut`: the reason of the `result` the loop broke on
        if moved is not None:
            _cost(moved, result)
        self.turns += 1
        return result

    async def _answered(self) -> bool:
        """After a resume that met an ended response: read on to the server's refusal of it (an
        `error` or `response.inject.failed`). True: the socket lives on; False: it is closing."""
        ws = self.client.socket.ws
        assert ws is not None
        while True:
            msg = await ws.receive()
            if msg.type is not aiohttp.WSMsgType.TEXT:
                return False
            event = decode_server_event(msg.data)
            if isinstance(event, ErrorEvent):
                return event.error.code != LIMIT_CODE
            if isinstance(event, ResponseInjectFailed):
                return True

    def _age(self) -> float:
        return 0.0 if self.opened_at is None else self.clock.now() - self.opened_at

    def _moved(self, reason: ReconnectReason, connect_s: float) -> Reconnect:
        record = Reconnect(reason, self.turns, self.clock.now(), connect_s)
        self.reconnects.append(record)
        return record

    async def _reopen(self, reason: ReconnectReason) -> Reconnect:
        """Close the socket and open the next one; what waited on the old one is gone."""
        start = self.clock.now()
        self.client.forget_pause()
        await self.client.socket.reopen()
        self.opened_at = self.clock.now()
        self._dead = False
        return self._moved(reason, self.opened_at - start)

    async def close(self) -> None:
        await self.client.close()


def session_client(client: ResponsesClient, clock: Clock, session: SessionConfig, lifetime_s: float) -> ResponsesClient:
    """`client` as `session` keeps it: a solo `ws`, `append` or `inject` client inside a
    `RotatingClient` for the server's connection `lifetime_s`; any other client as it is (HTTP has no
    connection limit; lanes, `async` and `steer` are not modeled across it)."""
    if isinstance(client, WSClient) and client.mode in RECONNECTING_MODES and client.socket.lanes is None:
        return RotatingClient(client, clock, lifetime_s, session.rotate_margin_s, enabled=session.reconnect)
    return client


def lost_input(result: TurnResult) -> bool:
    """Whether `result` is a paused response that ended under the client (the limit, or its pause
    timeout) with no call for the agent to answer: the input the turn carried never reached a
    model, and a loop that took it for the rollout's answer would end it early."""
    return _cut_reason(result) is not None and not result.call_ids


def cut_error(result: TurnResult) -> ClientError:
    """A cut response as the rollout's error, when the client does not move on."""
    reason = _cut_reason(result)
    code = LIMIT_CODE if reason == "connection_limit" else reason
    text = f"response {result.response.id} ended incomplete ({reason}) and the client does not reconnect"
    return ClientError(400, {"type": "invalid_request_error", "code": code, "message": text})


def _cost(record: Reconnect, result: TurnResult) -> None:
    record.e2e_s = result.e2e_s
    report = result.response.longrun
    if isinstance(report, StageReport):
        record.connection_cache = report.connection_cache
        record.load_s = report.stages_s.get("load_state", 0.0)
        record.render_s = report.stages_s.get("render", 0.0)
        record.tokens_rendered = report.tokens_rendered
        record.tokens_prefilled = report.tokens_prefilled
