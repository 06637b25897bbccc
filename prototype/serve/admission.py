"""Admission: whether a request may be served, and on which terms, decided once for the live server
(`app.py`, over aiohttp) and the in-process transport (`sim/runtime/inprocess.py`, without sockets),
so a virtual run refuses what a live one refuses (docs/protocol.md#server-options).

* `authorize`: the bearer key every `/v1` route asks for when the server has one (`api_key`).
* `admit_websocket`: a WebSocket upgrade on `/v1/responses`, after the key: refused outright when
  the server refuses WebSocket mode (`websocket.refuse`, 426 `upgrade_required`) or has every
  connection slot taken (`websocket.max_connections`, 503 `too_many_connections`); otherwise its
  dialect, negotiated from the upgrade's `OpenAI-Beta` header and `mode` query parameter, and
  whether it asked for timing frames. The slot it takes is the caller's to release when the
  socket closes.

Plain functions on headers and query parameters: no I/O, no clock.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from ..config import ServerConfig
from ..wire.errors import ProtocolError
from ..ws.timing import TIMING_HEADER, wants_timing

__all__ = [
    "APPEND_BETA",
    "MULTI_AGENT_BETA",
    "PLAIN",
    "Slots",
    "WebSocketTerms",
    "admit_websocket",
    "authorize",
]

# Append mode is opted into per connection (docs/protocol.md): the historical V1 beta header
# value, or `?mode=append` on the upgrade URL (openai-python can pass it with `extra_query`).
APPEND_BETA: Final = "responses_websockets=2026-02-04"
# The shipped beta of inject, steering and async tools (docs/beta.md), opted into per connection
# with this `OpenAI-Beta` value (the value openai-python's beta methods send as `betas`).
MULTI_AGENT_BETA: Final = "responses_multi_agent=v1"


def authorize(config: ServerConfig, path: str, authorization: str | None) -> None:
    """Raise the real API's 401 when the server has a key and `authorization` (the request's
    `Authorization` header) is not `Bearer <key>`. Only `/v1` routes are guarded."""
    key = config.api_key
    if key is None or not path.startswith("/v1/"):
        return
    if not hmac.compare_digest((authorization or "").encode(), f"Bearer {key}".encode()):
        raise ProtocolError(
            "Incorrect API key provided. You can find your API key in your server's configuration.",
            code="invalid_api_key",
            status=401,
            type="invalid_request_error",
        )


class Slots:
    """Open WebSocket connections against `WebSocketConfig.max_connections`. A slot is taken
    before the upgrade, so concurrent upgrades cannot overshoot the limit."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.taken = 0

    def acquire(self) -> bool:
        if self.limit is not None and self.taken >= self.limit:
            return False
        self.taken += 1
        return True

    def release(self) -> None:
        self.taken -= 1


@dataclass(frozen=True, slots=True)
class WebSocketTerms:
    """What an admitted upgrade asked for: the connection's pause dialect and timing frames."""

    append_mode: bool
    beta: bool
    timing: bool


PLAIN: Final = WebSocketTerms(append_mode=False, beta=False, timing=False)  # WebSocket mode, no timing frames


def admit_websocket(
    config: ServerConfig, headers: Mapping[str, str], query: Mapping[str, str], slots: Slots
) -> WebSocketTerms:
    """Admit a WebSocket upgrade (its key already authorized) and take a connection slot, or raise
    the refusal. `headers` are looked up by their canonical names (aiohttp's are case-blind)."""
    if config.websocket.refuse:
        raise ProtocolError("WebSocket mode is disabled on this server; use HTTP.", code="upgrade_required", status=426)
    if not slots.acquire():
        raise ProtocolError(
            f"Too many open WebSocket connections on this server (at most {slots.limit}). Retry later, or use HTTP.",
            code="too_many_connections",
            status=503,
        )
    betas = headers.get("OpenAI-Beta", "")
    mode = query.get("mode")
    return WebSocketTerms(
        append_mode=mode == "append" or APPEND_BETA in betas,
        beta=MULTI_AGENT_BETA in betas or mode == "beta",
        timing=wants_timing(headers.get(TIMING_HEADER)),
    )
