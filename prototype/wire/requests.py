"""The client's side of the Responses wire, as msgspec Structs: a create's parameters (both
transports), the WebSocket client events, and the tolerant views of input items and tools that
validation and rendering read (`schemas.py` holds the server's side and builds every codec once).
Sources as `schemas.py`'s."""

from __future__ import annotations

from typing import Final, TypeVar

import msgspec
from msgspec import UNSET, Raw, UnsetType

T = TypeVar("T")


__all__ = [
    "CacheBreakpointView",
    "ClientEvent",
    "ContentPartView",
    "CreateParams",
    "HTTPCreateParams",
    "InputItemView",
    "MultiAgentParams",
    "NULL",
    "ResponseAppend",
    "ResponseCreate",
    "ResponseInject",
    "ResponseSteer",
    "StreamTag",
    "ToolView",
    "is_null",
]


# msgspec cannot put `Raw` in a union with None, so absent-or-null Raw fields default to this.
NULL: Final = Raw(b"null")


def is_null(raw: Raw) -> bool:
    return raw == NULL or len(raw) == 0


class MultiAgentParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The beta create's `multi_agent` (openai-python 3.63 `types/beta/beta_responses_client_event.py`
    `ResponseCreateMultiAgent`); accepted on a `responses_multi_agent=v1` connection only (docs/beta.md)."""

    enabled: bool
    max_concurrent_subagents: int | None = None


class CreateParams(msgspec.Struct, kw_only=True):
    """The body of `POST /v1/responses`, and the fields of a WS `response.create`."""

    model: str | None = None  # required; checked after un-nesting (the nested `response` form, docs/protocol.md)
    input: str | list[Raw] = []
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool | None = None  # None means the default, true (WS reference)
    stream: bool | None = None  # HTTP: JSON vs SSE. WS: accepted and ignored.
    background: bool | None = None  # not supported: 400 param "background"
    # WS warm-up (`generate: false`); typed `Optional[bool]` on the WebSocket create by openai-python
    # 3.63 (`responses_client_event.py`, and the beta's), null meaning the default, true; the HTTP
    # API rejects the parameter, null included.
    generate: bool | None | UnsetType = UNSET
    tools: list[Raw] | None = None
    tool_choice: Raw = NULL  # "none" | "auto" | "required" | {"type":"function","name":…} | …
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    metadata: dict[str, str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    reasoning: Raw = NULL
    text: Raw = NULL
    truncation: str | None = None
    user: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    stream_id: str | None = None  # WebSocket lanes; HTTP refuses it as unknown
    # Known to the real API, changing nothing in the simulator (docs/contract.md), or refused
    # by `contract.check_params` because the simulator does not implement them.
    include: list[str] | None = None
    top_logprobs: int | None = None
    safety_identifier: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: Raw = NULL
    client_metadata: dict[str, str] | None = None  # Codex's request builder sends it; the API accepts it
    # The Open Responses spec's sampling penalties: refused (unknown) unless the server speaks that
    # dialect (`ServerConfig.open_responses`, docs/contract.md); UNSET tells a `null` from absent.
    frequency_penalty: float | None | UnsetType = UNSET
    presence_penalty: float | None | UnsetType = UNSET
    stream_options: Raw = NULL
    moderation: Raw = NULL
    conversation: Raw = NULL  # not implemented: 400
    prompt: Raw = NULL  # not implemented: 400
    context_management: Raw = NULL  # list of `ContextManagementEntry`; checked by contract.py
    access_programs: Raw = NULL
    background_options: Raw = NULL  # only meaningful with background, which is refused
    image: Raw = NULL
    multi_agent: MultiAgentParams | None = None  # the beta's hosted multi-agent (docs/beta.md)


class HTTPCreateParams(CreateParams, kw_only=True, forbid_unknown_fields=True):
    """`POST /v1/responses` (and the nested WebSocket form's body): the real API refuses a
    parameter it does not know (`unknown_parameter`)."""


class _ClientEvent(msgspec.Struct, tag_field="type", kw_only=True):
    """Base of every client → server WebSocket message."""


class ResponseCreate(_ClientEvent, CreateParams, tag="response.create", forbid_unknown_fields=True):
    # Some third-party clients nest the body (`{"type":"response.create","response":{…}}`,
    # docs/protocol.md): accepted, never emitted.
    response: HTTPCreateParams | None = None


class ResponseAppend(_ClientEvent, tag="response.append"):
    input: list[Raw]
    response_id: str | None = None


class ResponseInject(_ClientEvent, tag="response.inject"):
    input: list[Raw]
    response_id: str | None = None


class ResponseSteer(_ClientEvent, tag="response.steer"):
    """Beta dialect (docs/beta.md): user input queued for a running response."""

    input: Raw
    previous_response_id: str


ClientEvent = ResponseCreate | ResponseAppend | ResponseInject | ResponseSteer


class _Envelope(msgspec.Struct):
    """What we can still read from a frame that failed full validation: used to
    name the event type in errors and to evict a referenced cache entry."""

    type: str | None = None
    previous_response_id: str | None = None
    stream_id: object = None  # a create's lane, checked by the connection core


class StreamTag(msgspec.Struct):
    """The lane of a server frame in WebSocket mode (absent: the default lane)."""

    stream_id: str | None = None


class CacheBreakpointView(msgspec.Struct, forbid_unknown_fields=True):
    """A content part's `prompt_cache_breakpoint` (openai-python 3.63's `PromptCacheBreakpoint`):
    `mode` always `explicit`; `ttl` `30m` or `12h`, absent meaning the request's. Checked by
    `contract.check_breakpoint`."""

    mode: str
    ttl: str | None = None


class ContentPartView(msgspec.Struct):
    type: str = "input_text"
    text: str | None = None
    refusal: str | None = None
    prompt_cache_breakpoint: CacheBreakpointView | None = None


class InputItemView(msgspec.Struct):
    """A flat, tolerant view of one input item. `type` may be absent on messages."""

    type: str = "message"
    id: str | None = None
    role: str | None = None
    content: Raw = NULL  # str | list[ContentPartView] on messages; decoded by `decode_content`
    call_id: str | None = None
    name: str | None = None
    arguments: Raw = NULL  # a string on function_call (checked there); an object on tool_search_call
    output: Raw = NULL  # str | list[ContentPartView] on function_call_output
    input: str | None = None  # custom_tool_call
    status: str | None = None
    encrypted_content: str | None = None  # compaction (and reasoning) items


class ToolView(msgspec.Struct):
    """A flat view of one tool definition; the raw definition is echoed verbatim."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: Raw = NULL
    strict: bool | None = None
    # The beta's async function tools (`BetaFunctionTool.async_` in openai-python, docs/beta.md).
    is_async: bool | None = msgspec.field(default=None, name="async")
