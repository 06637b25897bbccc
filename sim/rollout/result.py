"""What a rollout produced, as the measuring client saw it: per turn a `TurnResult` (client-side
timings on an injected clock), per rollout a `RolloutResult`; and the API modes' names.

TTFT is measured to the first *token-carrying* delta, E2E to the terminal event (in append
mode, a segment ends at the pause). A turn's `output_items` are those of its
`output_item.done` events.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from prototype.wire.schemas import Response
from sim.rollout.spec import Interjection

__all__ = [
    "ALL_MODES",
    "MODES",
    "WS_MODES",
    "ClientError",
    "InterjectionRecord",
    "Mode",
    "Reconnect",
    "ReconnectReason",
    "RolloutFailure",
    "RolloutResult",
    "TurnResult",
    "error_line",
    "failure_lines",
    "tool_outputs",
]

Mode = Literal["http", "http_prev", "ws", "append", "inject", "async", "steer", "agents"]


# The default comparison's modes; `inject`, `async` and `steer` are opt-in (`--modes`, docs/experiments.md).
MODES: Final[tuple[Mode, ...]] = ("http", "http_prev", "ws", "append")


ALL_MODES: Final[tuple[Mode, ...]] = (*MODES, "inject", "async", "steer", "agents")


WS_MODES: Final[tuple[Mode, ...]] = ("ws", "append", "inject", "async", "steer")


class ClientError(Exception):
    def __init__(self, status: int, body: Any) -> None:
        super().__init__(f"{status}: {body}")
        self.status = status
        self.body = body


def error_line(exc: BaseException) -> str:
    """What a rollout failed of, in one line: a `ClientError` as its status, code and message
    (`400 context_length_exceeded: Your input exceeds …`), anything else as its type and first line."""
    if isinstance(exc, ClientError):
        body = exc.body
        if isinstance(body, dict) and isinstance(body.get("error"), dict):
            body = body["error"]  # an HTTP error reply: {"error": {...}}; a stream's error event is the object
        if isinstance(body, dict):
            code = body.get("code") or body.get("type") or ""
            text = f"{exc.status} {code}: {body.get('message', '')}".rstrip(": ")
        else:
            text = f"{exc.status}: {body}"
    else:
        text = f"{type(exc).__name__}: {exc}".rstrip(": ")
    line = " ".join(text.split())
    return line if len(line) <= 200 else line[:199] + "…"


@dataclass(frozen=True, slots=True)
class RolloutFailure:
    """A rollout that ended in an error (a `ClientError` from the server, a transport or engine
    error): reported beside the comparison's table, not in its metrics."""

    mode: Mode
    index: int
    error: str  # one line (`error_line`)


def failure_lines(failed: Sequence[RolloutFailure]) -> list[str]:
    """A line per mode and error, in a comparison table's first columns: `http  2 failed (rollouts 0, 3): …`."""
    groups: dict[tuple[str, str], list[int]] = {}
    for f in failed:
        groups.setdefault((f.mode, f.error), []).append(f.index)
    return [
        f"{mode:<10} {len(ix):>3} failed (rollout{'s' if len(ix) > 1 else ''} {', '.join(map(str, ix))}): {error}"
        for (mode, error), ix in groups.items()
    ]


@dataclass(slots=True)
class TurnResult:
    response: Response
    sent_at: float
    first_token_at: float | None
    done_at: float
    bytes_sent: int
    events: int
    output_items: list[dict[str, Any]] = field(default_factory=list)
    event_log: list[tuple[float, str]] = field(default_factory=list)  # (clock time, event type), in order
    steered: list[Response] = field(default_factory=list)  # `steer` mode: responses a steer ended in this turn

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.sent_at

    @property
    def e2e_s(self) -> float:
        return self.done_at - self.sent_at

    @property
    def call_ids(self) -> list[str]:
        """The function calls the client owes an output for (not one a steer cut off: `incomplete`)."""
        return [
            item["call_id"]
            for item in self.output_items
            if item.get("type") == "function_call" and item.get("status") != "incomplete"
        ]


@dataclass(slots=True)
class InterjectionRecord:
    """What became of one interjection: when it arrived, and when the first token of the model
    turn that has it in its context came (None: not yet)."""

    interjection: Interjection
    arrived_at: float
    seen_at: float | None = None
    via: Literal["next_turn", "steer"] = "next_turn"

    @property
    def latency_s(self) -> float | None:
        return None if self.seen_at is None else self.seen_at - self.arrived_at


ReconnectReason = Literal["rotate", "limit", "closed", "cut", "restart"]


@dataclass(slots=True)
class Reconnect:
    """One move of a WebSocket rollout to a new socket (or, `restart`, to a new response on the same
    one; sim/client/reconnect.py): why, at which turn, when, and what its first turn cost (the
    server's stage report)."""

    reason: ReconnectReason  # rotate: before the limit; limit: a create refused at it; closed: the socket
    # was gone; cut: a paused response ended at the limit; restart: a pause ended by its timeout
    turn: int  # the rollout's turn index (0 = the first)
    at: float  # clock time of the move
    connect_s: float = 0.0  # opening the new socket, on the client's clock
    e2e_s: float = 0.0  # the first turn after the move, send to its end
    connection_cache: str = ""  # that turn's `longrun.connection_cache` (miss: loaded from the store)
    load_s: float = 0.0  # its `load_state` stage (the store load on a miss)
    render_s: float = 0.0  # its `render` stage
    tokens_rendered: int = 0
    tokens_prefilled: int = 0


@dataclass(slots=True)
class RolloutResult:
    mode: Mode
    index: int
    started_at: float
    finished_at: float
    turns: list[TurnResult] = field(default_factory=list)
    tool_time_s: float = 0.0
    # Per model turn, the prompt tokens the model read (the comparison records them server-side).
    prompt_tokens: list[int] = field(default_factory=list)
    # Per model turn sampled, (prompt tokens found cached, tokens decoded), recorded the same way.
    model_tokens: list[tuple[int, int]] = field(default_factory=list)
    interjections: list[InterjectionRecord] = field(default_factory=list)
    tokens_discarded: int = 0  # decoded tokens of items a steer cut off (`steer` mode)
    successors: int = 0  # automatic successors the steers started (`steer` mode)
    reconnects: list[Reconnect] = field(default_factory=list)  # WebSocket modes across the connection limit

    @property
    def completion_s(self) -> float:
        return self.finished_at - self.started_at


def tool_outputs(result: TurnResult, output_text: str) -> list[dict[str, Any]]:
    """`function_call_output` items answering every call of a turn."""
    return [{"type": "function_call_output", "call_id": call_id, "output": output_text} for call_id in result.call_ids]
