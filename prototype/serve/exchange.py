"""The HTTP request path without aiohttp types: `HTTPExchange` is the one plan of a
`POST /v1/responses` for the live server (`app.py`, over aiohttp) and the in-process transport
(`sim/runtime/inprocess.py`, without sockets): its parse, its run, and what goes back. The
compact endpoint's body is parsed here too (`http_compact`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import msgspec

from ..config import ServerConfig
from ..context.conversation import CreateRequest, ToolCache, normalize_create
from ..response.engine import Engine
from ..response.finish import Outcome
from ..response.run import Emit
from ..response.services import Arrival
from ..wire.contract import from_validation_error
from ..wire.errors import IN_STREAM_CODES, INTERNAL_ERROR, ProtocolError, http_error_body, sse_error_events
from ..wire.requests import CreateParams
from ..wire.schemas import CompactParams, ServerEvent, checked_text, decode_compact_params, decode_create_params, encode

T = TypeVar("T")

__all__ = ["HTTPExchange", "JSONReply", "decoded_body", "http_compact", "http_create", "request_too_large"]


def request_too_large(limit: int) -> ProtocolError:
    return ProtocolError(f"The request body is larger than {limit} bytes.", code="request_too_large", status=413)


def http_create(
    body: bytes, engine: Engine, config: ServerConfig, *, tool_cache: ToolCache | None = None
) -> tuple[CreateParams, CreateRequest, Arrival]:
    """Parse and validate a `POST /v1/responses` body (the whole of it must be UTF-8), or raise the
    `ProtocolError` to answer with. `tool_cache`: skip validating a tool list identical to the last."""
    arrival = Arrival(engine.clock.now(), len(body), "http")
    params = decoded_body(body, config, decode_create_params)
    create = normalize_create(
        params, websocket=False, tool_cache=tool_cache, parse=engine.item_parser, open_responses=config.open_responses
    )
    return params, create, arrival


@dataclass(frozen=True, slots=True)
class JSONReply:
    """A whole HTTP reply with a JSON body: a response object, or an error."""

    status: int
    body: bytes

    @classmethod
    def error(cls, err: ProtocolError) -> JSONReply:
        return cls(err.status, http_error_body(err))


async def _discard(events: list[ServerEvent]) -> None:
    return None


class HTTPExchange:
    """One `POST /v1/responses`, planned once for every way it is carried: the live server's
    aiohttp handler and the in-process transport both construct one and drive `run`, so they
    answer alike on every path, errors included (docs/protocol.md#errors).

    Constructing it parses and validates the body (raising the `ProtocolError` to answer with
    as a JSON error). `run(emit)`: a streaming create sends its events to `emit` and returns
    None once the stream is whole (the caller ends it, with `data: [DONE]` when `done_frame`),
    or a `JSONReply` when the request failed before its first event; a non-streaming create
    returns its `JSONReply` (the response, or the error), its events discarded. An error the real
    API reports inside a stream it began (`IN_STREAM_CODES`) goes to `emit` as that stream's
    `error` event."""

    def __init__(self, body: bytes, engine: Engine, config: ServerConfig, *, tool_cache: ToolCache | None = None):
        self.engine = engine
        self.params, self.create, self.arrival = http_create(body, engine, config, tool_cache=tool_cache)
        self.stream = bool(self.params.stream)
        self.done_frame = config.sse_done

    async def run(self, emit: Emit = _discard) -> JSONReply | None:
        started = await self.engine.start(self.create, None, emit if self.stream else _discard, arrival=self.arrival)
        # The response's life awaited here: this frame sits right over its every event.
        outcome = started if isinstance(started, Outcome) else await started.run()
        if not self.stream:
            if outcome.error is not None:
                return JSONReply.error(outcome.error)
            if outcome.response.status == "failed":
                return JSONReply.error(outcome.failure or INTERNAL_ERROR)
            return JSONReply(200, encode(outcome.response))
        if outcome.error is not None and outcome.error.code in IN_STREAM_CODES:
            await emit(sse_error_events(outcome.response, outcome.error))  # as the real API: inside the stream
        elif outcome.error is not None:  # other request errors come before the first event: a plain JSON error
            return JSONReply.error(outcome.error)
        return None


def http_compact(body: bytes, engine: Engine, config: ServerConfig) -> tuple[CompactParams, Arrival]:
    """Parse a `POST /v1/responses/compact` body, or raise the `ProtocolError` to answer with."""
    arrival = Arrival(engine.clock.now(), len(body), "http")
    return decoded_body(body, config, decode_compact_params), arrival


def decoded_body(body: bytes, config: ServerConfig, decode: Callable[[bytes | str], T]) -> T:
    """An HTTP body within the size limit, UTF-8 as a whole, decoded and validated by `decode`;
    or the `ProtocolError` to answer with."""
    if len(body) > config.max_message_bytes:
        raise request_too_large(config.max_message_bytes)
    try:
        return decode(checked_text(body))
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise from_validation_error(exc) from None
