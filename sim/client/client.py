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

This module holds the HTTP clients and chooses each mode's client (`open_client`); each
WebSocket mode has its own driver over a shared socket part (sim/client/websocket.py,
sim/client/steer.py), chosen by `WS_DRIVERS`. In the WebSocket modes several rollouts may share
one socket, each on its own lane (`stream_id`, docs/lanes.md): `share_socket` puts a list of
clients on one `LaneSocket` (sim/client/lanes.py), whose reader hands each frame to the lane its
`stream_id` names.

Each turn returns a `TurnResult` (sim/rollout/result.py) with client-side timings taken on an
injected clock, folded from the event stream by a `Tracker` (sim/client/tracker.py). The client
decodes frames with the same msgspec types the server encodes with.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Final, Protocol

import aiohttp

from prototype.clock import Clock
from prototype.wire.schemas import ServerEvent, decode_server_event, encode
from prototype.wire.sse import SSEDecoder
from sim.client.agents_client import AgentsClient
from sim.client.steer import SteerDriver
from sim.client.tracker import History, Tracker
from sim.client.websocket import AppendDriver, AsyncDriver, ChainDriver, InjectDriver, WSClient, WSSocket
from sim.rollout.result import ALL_MODES, WS_MODES, ClientError, Mode, TurnResult

__all__ = ["WS_DRIVERS", "HTTPClient", "ResponsesClient", "open_client", "ws_client"]


class ResponsesClient(Protocol):
    mode: Mode

    async def turn(self, new_items: list[dict[str, Any]], **settings: Any) -> TurnResult: ...

    async def close(self) -> None: ...


class HTTPClient:
    """`http` (full history) or, with `chained=True`, `http_prev`. Subclasses replace
    `_exchange` to carry the same bodies over another transport."""

    def __init__(self, base_url: str, clock: Clock, *, chained: bool, api_key: str = "sk-longrun") -> None:
        self.mode: Mode = "http_prev" if chained else "http"
        self.url = base_url.rstrip("/") + "/responses"
        self.clock = clock
        self.chained = chained
        self.history = History(encoded=not chained)
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


def open_client(mode: Mode, base_url: str, clock: Clock, *, api_key: str = "sk-longrun") -> ResponsesClient:
    if mode == "http":
        return HTTPClient(base_url, clock, chained=False, api_key=api_key)
    if mode == "http_prev":
        return HTTPClient(base_url, clock, chained=True, api_key=api_key)
    if mode in WS_MODES:
        return ws_client(WSSocket(base_url, clock, api_key=api_key, mode=mode))
    if mode == "agents":
        return AgentsClient(base_url, clock, api_key=api_key)
    raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(ALL_MODES)}")


WS_DRIVERS: Final[dict[Mode, type[WSClient]]] = {
    "ws": ChainDriver,
    "append": AppendDriver,
    "inject": InjectDriver,
    "async": AsyncDriver,
    "steer": SteerDriver,
}  # each WebSocket mode's driver (sim/client/websocket.py, sim/client/steer.py)


def ws_client(socket: WSSocket) -> WSClient:
    """The driver of `socket`'s mode over it."""
    return WS_DRIVERS[socket.mode](socket)
