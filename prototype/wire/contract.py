"""The Responses API's request contract, as data: what a create may say, and the error
the real API answers when it says something else.

Sources (docs/contract.md has the table with one row per rule): the `CreateResponse`
schema of the openai-openapi spec (ranges, enums, `maxLength`, `pattern`, metadata
limits), openai-python's `ResponseCreateParams`, and error bodies captured in public
client code and issues (messages, codes and params of the real API). Where no capture
was found the message follows the same family of validation messages, and the doc says so.

Every check here reads only the request's own parameters (a few scalars and short
lists), never the input items' history, so it is O(parameters) per request. Item rules
are in `context/conversation.py` (checked once per item, when the item is new), continuation
rules (`function_call` / `function_call_output` pairing, duplicate ids) in
`conversation.check_continuation`, which reads only the new items and the context's
running sets.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from operator import attrgetter
from typing import Final, TypeVar

import msgspec
from msgspec import UNSET, Raw, UnsetType

from .errors import ProtocolError
from .requests import ContentPartView, CreateParams, is_null
from .schemas import CompactParams, NestingTooDeep, PromptCacheOptions, decode_context_management

__all__ = [
    "applied_prompt_cache_options",
    "comparison_response_id",
    "CALL_ID_MAX",
    "CONTEXT_LENGTH_MESSAGE",
    "FUNCTION_NAME_MAX",
    "CLIENT_PARAMETERS",
    "KNOWN_PARAMETERS",
    "OPEN_RESPONSES_PARAMETERS",
    "METADATA_KEYS_MAX",
    "MOVED_PARAMETERS",
    "RANGES",
    "STRING_MAX",
    "UNSUPPORTED_FEATURES",
    "COMPACT_THRESHOLD_MIN",
    "CONTEXT_MANAGEMENT_TYPES",
    "check_breakpoint",
    "check_compact_params",
    "check_context_window",
    "compact_threshold",
    "check_function_name",
    "check_has_input",
    "check_params",
    "check_string_length",
    "empty_array",
    "from_validation_error",
    "supported_values",
    "moved_parameter",
    "unsupported_message",
]

# Parameters real clients send that the SDK's types and the spec do not list, and the API
# accepts: Codex CLI's request builder (`ResponsesApiRequest` in openai/codex's codex-api) sends
# `client_metadata`, a map of strings.
CLIENT_PARAMETERS: Final = frozenset({"client_metadata"})

# Request fields of the Open Responses spec (`CreateResponseBody`) that OpenAI's does not have:
# accepted only when the server speaks that dialect (`ServerConfig.open_responses`).
OPEN_RESPONSES_PARAMETERS: Final = ("frequency_penalty", "presence_penalty")

# Every top-level parameter of `CreateResponse` in the spec, and of openai-python 3.57's
# `ResponseCreateParams` (which adds `access_programs`, `background_options`, `image`), and the
# client parameters above. A body naming anything else is refused, on either transport.
KNOWN_PARAMETERS: Final = CLIENT_PARAMETERS | frozenset(
    {
        "access_programs",
        "background",
        "background_options",
        "image",
        "context_management",
        "conversation",
        "include",
        "input",
        "instructions",
        "max_output_tokens",
        "max_tool_calls",
        "metadata",
        "model",
        "moderation",
        "parallel_tool_calls",
        "previous_response_id",
        "prompt",
        "prompt_cache_key",
        "prompt_cache_options",
        "prompt_cache_retention",
        "reasoning",
        "safety_identifier",
        "service_tier",
        "store",
        "stream",
        "stream_options",
        "temperature",
        "text",
        "tool_choice",
        "tools",
        "top_logprobs",
        "top_p",
        "truncation",
        "user",
    }
)

# Chat Completions parameters whose Responses counterpart has another name: the real API names
# the new place (captures: openai/codex users, vim-ai #162, public client code).
MOVED_PARAMETERS: Final = {
    "messages": "input",
    "response_format": "text.format",
    "max_completion_tokens": "max_output_tokens",
    "reasoning_effort": "reasoning.effort",
}


def moved_parameter(name: str) -> ProtocolError | None:
    target = MOVED_PARAMETERS.get(name)
    if target is None:
        return None
    return ProtocolError(
        f"Unsupported parameter: '{name}'. In the Responses API, this parameter has moved to '{target}'. "
        "Try again with the new parameter. See the API documentation for more information: "
        "https://platform.openai.com/docs/api-reference/responses/create.",
        code="unsupported_parameter",
        param=None,
    )


# Real-API features the simulator does not implement: refused with a 400 naming the feature,
# never silently ignored (a client relying on them would get wrong results).
UNSUPPORTED_FEATURES: Final = {
    "background": "Background mode",
    "conversation": "Conversation state kept on the server",
    "prompt": "A prompt template",
}


def unsupported_message(name: str) -> str:
    return (
        f"{UNSUPPORTED_FEATURES[name]} ('{name}') is not supported by this server (a simulator of the Responses API)."
    )


def _unsupported(name: str) -> ProtocolError:
    return ProtocolError(unsupported_message(name), code="unsupported_parameter", param=name)


@dataclass(frozen=True, slots=True)
class Range:
    name: str
    minimum: float | None
    maximum: float | None
    kind: str  # "integer" | "decimal": the word the API's message uses


RANGES: Final = (
    Range("temperature", 0, 2, "decimal"),
    Range("top_p", 0, 1, "decimal"),
    Range("max_output_tokens", 16, None, "integer"),
    Range("max_tool_calls", 0, None, "integer"),
    Range("top_logprobs", 0, 20, "integer"),
)

ENUMS: Final = (
    ("truncation", ("auto", "disabled")),
    ("service_tier", ("auto", "default", "flex", "scale", "priority", "fast", "ultrafast")),
    ("prompt_cache_retention", ("in_memory", "24h")),
)
INCLUDABLE: Final = (
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "message.input_image.image_url",
    "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
    "reasoning.encrypted_content",
    "message.output_text.logprobs",
)
REASONING_EFFORTS: Final = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
VERBOSITIES: Final = ("low", "medium", "high")
# The spec's enums on nested fields (`Reasoning`, `TextResponseFormatConfiguration`,
# `PromptCacheOptions`); tests/prototype/wire/test_spec_constraints.py derives the cases from the spec.
REASONING_SUMMARIES: Final = ("auto", "concise", "detailed")  # `summary` and the older `generate_summary`
REASONING_CONTEXTS: Final = ("auto", "current_turn", "all_turns")
TEXT_FORMATS: Final = ("text", "json_schema", "json_object")
PROMPT_CACHE_TTLS: Final = ("30m", "12h")  # openai-python 3.63's `PromptCacheOptions.ttl`
PROMPT_CACHE_MODES: Final = ("implicit", "explicit")
BREAKPOINT_MODES: Final = ("explicit",)  # `PromptCacheBreakpoint.mode`: "Always `explicit`"
# Content parts that carry `prompt_cache_breakpoint` in openai-python 3.63 (`ResponseInputTextParam`,
# `ResponseInputImageParam`, `ResponseInputFileParam` and their `*ContentParam` forms of tool output).
BREAKPOINT_PARTS: Final = frozenset({"input_text", "input_image", "input_file"})

METADATA_KEYS_MAX: Final = 16
METADATA_KEY_MAX: Final = 64
METADATA_VALUE_MAX: Final = 512
SAFETY_IDENTIFIER_MAX: Final = 64
PROMPT_CACHE_KEY_MAX: Final = 64  # `prompt_cache_key.maxLength` of the compact body in the spec
STRING_MAX: Final = 10_485_760  # the longest text part, string input or tool output the spec allows
CALL_ID_MAX: Final = 64
FUNCTION_NAME_MAX: Final = 128  # FunctionToolParam.name in the spec (Chat Completions allows 64)
FUNCTION_NAME_PATTERN: Final = "^[a-zA-Z0-9_-]+$"
_FUNCTION_NAME: Final = re.compile(r"[a-zA-Z0-9_-]+")  # the pattern, matched in full (no trailing newline)
CONTEXT_LENGTH_MESSAGE: Final = (
    "Your input exceeds the context window of this model. Please adjust your input and try again."
)


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() and abs(value) < 1e16 else repr(value)


def _check_range(rule: Range, value: float) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise ProtocolError(
            f"Invalid '{rule.name}': expected a finite number, but got {value!r} instead.",
            code="invalid_value",
            param=rule.name,
        )
    if rule.minimum is not None and value < rule.minimum:
        raise ProtocolError(
            f"Invalid '{rule.name}': {rule.kind} below minimum value. Expected a value >= {_num(rule.minimum)}, "
            f"but got {_num(value)} instead.",
            code=f"{rule.kind}_below_min_value",
            param=rule.name,
        )
    if rule.maximum is not None and value > rule.maximum:
        raise ProtocolError(
            f"Invalid '{rule.name}': {rule.kind} above maximum value. Expected a value <= {_num(rule.maximum)}, "
            f"but got {_num(value)} instead.",
            code=f"{rule.kind}_above_max_value",
            param=rule.name,
        )


def supported_values(values: Iterable[str]) -> str:
    quoted = [f"'{v}'" for v in values]
    if len(quoted) <= 2:
        return " and ".join(quoted)
    return ", ".join(quoted[:-1]) + ", and " + quoted[-1]


def _check_enum(param: str, value: str, values: tuple[str, ...]) -> None:
    if value not in values:
        raise ProtocolError(
            f"Invalid value: '{value}'. Supported values are: {supported_values(values)}.",
            code="invalid_value",
            param=param,
        )


def empty_array(param: str) -> ProtocolError:
    """An array the spec gives `minItems: 1`, sent empty (the real API's message: a recorded
    Chat Completions reply in envoyproxy/ai-gateway's fakeopenai cassettes)."""
    return ProtocolError(
        f"Invalid '{param}': empty array. Expected an array with minimum length 1, but got an empty array instead.",
        code="empty_array",
        param=param,
    )


def check_string_length(param: str, value: str, maximum: int) -> None:
    if len(value) > maximum:
        raise ProtocolError(
            f"Invalid '{param}': string too long. Expected a string with maximum length {maximum}, "
            f"but got a string with length {len(value)} instead.",
            code="string_above_max_length",
            param=param,
        )


def check_function_name(name: str, param: str) -> None:
    check_string_length(param, name, FUNCTION_NAME_MAX)
    if not _FUNCTION_NAME.fullmatch(name):
        raise ProtocolError(
            f"Invalid '{param}': string does not match pattern. Expected a string that matches the pattern "
            f"'{FUNCTION_NAME_PATTERN}'.",
            code="invalid_value",
            param=param,
        )


def _check_metadata(metadata: dict[str, str]) -> None:
    if len(metadata) > METADATA_KEYS_MAX:
        raise ProtocolError(
            f"Invalid 'metadata': too many properties. Expected an object with at most {METADATA_KEYS_MAX} "
            f"properties, but got an object with {len(metadata)} properties instead.",
            code="object_above_max_properties",
            param="metadata",
        )
    for key, value in metadata.items():
        if len(key) > METADATA_KEY_MAX:
            raise ProtocolError(
                f"Invalid 'metadata': key too long. Expected a key with maximum length {METADATA_KEY_MAX}, "
                f"but got a key with length {len(key)} instead.",
                code="string_above_max_length",
                param="metadata",
            )
        check_string_length(f"metadata.{key}", value, METADATA_VALUE_MAX)


class _Reasoning(msgspec.Struct):
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None
    context: str | None = None


class _Format(msgspec.Struct):
    type: str | None = None


class _Text(msgspec.Struct):
    verbosity: str | None = None
    format: _Format | None = None


class _PromptCacheOptions(msgspec.Struct):
    ttl: str | None = None
    mode: str | None = None
    prewarm: bool | None = None
    comparison_response_id: str | None = None


def comparison_response_id(params: CreateParams) -> str | None:
    """`prompt_cache_options.comparison_response_id`: the response whose prompt this one's is
    compared with; supplying it requests `prompt_cache_diagnostics` (openai-python 3.63's
    `PromptCacheOptions`). Checked by `check_params`."""
    if is_null(params.prompt_cache_options):
        return None
    return _decode_prompt_cache_options(params.prompt_cache_options).comparison_response_id


def applied_prompt_cache_options(params: CreateParams) -> PromptCacheOptions | UnsetType:
    """The Response's `prompt_cache_options` when the request sets them: the mode and time-to-live
    applied (the spec's defaults, `implicit` and `30m`, where the request leaves them out) and the
    comparison it named. Checked by `check_params`."""
    if is_null(params.prompt_cache_options):
        return UNSET
    o = _decode_prompt_cache_options(params.prompt_cache_options)
    return PromptCacheOptions(
        mode=o.mode or "implicit", ttl=o.ttl or "30m", comparison_response_id=o.comparison_response_id
    )


def check_breakpoint(part: ContentPartView, param: str) -> None:
    """A content part's `prompt_cache_breakpoint`: only on the part types that have the field,
    `mode` `explicit`, `ttl` one of `PROMPT_CACHE_TTLS`. `param` names the part."""
    bp = part.prompt_cache_breakpoint
    if bp is None:
        return
    where = f"{param}.prompt_cache_breakpoint"
    if part.type not in BREAKPOINT_PARTS:
        raise ProtocolError(f"Unknown parameter: '{where}'.", code="unknown_parameter", param=where)
    _check_enums(where, (("mode", bp.mode, BREAKPOINT_MODES), ("ttl", bp.ttl, PROMPT_CACHE_TTLS)))


def prewarms(params: CreateParams) -> bool:
    """`prompt_cache_options.prewarm: true`: prepare the prompt cache, generate nothing (it
    overrides `generate`, openai-python 3.63's `PromptCacheOptions`); checked by `check_params`."""
    if is_null(params.prompt_cache_options):
        return False
    return _decode_prompt_cache_options(params.prompt_cache_options).prewarm is True


_decode_reasoning: Final = msgspec.json.Decoder(_Reasoning).decode
_decode_text: Final = msgspec.json.Decoder(_Text).decode
_decode_prompt_cache_options: Final = msgspec.json.Decoder(_PromptCacheOptions).decode


def _check_enums(parent: str, fields: Iterable[tuple[str, str | None, tuple[str, ...]]]) -> None:
    for name, value, values in fields:
        if value is not None:
            _check_enum(f"{parent}.{name}", value, values)


T = TypeVar("T")


def _nested(decode: Callable[[Raw], T], raw: Raw, param: str) -> T:
    """A nested object decoded on its own; a type error names its place under `param`."""
    try:
        return decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        err = from_validation_error(exc)
        sub = err.param
        err.param = param if not sub else f"{param}{sub}" if sub.startswith("[") else f"{param}.{sub}"
        if sub:
            err.message = err.message.replace(f"'{sub}'", f"'{err.param}'", 1)
        elif err.code == "invalid_type":
            err.message = err.message.replace("Invalid request body:", f"Invalid type for '{param}':", 1)
        raise err from None


# Each table's fields of a create, read in one call: a tuple in the table's order (a table
# holds two or more fields; `attrgetter` of one name would return the bare value).
_open_responses_values: Final = attrgetter(*OPEN_RESPONSES_PARAMETERS)
_range_values: Final = attrgetter(*(rule.name for rule in RANGES))
_enum_values: Final = attrgetter(*(name for name, _ in ENUMS))


def check_params(
    params: CreateParams, *, websocket: bool, open_responses: bool = False, multi_agent: bool = False
) -> None:
    """The top-level rules: required parameters, exclusive pairs, features not implemented,
    ranges, enums, lengths, metadata. Raise the first broken rule's `ProtocolError`.
    `open_responses`: the Open Responses dialect, which adds its request fields; `multi_agent`:
    a `responses_multi_agent=v1` WebSocket connection, the only place `multi_agent` is a parameter."""
    if not open_responses:
        for name, value in zip(OPEN_RESPONSES_PARAMETERS, _open_responses_values(params), strict=True):
            if value is not msgspec.UNSET:
                raise ProtocolError(f"Unknown parameter: '{name}'.", code="unknown_parameter", param=name)
    if not params.model:
        raise ProtocolError("Missing required parameter: 'model'.", code="missing_required_parameter", param="model")
    conversation = not is_null(params.conversation)
    if params.previous_response_id is not None and conversation:
        raise ProtocolError(
            "Mutually exclusive parameters: Ensure you are only providing one of: 'previous_response_id' or "
            "'conversation'.",
            code="mutually_exclusive_parameters",
            param="conversation",
        )
    if params.background:
        raise _unsupported("background")
    if conversation:
        raise _unsupported("conversation")
    if not is_null(params.prompt):
        raise _unsupported("prompt")
    if not websocket and params.generate is not msgspec.UNSET:
        raise ProtocolError("Unsupported parameter: generate", code="unsupported_parameter", param="generate")
    if not multi_agent and params.multi_agent is not None:
        raise ProtocolError("Unknown parameter: 'multi_agent'.", code="unknown_parameter", param="multi_agent")
    if params.multi_agent is not None and params.multi_agent.max_concurrent_subagents is not None:
        if params.multi_agent.max_concurrent_subagents < 1:
            raise ProtocolError(
                "Invalid 'multi_agent.max_concurrent_subagents': integer below minimum value. Expected a value "
                f">= 1, but got {params.multi_agent.max_concurrent_subagents} instead.",
                code="integer_below_min_value",
                param="multi_agent.max_concurrent_subagents",
            )
    if not websocket and params.stream_id is not None:
        raise ProtocolError("Unknown parameter: 'stream_id'.", code="unknown_parameter", param="stream_id")
    for rule, value in zip(RANGES, _range_values(params), strict=True):
        if value is not None:
            _check_range(rule, value)
    for (name, values), value in zip(ENUMS, _enum_values(params), strict=True):
        if value is not None:
            _check_enum(name, value, values)
    for index, value in enumerate(params.include or ()):
        _check_enum(f"include[{index}]", value, INCLUDABLE)
    if params.safety_identifier is not None:
        check_string_length("safety_identifier", params.safety_identifier, SAFETY_IDENTIFIER_MAX)
    if params.metadata:
        _check_metadata(params.metadata)
    if not is_null(params.reasoning):
        r = _nested(_decode_reasoning, params.reasoning, "reasoning")
        _check_enums(
            "reasoning",
            (
                ("effort", r.effort, REASONING_EFFORTS),
                ("summary", r.summary, REASONING_SUMMARIES),
                ("generate_summary", r.generate_summary, REASONING_SUMMARIES),
                ("context", r.context, REASONING_CONTEXTS),
            ),
        )
    if not is_null(params.text):
        t = _nested(_decode_text, params.text, "text")
        _check_enums("text", (("verbosity", t.verbosity, VERBOSITIES),))
        if t.format is not None:
            _check_enums("text.format", (("type", t.format.type, TEXT_FORMATS),))
    if not is_null(params.prompt_cache_options):
        o = _nested(_decode_prompt_cache_options, params.prompt_cache_options, "prompt_cache_options")
        _check_enums("prompt_cache_options", (("ttl", o.ttl, PROMPT_CACHE_TTLS), ("mode", o.mode, PROMPT_CACHE_MODES)))
    if isinstance(params.input, str):
        check_string_length("input", params.input, STRING_MAX)
    compact_threshold(params)


COMPACT_THRESHOLD_MIN: Final = 1000  # `ContextManagementParam.compact_threshold.minimum` in the spec
CONTEXT_MANAGEMENT_TYPES: Final = ("compaction",)  # "Currently only 'compaction' is supported" (the spec)


def compact_threshold(params: CreateParams) -> int | None:
    """The create's compaction threshold in tokens: 0 when `context_management` asks for
    compaction without one (the model's context window is then the threshold), None when it
    does not ask. Raises the spec's constraint errors: a list of `{type, compact_threshold?}`,
    `type` one of `CONTEXT_MANAGEMENT_TYPES`, an integer threshold >= 1000. Several entries:
    the smallest threshold wins."""
    if is_null(params.context_management):
        return None
    entries = _nested(decode_context_management, params.context_management, "context_management")
    if not entries:  # the spec's `minItems: 1`
        raise empty_array("context_management")
    thresholds = []
    for index, entry in enumerate(entries):
        _check_enum(f"context_management[{index}].type", entry.type, CONTEXT_MANAGEMENT_TYPES)
        if entry.compact_threshold is not None:
            name = f"context_management[{index}].compact_threshold"
            _check_range(Range(name, COMPACT_THRESHOLD_MIN, None, "integer"), entry.compact_threshold)
            thresholds.append(entry.compact_threshold)
    if not entries:
        return None
    return min(thresholds) if thresholds else 0


def check_compact_params(params: CompactParams) -> None:
    """`POST /v1/responses/compact`'s parameter rules (the create's, where it shares them)."""
    if params.prompt_cache_retention is not None:
        _check_enum("prompt_cache_retention", params.prompt_cache_retention, dict(ENUMS)["prompt_cache_retention"])
    if params.service_tier is not None:
        _check_enum("service_tier", params.service_tier, dict(ENUMS)["service_tier"])
    if params.prompt_cache_key is not None:
        check_string_length("prompt_cache_key", params.prompt_cache_key, PROMPT_CACHE_KEY_MAX)
    if isinstance(params.input, str):
        check_string_length("input", params.input, STRING_MAX)


def check_has_input(params: CreateParams) -> None:
    """A create says what to respond to: `input`, or a `previous_response_id` to continue.
    Checked after the other parameters (tools, tool_choice) have been read."""
    if not params.input and params.previous_response_id is None:
        raise ProtocolError("Missing required parameter: 'input'.", code="missing_required_parameter", param="input")


def check_context_window(input_tokens: int, limit: int | None) -> None:
    """400 `context_length_exceeded` when a prompt is longer than the model may read."""
    if limit is not None and input_tokens > limit:
        raise ProtocolError(CONTEXT_LENGTH_MESSAGE, code="context_length_exceeded", param="input")


# -- decoder errors ----------------------------------------------------------------------------------
# What msgspec says about a body that does not decode, as the real API words it.

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
    `unknown_parameter` (or a moved parameter's hint, `MOVED_PARAMETERS`),
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
