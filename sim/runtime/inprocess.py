"""The server's logic without sockets: in-process transports for virtual-time runs.

Covers: running the same engine, connection core and WebSocket adapter
(`prototype.serve.session.WebSocketSession`) as the live server, with the client's frames
and the server's events handed over in memory. Bytes are still encoded and
decoded at both ends (that JSON work is part of what the modes cost), and the
cost profile's `network` stage still charges the modeled round trip and upload,
exactly as on the live server. What disappears is the kernel: no sockets, no
waiting on I/O, so on a `VirtualTimeLoop` a rollout runs as fast as its CPU work.
With `live_costs` (on a server whose run charges CPU: `InProcessServer.charge_cpu`) the transports charge what the live
one costs beyond that, as measured on this machine (`sim.runtime.virtual.LiveCosts`): an HTTP
request when it is sent, its response at the server's first events (where the live
server prepares the response and sends its headers), a WebSocket message when it is sent.

Silent connections (prototype/serve/wallclock.py): with `ServerConfig.idle_timeout_s` an
intermediary sits on every WebSocket and SSE stream and cuts one that carried no frame either way
for that long, as a load balancer drops the TCP connection: the client's next read gets `CLOSED`
(aiohttp's abnormal closure, 1006) and its next send `ClientConnectionResetError`; an SSE reader
gets `ClientPayloadError`; the server sees its socket close (or its next write fail). With
`websocket.ping_interval_s` the server pings a connection its client has been silent on, and the
client answers at once (as websockets' background keepalive does): two frames, which reset the
intermediary's timer; with `sse_keepalive_s` a silent SSE stream gets a comment line. Every cut is
kept in `InProcessServer.cuts`, every keepalive sent counted in `keepalives`.
"""

from __future__ import annotations

import asyncio
import collections
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, Generic, Literal, TypeVar

import aiohttp
import msgspec
from aiohttp import WSMsgType

from prototype.clock import Clock
from prototype.config import ServerConfig
from prototype.context.conversation import ToolCache
from prototype.model import TokenModel
from prototype.serve.admission import admit_websocket, authorize
from prototype.serve.compose import Overrides, compose
from prototype.serve.exchange import HTTPExchange, JSONReply
from prototype.serve.session import WebSocketSession
from prototype.serve.wallclock import IdleCut, IdleWatch, Keepalive
from prototype.store.base import ResponseStore
from prototype.wire.errors import ProtocolError
from prototype.wire.schemas import ServerEvent, decode_server_event, encode
from prototype.wire.sse import SSEDecoder, encode_event
from sim.client.agents_client import AgentsClient
from sim.client.client import HTTPClient, ResponsesClient, ws_client
from sim.client.lanes import TextSocket
from sim.client.websocket import WSSocket, upgrade_refused
from sim.rollout.result import WS_MODES, ClientError, Mode
from sim.runtime.virtual import IDLE_S, LiveCosts, VirtualTimeLoop

__all__ = ["InProcessServer", "Tap"]

_CLOSED = aiohttp.WSMessage(WSMsgType.CLOSED, None, None)
_TEXT = WSMsgType.TEXT
Tap = Callable[[Literal["up", "down"], bytes], None]
T = TypeVar("T")


class _Channel(Generic[T]):
    """An unbounded queue with one consumer: what `asyncio.Queue` does here, in half its steps
    (a transport's every frame goes through one)."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: collections.deque[T] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None

    def put_nowait(self, item: T) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> T:
        items = self._items
        while not items:
            if self._waiter is not None and not self._waiter.done():
                raise RuntimeError("a channel has one consumer")
            # The future the loop's `create_future` would make, without that call: a read waits here per frame.
            self._waiter = asyncio.Future(loop=asyncio.get_running_loop())
            try:
                await self._waiter
            finally:
                self._waiter = None
        return items.popleft()


class _LiveCharges:
    """One client's live transport costs, charged on a loop that charges CPU: each operation at
    its back-to-back cost, or at its after-a-wait cost when the loop slept since this client's
    last one (a turn's request follows the tool's time) or when it follows one that did."""

    __slots__ = ("_mark", "_slept", "costs")

    def __init__(self, costs: LiveCosts) -> None:
        self.costs = costs
        self._mark: tuple[float, float, float] | None = None
        self._slept = True

    def charge(self, back: float, after_wait: float, *, follows: bool = False) -> None:
        loop = asyncio.get_running_loop()
        assert isinstance(loop, VirtualTimeLoop)
        slept = self._mark is None or loop.idle_since(self._mark) >= IDLE_S or (follows and self._slept)
        loop.charge(after_wait if slept else back)
        self._mark, self._slept = loop.mark(), slept


def _charges(costs: LiveCosts | None) -> _LiveCharges | None:
    """Charges for a new client, if there are costs (only a server whose run charges CPU has them)."""
    return None if costs is None else _LiveCharges(costs)


class _Watched:
    """What lies on one in-process connection, each if set: the intermediary's idle timer
    (`idle_timeout_s`) and the server's keepalive (WebSocket pings or SSE comments, every
    `keepalive_s`). `heard()` for a frame that resets both; a keepalive sent counts as a frame
    either way (a ping and its pong, or the comment). A cut is kept in `server.cuts`, stops both
    timers, then `_on_cut()` tells the connection."""

    __slots__ = ("keepalive", "server", "watch")

    def __init__(
        self, server: InProcessServer, kind: Literal["websocket", "sse"], mode: str, keepalive_s: float | None
    ) -> None:
        self.server = server
        timeout_s = server.config.idle_timeout_s
        self.watch = IdleWatch(timeout_s, self._cut, kind=kind, mode=mode) if timeout_s else None
        self.keepalive = Keepalive(keepalive_s, self._kept) if keepalive_s is not None else None

    def heard(self) -> None:
        if self.watch is not None:
            self.watch.frame()
        if self.keepalive is not None:
            self.keepalive.heard()

    def _kept(self) -> None:
        self.server.keepalives += 1
        if self.watch is not None:
            self.watch.frame()

    def _cut(self, cut: IdleCut) -> None:
        self.server.cuts.append(cut)
        self.close()
        self._on_cut()

    def _on_cut(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        if self.watch is not None:
            self.watch.stop()
        if self.keepalive is not None:
            self.keepalive.stop()


class _Line(_Watched):
    """What lies between a WebSocket's two ends (`_Watched`, the keepalive the server's pings,
    `ping_interval_s`): `up()` for every frame from the client (it also resets the pings, as
    aiohttp's heartbeat), `down()` for every frame from the server."""

    __slots__ = ("cut",)

    def __init__(self, server: InProcessServer, mode: str, cut: Callable[[], None]) -> None:
        super().__init__(server, "websocket", mode, server.config.websocket.ping_interval_s)
        self.cut = cut

    up = _Watched.heard

    def down(self) -> None:
        if self.watch is not None:
            self.watch.frame()

    def _on_cut(self) -> None:
        self.cut()


class _ServerSocket:
    """The server's end of an in-process WebSocket: a `prototype.serve.session.SessionSocket`."""

    def __init__(self, inbox: _Channel[str | None], outbox: _Channel[aiohttp.WSMessage], tap: Tap | None) -> None:
        self.inbox = inbox
        self.outbox = outbox
        self.closed = False
        self.tap = tap
        self.line: _Line | None = None

    async def send_text(self, data: bytes) -> None:
        self.push(data)

    # A `prototype.serve.session.FrameBuffer`: a frame is handed over at once, nothing to drain.
    def push(self, data: bytes) -> bool:
        if self.closed:  # cut by the intermediary: the frame goes nowhere
            return False
        if self.line is not None:
            self.line.down()
        frame = bytes(data)  # the writer may hand over a view of its buffer
        if self.tap is not None:
            self.tap("down", frame)
        # Made as the tuple it is: its named constructor is a Python call, and every frame makes one.
        self.outbox.put_nowait(tuple.__new__(aiohttp.WSMessage, (_TEXT, frame.decode(), None)))
        return False

    async def drain(self) -> None:
        return None

    def flush(self) -> None:
        return None

    async def close(self, *, code: int = 1000, message: bytes = b"") -> bool:
        if not self.closed:
            self.closed = True
            if self.line is not None:
                self.line.close()
            self.outbox.put_nowait(aiohttp.WSMessage(WSMsgType.CLOSE, code, message.decode()))
            self.inbox.put_nowait(None)
        return True

    def cut(self) -> None:
        """The connection dropped under the server: its session reads the end."""
        if not self.closed:
            self.closed = True
            self.inbox.put_nowait(None)

    def __aiter__(self) -> _ServerSocket:
        return self

    async def __anext__(self) -> str:
        data = await self.inbox.get()
        if data is None:
            self.closed = True
            raise StopAsyncIteration
        return data


class _ClientSocket:
    """The client's end: `TextSocket` for `WSSocket`."""

    def __init__(
        self,
        inbox: _Channel[aiohttp.WSMessage],
        outbox: _Channel[str | None],
        tap: Tap | None,
        charges: _LiveCharges | None = None,
    ) -> None:
        self.inbox = inbox
        self.outbox = outbox
        self.session_task: asyncio.Task[None] | None = None
        self.tap = tap
        self.charges = charges
        self.line: _Line | None = None
        self.dropped = False  # cut by the intermediary
        self.receive: Callable[[], Coroutine[Any, Any, aiohttp.WSMessage]] = inbox.get  # a read is the channel's own

    async def send_str(self, data: str) -> None:
        if self.dropped:  # what aiohttp raises writing to a connection that dropped
            raise aiohttp.ClientConnectionResetError("Cannot write to closing transport")
        if self.line is not None:
            self.line.up()
        if self.tap is not None:
            self.tap("up", data.encode())
        if self.charges is not None:
            costs = self.charges.costs
            self.charges.charge(costs.ws_message, costs.ws_message_after_wait)
        self.outbox.put_nowait(data)

    async def close(self) -> None:
        if self.line is not None:
            self.line.close()
        self.outbox.put_nowait(None)
        if self.session_task is not None:
            await self.session_task

    def cut(self) -> None:
        """The connection dropped under the client: its next read gets the abnormal closure."""
        self.dropped = True
        self.inbox.put_nowait(_CLOSED)


class _Stream(_Watched):
    """What lies on one SSE stream (`_Watched`, the keepalive the server's comments,
    `sse_keepalive_s`): `frame()` for every chunk sent; the reader learns of a cut from `wake`
    (called once) or `next`."""

    __slots__ = ("cut", "wake")

    def __init__(self, server: InProcessServer, mode: str, wake: Callable[[], None] | None = None) -> None:
        self.cut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.wake = wake
        super().__init__(server, "sse", mode, server.config.sse_keepalive_s)

    @classmethod
    def of(cls, server: InProcessServer, mode: str, wake: Callable[[], None] | None = None) -> _Stream | None:
        """A stream's line, or None where nothing lies on it."""
        config = server.config
        return cls(server, mode, wake) if config.idle_timeout_s or config.sse_keepalive_s is not None else None

    frame = _Watched.heard

    def _on_cut(self) -> None:
        self.cut.set_result(None)
        if self.wake is not None:
            self.wake()

    def dropped(self) -> aiohttp.ClientPayloadError:
        """What aiohttp raises reading a streamed body whose connection dropped."""
        return aiohttp.ClientPayloadError("Response payload is not completed: the connection was closed")

    async def next(self, get: Awaitable[T]) -> T:
        """`get`'s result, or the cut's `ClientPayloadError` if the intermediary cuts first."""
        task = asyncio.ensure_future(get)
        await asyncio.wait((task, self.cut), return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            task.cancel()
            raise self.dropped()
        return task.result()


def _end(*channels: _Channel[Any]) -> None:
    """Wake the reader of whichever channel it reads: the stream is over."""
    for channel in channels:
        channel.put_nowait(None)


def _reply_error(reply: JSONReply) -> ClientError:
    """What the measuring client raises for a JSON reply on a socket (`sim.client.client`: the
    status and the decoded body). The client always streams, so a reply here is an error."""
    return ClientError(reply.status, msgspec.json.decode(reply.body))


class _InProcessHTTP(HTTPClient):
    def __init__(self, server: InProcessServer, clock: Clock, *, chained: bool) -> None:
        super().__init__("inprocess://", clock, chained=chained)
        self.server = server
        self.charges: _LiveCharges | None = None

    async def _exchange(self, data: bytes) -> AsyncIterator[ServerEvent]:
        engine, tap = self.server.engine, self.server.tap
        if tap is not None:
            tap("up", data)
        if self.charges is None:
            self.charges = _charges(self.server.live_costs)
        charges = self.charges
        if charges is not None:  # the request's way to the handler, before the server reads the body
            charges.charge(charges.costs.http_request, charges.costs.http_request_after_wait)
        try:  # the live server's admission and exchange (prototype.serve): the same answer on every path
            authorize(self.server.config, "/v1/responses", f"Bearer {self.api_key}")
            exchange = HTTPExchange(data, engine, self.server.config, tool_cache=self.server.tool_cache)
        except ProtocolError as err:
            raise _reply_error(JSONReply.error(err)) from None
        queue: _Channel[ServerEvent | None] = _Channel()
        # With CPU charged, the server frames its events as SSE and the client's task parses them
        # with the client's decoder when it runs, as over a socket (real work at both ends, each
        # where it runs live); with CPU free that framing is skipped (the same events).
        sse = SSEDecoder() if self.server.charge_cpu else None
        chunks: _Channel[bytes | None] = _Channel()
        line = _Stream.of(self.server, "http_prev" if self.chained else "http", wake=lambda: _end(queue, chunks))

        def sent() -> None:  # a chunk on the stream; after a cut, the live server's write fails
            if line is not None:
                if line.cut.done():
                    raise ConnectionResetError("the client went away")
                line.frame()

        async def emit(events: list[ServerEvent]) -> None:
            sent()
            for ev in events:
                data = encode(ev)  # the bytes a socket would carry
                if tap is not None:
                    tap("down", data)
                queue.put_nowait(decode_server_event(data))

        responded = charges is None

        async def emit_sse(events: list[ServerEvent]) -> None:
            nonlocal responded
            sent()
            if not responded:  # the live server prepares the response (its headers) at its first events
                assert charges is not None
                responded = True
                charges.charge(charges.costs.http_response, charges.costs.http_response_after_wait, follows=True)
            frames = []
            for ev in events:
                data = encode(ev)
                if tap is not None:
                    tap("down", data)
                frames.append(encode_event(data, event=ev.__struct_config__.tag))  # type: ignore[arg-type]
            chunks.put_nowait(b"".join(frames))

        async def run() -> None:
            try:
                reply = await exchange.run(emit if sse is None else emit_sse)
                if reply is not None:  # a JSON reply instead of a stream: the error, as a socket carries it
                    raise _reply_error(reply)
            finally:
                (queue if sse is None else chunks).put_nowait(None)

        task = asyncio.get_running_loop().create_task(run())
        try:
            if sse is None:
                while (event := await queue.get()) is not None:
                    yield event
            else:
                while (chunk := await chunks.get()) is not None:
                    for parsed in sse.feed(chunk):
                        yield decode_server_event(parsed.data)
            if line is not None and line.cut.done():
                raise line.dropped()
        finally:
            if line is not None:
                line.close()
            if line is not None and line.cut.done():
                self.server.orphan(task)  # the server finds out at its next write, as live
            else:
                await task


class _InProcessWS(WSSocket):
    def __init__(
        self,
        server: InProcessServer,
        clock: Clock,
        mode: Mode,
    ) -> None:
        super().__init__("inprocess://", clock, mode=mode)
        self.server = server

    async def connect(self) -> TextSocket:
        server = self.server
        headers = self.upgrade_headers()
        query = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(self.url).query))
        try:  # the live server's admission: the same refusal, the same terms
            authorize(server.config, "/v1/responses", headers.get("Authorization"))
            terms = admit_websocket(server.config, headers, query, server.slots)
        except ProtocolError as err:
            raise upgrade_refused(err.status) from None
        to_server: _Channel[str | None] = _Channel()
        to_client: _Channel[aiohttp.WSMessage] = _Channel()
        server_end = _ServerSocket(to_server, to_client, server.tap)
        client_end = _ClientSocket(to_client, to_server, server.tap, _charges(server.live_costs))
        if server.config.idle_timeout_s or server.config.websocket.ping_interval_s is not None:

            def cut() -> None:
                server_end.cut()
                client_end.cut()

            server_end.line = client_end.line = _Line(server, self.mode, cut)
        session = WebSocketSession(server.engine, server.config, server_end, terms=terms)

        async def serve() -> None:
            try:
                await session.serve()
            finally:
                server.slots.release()

        client_end.session_task = asyncio.get_running_loop().create_task(serve())
        return client_end


async def _read(get: Awaitable[bytes | None], line: _Stream | None) -> bytes | None:
    """An Agents API stream's next chunk through its line: a chunk is a frame."""
    if line is None:
        return await get
    chunk = await line.next(get)
    if chunk is not None:
        line.frame()
    return chunk


class _InProcessAgents(AgentsClient):
    """The `agents` client over the server's own `AgentsAPI` (the routes' plans), no sockets."""

    def __init__(self, server: InProcessServer, clock: Clock) -> None:
        super().__init__("inprocess://", clock)
        self.server = server

    def _admit(self) -> None:
        """The live server's admission of every Agents API route: the key, then the beta header."""
        headers = self._headers()
        try:
            authorize(self.server.config, "/v1/agents/sessions", headers.get("Authorization"))
            self.server.agents.check_beta(headers)
        except ProtocolError as err:
            raise _reply_error(JSONReply.error(err)) from None

    async def _create(self, data: bytes) -> AsyncIterator[bytes]:
        api, tap = self.server.agents, self.server.tap
        if tap is not None:
            tap("up", data)
        self._admit()
        try:
            reply = await api.create(data)
        except ProtocolError as err:
            raise _reply_error(JSONReply.error(err)) from None
        if isinstance(reply, JSONReply):
            raise _reply_error(reply)
        line = _Stream.of(self.server, "agents")
        try:
            while (chunk := await _read(reply.feed.get(), line)) is not None:
                if tap is not None:
                    tap("down", chunk)
                yield chunk
        finally:
            if line is not None:
                line.close()
            reply.runner.unsubscribe(reply.feed)

    async def _subscribe(self, session_id: str) -> AsyncIterator[bytes]:
        self._admit()
        reply = await self.server.agents.stream_events(session_id)  # subscribed now

        async def chunks() -> AsyncIterator[bytes]:
            line = _Stream.of(self.server, "agents")
            try:
                while (chunk := await _read(reply.feed.get(), line)) is not None:
                    if self.server.tap is not None:
                        self.server.tap("down", chunk)
                    yield chunk
            finally:
                if line is not None:
                    line.close()
                reply.runner.unsubscribe(reply.feed)

        return chunks()

    async def _turn(self, session_id: str, turn_id: str) -> dict[str, Any]:
        self._admit()
        try:
            reply = await self.server.agents.get_turn(session_id, turn_id)
        except ProtocolError as err:
            raise _reply_error(JSONReply.error(err)) from None
        return msgspec.json.decode(reply.body)  # type: ignore[no-any-return]

    async def _post(self, session_id: str, data: bytes, key: str) -> None:
        if self.server.tap is not None:
            self.server.tap("up", data)
        self._admit()
        try:
            await self.server.agents.post_events(session_id, data, key)
        except ProtocolError as err:
            raise _reply_error(JSONReply.error(err)) from None


class InProcessServer:
    """The server's parts, reachable without sockets. One per simulated server.

    `charge_cpu` is the run mode, set by whoever runs it and matching its loop
    (`sim.runtime.virtual.run_virtual`): with CPU charged, the service tokenizes long texts on
    render threads as the live server does, the HTTP transport frames and parses SSE, and
    `live_costs` are charged; with CPU free none of that work is done (it would take no time)."""

    def __init__(
        self,
        config: ServerConfig,
        *,
        model: TokenModel,
        store: ResponseStore,
        clock: Clock,
        seed: int | None = None,
        charge_cpu: bool = False,
        overrides: Overrides | None = None,
        tool_cache: ToolCache | None = None,
        tap: Tap | None = None,
        live_costs: LiveCosts | None = None,
    ) -> None:
        """The service is `prototype.serve.compose`'s, as the live server's, with `overrides` (the
        simulator's memoizing parts, where CPU is free). `tool_cache`: shared by every HTTP request
        (`sim.runtime.memo`, where CPU is free), so a tool list identical to the last one is not
        validated again; the engine's `item_parser` validates their input items. `tap`: called
        with ("up" or "down", bytes) for every request body, client frame, event and server frame
        carried (to count or time them). `live_costs`: charged by the transports when
        `charge_cpu` (ignored otherwise)."""
        self.config = config
        self.charge_cpu = charge_cpu
        self.service = compose(
            config, model=model, store=store, clock=clock, seed=seed, render_threads=charge_cpu, overrides=overrides
        )
        self.engine = self.service.engine
        self.agents = self.service.agents  # the Agents API's sessions (`agents` mode)
        self.slots = self.service.slots  # open WebSocket connections, as live
        self.tool_cache = tool_cache
        self.tap = tap
        self.live_costs = live_costs if charge_cpu else None
        self.cuts: list[IdleCut] = []  # connections the intermediary cut (`config.idle_timeout_s`)
        self.keepalives = 0  # pings and SSE comments the server sent
        self._orphans: set[asyncio.Task[None]] = set()

    def orphan(self, task: asyncio.Task[None]) -> None:
        """A request's run whose client was cut off: it ends at its next write (its error dropped)."""
        self._orphans.add(task)

        def done(t: asyncio.Task[None]) -> None:
            self._orphans.discard(t)
            if not t.cancelled():
                t.exception()

        task.add_done_callback(done)

    async def close(self) -> None:
        """What the live server does at shutdown: the service closed (`Service.close`), once the
        requests whose clients were cut off have ended (at their next write)."""
        if self._orphans:
            await asyncio.wait(set(self._orphans))
        await self.service.close()

    def client(self, mode: Mode, clock: Clock) -> ResponsesClient:
        if mode in ("http", "http_prev"):
            return _InProcessHTTP(self, clock, chained=mode == "http_prev")
        if mode in WS_MODES:
            return ws_client(_InProcessWS(self, clock, mode))
        if mode == "agents":
            return _InProcessAgents(self, clock)
        raise ValueError(f"unknown mode {mode!r}")
