"""Folding a server event stream into a `TurnResult`, and the history a client keeps across
turns: the parts every measuring client shares (sim/client/client.py's HTTP clients,
sim/client/websocket.py's and sim/client/steer.py's WebSocket drivers, sim/client/agents_client.py's).
Decodes nothing itself: it sees the msgspec events the server encodes with."""

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
    encode,
)
from sim.rollout.result import ClientError, TurnResult

__all__ = ["TERMINALS", "TOKEN_DELTAS", "History", "Tracker"]

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
        now = self.clock.now()
        self.log.append((now, event.__struct_config__.tag))  # type: ignore[arg-type]
        role = _ROLES.get(type(event))  # one lookup per event (the wire's event types have no subclasses)
        if role is None:
            return None
        if role is _TOKEN:
            if self.first_token_at is None:
                self.first_token_at = now
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


class History:
    """What a client keeps across turns: input so far + outputs so far and the last response's
    id; with `encoded`, each item's JSON too, made once, so a body that resends them copies bytes."""

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
