"""The `steer` mode's driver: `inject`, and a user message that arrives while the rollout runs
(an interjection, docs/experiments.md) sent at once as `response.steer` to the response in
flight. The client follows the automatic successor (`response.incomplete` with reason
`steered`, then the successor's `response.created`) within the same turn. The other modes hold
such a message and send it with the next turn's input (sim/client/loop.py's `run_interjected`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec

from prototype.wire.schemas import (
    FunctionCall,
    OutputItemDone,
    Response,
    ResponseCompleted,
    ResponseCreated,
    ResponseIncomplete,
    ResponseSteerAccepted,
    ResponseSteerFailed,
    decode_server_event,
    encode,
)
from sim.client.tracker import TOKEN_DELTAS
from sim.client.websocket import InjectDriver, WSSocket, socket_ended
from sim.rollout.result import InterjectionRecord, TurnResult
from sim.rollout.spec import Interjection

__all__ = ["SteerDriver", "SteerState"]


@dataclass(slots=True)
class SteerState:
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


class SteerDriver(InjectDriver):
    """`steer`: `inject`'s turns (its socket, create and resumes), and the steers: `arm` before
    a turn, `disarm` at the rollout's end. With `steering` off it holds interjections as every
    other mode does (a negative control)."""

    def __init__(self, socket: WSSocket) -> None:
        super().__init__(socket)
        self.steering = True
        self.steer_state = SteerState()

    def arm(self, interjection: Interjection) -> None:
        """Send `interjection` as `response.steer` its delay after the next turn's first token,
        to the response in flight then (the turn's, or its successor)."""
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
        ws = self.socket.ws
        assert ws is not None and st.current is not None
        body = {"type": "response.steer", "previous_response_id": st.current, "input": record.interjection.text}
        st.unanswered.append(record)
        await ws.send_str(encode(body).decode())

    async def turn(self, new_items: list[dict[str, Any]], **settings: Any) -> TurnResult:
        """`inject`'s turn, and the steers: a turn runs on through `response.incomplete`
        (`steered`) into the successor, and past a terminal event while a steer it sent is
        unanswered or accepted but not committed (a successor, or a failure, is coming)."""
        if not self.steering:
            return await super().turn(new_items, **settings)
        st = self.steer_state
        tracker = await self.socket.start(self.frame(new_items, settings))
        ws = self.socket.ws
        assert ws is not None
        latest: Response | None = None
        held: Response | None = None  # a terminal event passed over while a steer was outstanding
        loop = asyncio.get_running_loop()
        while True:
            msg = await ws.receive()
            if msg.type is not aiohttp.WSMsgType.TEXT:
                raise socket_ended(msg)
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
                    return self._done(new_items, ended)
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
                return self._done(new_items, result)
            if isinstance(event, OutputItemDone) and isinstance(event.item, FunctionCall) and event.item.is_async:
                if event.item.status == "incomplete":
                    continue  # cut off by a steer: not owed
                return self._done(new_items, tracker.paused(self.wait_on(latest)))

    def _done(self, sent: list[dict[str, Any]], result: TurnResult) -> TurnResult:
        result.steered, self.steer_state.ended = self.steer_state.ended, []
        self.history.record(sent, result)
        return result

    async def close(self) -> None:
        for _, timer in self.steer_state.timers:
            timer.cancel()
        await super().close()


def _steered(response: Response) -> bool:
    return response.incomplete_details is not None and response.incomplete_details.reason == "steered"
