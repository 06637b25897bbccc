"""One error hierarchy, rendered in one place (docs/protocol.md#errors, docs/contract.md).

Strategy (after h11's `ProtocolError`): code deep inside the service raises a
`ProtocolError` that carries everything the wire needs (HTTP-like status, error
type, code, param). Socket-level violations (binary frames) are closes decided
by the adapter. The adapters never build error payloads themselves; they call
`ws_error_event` or `http_error_body` (a failure after an SSE stream started
ends it with `response.failed`). Unexpected exceptions
become `server_error` 500 with a generic message: details go only to the log,
never to the peer (websockets, protocol.py: "Don't include exception details,
which may be security-sensitive").
"""

from __future__ import annotations

from typing import Final

from .schemas import (
    ErrorBody,
    ErrorEvent,
    HTTPErrorBody,
    Response,
    ResponseCreated,
    ResponseInProgress,
    ServerEvent,
    encode,
)

__all__ = [
    "INTERNAL_ERROR",
    "ProtocolError",
    "http_error_body",
    "IN_STREAM_CODES",
    "sse_error_events",
    "ws_error_event",
]


class ProtocolError(Exception):
    """A request-level problem reported to the peer in the protocol's own shape."""

    def __init__(
        self,
        message: str,
        *,
        code: str | None,
        status: int = 400,
        param: str | None = None,
        type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.status = status
        self.param = param
        self.type = type or _default_type(status)

    def body(self) -> ErrorBody:
        return ErrorBody(type=self.type, code=self.code, message=self.message, param=self.param)

    def __repr__(self) -> str:
        return f"ProtocolError({self.status}, {self.code!r}, {self.message!r}, param={self.param!r})"


def _default_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 404:
        return "not_found_error"
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


INTERNAL_ERROR: Final = ProtocolError(
    "The server had an error while processing your request. Sorry about that!",
    code="server_error",
    status=500,
)


def ws_error_event(err: ProtocolError) -> bytes:
    """A WebSocket `error` frame: nested `error`, with `status` (Codex maps it like HTTP)."""
    return encode(ErrorEvent(status=err.status, error=err.body()))


def http_error_body(err: ProtocolError) -> bytes:
    return encode(HTTPErrorBody(error=err.body()))


# Errors the real API reports inside an SSE stream it has already begun (`response.created`,
# `response.in_progress`, then `error`), where a request error before the stream is a plain
# JSON 400: the context window is checked once the input is read (a capture in
# anomalyco/opencode#6071 has the `error` at sequence number 2).
IN_STREAM_CODES: Final = frozenset({"context_length_exceeded"})


def sse_error_events(response: Response, err: ProtocolError) -> list[ServerEvent]:
    """The SSE events of a response refused after its stream began."""
    body = err.body()
    return [
        ResponseCreated(sequence_number=0, response=response),
        ResponseInProgress(sequence_number=1, response=response),
        ErrorEvent(code=body.code, message=body.message, param=body.param, error=body, sequence_number=2),
    ]
