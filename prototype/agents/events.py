"""An Agents API session's vocabulary (docs/agents-api.md): the session's and a turn's states, the
inputs the session machine (`machine.py`) takes and the outputs it gives, a turn's record and its
transition table."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Final

from ..wire.schemas import (
    FunctionCall,
    RequiredInput,
    Response,
    Usage,
)
from . import wire as w

__all__ = [
    "AgentStateError",
    "AllAnswered",
    "CallAdded",
    "CancelReceived",
    "CancelTurn",
    "DeleteReceived",
    "ENGINE_INPUTS",
    "Input",
    "MAX_TOOLS_BYTES",
    "MessageReceived",
    "Output",
    "Publish",
    "ResumeTurn",
    "SS",
    "StartTurn",
    "TS",
    "TURN_ERROR_CODES",
    "TURN_TRANSITIONS",
    "ToolResultReceived",
    "TurnEnded",
    "TurnPaused",
    "TurnRecord",
]


# A turn's end reason (its response's incomplete reason or failure code) as `SessionTurnError.code`.
TURN_ERROR_CODES: Final = {
    "max_output_tokens": "max_output_tokens",
    "context_length_exceeded": "context_length_exceeded",
    "append_timeout": "request_timeout",  # the pause timeout (serve/agents_api.py)
}
MAX_TOOLS_BYTES: Final = 8 * 1024 * 1024  # the resolved tool list, as compact UTF-8 JSON (session_create_params)


class SS(enum.Enum):
    """The session's state (`AgentSession.status`)."""

    IDLE = "idle"
    IN_PROGRESS = "in_progress"
    REQUIRES_ACTION = "requires_action"
    FAILED = "failed"  # its context is lost: no turn can continue it
    DELETED = "deleted"


class TS(enum.Enum):
    """A turn's state (`Turn.status`)."""

    QUEUED = "queued"
    IN_PROGRESS = "in_progress"
    WAITING = "waiting"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


class AgentStateError(Exception):
    """An input the session cannot take in its state: a bug in the adapter."""


# -- inputs ------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MessageReceived:
    messages: tuple[bytes, ...]  # Responses input items (user messages), as JSON


@dataclass(frozen=True, slots=True)
class ToolResultReceived:
    result: w.InputToolResult


@dataclass(frozen=True, slots=True)
class CancelReceived:
    pass


@dataclass(frozen=True, slots=True)
class DeleteReceived:
    pass


@dataclass(frozen=True, slots=True)
class CallAdded:
    """The engine finished a function call item of the running turn (its arguments are whole)."""

    call: FunctionCall
    output_index: int
    turn_id: str | None = None  # the turn whose response said so (None: the active one)


@dataclass(frozen=True, slots=True)
class TurnPaused:
    required: tuple[RequiredInput, ...]
    turn_id: str | None = None


@dataclass(frozen=True, slots=True)
class AllAnswered:
    pass


@dataclass(frozen=True, slots=True)
class TurnEnded:
    """The running turn's response ended: `completed`, `incomplete`, `failed`, or `cancelled`
    (the adapter cancelled it); `reason` is the incomplete reason or the failure's code."""

    status: str
    response_id: str | None = None
    usage: Usage | None = None
    reason: str | None = None
    message: str | None = None
    stored: bool = False  # the response can be continued by the next turn
    response: Response | None = None  # its final snapshot (for the `longrun` extension field)
    turn_id: str | None = None  # the turn whose response ended (None: the active one)


# What the engine says about a turn: dropped when that turn is no longer the active one (it was
# cancelled, or the session was restored from the store by another process).
ENGINE_INPUTS: Final = (CallAdded, TurnPaused, TurnEnded)


Input = (
    MessageReceived
    | ToolResultReceived
    | CancelReceived
    | DeleteReceived
    | CallAdded
    | TurnPaused
    | AllAnswered
    | TurnEnded
)

# -- outputs -----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Publish:
    event: w.SessionEvent


@dataclass(frozen=True, slots=True)
class StartTurn:
    turn_id: str
    items: tuple[bytes, ...]
    previous_response_id: str | None


@dataclass(frozen=True, slots=True)
class ResumeTurn:
    turn_id: str
    items: tuple[bytes, ...]  # function_call_output items, then steering messages


@dataclass(frozen=True, slots=True)
class CancelTurn:
    turn_id: str


Output = Publish | StartTurn | ResumeTurn | CancelTurn


# -- records -----------------------------------------------------------------------------------------


@dataclass(slots=True)
class TurnRecord:
    id: str
    created_at: int
    status: TS = TS.QUEUED
    started_at: int | None = None
    completed_at: int | None = None
    error: w.TurnErrorOut | None = None
    usage: w.TokenUsageOut | None = None

    def view(self, session_id: str, agent_id: str) -> w.TurnOut:
        return w.TurnOut(
            id=self.id,
            agent_id=agent_id,
            completed_at=self.completed_at,
            created_at=self.created_at,
            error=self.error,
            session_id=session_id,
            started_at=self.started_at,
            status=self.status.value,
            usage=self.usage,
        )

    def move(self, move: str) -> None:
        """Take one of the turn's transitions (`TURN_TRANSITIONS`)."""
        after = TURN_TRANSITIONS.get((self.status, move))
        if after is None:
            raise AgentStateError(f"turn {self.id}: {move} in state {self.status.name}")
        self.status = after


TURN_TRANSITIONS: Final[dict[tuple[TS, str], TS]] = {
    (TS.QUEUED, "start"): TS.IN_PROGRESS,
    (TS.IN_PROGRESS, "pause"): TS.WAITING,
    (TS.WAITING, "resume"): TS.IN_PROGRESS,
    (TS.IN_PROGRESS, "complete"): TS.COMPLETED,
    (TS.IN_PROGRESS, "fail"): TS.FAILED,
    (TS.WAITING, "fail"): TS.FAILED,
    (TS.QUEUED, "cancel"): TS.CANCELLED,
    (TS.IN_PROGRESS, "cancel"): TS.CANCELLED,
    (TS.WAITING, "cancel"): TS.CANCELLED,
}
