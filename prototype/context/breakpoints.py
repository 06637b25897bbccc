"""Explicit prompt-cache breakpoints: where in the model-visible prompt each one falls.

A content part's `prompt_cache_breakpoint` "marks the exact end of a reusable prompt prefix" and
"the boundary is not rounded to a token block" (openai-python 3.63's `PromptCacheBreakpoint`).
Rendering is item-local (conversation.py), so a breakpoint's boundary is its item's first token
plus the tokens of the item's rendering up to the end of the marked part. The rules of what is
written and matched are the model's (sim/model/breakpoints.py); this module only places them and
keeps "up to the latest 80 breakpoints in the conversation" (the SDK's `PromptCacheOptions`).

Costs: `Context.extend` notes the items whose JSON holds the field (new items only); a turn
walks those from the latest back until it has 80, tokenizing a marked item's head once (`_MARKS`
keeps it by the item's bytes, whose hash Python caches).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from ..model import CacheBreakpoint
from ..wire.errors import ProtocolError
from ..wire.requests import ContentPartView
from ..wire.schemas import decode_content
from .conversation import Context, Item
from .tokenizer import Tokenizer

__all__ = [
    "MATCHED_BREAKPOINTS",
    "TTL_S",
    "conversation_breakpoints",
    "first_breakpoint",
    "has_breakpoints",
    "item_marks",
    "refuse_explicit",
]

MATCHED_BREAKPOINTS: Final = 80  # "up to the latest 80 breakpoints in the conversation" are matched
TTL_S: Final = {"30m": 1800.0, "12h": 43_200.0}  # `ttl` values (contract.PROMPT_CACHE_TTLS), in seconds
_TOOL_HEAD: Final = "<|start|>tool<|message|>"  # conversation._render_text of a tool output
_MARKS_KEPT: Final = 4096  # items whose marks `_MARKS` keeps before starting afresh

Mark = tuple[int, str | None]  # (tokens of the item's rendering before the boundary, the part's own ttl)
# Module state in the sans-IO core, on purpose: a memo of a pure function of its key (a tokenizer's
# name fixes its encoding; the item's bytes fix its parts), so a lookup answers what computing would,
# whichever connection or engine asks; bounded by `_MARKS_KEPT`, it cannot grow with the traffic.
_MARKS: dict[tuple[str, bytes], tuple[Mark, ...]] = {}


def _parts(item: Item) -> tuple[str, list[ContentPartView]] | None:
    """The rendering's head and the content parts of an item that can carry breakpoints."""
    view = item.view
    if view.type == "message":
        raw, head = view.content, f"<|start|>{view.role}<|message|>"
    elif view.type in ("function_call_output", "custom_tool_call_output"):
        raw, head = view.output, _TOOL_HEAD
    else:
        return None
    parts = decode_content(raw)  # validated when the item was parsed
    return None if isinstance(parts, str) else (head, parts)


def item_marks(item: Item, tokenizer: Tokenizer) -> tuple[Mark, ...]:
    """The item's breakpoints, in order: where each falls within the item's tokens, and its own `ttl`."""
    key = (tokenizer.name, item.raw)
    marks = _MARKS.get(key)
    if marks is not None:
        return marks
    found: list[Mark] = []
    parsed = _parts(item)
    if parsed is not None:
        text, parts = parsed
        for part in parts:
            text += part.text or part.refusal or f"[{part.type}]"  # as conversation._decode_parts joins them
            bp = part.prompt_cache_breakpoint
            if bp is not None:
                found.append((len(tokenizer.encode(text)), bp.ttl))
    if len(_MARKS) >= _MARKS_KEPT:
        _MARKS.clear()
    marks = _MARKS[key] = tuple(found)
    return marks


def conversation_breakpoints(
    context: Context, offset: int, tokenizer: Tokenizer, ttl_s: float
) -> tuple[CacheBreakpoint, ...]:
    """The latest `MATCHED_BREAKPOINTS` breakpoints of the context, in prompt order; `offset`: the
    prompt tokens before the context (the preamble); `ttl_s`: the request's `ttl`, which a
    breakpoint without its own takes."""
    out: list[CacheBreakpoint] = []
    for index, start in reversed(context.marked):
        for tokens, ttl in reversed(item_marks(context.items[index], tokenizer)):
            out.append(CacheBreakpoint(offset + start + tokens, ttl_s if ttl is None else TTL_S[ttl]))
            if len(out) == MATCHED_BREAKPOINTS:
                return tuple(reversed(out))
    return tuple(reversed(out))


def has_breakpoints(context: Context) -> bool:
    """Whether any content part of the context carries a breakpoint (a `null` one does not)."""
    return any(first_breakpoint([context.items[index]]) is not None for index, _ in context.marked)


def first_breakpoint(items: Sequence[Item]) -> str | None:
    """Where the first content part of `items` (a request's input, in order) that carries a
    breakpoint is, as a `param` (`input[i].content[j].prompt_cache_breakpoint`); None: none does."""
    for index, item in enumerate(items):
        if not item.marked:
            continue
        parsed = _parts(item)
        field = "content" if item.view.type == "message" else "output"
        for j, part in enumerate(parsed[1] if parsed is not None else ()):
            if part.prompt_cache_breakpoint is not None:
                return f"input[{index}].{field}[{j}].prompt_cache_breakpoint"
    return None


def refuse_explicit(explicit: bool, items: Sequence[Item], engine: str) -> None:
    """For a model whose cache cannot follow breakpoints (`prototype.model.ImplicitCacheOnly`):
    the API's 400 for `mode: "explicit"` or the first breakpoint of `items`, naming it; `engine`
    says which cache it is, in the message."""
    param = "prompt_cache_options.mode" if explicit else first_breakpoint(items)
    if param is None:
        return
    raise ProtocolError(
        f"Unsupported parameter: '{param}' is not supported with this model: {engine} reuses a prompt's "
        "prefix by its own rules and cannot write, match or expire explicit prompt-cache breakpoints.",
        code="unsupported_parameter",
        param=param,
    )
