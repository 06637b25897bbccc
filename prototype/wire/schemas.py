"""Every wire type of the Responses API that longrun speaks, as msgspec Structs.

One module, codecs built once (msgspec perf tip 1). Sources: openai-python's
`types/responses/*.py`, the openai-openapi spec and the WebSocket-mode guide; what
longrun does with them is in docs/protocol.md, docs/lanes.md and docs/contract.md.

Input is tolerant, output is exact:

* A create's body refuses unknown top-level fields on both transports, as the real
  API does (`HTTPCreateParams`, `ResponseCreate`). Every parameter the real API
  knows is a field, with the ones real clients send beyond the SDK's types
  (Codex's `client_metadata`); prototype/wire/contract.py has the rules, docs/contract.md
  the table. Input *items*
  are kept as `msgspec.Raw` so that whatever a client sends
  (its own `fco_…`/`msg_…` ids, replayed `status`/`annotations`/`logprobs`,
  `reasoning` items with `encrypted_content`) is stored and replayed verbatim;
  `InputItemView` is a flat, tolerant view of one item for validation and
  rendering (a message may omit `type`).
* Server Structs spell every field the way OpenAI does and keep `null`s that
  clients expect (`usage: null` in in-progress snapshots), so nothing here uses
  `omit_defaults`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final, Literal, TypeVar

import msgspec
from msgspec import UNSET, Raw, UnsetType

from .requests import (
    NULL,
    ClientEvent,
    ContentPartView,
    HTTPCreateParams,
    InputItemView,
    StreamTag,
    ToolView,
    _Envelope,
)

T = TypeVar("T")

__all__ = [
    "CompactParams",
    "CompactedResponse",
    "CompactionItem",
    "ContextManagementEntry",
    "ContentPartAdded",
    "ContentPartDone",
    "DeletedResponse",
    "ErrorBody",
    "ErrorEvent",
    "FunctionCall",
    "FunctionCallArgumentsDelta",
    "FunctionCallArgumentsDone",
    "HTTPErrorBody",
    "IncompleteDetails",
    "InputTokensDetails",
    "OutputItem",
    "OutputItemAdded",
    "OutputItemDone",
    "OutputMessage",
    "CacheHit",
    "CacheMiss",
    "ComparisonResponseNotFound",
    "DiagnosticsUnavailable",
    "PromptCacheDiagnostics",
    "AgentRef",
    "ROOT_AGENT",
    "OutputText",
    "OutputTextDelta",
    "OutputTextDone",
    "OutputTokensDetails",
    "RequiredInput",
    "Response",
    "ResponseCompactionCompacting",
    "ResponseCompleted",
    "ResponseCreated",
    "ResponseDone",
    "ResponseError",
    "ResponseFailed",
    "ResponseInProgress",
    "ResponseIncomplete",
    "ResponseInjectCreated",
    "ResponseInjectFailed",
    "ResponseSteerAccepted",
    "ResponseSteerFailed",
    "ResponseSteerPending",
    "SteerError",
    "SteerRef",
    "SteerSubmission",
    "ServerEvent",
    "StageReport",
    "StoredResponse",
    "NestingTooDeep",
    "Usage",
    "decode_client_event",
    "decode_compact_params",
    "decode_context_management",
    "decode_content",
    "decode_json",
    "decode_create_params",
    "decode_envelope",
    "decode_stream_tag",
    "decode_item",
    "decode_stored",
    "checked_text",
    "decode_tool",
    "encode",
    "guarded_decoder",
]

# --------------------------------------------------------------------------- items and the Response object


class OutputText(msgspec.Struct, tag_field="type", tag="output_text"):
    text: str
    annotations: list[Raw] = []
    logprobs: list[Raw] = []


class AgentRef(msgspec.Struct):
    """The beta's attribution of an output item to the agent that produced it."""

    agent_name: str


ROOT_AGENT: Final = AgentRef(agent_name="/root")  # the hosted tree's root (longrun runs no subagents)


class OutputMessage(msgspec.Struct, tag_field="type", tag="message", kw_only=True):
    id: str
    status: str
    role: str = "assistant"
    content: list[OutputText] = []
    # Beta, `multi_agent` responses only (docs/beta.md#hosted-multi-agent): absent otherwise.
    agent: AgentRef | UnsetType = UNSET
    phase: str | UnsetType = UNSET


class FunctionCall(msgspec.Struct, tag_field="type", tag="function_call", kw_only=True):
    id: str
    status: str
    arguments: str
    call_id: str
    name: str
    # Beta dialect only: the call of an async function tool (docs/beta.md); absent otherwise.
    is_async: bool | UnsetType = msgspec.field(default=UNSET, name="async")
    agent: AgentRef | UnsetType = UNSET  # beta `multi_agent` responses only


class CompactionItem(msgspec.Struct, tag_field="type", tag="compaction", kw_only=True):
    """What server-side compaction (or `POST /v1/responses/compact`) leaves of the history it
    drops: an opaque `encrypted_content` (docs/compaction.md has what longrun puts in it)."""

    id: str
    encrypted_content: str


OutputItem = OutputMessage | FunctionCall | CompactionItem


class InputTokensDetails(msgspec.Struct):
    cached_tokens: int = 0
    # Required by the API's Usage object. longrun models no billed cache writes, the explicit
    # breakpoints' included (docs/protocol.md#prompt-caching), so it reports none.
    cache_write_tokens: int = 0


class OutputTokensDetails(msgspec.Struct):
    reasoning_tokens: int = 0


class Usage(msgspec.Struct):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseError(msgspec.Struct):
    code: str
    message: str


class IncompleteDetails(msgspec.Struct):
    reason: str


DEFAULT_REASONING: Final = Raw(b'{"effort":null,"summary":null}')
DEFAULT_TEXT: Final = Raw(b'{"format":{"type":"text"}}')
DEFAULT_TOOL_CHOICE: Final = Raw(b'"auto"')


class CacheHit(msgspec.Struct, tag_field="type", tag="cache_hit"):
    """`prompt_cache_diagnostics`: the prompt reuses the compared response's prefix whole."""


class CacheMiss(msgspec.Struct, tag_field="type", tag="cache_miss", kw_only=True):
    """`prompt_cache_diagnostics`: why the prompt diverges from the compared response, and where."""

    reason: str  # one of openai-python 3.63's `PromptCacheDiagnosticsCacheMiss.reason` literals
    cache_missed_tokens: int  # input tokens after the first divergence
    comparison_reusable_tokens: int | None = None  # the compared response's reusable prefix


class ComparisonResponseNotFound(msgspec.Struct, tag_field="type", tag="comparison_response_not_found"):
    """`prompt_cache_diagnostics`: `comparison_response_id` names no response longrun has."""


class DiagnosticsUnavailable(msgspec.Struct, tag_field="type", tag="unavailable"):
    """`prompt_cache_diagnostics`: longrun cannot say (the two contexts are unrelated)."""


PromptCacheDiagnostics = CacheHit | CacheMiss | ComparisonResponseNotFound | DiagnosticsUnavailable


class PromptCacheOptions(msgspec.Struct, kw_only=True):
    """The Response's `prompt_cache_options`: the options applied, each default filled in (`implicit`,
    `30m`), and the comparison the request named (openai-python 3.63's `PromptCacheOptions`)."""

    mode: str
    ttl: str
    comparison_response_id: str | None = None


class Response(msgspec.Struct, kw_only=True):
    """The Response object (`Response` in the openai-openapi spec), field order as OpenAI sends it."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: str
    background: bool = False
    error: ResponseError | None = None
    frequency_penalty: float = 0.0  # not in the spec's Response; the real API sends it (docs/protocol.md)
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    model: str
    output: list[OutputItem] = []
    parallel_tool_calls: bool = True
    presence_penalty: float = 0.0  # as frequency_penalty
    previous_response_id: str | None = None
    # Requested by `prompt_cache_options.comparison_response_id` (docs/contract.md); absent otherwise.
    prompt_cache_diagnostics: PromptCacheDiagnostics | UnsetType = UNSET
    prompt_cache_key: str | None = None
    # Echoed when the request sets `prompt_cache_options` (docs/contract.md); absent otherwise.
    prompt_cache_options: PromptCacheOptions | UnsetType = UNSET
    prompt_cache_retention: str | None = None
    reasoning: Raw = DEFAULT_REASONING
    safety_identifier: str | None = None
    service_tier: str = "default"
    store: bool = True
    temperature: float = 1.0
    text: Raw = DEFAULT_TEXT
    tool_choice: Raw = DEFAULT_TOOL_CHOICE
    tools: list[Raw] = []
    top_logprobs: int = 0
    top_p: float = 1.0
    truncation: str = "disabled"
    usage: Usage | None = None
    user: str | None = None
    metadata: dict[str, str] = {}
    completed_at: int | None = None
    longrun: StageReport | UnsetType = UNSET  # stage timings, on terminal and pause events only


class StageReport(msgspec.Struct, kw_only=True):
    """Where one response's server time went: sent as `longrun` on the Response object of
    terminal and pause events (an extension field; SDKs keep unknown fields as extras).

    `stages_s` holds seconds per stage on the critical path (prototype.pipeline.Stage);
    `server_s` is the measured time from the request's arrival to its terminal (or
    pause) event, summed over segments in append mode; the `tokens_*` fields count
    the work the pre-inference stages did."""

    stages_s: dict[str, float] = {}
    server_s: float = 0.0
    tokens_rendered: int = 0
    tokens_classified: int = 0
    overlapped_s: float = 0.0  # post-inference work taken off the critical path (async billing)
    connection_cache: str = "none"  # hit (served from the connection cache) | miss | none (no previous_response_id)
    tokens_discarded: int = 0  # beta: decoded tokens of the item a steer cut off (docs/beta.md)
    tokens_prefilled: int = 0  # prompt tokens the model prefilled (not served from cached or held KV)
    tokens_decoded: int = 0  # tokens the model decoded


class DeletedResponse(msgspec.Struct):
    id: str
    object: str = "response"
    deleted: bool = True


class StoredResponse(msgspec.Struct, kw_only=True):
    """What a store keeps per `store:true` response: the object, and the full
    effective input of that turn (so a continuation loads O(1) records, never
    walks the chain; docs/protocol.md, "Store writes")."""

    response: Response
    context: list[Raw]  # effective input items: previous context + previous output + new input
    # Append mode: the first `output_in_context` output items already stand, interleaved with
    # the appended tool outputs, in `context`; a continuation adds only the rest.
    output_in_context: int = 0


# --------------------------------------------------------------------------- server → client events


class _ServerEvent(msgspec.Struct, tag_field="type", kw_only=True):
    sequence_number: int


class ResponseCreated(_ServerEvent, tag="response.created"):
    response: Response


class ResponseInProgress(_ServerEvent, tag="response.in_progress"):
    response: Response


class ResponseCompleted(_ServerEvent, tag="response.completed"):
    response: Response


class ResponseFailed(_ServerEvent, tag="response.failed"):
    response: Response


class ResponseIncomplete(_ServerEvent, tag="response.incomplete"):
    response: Response


class RequiredInput(msgspec.Struct):
    call_id: str
    name: str
    type: str = "function_call_output"


class ResponseDone(_ServerEvent, tag="response.done"):
    """Append mode only: the response paused for client tool outputs (docs/protocol.md, "Append mode")."""

    response: Response
    required_input: list[RequiredInput]


class OutputItemAdded(_ServerEvent, tag="response.output_item.added"):
    output_index: int
    item: OutputItem


class OutputItemDone(_ServerEvent, tag="response.output_item.done"):
    output_index: int
    item: OutputItem


class ContentPartAdded(_ServerEvent, tag="response.content_part.added"):
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class ContentPartDone(_ServerEvent, tag="response.content_part.done"):
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class OutputTextDelta(_ServerEvent, tag="response.output_text.delta"):
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Raw] = []


class OutputTextDone(_ServerEvent, tag="response.output_text.done"):
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Raw] = []


class FunctionCallArgumentsDelta(_ServerEvent, tag="response.function_call_arguments.delta"):
    item_id: str
    output_index: int
    delta: str


class FunctionCallArgumentsDone(_ServerEvent, tag="response.function_call_arguments.done"):
    item_id: str
    output_index: int
    arguments: str
    name: str


class ResponseInjectCreated(_ServerEvent, tag="response.inject.created"):
    response_id: str


class InjectError(msgspec.Struct):
    code: str
    message: str


class ResponseInjectFailed(_ServerEvent, tag="response.inject.failed"):
    response_id: str
    input: list[Raw]
    error: InjectError


class SteerRef(msgspec.Struct):
    id: str
    previous_response_id: str


class ResponseSteerAccepted(_ServerEvent, tag="response.steer.accepted"):
    steer: SteerRef


class ResponseSteerPending(_ServerEvent, tag="response.steer.pending"):
    reason: str
    required_input: list[RequiredInput]
    steer: SteerRef


class SteerError(msgspec.Struct):
    code: str
    message: str
    type: str = "invalid_request_error"


class SteerSubmission(msgspec.Struct):
    input: Raw
    previous_response_id: str
    id: str | UnsetType = UNSET  # absent when refused before an id was given


class ResponseSteerFailed(_ServerEvent, tag="response.steer.failed"):
    error: SteerError
    steer: SteerSubmission


class ErrorBody(msgspec.Struct):
    type: str
    code: str | None
    message: str
    param: str | None = None


class ErrorEvent(msgspec.Struct, tag_field="type", tag="error", kw_only=True):
    """WebSocket `error` (nested form, with `status`: `ResponseWsError` in the openai-openapi spec).

    Over SSE the same Struct is sent without `status` and with `sequence_number` and the error's
    `code`, `message` and `param` at the top level as well (the spec's `ResponseErrorEvent`, which
    the SDKs type), keeping the nested `error` a capture of the real API shows."""

    status: int | UnsetType = UNSET
    code: str | None | UnsetType = UNSET
    message: str | UnsetType = UNSET
    param: str | None | UnsetType = UNSET
    error: ErrorBody
    sequence_number: int | UnsetType = UNSET


class ResponseCompactionCompacting(_ServerEvent, tag="response.compaction.compacting"):
    """Server-side compaction is summarising the context into the item `item_id` (no content)."""

    item_id: str
    output_index: int


class ContextManagementEntry(msgspec.Struct, forbid_unknown_fields=True):
    """One entry of a create's `context_management` (`ContextManagementParam` in the spec)."""

    type: str
    compact_threshold: int | None = None


class CompactParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The body of `POST /v1/responses/compact` (`CompactResponseMethodPublicBody`)."""

    model: str | None = None
    input: str | list[Raw] | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: Raw = NULL
    service_tier: str | None = None
    image: Raw = NULL  # openai-python 3.57 sends it; accepted, no effect


class CompactedResponse(msgspec.Struct, kw_only=True):
    """`POST /v1/responses/compact`'s reply (`CompactResource`): the user messages of the
    history, verbatim, then one compaction item standing for everything else."""

    id: str
    object: Literal["response.compaction"] = "response.compaction"
    created_at: int
    output: list[Raw]
    usage: Usage


class HTTPErrorBody(msgspec.Struct):
    error: ErrorBody


class TimingMetrics(msgspec.Struct, kw_only=True):
    """Where one response's time went, in milliseconds, as Codex CLI reads it
    (docs/protocol.md, "Timing frames"). The engine is the model: queue, prefill, decode."""

    responses_duration_excl_engine_and_client_tool_time_ms: float
    engine_service_total_ms: float
    engine_iapi_ttft_total_ms: float
    engine_service_ttft_total_ms: float
    engine_iapi_tbt_across_engine_calls_ms: float
    engine_service_tbt_across_engine_calls_ms: float


class WebsocketTiming(msgspec.Struct, tag_field="type", tag="responsesapi.websocket_timing", kw_only=True):
    """Sent only to a WebSocket client that asked with `x-responsesapi-include-timing-metrics:
    true` on its upgrade, right before each terminal (or pause) event. Outside the response's
    event sequence: it carries no `sequence_number`."""

    timing_metrics: TimingMetrics


ServerEvent = (
    ResponseCreated
    | ResponseInProgress
    | ResponseCompleted
    | ResponseFailed
    | ResponseIncomplete
    | ResponseDone
    | OutputItemAdded
    | OutputItemDone
    | ContentPartAdded
    | ContentPartDone
    | OutputTextDelta
    | OutputTextDone
    | FunctionCallArgumentsDelta
    | FunctionCallArgumentsDone
    | ResponseInjectCreated
    | ResponseInjectFailed
    | ResponseSteerAccepted
    | ResponseSteerPending
    | ResponseSteerFailed
    | ResponseCompactionCompacting
    | WebsocketTiming
    | ErrorEvent
)

# --------------------------------------------------------------------------- codecs, built once


class NestingTooDeep(msgspec.DecodeError):
    """Valid JSON nested deeper than the decoder's recursion limit (about 1000 levels),
    raised instead of the `RecursionError` msgspec throws, so every caller's
    `except msgspec.DecodeError` turns it into a 400."""


def guarded_decoder(decoder: msgspec.json.Decoder[T]) -> Callable[[bytes | str], T]:
    """`decoder.decode` that raises `NestingTooDeep` instead of `RecursionError`."""
    decode = decoder.decode

    def guarded(data: bytes | str) -> T:
        try:
            return decode(data)
        except RecursionError:
            raise NestingTooDeep("JSON arrays or objects are nested too deeply.") from None

    return guarded


def checked_text(data: bytes | str) -> bytes | str:
    """A body or frame whose UTF-8 is checked, for a decoder to read. msgspec checks UTF-8 only
    in the strings it decodes, never in `Raw` parts (items, tools) that are kept and echoed
    verbatim, so the whole is checked here: text, and ASCII bytes (valid UTF-8 by construction;
    checked in C, no copy made), are returned as they are; other bytes are decoded."""
    if isinstance(data, str) or data.isascii():
        return data
    try:
        return data.decode()
    except UnicodeDecodeError:
        raise msgspec.DecodeError("Invalid UTF-8 encoded string") from None


encode: Final = msgspec.json.Encoder().encode
decode_json: Final = guarded_decoder(msgspec.json.Decoder())
decode_client_event: Final = guarded_decoder(msgspec.json.Decoder(ClientEvent))
decode_create_params: Final = guarded_decoder(msgspec.json.Decoder(HTTPCreateParams))
decode_compact_params: Final = guarded_decoder(msgspec.json.Decoder(CompactParams))
decode_context_management: Final = guarded_decoder(msgspec.json.Decoder(list[ContextManagementEntry]))
decode_envelope: Final = guarded_decoder(msgspec.json.Decoder(_Envelope))
decode_item: Final = guarded_decoder(msgspec.json.Decoder(InputItemView))
decode_content: Final = guarded_decoder(msgspec.json.Decoder(str | list[ContentPartView]))
decode_tool: Final = guarded_decoder(msgspec.json.Decoder(ToolView))
decode_stored: Final = guarded_decoder(msgspec.json.Decoder(StoredResponse))
decode_server_event: Final = guarded_decoder(msgspec.json.Decoder(ServerEvent))
decode_stream_tag: Final = guarded_decoder(msgspec.json.Decoder(StreamTag))
