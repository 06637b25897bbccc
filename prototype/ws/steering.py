"""Steering on a WebSocket connection (rule 15 of connection.py; docs/beta.md#steering).

One owner of a connection's steers from the core's side: a steer is validated and queued on
the lane of the response it names (acknowledged in that response's own stream), and when that
response ends this unit decides what becomes of the queue: an automatic successor, input parked
for the create that continues the parent, or `response.steer.failed` with the input echoed.
The engine's side (where the response stops) is `engine.ResponseRun`; it sees only the count
of queued steers, through its inbox.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable
from typing import Final

import msgspec

from ..context.cache import tag_stream
from ..context.conversation import CreateRequest, Item, parse_items
from ..ids import IdFactory
from ..wire.errors import ProtocolError
from ..wire.requests import ResponseSteer
from ..wire.schemas import ResponseSteerFailed, SteerError, SteerRef, SteerSubmission, encode
from .events import AckSteer, CreateReceived, Output, ResponseEnded, SendFrame
from .lanes import Lane, Parked, QueuedSteer

__all__ = ["MAX_PENDING_STEERS", "STEER_MESSAGE_KEYS", "UNSTEERABLE_MODELS", "Steering"]

MAX_PENDING_STEERS: Final = 8  # queued steers per response; more: `too_many_pending_steers`
STEER_MESSAGE_KEYS: Final = frozenset({"type", "role", "content"})
# Model families the steering guide says do not steer (GPT-5.6 and earlier), matched as name
# prefixes; any other name (GPT-6, the simulator's own) steers. docs/beta.md#steering.
UNSTEERABLE_MODELS: Final = ("gpt-3", "gpt-4", "gpt-5", "o1", "o3", "o4", "chatgpt-", "codex-")


class Steering:
    """`ended_ids` is the connection's memory of ended responses (read only)."""

    def __init__(
        self,
        emit: Callable[[Output], None],
        ids: IdFactory,
        ended_ids: deque[str],
        unsteerable_models: tuple[str, ...] = UNSTEERABLE_MODELS,
    ) -> None:
        self.emit = emit
        self.ids = ids
        self.ended_ids = ended_ids
        self.unsteerable_models = unsteerable_models

    def receive(self, lane: Lane, steer: ResponseSteer) -> None:
        """A steer for the response `previous_response_id` names (`lane` is that response's lane,
        when it is on one): queued and acknowledged, or refused with its input echoed."""
        target = steer.previous_response_id
        job = lane.in_flight
        owner = lane if lane.owns(target) or lane.last_ended == target else None
        try:
            items = self._items(steer.input)
        except ProtocolError as err:
            self.failed(owner, steer.input, target, "invalid_input", err.message)
            return
        if job is None or job.response_id != target:
            if target in self.ended_ids:
                self.failed(
                    owner,
                    steer.input,
                    target,
                    "response_already_completed",
                    f"Response '{target}' has already completed and no longer accepts steering input.",
                )
            else:
                self.failed(
                    None,
                    steer.input,
                    target,
                    "response_not_found",
                    f"Response '{target}' is not active on this connection.",
                )
            return
        refusal = self._refusal(lane, job.request)
        if refusal is not None:
            self.failed(lane, steer.input, target, *refusal)
            return
        ref = SteerRef(id=self.ids.new("steer"), previous_response_id=target)
        lane.steers.append(QueuedSteer(ref, steer.input, items))
        self.emit(AckSteer(job, ref))

    def _refusal(self, lane: Lane, request: CreateRequest) -> tuple[str, str] | None:
        """Why the response in flight cannot take a steer (code, message); None: it can."""
        if request.model.lower().startswith(self.unsteerable_models):
            return "steering_not_supported", f"The model '{request.model}' does not support steering."
        if request.compact_threshold is not None:
            # The beta's steer event: responses using automatic compaction do not support steering.
            return (
                "steering_not_supported",
                "Steering is not supported for responses that use automatic compaction (context_management).",
            )
        if len(lane.steers) >= MAX_PENDING_STEERS:
            return (
                "too_many_pending_steers",
                f"At most {MAX_PENDING_STEERS} steering submissions may wait for one response.",
            )
        return None

    @staticmethod
    def _items(value: msgspec.Raw) -> tuple[Item, ...]:
        """User messages only, each with only `type`, `role` and `content` (the beta's rule)."""
        try:
            decoded = msgspec.json.decode(value)
        except msgspec.DecodeError:
            raise ProtocolError("Invalid 'input'.", code="invalid_value", param="input") from None
        if isinstance(decoded, str):
            return parse_items(decoded)
        if not isinstance(decoded, list) or not decoded:
            raise ProtocolError(
                "'input' must be a string or a non-empty array of user messages.", code="invalid_value", param="input"
            )
        for index, message in enumerate(decoded):
            if (
                not isinstance(message, dict)
                or message.get("role") != "user"
                or message.get("type", "message") != "message"
                or not STEER_MESSAGE_KEYS.issuperset(message)
            ):
                raise ProtocolError(
                    f"Invalid 'input[{index}]': steering accepts only user messages with type, role and content.",
                    code="invalid_value",
                    param=f"input[{index}]",
                )
        return parse_items([msgspec.Raw(msgspec.json.encode(m)) for m in decoded])

    def continuing(self, lane: Lane, request: CreateRequest) -> CreateRequest:
        """`request` with the input parked for the response it continues before its own input;
        parked input for any other parent is refused (the lane no longer continues it)."""
        if lane.parked is not None and lane.parked.parent == request.previous_response_id:
            # Steers queued for a parent that stopped for client tool outputs are prepended,
            # in submission order, to the create that continues it.
            items = lane.parked.items()
            lane.parked = None
            return dataclasses.replace(request, items=items + request.items) if items else request
        self.unpark(lane)
        return request

    def ended(
        self, lane: Lane, event: ResponseEnded, committed: tuple[Item, ...], *, expired: bool
    ) -> CreateReceived | None:
        """The lane's response ended; `committed` is what the pause machine carries from it. The
        automatic successor to start now, or None."""
        steers, lane.steers = lane.steers, []
        if not steers and not committed:
            return None
        if event.entry is None:
            for steer in steers:  # nothing to continue from: the input comes back
                self.failed(
                    lane,
                    steer.input,
                    steer.ref.previous_response_id,
                    "response_not_active",
                    "The response ended before the steering input could be committed.",
                    steer.ref.id,
                )
            return None
        parked = Parked(event.job.response_id, steers, committed)
        if event.owed or not steers:
            self.unpark(lane)
            # With steers, the engine sent response.steer.pending for each.
            lane.parked = parked
            return None
        if not expired:
            return self._successor(event, parked.items())
        for steer in steers:  # past the lifetime limit no successor can start
            self.failed(
                lane,
                steer.input,
                steer.ref.previous_response_id,
                "successor_creation_failed",
                "The connection reached its lifetime limit before the successor could be created.",
                steer.ref.id,
            )
        return None

    @staticmethod
    def _successor(ended: ResponseEnded, items: tuple[Item, ...]) -> CreateReceived:
        """The automatic successor: the parent's settings, the queued input, the parent as its
        `previous_response_id`; it runs next on the lane (its `response.created` commits the steers).
        It arrives when the parent ended: the server, not the client, sent it."""
        parent = ended.job
        request = parent.request
        params = msgspec.structs.replace(request.params, previous_response_id=parent.response_id)
        successor = dataclasses.replace(request, params=params, items=items, generate=True)
        return CreateReceived(successor, ended.at)

    def unpark(self, lane: Lane) -> None:
        """Parked steers whose parent the lane no longer continues come back, with their ids."""
        if lane.parked is None:
            return
        parent, steers = lane.parked.parent, lane.parked.steers
        lane.parked = None
        for steer in steers:
            self.failed(
                lane,
                steer.input,
                parent,
                "response_not_active",
                f"The lane no longer continues response '{parent}'; its queued steering input was not committed.",
                steer.ref.id,
            )

    def failed(
        self, lane: Lane | None, value: msgspec.Raw, target: str, code: str, message: str, steer_id: str | None = None
    ) -> None:
        submission = SteerSubmission(input=value, previous_response_id=target)
        if steer_id is not None:
            submission = SteerSubmission(input=value, previous_response_id=target, id=steer_id)
        failed = ResponseSteerFailed(  # belongs to no running stream: numbered 0
            sequence_number=0, error=SteerError(code=code, message=message), steer=submission
        )
        self.emit(SendFrame(tag_stream(encode(failed), lane.prefix if lane is not None else None)))
