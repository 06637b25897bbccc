"""The WebSocket modes' measuring clients: one socket part, one driver per mode.

A `WSSocket` is what every WebSocket mode shares: the URL with its dialect (`?mode=append`,
`?mode=beta`), the upgrade, the socket (its own, or a lane of a shared one), the frames sent
and the events received. Transports replace its `connect` (sim/runtime/inprocess.py).

A driver (`WSClient` and its subclasses) is one mode's conversation over that socket; which
driver runs a mode is chosen in one place, sim/client/client.py's `ws_client`:

* `ChainDriver` (`ws`): each turn a `response.create` naming the last response.
* `AppendDriver` (`append`): a create, then each turn a `response.append` to the paused
  response; a turn ends at the pause (`response.done`) or the terminal event.
* `InjectDriver` (`inject`): the beta's create (function tools `async: true`, one call in
  flight), then each turn a `response.inject`; a turn ends at an async call's
  `output_item.done` or the terminal event.
* `AsyncDriver` (`async`): the beta's create with parallel calls; `begin`, `next_turn`,
  `inject_when_ready`, `settle` read on while the tools run (sim/client/loop.py's
  `run_async_rollout`).
* sim/client/steer.py's `SteerDriver` (`steer`): `inject`, and interjections sent as
  `response.steer` to the response in flight.

`share_socket` puts several drivers of one mode on one socket, each on its own lane
(`stream_id`, docs/lanes.md, sim/client/lanes.py).
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Awaitable
from typing import Any, Final

import aiohttp

from prototype.clock import Clock
from prototype.wire.schemas import (
    FunctionCall,
    OutputItemDone,
    Response,
    ResponseCreated,
    ResponseDone,
    ServerEvent,
    decode_server_event,
    encode,
)
from sim.client.lanes import LaneSocket, TextSocket
from sim.client.tracker import History, Tracker
from sim.rollout.result import WS_MODES, ClientError, Mode, TurnResult

__all__ = [
    "AppendDriver",
    "AsyncDriver",
    "ChainDriver",
    "InjectDriver",
    "WSClient",
    "WSSocket",
    "beta_settings",
    "share_socket",
    "socket_ended",
    "upgrade_refused",
]

_TEXT: Final = aiohttp.WSMsgType.TEXT  # every frame read is checked against it
BETA_MODES = ("inject", "async", "steer")  # the `responses_multi_agent` beta's dialect (docs/beta.md)


def socket_ended(msg: aiohttp.WSMessage) -> ClientError:
    """A turn's error when its socket ended (`msg` is not a text frame)."""
    return ClientError(502, f"socket ended: {msg.type.name} {msg.data!r}")


def upgrade_refused(status: int) -> ClientError:
    """A refused WebSocket upgrade as a client sees it: its status alone (aiohttp hands over no
    body with a failed handshake), the same whichever transport carried it."""
    return ClientError(status, "WebSocket upgrade refused")


class WSSocket:
    """The socket part of a WebSocket client of `mode`: opened with the first frame sent, alone
    or (with `lanes`, see `share_socket`) as lane `stream_id` of a shared socket."""

    def __init__(self, base_url: str, clock: Clock, *, api_key: str = "sk-longrun", mode: Mode = "ws") -> None:
        if mode not in WS_MODES:
            raise ValueError(f"{mode!r} is not a WebSocket mode; choose from {', '.join(WS_MODES)}")
        self.mode: Mode = mode
        self.clock = clock
        self.api_key = api_key
        self.url = base_url.rstrip("/").replace("http://", "ws://").replace("https://", "wss://") + "/responses"
        if mode in BETA_MODES:
            self.url += "?mode=beta"
        elif mode == "append":
            self.url += "?mode=append"
        self.session: aiohttp.ClientSession | None = None
        self.ws: TextSocket | None = None
        self.lanes: LaneSocket | None = None
        self.stream_id: str | None = None

    def upgrade_headers(self) -> dict[str, str]:
        """The upgrade request's headers (its dialect is in the URL's `mode`)."""
        return {"Authorization": f"Bearer {self.api_key}"}

    async def connect(self) -> TextSocket:
        """Open a socket of this client's own (a transport replaces this)."""
        self.session = aiohttp.ClientSession()
        try:
            return await self.session.ws_connect(self.url, headers=self.upgrade_headers(), max_msg_size=0)
        except aiohttp.WSServerHandshakeError as exc:
            raise upgrade_refused(exc.status) from None

    async def open(self) -> TextSocket:
        """The socket, opened (or its lane taken) if it is not yet."""
        if self.ws is None:
            self.ws = await self.connect() if self.lanes is None else self.lanes.lane(self.stream_id)
        return self.ws

    def create(self, settings: dict[str, Any], items: list[dict[str, Any]], previous_id: str | None) -> dict[str, Any]:
        """A `response.create` body on this socket (its lane's `stream_id`, if any)."""
        body: dict[str, Any] = {
            "type": "response.create",
            **settings,
            "input": items,
            "previous_response_id": previous_id,
        }
        if self.stream_id is not None:
            body["stream_id"] = self.stream_id
        return body

    async def start(self, body: dict[str, Any]) -> Tracker:
        """Send a turn's first frame and start timing the turn from it."""
        ws = await self.open()
        data = encode(body).decode()
        tracker = Tracker(self.clock, self.clock.now(), len(data))
        await ws.send_str(data)
        return tracker

    async def reopen(self) -> None:
        """Close this client's own socket and open the next one (sim/client/reconnect.py)."""
        if self.ws is not None:
            await self.ws.close()
        await self.close_session()
        self.ws, self.session = None, None
        self.ws = await self.connect()

    async def close_session(self) -> None:
        if self.session is not None:
            await self.session.close()

    async def close(self) -> None:
        if self.ws is not None:
            await self.ws.close()
        elif self.lanes is not None:  # never sent: its lane of the shared socket is released all the same
            await self.lanes.release()
        if self.session is not None and self.lanes is None:  # a shared socket's session closes with it
            await self.session.close()


class WSClient(ABC):
    """A WebSocket mode's driver over `socket` (the `ResponsesClient` interface): a turn sends
    `frame`'s body and reads to the terminal event, where `ended` sees it. The beta's drivers
    read their own turns (a turn also ends at an async call). Each read loop is written out in
    place: an event costs its decoding and the tracker's call only (the loops run for every event)."""

    def __init__(self, socket: WSSocket) -> None:
        self.socket = socket
        self.mode: Mode = socket.mode
        self.clock = socket.clock
        self.history = History()
        self.paused_id: str | None = None  # the waiting response the next turn continues (append, beta)

    def frame(self, new_items: list[dict[str, Any]], settings: dict[str, Any]) -> dict[str, Any]:
        """The turn's first frame: a create chained to the last response."""
        return self.socket.create(settings, new_items, self.history.previous_id)

    @abstractmethod
    def ended(self, event: ServerEvent) -> None:
        """The turn ended at `event` (a terminal event: `response.done` is append's pause)."""

    async def turn(self, new_items: list[dict[str, Any]], **settings: Any) -> TurnResult:
        tracker = await self.socket.start(self.frame(new_items, settings))
        ws = self.socket.ws
        assert ws is not None
        while True:
            msg = await ws.receive()
            if msg.type is not _TEXT:
                raise socket_ended(msg)
            event = decode_server_event(msg.data)
            result = tracker.see(event)
            if result is not None:
                self.ended(event)
                self.history.record(new_items, result)
                return result

    def forget_pause(self) -> None:
        """The waiting response is gone (its socket closed, or it ended): the next turn creates."""
        self.paused_id = None

    async def close(self) -> None:
        await self.socket.close()


class ChainDriver(WSClient):
    """`ws`: every turn a `response.create` with `previous_response_id` and the new items only;
    a turn ends at the terminal event."""

    def ended(self, event: ServerEvent) -> None:
        pass  # nothing waits: the next turn creates


class AppendDriver(WSClient):
    """`append`: one long response, created by the first turn; each later turn a
    `response.append` with the tool outputs. A turn ends at the pause (`response.done`) or at the
    terminal event."""

    def frame(self, new_items: list[dict[str, Any]], settings: dict[str, Any]) -> dict[str, Any]:
        if self.paused_id is not None:
            return {"type": "response.append", "response_id": self.paused_id, "input": new_items}
        return super().frame(new_items, settings)

    def ended(self, event: ServerEvent) -> None:
        self.paused_id = event.response.id if isinstance(event, ResponseDone) else None


class InjectDriver(WSClient):
    """`inject`: the beta's one long response, created with its function tools `async: true`;
    each later turn a `response.inject` with the tool outputs. The beta sends no pause event: a
    turn ends at an async call's `output_item.done` (its `response` the latest snapshot) or at
    the terminal event."""

    def __init__(self, socket: WSSocket) -> None:
        super().__init__(socket)
        self.waiting: Response | None = None  # the snapshot of the response that waits

    def create_settings(self, settings: dict[str, Any]) -> dict[str, Any]:
        return beta_settings(settings, overlap=False)

    def frame(self, new_items: list[dict[str, Any]], settings: dict[str, Any]) -> dict[str, Any]:
        if self.paused_id is not None:
            return {"type": "response.inject", "response_id": self.paused_id, "input": new_items}
        return super().frame(new_items, self.create_settings(settings))

    def ended(self, event: ServerEvent) -> None:
        self.paused_id = None

    async def turn(self, new_items: list[dict[str, Any]], **settings: Any) -> TurnResult:
        tracker = await self.socket.start(self.frame(new_items, settings))
        ws = self.socket.ws
        assert ws is not None
        latest: Response | None = None  # the response's latest snapshot
        while True:
            msg = await ws.receive()
            if msg.type is not _TEXT:
                raise socket_ended(msg)
            event = decode_server_event(msg.data)
            result = tracker.see(event)
            if result is not None:
                self.ended(event)
            elif isinstance(event, ResponseCreated):
                latest = event.response
            elif isinstance(event, OutputItemDone) and isinstance(event.item, FunctionCall):
                if event.item.is_async is True:  # the beta's pause: the call waits for its output
                    result = tracker.paused(self.wait_on(latest))
            if result is not None:
                self.history.record(new_items, result)
                return result

    def wait_on(self, latest: Response | None) -> Response:
        """An async call ended the turn: its response (`latest`, else the one already waiting)
        waits for the outputs."""
        response = latest if latest is not None else self.waiting
        if response is None:
            raise ClientError(502, "an async call before its response.created")
        self.waiting = response
        self.paused_id = response.id
        return response

    def forget_pause(self) -> None:
        super().forget_pause()
        self.waiting = None


class AsyncDriver(InjectDriver):
    """`async`: the beta's create with parallel calls allowed, driven as the async tools are
    meant to be used: `begin` sends the create, `next_turn` reads to the next async call or the
    terminal event, `inject_when_ready` sends a tool step's outputs when it finishes (while
    `next_turn` reads on), `settle` ends the steps at the rollout's end. `turn` works as
    `inject`'s, with these create settings."""

    def __init__(self, socket: WSSocket) -> None:
        super().__init__(socket)
        self.reading: Tracker | None = None  # the turn being read
        self.injecting: list[asyncio.Task[None]] = []  # tool steps whose output is still to send
        self.steps: list[Awaitable[list[dict[str, Any]]]] = []

    def create_settings(self, settings: dict[str, Any]) -> dict[str, Any]:
        return beta_settings(settings, overlap=True)

    async def begin(self, new_items: list[dict[str, Any]], **settings: Any) -> None:
        """Send the rollout's `response.create`; `next_turn` reads what follows."""
        ws = await self.socket.open()
        body: dict[str, Any] = {"type": "response.create", **self.create_settings(settings), "input": new_items}
        if self.socket.stream_id is not None:
            body["stream_id"] = self.socket.stream_id
        data = encode(body).decode()
        self.reading = Tracker(self.clock, self.clock.now(), len(data))
        self.waiting = None
        self.paused_id = None
        await ws.send_str(data)

    async def next_turn(self) -> TurnResult:
        """Read to the end of the next turn, the `output_item.done` of an async call (the next
        turn starts there) or the terminal event. The turn's `response` is the latest snapshot,
        its bytes what the client sent during it (the create, or injects)."""
        tracker, ws = self.reading, self.socket.ws
        if tracker is None or ws is None:
            raise ClientError(400, "next_turn before begin")
        while True:
            msg = await ws.receive()
            if msg.type is not _TEXT:
                raise socket_ended(msg)
            event = decode_server_event(msg.data)
            result = tracker.see(event)
            if result is not None:
                self.history.previous_id = result.response.id
                return result
            if isinstance(event, ResponseCreated):
                self.waiting = event.response
                self.paused_id = event.response.id
            elif isinstance(event, OutputItemDone) and isinstance(event.item, FunctionCall) and event.item.is_async:
                if self.waiting is None:
                    raise ClientError(502, "an async call before its response.created")
                self.reading = Tracker(self.clock, self.clock.now(), 0)
                return tracker.paused(self.waiting)

    async def inject(self, items: list[dict[str, Any]]) -> None:
        """Send `items` (tool outputs) to the running response (`response.inject`); may run
        while `next_turn` reads."""
        ws = self.socket.ws
        if ws is None or self.paused_id is None or self.reading is None:
            raise ClientError(400, "inject before the response was created")
        data = encode({"type": "response.inject", "response_id": self.paused_id, "input": items}).decode()
        self.reading.bytes_sent += len(data)
        await ws.send_str(data)

    def inject_when_ready(self, output: Awaitable[list[dict[str, Any]]]) -> None:
        """Inject the items `output` comes to (a tool step's outputs) once it is ready, while
        `next_turn` reads on."""

        async def send() -> None:
            await self.inject(await output)

        self.injecting.append(asyncio.get_running_loop().create_task(send()))
        self.steps.append(output)

    async def settle(self) -> BaseException | None:
        """At the rollout's end: cancel the tool steps still running (a rollout cut short), wait
        for the rest; the first failure of one, if any."""
        tasks, self.injecting = self.injecting, []
        steps, self.steps = self.steps, []
        for task in tasks:
            task.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for step in steps:
            if asyncio.iscoroutine(step):
                step.close()  # one cancelled before it started is never awaited: nothing to run
        return next((r for r in results if isinstance(r, Exception)), None)


def share_socket(clients: list[WSClient]) -> LaneSocket:
    """Put `clients` (WebSocket clients of one mode) on one socket, client k on lane `lane-k`.
    The socket is opened as the first client would open its own."""
    opener = clients[0].socket
    shared = LaneSocket(opener.connect, opener.close_session, lanes=len(clients))
    for k, client in enumerate(clients):
        client.socket.lanes = shared
        client.socket.stream_id = f"lane-{k}"
    return shared


def beta_settings(settings: dict[str, Any], *, overlap: bool) -> dict[str, Any]:
    """The beta modes' create settings: the function tools declared `async: true`; without
    `overlap` also `parallel_tool_calls: false`, one call in flight at a time."""
    out = dict(settings)
    if "tools" in out:
        out["tools"] = [_declared_async(tool) for tool in out["tools"]]
    if not overlap:
        out.setdefault("parallel_tool_calls", False)
    return out


def _declared_async(tool: Any) -> Any:
    """A function tool declared `async: true` (the beta's `BetaFunctionTool`); other tools as they are."""
    return {**tool, "async": True} if isinstance(tool, dict) and tool.get("type") == "function" else tool
