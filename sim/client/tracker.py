"""Folding a server event stream into a `TurnResult`: the part every measuring client shares
(sim/client/client.py's HTTP and WebSocket clients, sim/client/agents_client.py's). Decodes
nothing itself: it sees the msgspec events the server encodes with."""

from __future__ import annotations

from typing import Any, Final

import msgspec

from prototype.clock import Clock
from prototype.wire.schemas import (
    ErrorEvent,
    FunctionCallArgumentsDelta,
    OutputItemDone,
    OutputTextDelta,
    Response,
    ResponseCompleted,
    ResponseDone,
    ResponseFailed,
    ResponseIncomplete,
    ServerEvent,
)
from sim.rollout.result import ClientError, TurnResult

__all__ = ["TERMINALS", "TOKEN_DELTAS", "Tracker"]

TOKEN_DELTAS: Final = (OutputTextDelta, FunctionCallArgumentsDelta)


TERMINALS: Final = (ResponseCompleted, ResponseFailed, ResponseIncomplete, ResponseDone)  # done: append pause


_TOKEN, _ITEM, _END, _ERROR = "token", "item", "end", "error"
_ROLES: Final[dict[type, str]] = {
    **dict.fromkeys(TOKEN_DELTAS, _TOKEN),
    OutputItemDone: _ITEM,
    **dict.fromkeys(TERMINALS, _END),
    ErrorEvent: _ERROR,
}
"""What `Tracker.see` does with an event, by its type; any other type is only logged and counted."""


class Tracker:
    """Folds a server event stream into a `TurnResult`."""

    def __init__(self, clock: Clock, sent_at: float, bytes_sent: int) -> None:
        self.clock = clock
        self.sent_at = sent_at
        self.bytes_sent = bytes_sent
        self.first_token_at: float | None = None
        self.events = 0
        self.items: list[dict[str, Any]] = []
        self.log: list[tuple[float, str]] = []

    def see(self, event: ServerEvent) -> TurnResult | None:
        self.events += 1
        self.log.append((self.clock.now(), event.__struct_config__.tag))  # type: ignore[arg-type]
        role = _ROLES.get(type(event))  # one lookup per event (the wire's event types have no subclasses)
        if role is None:
            return None
        if role is _TOKEN:
            if self.first_token_at is None:
                self.first_token_at = self.clock.now()
        elif role is _ITEM:
            assert isinstance(event, OutputItemDone)
            self.items.append(msgspec.to_builtins(event.item))
        elif role is _END:
            return self.ended(event.response)  # type: ignore[union-attr]
        else:
            assert isinstance(event, ErrorEvent)
            raise ClientError(event.status if isinstance(event.status, int) else 400, msgspec.to_builtins(event.error))
        return None

    def paused(self, response: Response) -> TurnResult:
        """The beta's pause: the turn ends with its async call, the response still in progress."""
        return self.ended(response)

    def ended(self, response: Response) -> TurnResult:
        """The turn as it stands now, ending with `response`."""
        return TurnResult(
            response,
            self.sent_at,
            self.first_token_at,
            self.clock.now(),
            self.bytes_sent,
            self.events,
            self.items,
            self.log,
        )
