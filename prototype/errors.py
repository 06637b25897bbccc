"""One error hierarchy, rendered in one place (wire-protocol section 8).

Strategy (after h11's `ProtocolError`): code deep inside the service raises a
`ProtocolError` that carries everything the wire needs (HTTP-like status, error
type, code, param). Socket-level violations (binary frames) are closes decided
by the adapter. The adapters never build error payloads themselves; they call
`ws_error_event` or `http_error_body` (a failure after an SSE stream started
ends it with `response.failed`, wire-protocol 8.2). Unexpected exceptions
become `server_error` 500 with a generic message: details go only to the log,
never to the peer (websockets, protocol.py: "Don't include exception details,
which may be security-sensitive").
"""

from __future__ import annotations

from typing import Final

import msgspec

from .schemas import ErrorBody, ErrorEvent, HTTPErrorBody, NestingTooDeep, encode

__all__ = [
    "INTERNAL_ERROR",
    "ProtocolError",
    "from_validation_error",
    "http_error_body",
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


def from_validation_error(exc: msgspec.ValidationError | msgspec.DecodeError) -> ProtocolError:
    """Map a msgspec failure to a 400 whose `param` is the JSON path msgspec names."""
    text = str(exc)
    if isinstance(exc, NestingTooDeep):
        return ProtocolError(f"Invalid request: {text}", code="invalid_json", param=None)
    if isinstance(exc, msgspec.ValidationError):
        param = None
        if " - at `$." in text:
            param = text.rsplit(" - at `$.", 1)[1].rstrip("`")
        return ProtocolError(f"Invalid request: {text}", code="invalid_value", param=param)
    return ProtocolError(
        f"The request body is not valid JSON: {text}", code="invalid_json", type="invalid_request_error"
    )


def ws_error_event(err: ProtocolError) -> bytes:
    """A WebSocket `error` frame: nested `error`, with `status` (Codex maps it like HTTP)."""
    return encode(ErrorEvent(status=err.status, error=err.body()))


def http_error_body(err: ProtocolError) -> bytes:
    return encode(HTTPErrorBody(error=err.body()))
