"""Requests to model-visible tokens: validation, effective context, rendering.

Theory of operation
-------------------
A turn's *effective context* is ``previous.context + previous.output + new input``
(docs/protocol.md; the Open Responses spec: the server "MUST load both the
input and output associated with that prior response"). Each item is kept twice:
its raw JSON, verbatim as the client sent it (so replayed ids, statuses and
unknown item types round-trip), and its rendered token ids.

Rendering is *item-local*: the prompt is ``preamble(instructions, tools) +
concat(render(item) for item in context) + generation header``, and
``render(item)`` depends only on that item. So tokens cached from an earlier turn
plus the rendering of the new items equal the rendering of the whole history,
token for token. That is what lets the WebSocket connection cache and append
mode touch only new input while feeding the model exactly the sequence that a
full-history HTTP request produces ("same tokens in every mode"). Item ids and
call ids are not rendered (the model never sees them), because they differ
between transports.

`Context` is an append-only log. A holder (the connection cache, a paused
response) remembers the length it saw; extending from a shorter view copies
first, so an old holder never observes items appended after it.
"""

from __future__ import annotations

import operator
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final, TypeVar

import msgspec
from msgspec import Raw

from ..model import FunctionTool, TokenArray
from ..wire.constraints import SCHEMAS, violation
from ..wire.contract import (
    CALL_ID_MAX,
    STRING_MAX,
    check_breakpoint,
    check_function_name,
    check_has_input,
    check_params,
    check_string_length,
    compact_threshold,
    from_validation_error,
    prewarms,
    supported_values,
)
from ..wire.errors import ProtocolError
from ..wire.requests import CreateParams, InputItemView, is_null
from ..wire.schemas import (
    CompactionItem,
    FunctionCall,
    OutputItem,
    OutputMessage,
    decode_content,
    decode_item,
    decode_json,
    decode_tool,
    encode,
    guarded_decoder,
)
from ..wire.tool_schema import check_parameters, echo_tools
from .compaction import COMPACTION_TYPE, ENCRYPTED_CONTENT_MAX, TRIGGER_TYPE, decode_payload
from .tokenizer import Tokenizer

__all__ = [
    "Context",
    "check_continuation",
    "split_trigger",
    "conversation_key",
    "CreateRequest",
    "Item",
    "Preamble",
    "item_from_output",
    "ItemParser",
    "ToolCache",
    "normalize_create",
    "parse_item",
    "parse_items",
    "render_items",
    "render_model_output",
    "render_texts",
    "render_preamble",
]

T = TypeVar("T")
MESSAGE_ROLES: Final = frozenset({"user", "assistant", "system", "developer"})
# Item types produced by the model: a run of them is one model turn.
MODEL_ITEM_TYPES: Final = frozenset({"function_call", "reasoning", "custom_tool_call"})
GENERATION_HEADER: Final = "<|start|>assistant"
TOOL_CHOICES: Final = frozenset({"auto", "none", "required"})
# Items that call a client tool, and the items that answer them (paired by `call_id`).
CALL_TYPES: Final = frozenset({"function_call", "custom_tool_call"})
OUTPUT_TYPES: Final = frozenset({"function_call_output", "custom_tool_call_output"})
REFERENCE_TYPE: Final = "item_reference"
# tool_choice types the simulator honours; a forced hosted tool is a feature it lacks.
TOOL_CHOICE_TYPES: Final = frozenset({"function", "allowed_tools"})
# Every `type` of the spec's `ToolChoiceParam` objects: another is not a tool choice at all.
TOOL_CHOICE_KNOWN_TYPES: Final = (
    "allowed_tools",
    "function",
    "mcp",
    "custom",
    "programmatic_tool_calling",
    "apply_patch",
    "shell",
    "file_search",
    "web_search_preview",
    "computer",
    "computer_use_preview",
    "computer_use",
    "web_search_preview_2025_03_11",
    "image_generation",
    "code_interpreter",
)
ALLOWED_TOOLS_MODES: Final = ("auto", "required")
BREAKPOINT_KEY: Final = b'"prompt_cache_breakpoint"'  # a content part's field, as any JSON encoder writes it
item_type: Final = operator.attrgetter("view.type")  # an Item's type, read in C over a whole input


def conversation_key(first_user_text: str) -> int:
    """What seeds the model's policy for a conversation: its first user message, hashed.
    A harness that knows its tasks can compute it too (sim/workload.py does)."""
    return zlib.crc32(first_user_text.encode()) or 1


@dataclass(frozen=True, slots=True)
class Item:
    raw: bytes  # verbatim JSON of the item
    view: InputItemView
    # Read once when the item is made, not each time a context or a request holds it: whether its
    # JSON names a breakpoint field (context/breakpoints.py reads which part, if any), whether the
    # model produced it (a run of such items is one model turn).
    marked: bool = field(init=False, repr=False, compare=False)
    is_model_output: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        v = self.view
        object.__setattr__(self, "marked", BREAKPOINT_KEY in self.raw)
        model = v.type in MODEL_ITEM_TYPES or (v.type == "message" and v.role == "assistant")
        object.__setattr__(self, "is_model_output", model)


@dataclass(frozen=True, slots=True)
class Preamble:
    """Instructions and tools, rendered; reused when a continuation repeats them byte for byte."""

    key: bytes
    tokens: TokenArray


@dataclass(slots=True)
class Context:
    """The effective input of a turn as an append-only log of items and their tokens."""

    items: list[Item] = field(default_factory=list)
    chunks: list[TokenArray] = field(default_factory=list)
    n_tokens: int = 0
    held_bytes: int = 0  # the items' JSON and their token arrays (what a connection cache entry holds)
    turn_index: int = 0  # model turns in the context
    conversation_key: int = 0  # crc32 of the first user message; 0 until there is one
    last_was_model: bool = False
    # Running sets for `check_continuation`, kept up to date item by item, so that checking a
    # continuation reads only its new items.
    item_ids: set[str] = field(default_factory=set)
    call_ids: set[str] = field(default_factory=set)  # every call in the context
    pending: dict[str, None] = field(default_factory=dict)  # calls without an output yet, in order
    # (item index, its first token) of the items that may carry a prompt-cache breakpoint
    # (context/breakpoints.py): found among new items only, so a turn never rescans its history.
    marked: list[tuple[int, int]] = field(default_factory=list)

    def extend(self, items: Sequence[Item], chunks: Sequence[TokenArray]) -> None:
        for item, chunk in zip(items, chunks, strict=True):
            view = item.view
            kind, call_id = view.type, view.call_id
            if view.id is not None and kind != REFERENCE_TYPE:
                self.item_ids.add(view.id)
            if call_id is not None:
                if kind in CALL_TYPES:
                    self.call_ids.add(call_id)
                    self.pending[call_id] = None
                elif kind in OUTPUT_TYPES:
                    self.pending.pop(call_id, None)
            if kind == COMPACTION_TYPE:  # the history it stands for counted its model turns
                payload = decode_payload(view.encrypted_content or "", "input")
                self.turn_index = payload.turns
                if payload.conversation_key:
                    self.conversation_key = payload.conversation_key
            model = item.is_model_output
            if model and not self.last_was_model:
                self.turn_index += 1
            self.last_was_model = model
            if self.conversation_key == 0 and kind == "message" and view.role == "user":
                self.conversation_key = conversation_key(_text_of(view))
            if item.marked:
                self.marked.append((len(self.items), self.n_tokens))
            self.items.append(item)
            self.chunks.append(chunk)
            self.n_tokens += len(chunk)
            self.held_bytes += len(item.raw) + chunk.nbytes

    def end_turn(self) -> None:
        """The model's turn ends here: its next item starts a new turn even with no input in
        between (the beta's async tools, when the model decodes on past its calls). Items alone
        do not show it, so a context rebuilt from them counts those turns as one."""
        self.last_was_model = False

    def prefix(self, n_items: int) -> Context:
        """This context as it was when it held `n_items` items: shared if unchanged, else a copy."""
        if n_items == len(self.items):
            return self
        fresh = Context()
        fresh.extend(self.items[:n_items], self.chunks[:n_items])
        return fresh

    def copy(self) -> Context:
        """This context as it is now, sharing no mutable state with it (its lists, sets and dict
        copied; the items and token arrays they hold are immutable)."""
        return Context(
            list(self.items),
            list(self.chunks),
            self.n_tokens,
            self.held_bytes,
            self.turn_index,
            self.conversation_key,
            self.last_was_model,
            set(self.item_ids),
            set(self.call_ids),
            dict(self.pending),
            list(self.marked),
        )

    def raw_items(self) -> list[Raw]:
        return [Raw(i.raw) for i in self.items]


def check_continuation(context: Context, items: Sequence[Item]) -> None:
    """The rules that relate new input to the context it extends (history from the cache or
    the store, then the new items in order): item ids are unique; every tool output answers a
    call; no call is left without an output. Reads only `items` and the context's sets."""
    ids: set[str] = set()
    calls: set[str] = set()
    pending = dict(context.pending)
    for item in items:
        view = item.view
        if view.id is not None and view.type != REFERENCE_TYPE:  # a reference names another item's id
            if view.id in ids or view.id in context.item_ids:
                raise ProtocolError(
                    f"Duplicate item found with id {view.id}. Remove duplicate items from your input and try again.",
                    code=None,
                    param="input",
                )
            ids.add(view.id)
        call_id = view.call_id
        if call_id is None:
            continue
        if view.type in CALL_TYPES:
            calls.add(call_id)
            pending[call_id] = None
        elif view.type in OUTPUT_TYPES:
            # A referenced item is not resolved here (the simulator does not render references), so
            # an output after a reference may answer the call it stands for (looked for only now).
            if call_id not in calls and call_id not in context.call_ids and not _references(items):
                raise ProtocolError(
                    f"No tool call found for function call output with call_id {call_id}.", code=None, param="input"
                )
            pending.pop(call_id, None)
    if pending:
        raise ProtocolError(f"No tool output found for function call {next(iter(pending))}.", code=None, param="input")


def _references(items: Sequence[Item]) -> bool:
    return REFERENCE_TYPE in map(item_type, items)


@dataclass(frozen=True, slots=True)
class CreateRequest:
    """A validated `response.create` / POST body, in the shapes the engine uses."""

    params: CreateParams
    model: str
    items: tuple[Item, ...]
    tools: tuple[FunctionTool, ...]
    tools_raw: tuple[Raw, ...]
    tools_echo: tuple[Raw, ...]  # `tools_raw` as the response echoes them (`tool_schema.echo_tools`)
    tool_choice: str
    store: bool
    generate: bool
    preamble_key: bytes
    # `context_management`: compact past this many prompt tokens; 0: past the context window;
    # None: never (contract.compact_threshold).
    compact_threshold: int | None = None
    compact_now: bool = False  # the input ended with a `compaction_trigger` (not in `items`)

    @property
    def previous_response_id(self) -> str | None:
        return self.params.previous_response_id


class ToolCache:
    """The last tool list a connection validated, by its exact bytes: a client resends the
    same definitions every turn (Codex does), and validating them again would touch input
    that is not new. A list that differs in any byte is validated in full."""

    __slots__ = ("_raw", "_tools", "hits")

    def __init__(self) -> None:
        self._raw: tuple[bytes, ...] | None = None
        self._tools: tuple[FunctionTool, ...] = ()
        self.hits = 0

    def parse(self, tools_raw: tuple[Raw, ...]) -> tuple[FunctionTool, ...]:
        raw = tuple(bytes(t) for t in tools_raw)
        if raw == self._raw:
            self.hits += 1
            return self._tools
        tools = _parse_tools(tools_raw)  # raises on a bad list: the cache keeps the last good one
        self._raw, self._tools = raw, tools
        return tools


class _UserMessage(msgspec.Struct, tag_field="type", tag="message"):
    role: str
    content: str


ItemParser = Callable[[str | list[Raw]], tuple[Item, ...]]  # `parse_items`, or one that looks items up


def parse_items(value: str | list[Raw]) -> tuple[Item, ...]:
    """An `input`: a string (one user message) or a list of items, each validated."""
    if isinstance(value, str):
        raw = encode(_UserMessage(role="user", content=value))
        return (Item(raw, InputItemView(role="user", content=Raw(encode(value)))),)
    return tuple(parse_item(bytes(raw), index) for index, raw in enumerate(value))


def parse_item(data: bytes, index: int) -> Item:
    """One input item's JSON, validated; errors name it as ``input[index]``."""
    view = _decode_at(decode_item, data, f"input[{index}]")
    _check_item(view, index)
    _check_constraints(INPUT_ITEM, data, f"input[{index}]")
    return Item(data, view)


INPUT_ITEM: Final = SCHEMAS["InputItem"]
TOOL: Final = SCHEMAS["Tool"]


def _check_constraints(schema: dict[str, object], data: bytes | Raw, where: str) -> None:
    """The spec's value constraints on one item or tool (prototype/wire/constraints.py), after the
    rules above, which name their own errors first."""
    err = violation(schema, msgspec.json.decode(data), where)
    if err is not None:
        raise err


def _decode_at(decode: Callable[[bytes | Raw], T], data: bytes | Raw, where: str) -> T:
    """`decode(data)`; a decode or validation error names its place under `where`."""
    try:
        return decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise _relocate(from_validation_error(exc, part=True), where) from None


def _relocate(err: ProtocolError, where: str) -> ProtocolError:
    """An error about a part decoded on its own, named by its place in the request."""
    sub = err.param or ""
    path = where + (sub if sub.startswith("[") or not sub else f".{sub}")
    if sub:
        err.message = err.message.replace(f"'{sub}'", f"'{path}'", 1)
    elif err.code == "invalid_type":
        err.message = err.message.replace("Invalid request body:", f"Invalid type for '{path}':", 1)
    err.param = path
    return err


def normalize_create(
    params: CreateParams,
    *,
    websocket: bool,
    tool_cache: ToolCache | None = None,
    parse: ItemParser = parse_items,
    open_responses: bool = False,
    multi_agent: bool = False,
) -> CreateRequest:
    """Validate one create; raise `ProtocolError` with the offending `param`. With `tool_cache`
    (a WebSocket connection's), a tool list identical to the last one is not validated again;
    `parse` validates the input items (`sim.memo` passes one that looks them up);
    `open_responses` accepts that spec's extra request fields; `multi_agent` the beta's. The
    top-level rules are `contract.check_params`; the item rules are checked per item here."""
    check_params(params, websocket=websocket, open_responses=open_responses, multi_agent=multi_agent)
    assert params.model is not None  # check_params refuses a create without one
    prev = params.previous_response_id
    if prev is not None and not prev.startswith("resp_"):
        raise ProtocolError(
            f"Invalid 'previous_response_id': '{prev}'. Expected an ID that begins with 'resp_'.",
            code="invalid_value",
            param="previous_response_id",
        )
    items, compact_now = split_trigger(parse(params.input))
    tools_raw = tuple(params.tools or ())
    tools = tool_cache.parse(tools_raw) if tool_cache is not None else _parse_tools(tools_raw)
    tool_choice = _parse_tool_choice(params.tool_choice, tools)
    check_has_input(params)
    generate = params.generate is not False and not prewarms(params)  # absent or null: true
    key = encode((params.instructions, [bytes(t) for t in tools_raw]))
    return CreateRequest(
        params=params,
        model=params.model,
        items=items,
        tools=tools,
        tools_raw=tools_raw,
        tools_echo=echo_tools(tools_raw),
        tool_choice=tool_choice,
        store=params.store is not False,
        generate=generate,
        preamble_key=key,
        compact_threshold=compact_threshold(params),
        compact_now=compact_now,
    )


def split_trigger(items: tuple[Item, ...]) -> tuple[tuple[Item, ...], bool]:
    """The input without its final `compaction_trigger` (an instruction to the server, not part
    of the context), and whether it had one; a trigger anywhere else is refused."""
    types = list(map(item_type, items))  # one pass in C: a resent history is long
    compact_now = bool(types) and types[-1] == TRIGGER_TYPE
    if compact_now:
        items = items[:-1]
        types.pop()
    if TRIGGER_TYPE in types:
        index = types.index(TRIGGER_TYPE)
        raise ProtocolError(
            f"Invalid 'input[{index}]': a compaction_trigger item must be the final input item.",
            code="invalid_value",
            param=f"input[{index}]",
        )
    return items, compact_now


def _check_item(view: InputItemView, index: int) -> None:
    where = f"input[{index}]"
    if view.call_id is not None:
        check_string_length(f"{where}.call_id", view.call_id, CALL_ID_MAX)
    if view.type == "message":
        if view.role not in MESSAGE_ROLES:
            raise ProtocolError(
                f"Invalid value for '{where}.role': {view.role!r}. Supported values are: "
                "'assistant', 'developer', 'system', and 'user'.",
                code="invalid_value",
                param=f"{where}.role",
            )
        if is_null(view.content):
            raise ProtocolError(
                f"Missing required parameter: '{where}.content'.",
                code="missing_required_parameter",
                param=f"{where}.content",
            )
        _decode_parts(view.content, f"{where}.content")
    elif view.type == "function_call":
        for name in ("call_id", "name", "arguments"):
            value = getattr(view, name)
            if value is None or (name == "arguments" and is_null(value)):
                raise ProtocolError(
                    f"Missing required parameter: '{where}.{name}'.",
                    code="missing_required_parameter",
                    param=f"{where}.{name}",
                )
        _decode_at(_decode_str, view.arguments, f"{where}.arguments")
    elif view.type == "function_call_output":
        if view.call_id is None or is_null(view.output):
            missing = "call_id" if view.call_id is None else "output"
            raise ProtocolError(
                f"Missing required parameter: '{where}.{missing}'.",
                code="missing_required_parameter",
                param=f"{where}.{missing}",
            )
        _decode_parts(view.output, f"{where}.output")
    elif view.type == COMPACTION_TYPE:
        if view.encrypted_content is None:
            raise ProtocolError(
                f"Missing required parameter: '{where}.encrypted_content'.",
                code="missing_required_parameter",
                param=f"{where}.encrypted_content",
            )
        check_string_length(f"{where}.encrypted_content", view.encrypted_content, ENCRYPTED_CONTENT_MAX)
        decode_payload(view.encrypted_content, f"{where}.encrypted_content")
    # Other item types (reasoning, additional_tools, custom_tool_call, item_reference, …) pass through.


_decode_str: Final = guarded_decoder(msgspec.json.Decoder(str))
TEXT_PARTS: Final = frozenset({"input_text", "output_text"})  # content parts whose `text` the spec requires


def _decode_parts(raw: Raw, param: str) -> str:
    try:
        value = decode_content(raw)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        err = from_validation_error(exc)
        if err.code in ("invalid_type", "unknown_parameter", "missing_required_parameter"):  # a breakpoint's fields
            raise _relocate(err, param) from None
        raise ProtocolError(f"Invalid '{param}': {exc}", code="invalid_value", param=param) from None
    if isinstance(value, str):
        check_string_length(param, value, STRING_MAX)
        return value
    for i, part in enumerate(value):
        if part.type in TEXT_PARTS and part.text is None:
            raise ProtocolError(
                f"Missing required parameter: '{param}[{i}].text'.",
                code="missing_required_parameter",
                param=f"{param}[{i}].text",
            )
        for text in (part.text, part.refusal):
            if text is not None:
                check_string_length(f"{param}[{i}].text", text, STRING_MAX)
        check_breakpoint(part, f"{param}[{i}]")
    return "".join(p.text or p.refusal or f"[{p.type}]" for p in value)


def message_text(view: InputItemView) -> str:
    """A message's text (its parts joined)."""
    return _text_of(view)


def _text_of(view: InputItemView) -> str:
    if not is_null(view.content):
        return _decode_parts(view.content, "content")
    return ""


def _parse_tools(tools_raw: tuple[Raw, ...]) -> tuple[FunctionTool, ...]:
    tools = []
    seen: set[str] = set()
    for index, raw in enumerate(tools_raw):
        view = _decode_at(decode_tool, raw, f"tools[{index}]")
        if view.type != "function":
            _check_constraints(TOOL, raw, f"tools[{index}]")
            continue  # namespace, web_search, custom, …: accepted and echoed, never called by the simulator
        if not view.name:
            raise ProtocolError(
                f"Missing required parameter: 'tools[{index}].name'.",
                code="missing_required_parameter",
                param=f"tools[{index}].name",
            )
        check_function_name(view.name, f"tools[{index}].name")
        # The model sees a canonical (compact, order-preserving) rendering of the schema, so
        # whitespace in the client's JSON never changes the prompt: openai-python sends compact
        # JSON over HTTP and `json.dumps` spacing over WebSocket.
        schema = None if is_null(view.parameters) else decode_json(view.parameters)
        if schema is None:
            params = b'{"type":"object","properties":{}}'
        else:
            check_parameters(schema, function=view.name, param=f"tools[{index}].parameters")
            params = encode(schema)
        if view.name in seen:
            raise ProtocolError(
                f"Duplicate tool name: '{view.name}'.", code="invalid_value", param=f"tools[{index}].name"
            )
        seen.add(view.name)
        _check_constraints(TOOL, raw, f"tools[{index}]")
        tools.append(FunctionTool(view.name, view.description, params, view.strict, view.is_async is True))
    return tuple(tools)


class _NamedChoice(msgspec.Struct):
    type: str
    name: str | None = None
    mode: str | None = None  # allowed_tools


_decode_tool_choice: Final = guarded_decoder(msgspec.json.Decoder(str | _NamedChoice))


def _parse_tool_choice(raw: Raw, tools: tuple[FunctionTool, ...]) -> str:
    if is_null(raw):
        return "auto"
    try:
        value = _decode_tool_choice(raw)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ProtocolError(f"Invalid 'tool_choice': {exc}", code="invalid_value", param="tool_choice") from None
    if isinstance(value, str):
        if value not in TOOL_CHOICES:
            raise ProtocolError(
                f"Invalid value for 'tool_choice': {value!r}. Supported values are: 'none', 'auto', and 'required'.",
                code="invalid_value",
                param="tool_choice",
            )
        return value
    if value.type == "function":
        if value.name not in {t.name for t in tools}:
            raise ProtocolError(
                f"Tool choice '{value.name}' not found in 'tools' parameter.",
                code="invalid_value",
                param="tool_choice",
            )
        return str(value.name)
    if value.type not in TOOL_CHOICE_KNOWN_TYPES:
        raise ProtocolError(
            f"Invalid value: '{value.type}'. Supported values are: {supported_values(TOOL_CHOICE_KNOWN_TYPES)}.",
            code="invalid_value",
            param="tool_choice.type",
        )
    if value.type == "allowed_tools" and value.mode is not None and value.mode not in ALLOWED_TOOLS_MODES:
        raise ProtocolError(
            f"Invalid value: '{value.mode}'. Supported values are: {supported_values(ALLOWED_TOOLS_MODES)}.",
            code="invalid_value",
            param="tool_choice.mode",
        )
    if value.type not in TOOL_CHOICE_TYPES:
        raise ProtocolError(
            f"Forcing the tool type '{value.type}' with 'tool_choice' is not supported by this server "
            "(a simulator of the Responses API: its model calls function tools only).",
            code="unsupported_parameter",
            param="tool_choice",
        )
    return "auto"  # allowed_tools: the simulator treats it as auto


def item_from_output(item: OutputItem) -> Item:
    """The model's own output as an input item of the next turn (what a client replays)."""
    raw = encode(item)
    if isinstance(item, FunctionCall):
        args = Raw(encode(item.arguments))
        view = InputItemView(type="function_call", id=item.id, call_id=item.call_id, name=item.name, arguments=args)
    elif isinstance(item, CompactionItem):
        view = InputItemView(type=COMPACTION_TYPE, id=item.id, encrypted_content=item.encrypted_content)
    else:
        assert isinstance(item, OutputMessage)
        text = "".join(part.text for part in item.content)
        view = InputItemView(type="message", id=item.id, role="assistant", content=Raw(encode(text)))
    return Item(raw, view)


def render_model_output(kind: str, name: str, text: str) -> str:
    """What an item the model says (an assistant message, or a call of function `name`) stands
    for in the context: the same text whether the item comes back as input or is being decoded,
    so a real engine that decodes it (sim/engine) holds the KV the next turn's prompt starts with."""
    if kind == "function_call":
        return f"<|start|>assistant to=functions.{name}<|message|>{text}<|call|>"
    return _message_text("assistant", text)


def _message_text(role: str | None, text: str) -> str:
    return f"<|start|>{role}<|message|>{text}<|end|>"


def _render_text(view: InputItemView) -> str:
    t = view.type
    if t == "message":
        return _message_text(view.role, _text_of(view))
    if t == "function_call":
        return render_model_output("function_call", view.name or "", _decode_str(view.arguments))
    if t == "function_call_output":
        return f"<|start|>tool<|message|>{_decode_parts(view.output, 'output')}<|end|>"
    if t == "custom_tool_call":
        return f"<|start|>assistant to=functions.{view.name}<|message|>{view.input or ''}<|call|>"
    if t == COMPACTION_TYPE:
        return f"<|start|>compaction<|message|>{decode_payload(view.encrypted_content or '', 'input').summary}<|end|>"
    if t == "custom_tool_call_output" and not is_null(view.output):
        return f"<|start|>tool<|message|>{_decode_parts(view.output, 'output')}<|end|>"
    return ""  # reasoning (encrypted), item references, tool-list items: nothing model-visible here


def render_texts(items: Sequence[Item]) -> list[str]:
    """Each item's model-visible text (harmony-style), to be tokenized."""
    return [_render_text(item.view) for item in items]


def render_items(items: Sequence[Item], tokenizer: Tokenizer) -> list[TokenArray]:
    return [tokenizer.encode(text) for text in render_texts(items)]


def render_preamble(request: CreateRequest, tokenizer: Tokenizer) -> Preamble:
    parts = []
    if request.params.instructions:
        parts.append(f"<|start|>developer<|message|>{request.params.instructions}<|end|>")
    if request.tools:
        lines = ["<|start|>system<|message|># Tools"]
        for tool in request.tools:
            lines.append(f"## {tool.name}\n{tool.description or ''}\n{tool.parameters_json.decode()}")
        parts.append("\n".join(lines) + "<|end|>")
    return Preamble(request.preamble_key, tokenizer.encode("".join(parts)))


_HEADER_CACHE: dict[str, TokenArray] = {}


def generation_header(tokenizer: Tokenizer) -> TokenArray:
    header = _HEADER_CACHE.get(tokenizer.name)
    if header is None:
        header = _HEADER_CACHE[tokenizer.name] = tokenizer.encode(GENERATION_HEADER)
    return header
