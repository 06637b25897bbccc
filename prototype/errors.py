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

import re
from typing import Final

import msgspec

from .schemas import (
    ErrorBody,
    ErrorEvent,
    HTTPErrorBody,
    NestingTooDeep,
    Response,
    ResponseCreated,
    ResponseInProgress,
    ServerEvent,
    encode,
)

__all__ = [
    "INTERNAL_ERROR",
    "ProtocolError",
    "from_validation_error",
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


_TYPE_NAMES: Final = {
    "str": "a string",
    "int": "an integer",
    "float": "a decimal",
    "bool": "a boolean",
    "object": "an object",
    "array": "an array",
    "null": "null",
}
_EXPECTED: Final = re.compile(r"^Expected `([^`]*)`, got `([^`]*)`(?: - at `\$\.?(.*)`)?$")
_UNKNOWN: Final = re.compile(r"^Object contains unknown field `([^`]*)`(?: - at `\$\.?(.*)`)?$")
_MISSING: Final = re.compile(r"^Object missing required field `([^`]*)`(?: - at `\$\.?(.*)`)?$")
_AT: Final = re.compile(r" - at `\$\.?(.*)`$")


def _param(path: str) -> str:
    """A msgspec path (`input[0].content`, `metadata[...]`) as the API names a parameter."""
    return path.replace("[...]", "")


def _type_phrase(names: str) -> str:
    kinds = [_TYPE_NAMES.get(n.strip(), n.strip()) for n in names.split("|") if n.strip() != "null"] or ["null"]
    if len(kinds) == 1:
        return kinds[0]
    return "one of " + ", ".join(kinds[:-1]) + " or " + kinds[-1]


def from_validation_error(exc: msgspec.ValidationError | msgspec.DecodeError, *, part: bool = False) -> ProtocolError:
    """Map a msgspec failure to the real API's 400: `invalid_type` with the parameter's path,
    `unknown_parameter` (or a moved parameter's hint, `contract.MOVED_PARAMETERS`),
    `missing_required_parameter`, else `invalid_value` / `invalid_json`."""
    text = str(exc)
    if isinstance(exc, NestingTooDeep):
        return ProtocolError(f"Invalid request: {text}", code="invalid_json", param=None)
    if isinstance(exc, msgspec.ValidationError):
        if m := _EXPECTED.match(text):
            expected, got, path = m.group(1), m.group(2), _param(m.group(3) or "")
            if not path:
                return ProtocolError(
                    f"Invalid request body: expected {_type_phrase(expected)}, but got {_type_phrase(got)} instead.",
                    code="invalid_type",
                )
            return ProtocolError(
                f"Invalid type for '{path}': expected {_type_phrase(expected)}, but got {_type_phrase(got)} instead.",
                code="invalid_type",
                param=path,
            )
        if m := _UNKNOWN.match(text):
            name = ".".join(p for p in (_param(m.group(2) or ""), m.group(1)) if p)
            from .contract import moved_parameter  # the rule table; imported here to avoid a cycle

            return moved_parameter(name) or ProtocolError(
                f"Unknown parameter: '{name}'.", code="unknown_parameter", param=name
            )
        # A required field missing inside the body, or in a part decoded on its own (`part`: a
        # tool, an item); a WebSocket event's own missing fields stay `invalid_value`.
        if (m := _MISSING.match(text)) and (part or m.group(2)):
            name = ".".join(p for p in (_param(m.group(2) or ""), m.group(1)) if p)
            return ProtocolError(
                f"Missing required parameter: '{name}'.", code="missing_required_parameter", param=name
            )
        param = None
        if m := _AT.search(text):
            param = _param(m.group(1))
            text = text[: m.start()]
        where = f"'{param}'" if param else "request"
        return ProtocolError(f"Invalid {where}: {text}.", code="invalid_value", param=param)
    return ProtocolError(
        f"The request body is not valid JSON: {text}", code="invalid_json", type="invalid_request_error"
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
