"""What the simulated model says: a `Policy` turns a `ModelRequest` into planned output items.

The accelerator (`sim/model/accelerator.py`) decides *when* tokens come out; a policy
decides *what* they are. A policy sees only the model-visible request fields
and an ``rng`` seeded from ``(seed, conversation_key, turn_index)``, so a turn's
output is the same however the request reached the service (the "same tokens
in every mode" invariant of `prototype/model.py`).

Two policies:

* `DefaultPolicy`: an agent-loop stand-in. While ``turn_index < tool_calls`` it
  calls one of the request's function tools with arguments sampled from that
  tool's JSON schema (`sim.model.schema_values.sample_json`); afterwards it answers
  with an English-ish text message. Output size per turn is lognormal, median
  120 tokens, sigma 0.8, fitted to SWE-Bench Pro runs (about 110 tokens a turn
  for GPT-5, nearly all tool-call arguments; sources in docs/pipeline.md,
  "Calibration").
* `ScriptPolicy`: replays a JSON Lines script, one line per model turn (format
  in `load_script`). For demos and for tests of client behaviour.
"""

from __future__ import annotations

import math
import os
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final, Literal, Protocol

import msgspec
import numpy as np

from prototype.model import FunctionTool, ModelRequest
from sim.model.schema_values import sample_json, sample_prose

__all__ = [
    "ARGUMENTS_CHARS_PER_TOKEN",
    "SCRIPT_EXHAUSTED_TEXT",
    "TEXT_CHARS_PER_TOKEN",
    "DefaultPolicy",
    "PlannedItem",
    "Policy",
    "ScriptPolicy",
    "load_script",
    "parse_script",
]

# Policies plan in characters and the accelerator tokenizes, so token targets are
# converted with average o200k_base ratios measured on this module's own output
# (tests/sim/model/test_sim_policy.py checks the resulting medians): compact JSON with
# shell commands and paths tokenizes densely (~3.5 chars/token); English-ish prose
# at ~5 chars/token.
ARGUMENTS_CHARS_PER_TOKEN: Final = 3.5
TEXT_CHARS_PER_TOKEN: Final = 5.2
SCRIPT_EXHAUSTED_TEXT: Final = "(script exhausted)"

_EMPTY_OBJECT_SCHEMA: Final[dict[str, object]] = {"type": "object", "properties": {}}


@dataclass(frozen=True, slots=True)
class PlannedItem:
    """One output item a policy wants sampled.

    ``kind == "message"``: ``name`` is "" and ``text`` is the assistant message.
    ``kind == "function_call"``: ``name`` is the function and ``text`` the
    arguments as a JSON string, exactly as it will be streamed.
    """

    kind: Literal["message", "function_call"]
    name: str
    text: str

    def __post_init__(self) -> None:
        if self.kind not in ("message", "function_call"):
            raise ValueError(f"unknown item kind {self.kind!r}")
        if self.kind == "message" and self.name:
            raise ValueError(f"a message has no name, got {self.name!r}")
        if self.kind == "function_call" and not self.name:
            raise ValueError("a function_call needs a name")


class Policy(Protocol):
    def plan(self, request: ModelRequest, rng: np.random.Generator) -> list[PlannedItem]:
        """The items of one model turn, in order. Must depend only on the model-visible
        fields of `request` and on `rng` (drawn from in a fixed order). The model reuses
        one generator for every turn: a policy must not keep `rng` past the call.

        A policy may also define ``plan_key(request) -> Hashable | None``: the request
        fields (and its own settings) its plan reads, so that runs with free CPU can
        look plans up (`sim.runtime.memo.MemoPolicy`); None, or no such method, plans every time."""
        ...


def _lognormal_tokens(rng: np.random.Generator, median: int, sigma: float, cap: int) -> int:
    return int(min(max(round(float(rng.lognormal(math.log(median), sigma))), 1), cap))


@dataclass(frozen=True, slots=True)
class DefaultPolicy:
    """Call a tool on the first `tool_calls` turns, then answer in text.

    Decision, in order:

    1. No tools, or ``tool_choice == "none"``: text.
    2. ``tool_choice`` names a tool in ``request.tools``: call that tool (on any turn).
    3. ``tool_choice == "required"``: call a tool (uniformly chosen), on any turn.
    4. Otherwise (``"auto"``, or a name that matches no tool, which the service
       rejects before the model sees it): call a uniformly chosen tool iff
       ``request.turn_index < tool_calls``, else text.

    One call per turn even if ``parallel_tool_calls`` is on: agent traces are
    dominated by single calls. Sizes are lognormal(median, `tokens_sigma`),
    capped at `max_item_tokens` (a named cap, since the lognormal tail is
    unbounded) and converted to characters with the ``*_CHARS_PER_TOKEN``
    constants; a tool whose schema has no free-text field (``get_weather(city)``)
    produces its natural, shorter arguments.
    """

    tool_calls: int = 10
    # Tool calls per conversation, by `ModelRequest.conversation_key`, overriding `tool_calls`:
    # how a workload gives each rollout its own length (sim/rollout/workload.py).
    per_conversation: Mapping[int, int] = field(default_factory=dict)
    text_tokens_median: int = 120
    arguments_tokens_median: int = 120
    tokens_sigma: float = 0.8
    max_item_tokens: int = 4096

    def __post_init__(self) -> None:
        if self.tool_calls < 0:
            raise ValueError(f"tool_calls must be >= 0, got {self.tool_calls}")
        if self.text_tokens_median < 1 or self.arguments_tokens_median < 1:
            raise ValueError("token medians must be >= 1")
        if not self.tokens_sigma >= 0:
            raise ValueError(f"tokens_sigma must be >= 0, got {self.tokens_sigma}")
        if self.max_item_tokens < 1:
            raise ValueError(f"max_item_tokens must be >= 1, got {self.max_item_tokens}")

    def _choose_tool(self, request: ModelRequest, rng: np.random.Generator) -> FunctionTool | None:
        tools = request.tools
        choice = request.tool_choice
        if not tools or choice == "none":
            return None
        named = [t for t in tools if t.name == choice]
        if named:
            return named[0]
        limit = self.per_conversation.get(request.conversation_key, self.tool_calls)
        if choice == "required" or request.turn_index < limit:
            return tools[int(rng.integers(len(tools)))]
        return None

    def plan_key(self, request: ModelRequest) -> Hashable:
        """What `plan` reads besides the rng: for `sim.runtime.memo.MemoPolicy` (a plan is the same
        for equal keys and equal rng states)."""
        limit = self.per_conversation.get(request.conversation_key, self.tool_calls)
        return (
            limit,
            self.text_tokens_median,
            self.arguments_tokens_median,
            self.tokens_sigma,
            self.max_item_tokens,
            request.turn_index,
            request.tools,
            request.tool_choice,
        )

    def plan(self, request: ModelRequest, rng: np.random.Generator) -> list[PlannedItem]:
        tool = self._choose_tool(request, rng)
        if tool is None:
            n_tokens = _lognormal_tokens(rng, self.text_tokens_median, self.tokens_sigma, self.max_item_tokens)
            text = sample_prose(rng, round(n_tokens * TEXT_CHARS_PER_TOKEN))
            return [PlannedItem("message", "", text)]
        n_tokens = _lognormal_tokens(rng, self.arguments_tokens_median, self.tokens_sigma, self.max_item_tokens)
        schema = msgspec.json.decode(tool.parameters_json) if tool.parameters_json.strip() else None
        if schema is None:  # a tool without parameters takes an empty object
            schema = _EMPTY_OBJECT_SCHEMA
        arguments = sample_json(schema, rng, target_chars=round(n_tokens * ARGUMENTS_CHARS_PER_TOKEN))
        return [PlannedItem("function_call", tool.name, msgspec.json.encode(arguments).decode())]


@dataclass(frozen=True, slots=True, init=False)
class ScriptPolicy:
    """Replay fixed turns: turn k (``request.turn_index``) gets ``turns[k]``.

    Past the end every turn is one message, ``"(script exhausted)"``. The script
    is followed literally: ``tools`` and ``tool_choice`` are ignored, so a script
    may call a function the request did not declare (useful to test clients).
    `rng` is not used.
    """

    turns: tuple[tuple[PlannedItem, ...], ...]

    def __init__(self, turns: Sequence[PlannedItem | Sequence[PlannedItem]]) -> None:
        normalized = tuple((t,) if isinstance(t, PlannedItem) else tuple(t) for t in turns)
        for k, items in enumerate(normalized):
            if not items:
                raise ValueError(f"turn {k} has no items")
        object.__setattr__(self, "turns", normalized)

    def plan(self, request: ModelRequest, rng: np.random.Generator) -> list[PlannedItem]:
        if 0 <= request.turn_index < len(self.turns):
            return list(self.turns[request.turn_index])
        return [PlannedItem("message", "", SCRIPT_EXHAUSTED_TEXT)]


_LINE_KEYS: Final = frozenset({"text", "tool_call", "tool_calls"})
_CALL_KEYS: Final = frozenset({"name", "arguments"})


def _parse_call(call: object, where: str) -> PlannedItem:
    if not isinstance(call, dict):
        raise ValueError(f"{where}: a tool call must be an object, got {type(call).__name__}")
    unknown = sorted(set(call) - _CALL_KEYS)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))} in a tool call")
    name = call.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}: a tool call needs a non-empty string 'name'")
    arguments = call.get("arguments", {})
    if isinstance(arguments, dict):
        text = msgspec.json.encode(arguments).decode()
    elif isinstance(arguments, str):
        try:
            msgspec.json.decode(arguments)
        except msgspec.DecodeError as exc:
            raise ValueError(f"{where}: 'arguments' string is not valid JSON ({exc})") from None
        text = arguments
    else:
        raise ValueError(f"{where}: 'arguments' must be an object or a JSON string")
    return PlannedItem("function_call", name, text)


def parse_turn(entry: dict[str, object], where: str) -> tuple[PlannedItem, ...]:
    """One model turn in the script-line format (`load_script`); errors name `where`."""
    keys = set(entry) & _LINE_KEYS
    unknown = sorted(set(entry) - _LINE_KEYS)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}")
    if len(keys) != 1:
        raise ValueError(f"{where}: expected exactly one of 'text', 'tool_call', 'tool_calls'")
    if "text" in entry:
        text = entry["text"]
        if not isinstance(text, str):
            raise ValueError(f"{where}: 'text' must be a string")
        return (PlannedItem("message", "", text),)
    if "tool_call" in entry:
        return (_parse_call(entry["tool_call"], where),)
    calls = entry["tool_calls"]
    if not isinstance(calls, list) or not calls:
        raise ValueError(f"{where}: 'tool_calls' must be a non-empty list")
    return tuple(_parse_call(c, f"{where}: tool_calls[{i}]") for i, c in enumerate(calls))


@dataclass(frozen=True, slots=True)
class ConversationPolicy:
    """A policy per conversation (by `ModelRequest.conversation_key`), a fallback for the rest:
    how a recorded trace replays each rollout's own assistant turns (sim/rollout/replay.py)."""

    by_conversation: Mapping[int, Policy]
    fallback: Policy

    def plan(self, request: ModelRequest, rng: np.random.Generator) -> list[PlannedItem]:
        return self.by_conversation.get(request.conversation_key, self.fallback).plan(request, rng)


def parse_script(source: str, *, origin: str = "<script>") -> ScriptPolicy:
    """Parse script text (format in `load_script`); errors name ``origin:line``."""
    turns: list[tuple[PlannedItem, ...]] = []
    for lineno, raw in enumerate(source.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{origin}:{lineno}"
        try:
            entry = msgspec.json.decode(line)
        except msgspec.DecodeError as exc:
            raise ValueError(f"{where}: not valid JSON ({exc})") from None
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(entry).__name__}")
        turns.append(parse_turn(entry, where))
    return ScriptPolicy(turns)


def load_script(path: str | os.PathLike[str]) -> ScriptPolicy:
    """Load a model script: JSON Lines, one line per model turn.

    Each line is one JSON object with exactly one of these keys::

        {"text": "Done: the tests pass."}
        {"tool_call": {"name": "exec_command", "arguments": {"cmd": "ls -la"}}}
        {"tool_call": {"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}}
        {"tool_calls": [{"name": "read", "arguments": {"path": "a.py"}}, {"name": "read"}]}

    * ``text``: the turn is one assistant message with this text.
    * ``tool_call``: one function call. ``arguments`` is an object (sent as
      compact JSON, key order kept) or a string holding JSON (sent verbatim);
      omitted means ``{}``.
    * ``tool_calls``: several function calls in one turn (parallel calls).
    * Blank lines and lines whose first non-blank character is ``#`` are skipped.

    Line k (counting only the non-skipped lines, from 0) is the model turn with
    ``turn_index == k``, i.e. the turn after k earlier model turns; the client's
    function-call outputs and user messages in between are not lines. After the
    last line every turn answers ``"(script exhausted)"``. Tools and
    ``tool_choice`` in the request are not checked. A malformed file raises
    `ValueError` naming ``path:line``. The file is UTF-8.
    """
    with open(path, encoding="utf-8") as f:
        source = f.read()
    return parse_script(source, origin=os.fspath(path))
