"""A small measuring client for the five API modes, used by tests and the harness.

Modes (names used everywhere):

* `http`: POST with the full history every turn (no `previous_response_id`).
* `http_prev`: POST with `previous_response_id` and only the new items; the
  server loads the rest from its store.
* `ws`: one WebSocket per rollout, `response.create` + `previous_response_id`,
  new items only; the server's connection cache holds the rest.
* `append`: one WebSocket (opted in with `?mode=append`), one long response:
  the first turn is a `response.create`, each later turn a `response.append`
  with the tool outputs; a turn ends at the pause (`response.done`) or at the
  terminal event.
* `inject`: one WebSocket speaking the `responses_multi_agent` beta (`?mode=beta`,
  docs/beta.md), one long response: the first turn is a `response.create` whose
  function tools are declared `async: true`, each later turn a `response.inject` with
  the tool outputs. The beta sends no pause event, so a turn ends at the
  `output_item.done` of an async call (one call per turn, as the simulated agent
  makes them) or at the terminal event; the turn's `response` is the latest snapshot
  of the response (`response.created`, or the terminal event's). Its create sends
  `parallel_tool_calls: false`: one call in flight at a time, so the model waits for each
  output before its next turn (docs/beta.md).
* `async`: the same beta socket and create (with parallel calls allowed), driven as the
  async tools are meant to be used (`begin`, `next_turn`, `inject_when_ready`, `settle`;
  sim/client/loop.py's `run_async_rollout`): each tool starts when its call's `output_item.done` arrives, the
  client keeps reading while it runs and injects its output when it finishes; the model may
  decode its next turn meanwhile. A turn ends at an async call's `output_item.done` (the next
  one starts right there) or at the terminal event.

* `steer`: `inject`, and a user message that arrives while the rollout runs (an
  interjection, docs/experiments.md) is sent at once as `response.steer` to the response
  in flight; the client follows the automatic successor (`response.incomplete` with reason
  `steered`, then the successor's `response.created`) within the same turn. The other
  modes hold such a message and send it with the next turn's input.
* `agents`: one Agents API session (beta `agents=v1`, docs/agents-api.md) per rollout:
  the first turn creates it with `stream: true` and reads that stream on; each later turn
  POSTs the tool outputs as input events. A turn ends at `agent.session.requires_action`
  or at the session turn's end (sim/client/agents_client.py).

In the WebSocket modes several rollouts may share one socket, each on its own lane
(`stream_id`, docs/lanes.md): `share_socket` puts a list of clients on one `LaneSocket`
(sim/client/lanes.py), whose reader hands each frame to the lane its `stream_id` names.

Each turn returns a `TurnResult` (sim/rollout/result.py) with client-side timings taken on an
injected clock, folded from the event stream by a `Tracker` (sim/client/tracker.py). The client
decodes frames with the same msgspec types the server encodes with.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp
import msgspec

from prototype.clock import Clock
from prototype.wire.schemas import (
    FunctionCall,
    OutputItemDone,
    Response,
    ResponseCompleted,
    ResponseCreated,
    ResponseDone,
    ResponseIncomplete,
    ResponseSteerAccepted,
    ResponseSteerFailed,
    ServerEvent,
    decode_server_event,
    encode,
)
from prototype.wire.sse import SSEDecoder
from sim.client.agents_client import AgentsClient
from sim.client.lanes import LaneSocket, TextSocket
from sim.client.tracker import TOKEN_DELTAS, Tracker
from sim.rollout.result import ALL_MODES, WS_MODES, ClientError, InterjectionRecord, Mode, TurnResult
from sim.rollout.spec import Interjection

__all__ = ["HTTPClient", "ResponsesClient", "WSClient", "open_client", "share_socket"]


class ResponsesClient(Protocol):
    mode: Mode

    async def turn(self, new_items: list[dict[str, Any]], **settings: Any) -> TurnResult: ...

    async def close(self) -> None: ...


class _History:
    """What a client that resends everything keeps: input so far + outputs so far; with
    `encoded`, each item's JSON too, made once, so a body that resends them copies bytes."""

    def __init__(self, *, encoded: bool = False) -> None:
        self.items: list[dict[str, Any]] = []
        self.encoded: list[msgspec.Raw] | None = [] if encoded else None
        self.previous_id: str | None = None

    def record(self, sent: list[dict[str, Any]], result: TurnResult) -> None:
        self.items.extend(sent)
        self.items.extend(result.output_items)
        if self.encoded is not None:
            self.encoded.extend(msgspec.Raw(encode(item)) for item in (*sent, *result.output_items))
        self.previous_id = result.response.id
        if any(item.get("type") == "compaction" for item in result.output_items):
            # The compaction guide's latency tip: what came before the latest compaction item,
            # but user messages, is not resent (the item stands for it; the server would drop it).
            last = max(i for i, item in enumerate(self.items) if item.get("type") == "compaction")
            keep = [i for i, item in enumerate(self.items) if i >= last or _is_user_message(item)]
            self.items = [self.items[i] for i in keep]
            if self.encoded is not None:
                self.encoded = [self.encoded[i] for i in keep]


def _is_user_message(item: dict[str, Any]) -> bool:
    return item.get("type", "message") == "message" and item.get("role") == "user"


class HTTPClient:
    """`http` (full history) or, with `chained=True`, `http_prev`. Subclasses replace
    `_exchange` to carry the same bodies over another transport."""

    def __init__(self, base_url: str, clock: Clock, *, chained: bool, api_key: str = "sk-longrun") -> None:
        self.mode: Mode = "http_prev" if chained else "http"
        self.url = base_url.rstrip("/") + "/responses"
        self.clock = clock
        self.chained = chained
        self.history = _History(encoded=not chained)
        self.api_key = api_key
        self.session: aiohttp.ClientSession | None = None

    def body(self, new_items: list[dict[str, Any]], settings: dict[str, Any]) -> bytes:
        if self.chained:
            body = {**settings, "input": new_items, "previous_response_id": self.history.previous_id, "stream": True}
        else:
            assert self.history.encoded is not None
            body = {**settings, "input": [*self.history.encoded, *new_items], "stream": True}
        return encode(body)

    async def turn(self, new_items: list[dict[str, Any]], **settings: Any) -> TurnResult:
        data = self.body(new_items, settings)
        tracker = Tracker(self.clock, self.clock.now(), len(data))
        result = None
        async for event in self._exchange(data):
            result = tracker.see(event) or result
        if result is None:
            raise ClientError(502, "stream ended before a terminal event")
        self.history.record(new_items, result)
        return result

    async def _exchange(self, data: bytes) -> AsyncIterator[ServerEvent]:
        """POST the body and yield the server's events as they arrive (SSE)."""
        if self.session is None:
            self.session = aiohttp.ClientSession(headers={"Authorization": f"Bearer {self.api_key}"})
        async with self.session.post(self.url, data=data, headers={"Content-Type": "application/json"}) as resp:
            if resp.status != 200:
                raise ClientError(resp.status, await resp.json())
            decoder = SSEDecoder()
            async for chunk in resp.content.iter_any():
                for sse in decoder.feed(chunk):
                    if sse.data != "[DONE]":
                        yield decode_server_event(sse.data)

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()


def upgrade_refused(status: int) -> ClientError:
    """A refused WebSocket upgrade as a client sees it: its status alone (aiohttp hands over no
    body with a failed handshake), the same whichever transport carried it."""
    return ClientError(status, "WebSocket upgrade refused")


class WSClient:
    """Every WebSocket mode (`WS_MODES`: `ws`, `append`, and the beta's `inject`, `async`,
    `steer`), on the same socket machinery.
    Subclasses replace `_connect` to use another transport. With `lanes` (see
    `share_socket`) the client runs on lane `stream_id` of a shared socket."""

    def __init__(
        self,
        base_url: str,
        clock: Clock,
        *,
        api_key: str = "sk-longrun",
        mode: Mode = "ws",
    ) -> None:
        if mode not in WS_MODES:
            raise ValueError(f"{mode!r} is not a WebSocket mode; choose from {', '.join(WS_MODES)}")
        self.mode: Mode = mode
        # The beta's modes: `inject`; `async`, its tools overlapping the model's decoding; `steer`,
        # `inject` with interjections sent as `response.steer`.
        self.beta = mode in ("inject", "async", "steer")
        self.overlap = mode == "async"
        self.steering = mode == "steer"
        self.steer_state = _SteerState()
        self.url = base_url.rstrip("/").replace("http://", "ws://").replace("https://", "wss://") + "/responses"
        if self.beta:
            self.url += "?mode=beta"
        elif mode == "append":
            self.url += "?mode=append"
        self.paused_id: str | None = None  # append and inject modes: the waiting response this client continues
        self._waiting: Response | None = None  # inject mode: the snapshot of the response that waits
        self.clock = clock
        self.history = _History()
        self.api_key = api_key
        self.session: aiohttp.ClientSession | None = None
        self.ws: TextSocket | None = None
        self.lanes: LaneSocket | None = None
        self.stream_id: str | None = None
        self._tracker: Tracker | None = None  # async mode: the turn being read
        self._injecting: list[asyncio.Task[None]] = []  # async mode: tool steps whose output is still to send
        self._steps: list[Awaitable[list[dict[str, Any]]]] = []

    def upgrade_headers(self) -> dict[str, str]:
        """The upgrade request's headers (its dialect is in the URL's `mode`)."""
        return {"Authorization": f"Bearer {self.api_key}"}

    async def _connect(self) -> TextSocket:
        self.session = aiohttp.ClientSession()
        try:
            return await self.session.ws_connect(self.url, headers=self.upgrade_headers(), max_msg_size=0)
        except aiohttp.WSServerHandshakeError as exc:
            raise upgrade_refused(exc.status) from None

    async def _send_turn(self, new_items: list[dict[str, Any]], settings: dict[str, Any]) -> Tracker:
        """Send a turn's frame (the resume of a paused response, or a create) and start timing it."""
        if self.ws is None:
            self.ws = await self._connect() if self.lanes is None else self.lanes.lane(self.stream_id)
        if self.paused_id is not None:
            resume = "response.inject" if self.beta else "response.append"
            body: dict[str, Any] = {"type": resume, "response_id": self.paused_id, "input": new_items}
        else:
            if self.beta:
                settings = _beta_settings(settings, overlap=self.overlap)
            body = {
                "type": "response.create",
                **settings,
                "input": new_items,
                "previous_response_id": self.history.previous_id,
            }
            if self.stream_id is not None:
                body["stream_id"] = self.stream_id
        data = encode(body).decode()
        tracker = Tracker(self.clock, self.clock.now(), len(data))
        await self.ws.send_str(data)
        return tracker

    async def turn(self, new_items: list[dict[str, Any]], **settings: Any) -> TurnResult:
        if self.steering:
            return await self._steering_turn(new_items, settings)
        tracker = await self._send_turn(new_items, settings)
        assert self.ws is not None
        latest: Response | None = None  # inject mode: the response's latest snapshot
        while True:
            msg = await self.ws.receive()
            if msg.type is not aiohttp.WSMsgType.TEXT:
                raise ClientError(502, f"socket ended: {msg.type.name} {msg.data!r}")
            event = decode_server_event(msg.data)
            result = tracker.see(event)
            if result is not None:
                self.paused_id = event.response.id if isinstance(event, ResponseDone) else None
                self.history.record(new_items, result)
                return result
            if isinstance(event, ResponseCreated):
                latest = event.response
            elif (
                self.beta
                and isinstance(event, OutputItemDone)
                and isinstance(event.item, FunctionCall)
                and event.item.is_async is True
            ):
                response = latest if latest is not None else self._waiting
                if response is None:
                    raise ClientError(502, "an async call before its response.created")
                self._waiting = response
                self.paused_id = response.id
                result = tracker.paused(response)
                self.history.record(new_items, result)
                return result

    # -- `steer` mode ------------------------------------------------------------------------------

    def arm(self, interjection: Interjection) -> None:
        """`steer` mode: send `interjection` as `response.steer` its delay after the next turn's
        first token, to the response in flight then (the turn's, or its successor)."""
        self.steer_state.armed = interjection

    def disarm(self) -> list[InterjectionRecord]:
        """The rollout is over: interjections whose time has not come are not sent, and those whose
        steer failed: they come back, for the driver to send as a turn of their own."""
        st = self.steer_state
        back = [record for record, timer in st.timers if not timer.done()]
        for _, timer in st.timers:
            timer.cancel()
        st.timers.clear()
        st.armed = None
        back.extend(st.returned)
        st.returned.clear()
        for record in back:
            record.via = "next_turn"
        return back

    async def _fire(self, record: InterjectionRecord) -> None:
        st = self.steer_state
        await self.clock.sleep_until(record.arrived_at)
        assert self.ws is not None and st.current is not None
        body = {"type": "response.steer", "previous_response_id": st.current, "input": record.interjection.text}
        st.unanswered.append(record)
        await self.ws.send_str(encode(body).decode())

    async def _steering_turn(self, new_items: list[dict[str, Any]], settings: dict[str, Any]) -> TurnResult:
        """`inject`'s turn, and the steers: a turn runs on through `response.incomplete`
        (`steered`) into the successor, and past a terminal event while a steer it sent is
        unanswered or accepted but not committed (a successor, or a failure, is coming)."""
        st = self.steer_state
        tracker = await self._send_turn(new_items, settings)  # as `inject`'s (its create: `_beta_settings`)
        assert self.ws is not None
        latest: Response | None = None
        held: Response | None = None  # a terminal event passed over while a steer was outstanding
        loop = asyncio.get_running_loop()
        while True:
            msg = await self.ws.receive()
            if msg.type is not aiohttp.WSMsgType.TEXT:
                raise ClientError(502, f"socket ended: {msg.type.name} {msg.data!r}")
            event = decode_server_event(msg.data)
            if isinstance(event, ResponseSteerAccepted):
                if st.unanswered:
                    record = st.unanswered.pop(0)
                    st.accepted.setdefault(event.steer.previous_response_id, []).append(record)
            elif isinstance(event, ResponseSteerFailed):
                if st.unanswered and isinstance(event.steer.id, msgspec.UnsetType):
                    st.returned.append(st.unanswered.pop(0))
                else:
                    for records in st.accepted.values():
                        if records:
                            st.returned.append(records.pop(0))
                            break
                if held is not None and not st.unanswered and not any(st.accepted.values()):
                    tracker.events += 1
                    self.paused_id = None
                    ended = tracker.ended(held)  # no successor will come: the turn ended there
                    return self._steering_done(new_items, ended)
            elif isinstance(event, ResponseCreated):
                latest = event.response
                st.current = event.response.id
                committed = st.accepted.pop(event.response.previous_response_id or "", [])
                if committed:  # the automatic successor: its response.created commits the steers
                    st.successors += 1
                    st.committed.extend(committed)
            elif isinstance(event, TOKEN_DELTAS):
                if st.committed:
                    now = self.clock.now()
                    for record in st.committed:
                        record.seen_at = now
                    st.committed.clear()
                if st.armed is not None and tracker.first_token_at is None:
                    record = InterjectionRecord(st.armed, self.clock.now() + st.armed.delay_s, via="steer")
                    st.records.append(record)
                    st.timers.append((record, loop.create_task(self._fire(record))))
                    st.armed = None
            elif isinstance(event, ResponseIncomplete) and _steered(event.response):
                report = event.response.longrun
                st.tokens_discarded += report.tokens_discarded if isinstance(report, msgspec.Struct) else 0
                st.ended.append(event.response)
                tracker.events += 1
                tracker.log.append((self.clock.now(), "response.incomplete"))
                continue  # the successor follows
            if isinstance(event, (ResponseCompleted, ResponseIncomplete)) and (
                st.unanswered or any(st.accepted.values())
            ):
                tracker.events += 1
                tracker.log.append((self.clock.now(), event.__struct_config__.tag))  # type: ignore[arg-type]
                held = event.response
                continue  # a steer of this response: its successor (or its failure) is coming
            result = tracker.see(event)
            if result is not None:
                self.paused_id = None
                return self._steering_done(new_items, result)
            if isinstance(event, OutputItemDone) and isinstance(event.item, FunctionCall) and event.item.is_async:
                if event.item.status == "incomplete":
                    continue  # cut off by a steer: not owed
                response = latest if latest is not None else self._waiting
                if response is None:
                    raise ClientError(502, "an async call before its response.created")
                self._waiting = response
                self.paused_id = response.id
                return self._steering_done(new_items, tracker.paused(response))

    def _steering_done(self, sent: list[dict[str, Any]], result: TurnResult) -> TurnResult:
        result.steered, self.steer_state.ended = self.steer_state.ended, []
        self.history.record(sent, result)
        return result

    # -- async mode: the client reads on while its tools run ------------------------------------------

    async def begin(self, new_items: list[dict[str, Any]], **settings: Any) -> None:
        """`async` mode: send the rollout's `response.create`; `next_turn` reads what follows."""
        if self.ws is None:
            self.ws = await self._connect() if self.lanes is None else self.lanes.lane(self.stream_id)
        body: dict[str, Any] = {"type": "response.create", **_beta_settings(settings, overlap=True), "input": new_items}
        if self.stream_id is not None:
            body["stream_id"] = self.stream_id
        data = encode(body).decode()
        self._tracker = Tracker(self.clock, self.clock.now(), len(data))
        self._waiting = None
        self.paused_id = None
        await self.ws.send_str(data)

    async def next_turn(self) -> TurnResult:
        """`async` mode: read to the end of the next turn, the `output_item.done` of an async call
        (the next turn starts there) or the terminal event. The turn's `response` is the latest
        snapshot, its bytes what the client sent during it (the create, or injects)."""
        tracker, ws = self._tracker, self.ws
        if tracker is None or ws is None:
            raise ClientError(400, "next_turn before begin")
        while True:
            msg = await ws.receive()
            if msg.type is not aiohttp.WSMsgType.TEXT:
                raise ClientError(502, f"socket ended: {msg.type.name} {msg.data!r}")
            event = decode_server_event(msg.data)
            result = tracker.see(event)
            if result is not None:
                self.history.previous_id = result.response.id
                return result
            if isinstance(event, ResponseCreated):
                self._waiting = event.response
                self.paused_id = event.response.id
            elif isinstance(event, OutputItemDone) and isinstance(event.item, FunctionCall) and event.item.is_async:
                if self._waiting is None:
                    raise ClientError(502, "an async call before its response.created")
                self._tracker = Tracker(self.clock, self.clock.now(), 0)
                return tracker.paused(self._waiting)

    async def inject(self, items: list[dict[str, Any]]) -> None:
        """`async` mode: send `items` (tool outputs) to the running response (`response.inject`);
        may run while `next_turn` reads."""
        if self.ws is None or self.paused_id is None or self._tracker is None:
            raise ClientError(400, "inject before the response was created")
        data = encode({"type": "response.inject", "response_id": self.paused_id, "input": items}).decode()
        self._tracker.bytes_sent += len(data)
        await self.ws.send_str(data)

    def inject_when_ready(self, output: Awaitable[list[dict[str, Any]]]) -> None:
        """`async` mode: inject the items `output` comes to (a tool step's outputs) once it is
        ready, while `next_turn` reads on."""

        async def send() -> None:
            await self.inject(await output)

        self._injecting.append(asyncio.get_running_loop().create_task(send()))
        self._steps.append(output)

    async def settle(self) -> BaseException | None:
        """`async` mode, at the rollout's end: cancel the tool steps still running (a rollout cut
        short), wait for the rest; the first failure of one, if any."""
        tasks, self._injecting = self._injecting, []
        steps, self._steps = self._steps, []
        for task in tasks:
            task.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for step in steps:
            if asyncio.iscoroutine(step):
                step.close()  # one cancelled before it started is never awaited: nothing to run
        return next((r for r in results if isinstance(r, Exception)), None)

    async def close(self) -> None:
        for _, timer in self.steer_state.timers:
            timer.cancel()
        if self.ws is not None:
            await self.ws.close()
        elif self.lanes is not None:  # never sent: its lane of the shared socket is released all the same
            await self.lanes.release()
        if self.session is not None and self.lanes is None:  # a shared socket's session closes with it
            await self.session.close()

    async def _close_session(self) -> None:
        if self.session is not None:
            await self.session.close()


@dataclass(slots=True)
class _SteerState:
    """`steer` mode's bookkeeping of its interjections (one rollout's)."""

    armed: Interjection | None = None  # to be timed from the next turn's first token
    current: str | None = None  # the response in flight (the latest `response.created`)
    records: list[InterjectionRecord] = field(default_factory=list)
    timers: list[tuple[InterjectionRecord, asyncio.Task[None]]] = field(default_factory=list)
    unanswered: list[InterjectionRecord] = field(default_factory=list)  # sent, neither accepted nor failed
    accepted: dict[str, list[InterjectionRecord]] = field(default_factory=dict)  # by target, not committed
    committed: list[InterjectionRecord] = field(default_factory=list)  # in a successor, before its first token
    returned: list[InterjectionRecord] = field(default_factory=list)  # failed: the driver sends them as a turn
    ended: list[Response] = field(default_factory=list)  # terminal snapshots of steered responses, this turn
    tokens_discarded: int = 0
    successors: int = 0


def _steered(response: Response) -> bool:
    return response.incomplete_details is not None and response.incomplete_details.reason == "steered"


def share_socket(clients: list[WSClient]) -> LaneSocket:
    """Put `clients` (WebSocket clients of one mode) on one socket, client k on lane `lane-k`.
    The socket is opened as the first client would open its own."""
    opener = clients[0]
    shared = LaneSocket(opener._connect, opener._close_session)
    shared._open_lanes = len(clients)
    for k, client in enumerate(clients):
        client.lanes = shared
        client.stream_id = f"lane-{k}"
    return shared


def open_client(mode: Mode, base_url: str, clock: Clock, *, api_key: str = "sk-longrun") -> ResponsesClient:
    if mode == "http":
        return HTTPClient(base_url, clock, chained=False, api_key=api_key)
    if mode == "http_prev":
        return HTTPClient(base_url, clock, chained=True, api_key=api_key)
    if mode in WS_MODES:
        return WSClient(base_url, clock, api_key=api_key, mode=mode)
    if mode == "agents":
        return AgentsClient(base_url, clock, api_key=api_key)
    raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(ALL_MODES)}")


def _beta_settings(settings: dict[str, Any], *, overlap: bool) -> dict[str, Any]:
    """The beta modes' create settings: the function tools declared `async: true`; `inject`
    (not `overlap`) also sends `parallel_tool_calls: false`, one call in flight at a time."""
    out = dict(settings)
    if "tools" in out:
        out["tools"] = [_declared_async(tool) for tool in out["tools"]]
    if not overlap:
        out.setdefault("parallel_tool_calls", False)
    return out


def _declared_async(tool: Any) -> Any:
    """A function tool declared `async: true` (the beta's `BetaFunctionTool`); other tools as they are."""
    return {**tool, "async": True} if isinstance(tool, dict) and tool.get("type") == "function" else tool
