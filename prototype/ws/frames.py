"""What a client's text frame is: a create, an append or inject, a steer, or a bad frame with
the error the real API answers (docs/protocol.md#errors, docs/lanes.md).

The connection's frame layer, as h2's `FrameBuffer` is its: it decodes and validates, and
decides nothing about lanes beyond what a frame's own `stream_id` says. Whether a new lane fits
the connection is asked of the caller (`opens`), so the limit and the lanes stay the
connection's.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec
from msgspec import structs

from ..context.conversation import ItemParser, ToolCache, normalize_create, parse_items
from ..wire.contract import from_validation_error
from ..wire.errors import ProtocolError
from ..wire.requests import ResponseCreate, ResponseSteer
from ..wire.schemas import checked_text, decode_client_event, decode_envelope
from .events import AppendReceived, BadFrame, CreateReceived, SteerReceived
from .lanes import INVALID_STREAM_ID, STREAM_LIMIT, valid_stream_id

__all__ = ["CLIENT_EVENT_TYPES", "FrameClassifier", "unsupported"]

CLIENT_EVENT_TYPES: frozenset[str] = frozenset(
    {"response.create", "response.append", "response.inject", "response.steer"}
)


def unsupported(event_type: str, detail: str = "") -> ProtocolError:
    message = f"Unsupported event type: '{event_type}'." + (f" {detail}" if detail else "")
    return ProtocolError(message, code="unsupported_event_type", param="type")


class FrameClassifier:
    """Turns one text frame into the connection's input. `steering`: whether `response.steer` is
    an event type on this connection (it is not in append mode). `tools` is the connection's
    cache of the last validated tool list; `open_responses` admits that dialect's fields."""

    def __init__(
        self,
        *,
        steering: bool,
        tools: ToolCache | None,
        open_responses: bool,
        multi_agent: bool = False,
        parse: ItemParser = parse_items,
    ) -> None:
        self.steering = steering
        self.parse = parse  # the engine's item parser, as an HTTP body's items are validated
        self.multi_agent = multi_agent  # the beta connection: `multi_agent` is a create parameter
        self.tools = tools
        self.open_responses = open_responses

    def classify(
        self, data: str | bytes, lanes: Callable[[str | None], bool], at: float = 0.0
    ) -> CreateReceived | AppendReceived | SteerReceived | BadFrame:
        """`lanes(stream_id)`: whether a create may run on that lane (it exists, or one more
        named lane fits); a create naming a lane that does not fit gets `STREAM_LIMIT`."""
        try:
            event = decode_client_event(checked_text(data))
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            return self._bad(data, exc)
        if isinstance(event, ResponseCreate):
            params = event.response if event.response is not None else event
            if params.stream_id is None and event.stream_id is not None:  # the lane named on the envelope
                params = structs.replace(params, stream_id=event.stream_id)
            stream_id = params.stream_id
            if stream_id is not None and not valid_stream_id(stream_id):
                return BadFrame(INVALID_STREAM_ID)
            if not lanes(stream_id):
                return BadFrame(STREAM_LIMIT, None, stream_id)  # a refused fork keeps its parent
            try:
                request = normalize_create(
                    params,
                    websocket=True,
                    tool_cache=self.tools,
                    parse=self.parse,
                    open_responses=self.open_responses,
                    multi_agent=self.multi_agent,
                )
            except ProtocolError as err:
                return BadFrame(err, params.previous_response_id, stream_id)
            return CreateReceived(request, at, len(data))
        if isinstance(event, ResponseSteer):
            return SteerReceived(event) if self.steering else BadFrame(unsupported("response.steer"))
        return AppendReceived(event, at, len(data))

    def _bad(self, data: str | bytes, exc: msgspec.ValidationError | msgspec.DecodeError) -> BadFrame:
        try:
            env = decode_envelope(data)
        except (msgspec.ValidationError, msgspec.DecodeError):
            if not isinstance(exc, msgspec.ValidationError):  # malformed JSON (ValidationError subclasses DecodeError)
                return BadFrame(from_validation_error(exc))
            return BadFrame(
                ProtocolError("Each WebSocket message must be a JSON object.", code="invalid_json", param=None)
            )
        if env.type == "response.steer" and not self.steering:
            return BadFrame(unsupported(env.type))  # not an event type of append mode
        if env.type is None:
            err = ProtocolError("Missing required parameter: 'type'.", code="missing_required_parameter", param="type")
        elif env.type not in CLIENT_EVENT_TYPES:
            err = unsupported(env.type)
        elif env.type == "response.create" and "$.stream_id" in str(exc):
            return BadFrame(INVALID_STREAM_ID)  # not a string: no lane to answer on, nothing to evict
        else:
            err = from_validation_error(exc)
        if env.type != "response.create":
            return BadFrame(err, event_type=env.type)
        # The frame still names its lane (if that lane exists) and the response it continued.
        stream_id = env.stream_id if isinstance(env.stream_id, str) and valid_stream_id(env.stream_id) else None
        return BadFrame(err, env.previous_response_id, stream_id)
