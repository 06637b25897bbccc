"""What a WebSocket connection's core takes in and puts out (connection.py).

Inputs are what the adapter (`prototype/serve/session.py`) tells the core: a classified client frame, or
something that happened to a response in flight (a call emitted, a turn ended, a pause, an
end), a timer, a disconnect; a few are the core's own (`Dequeue`, `AllAnswered`). Outputs are
what the core asks the adapter to do: frames to write, jobs to start, resume, abort or cancel,
acknowledgements to number in a response's own stream, a pause timer to arm, a close. Plain
frozen records, no behaviour: the rules are in the units that produce them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from ..context.cache import CacheEntry
from ..context.conversation import CreateRequest, Item
from ..response.stream import InjectRefused
from ..wire.errors import ProtocolError
from ..wire.requests import ResponseAppend, ResponseInject, ResponseSteer
from ..wire.schemas import RequiredInput, SteerRef

__all__ = [
    "INPUT_TYPES",
    "AbortPause",
    "AckInject",
    "AckSteer",
    "AllAnswered",
    "AppendReceived",
    "ArmPauseTimer",
    "BadFrame",
    "CallEmitted",
    "CancelJob",
    "CloseSocket",
    "CreateReceived",
    "Dequeue",
    "Disconnected",
    "Input",
    "Job",
    "LimitReached",
    "Output",
    "PauseTimedOut",
    "ResponseEnded",
    "ResponsePaused",
    "ResumeJob",
    "SendFrame",
    "StartJob",
    "SteerReceived",
    "TakeInput",
    "TurnEnded",
]


# -- inputs -----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CreateReceived:
    request: CreateRequest
    at: float = 0.0  # when the frame arrived (adapter's clock)
    body_bytes: int = 0


@dataclass(frozen=True, slots=True)
class AppendReceived:
    event: ResponseAppend | ResponseInject
    at: float = 0.0  # when the frame arrived (adapter's clock)
    body_bytes: int = 0


@dataclass(frozen=True, slots=True)
class SteerReceived:
    event: ResponseSteer


@dataclass(frozen=True, slots=True)
class CallEmitted:
    """Beta: the in-flight response emitted a call of an async tool (it may be answered now)."""

    job: Job
    call: RequiredInput


@dataclass(frozen=True, slots=True)
class TurnEnded:
    """Beta: the in-flight response's turn ended in async calls; it takes what was injected so
    far (into its next turn's context if its model decodes on, else at its resume)."""

    job: Job


@dataclass(frozen=True, slots=True)
class BadFrame:
    error: ProtocolError
    previous_response_id: str | None = None
    stream_id: str | None = None  # the lane the frame named (its error carries it); None: the default lane
    event_type: str | None = None  # the frame's `type`, when it names one


@dataclass(frozen=True, slots=True)
class Dequeue:
    """Internal: start the next queued create."""


@dataclass(frozen=True, slots=True)
class ResponsePaused:
    job: Job
    required: tuple[RequiredInput, ...]


@dataclass(frozen=True, slots=True)
class AllAnswered:
    """Internal: every pending call of the paused response has an output."""


@dataclass(frozen=True, slots=True)
class PauseTimedOut:
    job: Job


@dataclass(frozen=True, slots=True)
class ResponseEnded:
    job: Job
    entry: CacheEntry | None  # the new cache entry; None if the turn failed
    error: ProtocolError | None = None  # a request error to report as an `error` event
    owed: tuple[RequiredInput, ...] = ()  # beta: client calls the ended response left unanswered
    at: float = 0.0  # when it ended (adapter's clock): an automatic successor arrives then


@dataclass(frozen=True, slots=True)
class LimitReached:
    pass


@dataclass(frozen=True, slots=True)
class Disconnected:
    pass


Input = (
    CreateReceived
    | AppendReceived
    | SteerReceived
    | CallEmitted
    | TurnEnded
    | BadFrame
    | Dequeue
    | ResponsePaused
    | AllAnswered
    | PauseTimedOut
    | ResponseEnded
    | LimitReached
    | Disconnected
)
INPUT_TYPES: Final = (
    CreateReceived,
    AppendReceived,
    SteerReceived,
    CallEmitted,
    TurnEnded,
    BadFrame,
    Dequeue,
    ResponsePaused,
    AllAnswered,
    PauseTimedOut,
    ResponseEnded,
    LimitReached,
    Disconnected,
)

# -- outputs ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Job:
    number: int  # 1, 2, … per connection
    request: CreateRequest
    cached: CacheEntry | None  # the cache entry the job may continue from (matched by id at start)
    response_id: str = ""
    arrived_at: float = 0.0  # when its response.create frame arrived
    body_bytes: int = 0
    exclusive: bool = True  # False: another job already took `cached`'s context, so copy it (a fork)

    @property
    def stream_id(self) -> str | None:
        """The lane (`None`: the default lane)."""
        return self.request.params.stream_id


@dataclass(frozen=True, slots=True)
class SendFrame:
    data: bytes


@dataclass(frozen=True, slots=True)
class StartJob:
    job: Job


@dataclass(frozen=True, slots=True)
class CancelJob:
    job: Job


@dataclass(frozen=True, slots=True)
class CloseSocket:
    code: int
    reason: str


@dataclass(frozen=True, slots=True)
class ArmPauseTimer:
    job: Job


@dataclass(frozen=True, slots=True)
class ResumeJob:
    job: Job
    items: tuple[Item, ...]  # everything committed while paused, in arrival order
    at: float = 0.0  # arrival of the append that answered the last pending call
    body_bytes: int = 0  # and its size


@dataclass(frozen=True, slots=True)
class TakeInput:
    """Beta: what was injected into the response since its last boundary, in arrival order, for
    its next turn's context (the response did not pause)."""

    job: Job
    items: tuple[Item, ...]


@dataclass(frozen=True, slots=True)
class AckInject:
    """Acknowledge an inject in the paused response's own stream (accepted, or refused)."""

    job: Job
    refused: InjectRefused | None = None


@dataclass(frozen=True, slots=True)
class AckSteer:
    """Beta: acknowledge a queued steer in the target response's own stream."""

    job: Job
    steer: SteerRef


@dataclass(frozen=True, slots=True)
class AbortPause:
    job: Job
    reason: str  # `incomplete_details.reason` of the response


Output = (
    SendFrame
    | StartJob
    | CancelJob
    | CloseSocket
    | ArmPauseTimer
    | ResumeJob
    | AbortPause
    | AckInject
    | AckSteer
    | TakeInput
)
