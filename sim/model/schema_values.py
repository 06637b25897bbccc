"""Plausible JSON values for a JSON-Schema subset.

The simulated model must emit function-call arguments that a real client (Codex,
the openai-agents SDK) can parse and act on, so arguments are sampled *from the
tool's own schema*. Only the subset that tool schemas use in practice is
understood:

* ``type``: ``object``, ``string``, ``integer``, ``number``, ``boolean``,
  ``array``, ``null``, or a list of those (``["string", "null"]``, OpenAI
  strict mode's spelling of "optional").
* ``enum`` and ``const`` at any level (they win over everything else).
* objects: ``properties`` and ``required``. Required properties are always
  present; optional ones with probability `OPTIONAL_PROPERTY_P`.
  ``additionalProperties`` is ignored (the sampler never adds extra keys).
* strings: ``minLength`` / ``maxLength`` (in code points, as JSON Schema counts
  them) and a few ``format`` values; ``pattern`` is ignored.
* numbers: ``minimum`` / ``maximum`` and ``exclusiveMinimum`` /
  ``exclusiveMaximum`` (draft 4 booleans and draft 6+ numbers).
* arrays: ``items`` (one schema), ``minItems`` / ``maxItems``.
* ``anyOf`` / ``oneOf`` (one branch is picked; keywords next to them are merged
  under the branch; a ``oneOf`` value is drawn again, up to `_ONE_OF_ATTEMPTS` times,
  until it matches exactly one branch as far as this subset tells), ``allOf`` (merged shallowly).
* Anything else (``$ref``, no ``type``, an unknown ``type``) samples as a string.

Sizing: `sample_json` takes ``target_chars``, the wanted length of the value
*serialised as compact JSON*. Object framing (keys, quotes, commas) is subtracted
and the rest is shared among the free-text leaves (a ``cmd``, a ``content``, a
``query``) in proportion to `_free_text_weight`. Short natural values (paths,
city names, enums, numbers) keep their natural size, so a schema with no free
text (``get_weather(city)``) cannot reach a large target: that is deliberate,
plausibility beats size.

String content is chosen by the property name: ``cmd``/``command`` get shell
commands (``rg -n "parse" src``, chained with ``&&`` or written as a heredoc when
long), path-like names get paths, ``city``/``location`` get city names,
``code``/``content``/``patch`` get code-ish lines, everything else English-ish
words, from the tables in `sim.model.words`. All randomness comes from the ``rng``
argument.
"""

from __future__ import annotations

import copy
import math
import random
import string
from collections.abc import Callable, Sequence
from typing import Final

import numpy as np

# Sampled arrays hold at most this many items past their minimum: the server's schema check
# (prototype/wire/tool_schema.py) sizes the arguments the simulator may write with the same number.
from prototype.wire.tool_schema import EXTRA_ITEMS
from sim.model.words import (
    CITIES,
    CODE_TEMPLATES,
    COMMAND_TEMPLATES,
    DIRS,
    EXTENSIONS,
    IDENT_WORDS,
    MODULES,
    REPOS,
    WORDS,
)

__all__ = ["OPTIONAL_PROPERTY_P", "sample_json", "sample_prose"]

OPTIONAL_PROPERTY_P: Final = 0.5  # chance an optional object property is present
NULL_IN_TYPE_LIST_P: Final = 0.2  # chance of null when the type list allows null and something else
_DEPTH_LIMIT: Final = 16  # recursive schemas without $ref cannot loop, but a hostile one can nest deeply
_ONE_OF_ATTEMPTS: Final = 8  # resamples until a oneOf value matches exactly one branch
_SHORT_STRING_CHARS: Final = 24  # budget for a string leaf that gets no share of the free-text budget
_OBJECT_BRACES_CHARS: Final = 2  # "{" and "}"
_PROPERTY_FRAMING_CHARS: Final = 4  # two quotes around the key, ":" and ","
_STRING_QUOTES_CHARS: Final = 2
_HEREDOC_MIN_CHARS: Final = 240  # below this a heredoc looks silly; chain commands instead
_HEREDOC_P: Final = 0.4  # chance a long command is "write a file" rather than a command chain
_INT_DEFAULT_SPAN: Final = 100  # integers with at most one bound range over this many values

# The property names whose string values are shell commands, paths, places or code (`_string_kind`).
_COMMAND_NAMES: Final = frozenset({"cmd", "command", "commands", "shell", "script", "bash"})
_PATH_NAMES: Final = frozenset(
    {"path", "file", "filename", "file_path", "filepath", "workdir", "cwd", "dir", "directory", "root"}
)
_PLACE_NAMES: Final = frozenset({"city", "location", "place", "town"})
_CODE_NAMES: Final = frozenset({"code", "content", "contents", "patch", "input", "source", "diff", "body"})


class _Rand:
    """The samplers' random source: a `random.Random` seeded by one draw from the caller's
    numpy Generator: a `random.Random` call is much cheaper than a `Generator.integers` call,
    and argument planning makes hundreds of picks per tool call; the same Generator state
    still gives the same values."""

    __slots__ = ("_random", "_randrange", "_uniform", "random")

    def __init__(self, rng: np.random.Generator) -> None:
        r = random.Random(int(rng.integers(1 << 63)))
        self._random, self._randrange, self._uniform = r.random, r.randrange, r.uniform
        self.random: Callable[[], float] = r.random  # a float in [0, 1): the bound method itself, no wrapper call

    def integers(self, lo: int, hi: int | None = None) -> int:
        """Like `Generator.integers`: [0, lo) with one argument, else [lo, hi)."""
        return self._randrange(lo) if hi is None else self._randrange(lo, hi)

    def uniform(self, lo: float, hi: float) -> float:
        return self._uniform(lo, hi)

    def pick(self, options: Sequence[str]) -> str:
        return options[int(self._random() * len(options))]


def _rand(rng: np.random.Generator | _Rand) -> _Rand:
    return rng if isinstance(rng, _Rand) else _Rand(rng)


def _ident(rng: _Rand) -> str:
    return f"{rng.pick(IDENT_WORDS)}_{rng.pick(IDENT_WORDS)}"


def _path(rng: _Rand) -> str:
    directory = rng.pick(DIRS[1:])  # a file directly under "." reads oddly in a command
    return f"{directory}/{_ident(rng)}{rng.pick(EXTENSIONS)}"


def _test_path(rng: _Rand) -> str:
    return f"tests/test_{rng.pick(IDENT_WORDS)}.py"


def _fields(templates: tuple[str, ...]) -> tuple[frozenset[str], ...]:
    return tuple(frozenset(f for _, f, _, _ in string.Formatter().parse(t) if f) for t in templates)


_COMMAND_FIELDS: Final = _fields(COMMAND_TEMPLATES)
_CODE_FIELDS: Final = _fields(CODE_TEMPLATES)


def _command(rng: _Rand) -> str:
    k = int(rng.random() * len(COMMAND_TEMPLATES))
    need = _COMMAND_FIELDS[k]  # draw only what the template uses
    values: dict[str, object] = {}
    if "dir" in need:
        values["dir"] = rng.pick(DIRS)
    if "path" in need:
        values["path"] = _path(rng)
    if "word" in need:
        values["word"] = rng.pick(IDENT_WORDS)
    if "test" in need:
        values["test"] = _test_path(rng)
    if "n" in need:
        values["n"] = rng.integers(5, 80)
    if "a" in need:
        a = values["a"] = rng.integers(1, 200)
        values["b"] = a + rng.integers(20, 200)
    if "ext" in need:
        values["ext"] = rng.pick(EXTENSIONS)
    if "module" in need:
        values["module"] = rng.pick(MODULES)
    return COMMAND_TEMPLATES[k].format_map(values)


def _code_line(rng: _Rand) -> str:
    k = int(rng.random() * len(CODE_TEMPLATES))
    need = _CODE_FIELDS[k]
    values: dict[str, object] = {}
    if "ident" in need or "Ident" in need:
        ident = values["ident"] = _ident(rng)
        values["Ident"] = "".join(part.capitalize() for part in ident.split("_"))
    for name in ("arg", "arg2"):
        if name in need:
            values[name] = rng.pick(IDENT_WORDS)
    for name in ("word", "word2", "word3"):
        if name in need:
            values[name] = rng.pick(WORDS)
    if "n" in need:
        values["n"] = rng.integers(1, 64)
    if "module" in need:
        values["module"] = rng.pick(MODULES)
    return CODE_TEMPLATES[k].format_map(values)


def _grow(rng: _Rand, first: str, piece: Callable[[], str], sep: str, target: int) -> str:
    """Append `sep + piece()` while that keeps the length closer to `target` than stopping."""
    out = first
    while len(out) < target:
        nxt = piece()
        if len(out) + len(sep) + len(nxt) - target > target - len(out):
            break  # overshooting by more than we are short
        out = f"{out}{sep}{nxt}"
    return out


def _code(rng: _Rand, target: int) -> str:
    return _grow(rng, _code_line(rng), lambda: _code_line(rng), "\n", target)


def _shell(rng: _Rand, target: int) -> str:
    if target >= _HEREDOC_MIN_CHARS and rng.random() < _HEREDOC_P:
        head = f"cat > {_path(rng)} <<'EOF'\n"
        tail = "\nEOF"
        return head + _code(rng, target - len(head) - len(tail)) + tail
    return _grow(rng, _command(rng), lambda: _command(rng), " && ", target)


def sample_prose(rng: np.random.Generator | _Rand, target_chars: int) -> str:
    """English-ish sentences of about `target_chars` characters (at least one word).

    Words are added until the length reaches `target_chars`, so the result
    overshoots by less than one word plus a period. Sentences run 5-17 words,
    start with a capital and end with a period; an occasional word is a
    backticked identifier, as in an agent's summary of its work.
    """
    rng = _rand(rng)
    parts: list[str] = []
    length = -1  # the first word has no separating space
    left_in_sentence = 0
    while length < target_chars - 1:  # -1: the closing period
        if left_in_sentence == 0:
            if parts:
                parts[-1] += "."
                length += 1
            left_in_sentence = int(rng.integers(5, 18))
            word = rng.pick(WORDS).capitalize()
        else:
            word = f"`{_ident(rng)}`" if rng.random() < 0.05 else rng.pick(WORDS)
        parts.append(word)
        length += len(word) + 1
        left_in_sentence -= 1
    return " ".join(parts) + "."


# --- sampling ---------------------------------------------------------------------------------


def _merge(base: dict[str, object], over: dict[str, object]) -> dict[str, object]:
    """Shallow schema merge; `properties` are united and `required` lists concatenated."""
    out = dict(base)
    for key, value in over.items():
        prior = out.get(key)
        if key == "properties" and isinstance(value, dict) and isinstance(prior, dict):
            out[key] = {**prior, **value}
        elif key == "required" and isinstance(value, list) and isinstance(prior, list):
            out[key] = prior + [name for name in value if name not in prior]
        else:
            out[key] = value
    return out


def _string_kind(name: str) -> str:
    low = name.lower()
    if low in _COMMAND_NAMES:
        return "command"
    if low in _PATH_NAMES or low.endswith(("_path", "_file", "_dir")):
        return "path"
    if low in _PLACE_NAMES:
        return "place"
    if low in _CODE_NAMES:
        return "code"
    return "prose"


def _free_text_weight(schema: object, name: str, depth: int = 0) -> float:
    """How much of a size budget this subschema can usefully absorb (0 = keeps its natural size)."""
    if depth > _DEPTH_LIMIT or not isinstance(schema, dict):
        return 1.0 if schema is True or schema is None else 0.0
    if "enum" in schema or "const" in schema:
        return 0.0
    for key in ("anyOf", "oneOf"):
        branches = schema.get(key)
        if isinstance(branches, list) and branches:
            return max(_free_text_weight(b, name, depth + 1) for b in branches)
    types = schema.get("type")
    type_list = types if isinstance(types, list) else [types]
    if "object" in type_list or (types is None and "properties" in schema):
        props = schema.get("properties")
        if not isinstance(props, dict):
            return 0.0
        required = schema.get("required")
        req = set(required) if isinstance(required, list) else set()
        return sum(
            _free_text_weight(sub, key, depth + 1) * (1.0 if key in req else OPTIONAL_PROPERTY_P)
            for key, sub in props.items()
        )
    if "array" in type_list or (types is None and "items" in schema):
        return _free_text_weight(schema.get("items"), name, depth + 1)
    if any(t in type_list for t in ("integer", "number", "boolean", "null")) and "string" not in type_list:
        return 0.0
    if "format" in schema or _string_kind(name) in ("path", "place"):
        return 0.0
    return 1.0


def _fit_length(text: str, lo: int, hi: int | None, rng: _Rand) -> str:
    """Pad with words to at least `lo` code points, then cut to at most `hi`."""
    while len(text) < lo:
        text = f"{text} {rng.pick(WORDS)}" if text else rng.pick(WORDS)
    if hi is not None and len(text) > hi:
        text = text[:hi]
        stripped = text.rstrip()
        if len(stripped) >= lo:  # a trailing space left by the cut looks like a bug
            text = stripped
    return text


def _sample_string(schema: dict[str, object], name: str, rng: _Rand, target: int) -> str:
    lo = _as_int(schema.get("minLength"), 0)
    hi_raw = schema.get("maxLength")
    hi = _as_int(hi_raw, 0) if hi_raw is not None else None
    target = max(target, lo, 1)
    if hi is not None:
        target = min(target, hi)
    fmt = schema.get("format")
    text: str
    if fmt in ("date-time", "date"):
        text = f"2026-0{int(rng.integers(1, 10))}-{int(rng.integers(10, 29))}"
        if fmt == "date-time":
            text += f"T{int(rng.integers(10, 24))}:00:00Z"
    elif fmt == "email":
        text = f"{rng.pick(IDENT_WORDS)}@example.com"
    elif fmt in ("uri", "url"):
        text = f"https://example.com/{rng.pick(IDENT_WORDS)}/{rng.pick(IDENT_WORDS)}"
    elif fmt == "uuid":
        text = "-".join("".join(f"{rng.integers(16):x}" for _ in range(n)) for n in (8, 4, 4, 4, 12))
    else:
        kind = _string_kind(name)
        if kind == "command":
            text = _shell(rng, target)
        elif kind == "path":
            text = f"/workspace/{rng.pick(REPOS)}" if name.lower() in ("workdir", "cwd") else _path(rng)
        elif kind == "place":
            text = rng.pick(CITIES)
        elif kind == "code":
            text = _code(rng, target)
        else:
            text = sample_prose(rng, target)
            if target < 40:  # a short free-text field is a phrase, not a sentence
                text = text.rstrip(".")
    return _fit_length(text, lo, hi, rng)


def _as_int(value: object, default: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return default
    return int(value)


def _bounds(schema: dict[str, object]) -> tuple[float | None, bool, float | None, bool]:
    """(low, low_exclusive, high, high_exclusive) from draft-4 or draft-6+ spellings."""

    def num(key: str) -> float | None:
        value = schema.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float):
            return None
        return float(value)

    lo, hi = num("minimum"), num("maximum")
    lo_x = hi_x = False
    if schema.get("exclusiveMinimum") is True:
        lo_x = True
    elif (x := num("exclusiveMinimum")) is not None and (lo is None or x >= lo):
        lo, lo_x = x, True
    if schema.get("exclusiveMaximum") is True:
        hi_x = True
    elif (x := num("exclusiveMaximum")) is not None and (hi is None or x <= hi):
        hi, hi_x = x, True
    return lo, lo_x, hi, hi_x


_TIMEOUT_MS_CHOICES: Final = (1_000, 5_000, 10_000, 30_000, 60_000, 120_000)


def _sample_integer(schema: dict[str, object], name: str, rng: _Rand) -> int:
    lo_f, lo_x, hi_f, hi_x = _bounds(schema)
    lo = None if lo_f is None else (math.floor(lo_f) + 1 if lo_x else math.ceil(lo_f))
    hi = None if hi_f is None else (math.ceil(hi_f) - 1 if hi_x else math.floor(hi_f))
    low_name = name.lower()
    if "timeout" in low_name and low_name.endswith("ms"):
        # Codex's exec_command: round millisecond timeouts read as real ones.
        fits = [v for v in _TIMEOUT_MS_CHOICES if (lo is None or v >= lo) and (hi is None or v <= hi)]
        if fits:
            return fits[int(rng.integers(len(fits)))]
    if lo is None and hi is None:
        lo, hi = 0, _INT_DEFAULT_SPAN
    elif lo is None:
        assert hi is not None
        lo = max(0, hi - _INT_DEFAULT_SPAN) if hi >= 0 else hi - _INT_DEFAULT_SPAN  # counts are >= 0
    elif hi is None:
        hi = lo + _INT_DEFAULT_SPAN
    if hi < lo:
        raise ValueError(f"integer schema for {name!r} admits no value: {schema!r}")
    return int(rng.integers(lo, hi + 1))


def _sample_number(schema: dict[str, object], name: str, rng: _Rand) -> float:
    lo, lo_x, hi, hi_x = _bounds(schema)
    if lo is None and hi is None:
        lo, hi = 0.0, float(_INT_DEFAULT_SPAN)
    elif lo is None:
        assert hi is not None
        lo = hi - _INT_DEFAULT_SPAN
    elif hi is None:
        hi = lo + _INT_DEFAULT_SPAN
    if hi < lo or (hi == lo and (lo_x or hi_x)):
        raise ValueError(f"number schema for {name!r} admits no value: {schema!r}")
    value = round(float(rng.uniform(lo, hi)), 3)  # three decimals read like a model's number
    value = min(max(value, lo), hi)
    if (lo_x and value <= lo) or (hi_x and value >= hi):
        value = (lo + hi) / 2  # strictly inside an open interval
    return value


def _sample(schema: object, name: str, rng: _Rand, target: int, depth: int) -> object:
    if schema is False:
        raise ValueError(f"schema for {name or '$'!r} is false: no value is valid")
    if not isinstance(schema, dict) or depth > _DEPTH_LIMIT:
        return _sample_string({}, name, rng, target)
    if "const" in schema:
        return copy.deepcopy(schema["const"])
    enum = schema.get("enum")
    if isinstance(enum, list) and enum:
        return copy.deepcopy(enum[int(rng.integers(len(enum)))])
    all_of = schema.get("allOf")
    if isinstance(all_of, list):
        merged: dict[str, object] = {k: v for k, v in schema.items() if k != "allOf"}
        for sub in all_of:
            if isinstance(sub, dict):
                merged = _merge(merged, sub)
        return _sample(merged, name, rng, target, depth + 1)
    for key in ("oneOf", "anyOf"):
        branches = schema.get(key)
        if isinstance(branches, list) and branches:
            parent = {k: v for k, v in schema.items() if k != key}
            value: object = None
            # Branches in a random order, taken in turn: a branch whose values always match
            # another one too (an enum inside a plain type) cannot use up every attempt.
            order = sorted(range(len(branches)), key=lambda _: rng.random())
            for attempt in range(_ONE_OF_ATTEMPTS if key == "oneOf" else 1):
                branch = branches[order[attempt % len(order)]]
                sub = _merge(parent, branch) if isinstance(branch, dict) else branch
                value = _sample(sub, name, rng, target, depth + 1)
                if key == "anyOf" or sum(_matches(b, value) for b in branches) == 1:
                    break
            return value
    types = schema.get("type")
    if isinstance(types, list):
        known = [t for t in types if isinstance(t, str)]
        non_null = [t for t in known if t != "null"]
        if not non_null:
            return None if "null" in known else _sample_string(schema, name, rng, target)
        if "null" in known and rng.random() < NULL_IN_TYPE_LIST_P:
            return None
        return _sample({**schema, "type": rng.pick(non_null)}, name, rng, target, depth + 1)
    if types is None:
        if "properties" in schema or "required" in schema:
            types = "object"
        elif "items" in schema:
            types = "array"
    if types == "object":
        return _sample_object(schema, rng, target, depth)
    if types == "array":
        return _sample_array(schema, name, rng, target, depth)
    if types == "integer":
        return _sample_integer(schema, name, rng)
    if types == "number":
        return _sample_number(schema, name, rng)
    if types == "boolean":
        return bool(rng.random() < 0.5)
    if types == "null":
        return None
    return _sample_string(schema, name, rng, max(target - _STRING_QUOTES_CHARS, 1))


def _sample_object(schema: dict[str, object], rng: _Rand, target: int, depth: int) -> object:
    props_raw = schema.get("properties")
    props: dict[str, object] = props_raw if isinstance(props_raw, dict) else {}
    required_raw = schema.get("required")
    required = [r for r in required_raw if isinstance(r, str)] if isinstance(required_raw, list) else []
    # Keep the schema's property order (it is how models write them), then any
    # required name the schema forgot to describe.
    names = [key for key in props if key in required or rng.random() < OPTIONAL_PROPERTY_P] + [
        r for r in required if r not in props
    ]
    weights = [_free_text_weight(props.get(key, True), key, depth + 1) for key in names]
    framing = _OBJECT_BRACES_CHARS + sum(len(key) + _PROPERTY_FRAMING_CHARS for key in names)
    free = max(target - framing, 0)
    total_weight = sum(weights)
    out: dict[str, object] = {}
    for key, weight in zip(names, weights, strict=True):
        share = int(free * weight / total_weight) if weight > 0 else _SHORT_STRING_CHARS
        out[key] = _sample(props.get(key, True), key, rng, max(share, 1), depth + 1)
    return out


def _sample_array(schema: dict[str, object], name: str, rng: _Rand, target: int, depth: int) -> list[object]:
    lo = max(_as_int(schema.get("minItems"), 0), 0)
    hi_raw = schema.get("maxItems")
    hi = _as_int(hi_raw, 0) if hi_raw is not None else lo + EXTRA_ITEMS
    if hi < lo:
        raise ValueError(f"array schema for {name!r} admits no value: {schema!r}")
    first = min(max(lo, 1), hi)  # an empty list is legal but a dull argument
    # A few items past the minimum: a huge `maxItems` must not make a huge argument.
    n = int(rng.integers(first, min(hi, first + EXTRA_ITEMS) + 1))
    items = schema.get("items", True)
    singular = name[:-1] if name.endswith("s") and len(name) > 1 else name  # "paths" items are paths
    share = max((target - 2) // max(n, 1) - 1, 1)
    return [_sample(items, singular, rng, share, depth + 1) for _ in range(n)]


def sample_json(schema: object, rng: np.random.Generator, *, target_chars: int = 80) -> object:
    """Sample a JSON value (dict/list/str/int/float/bool/None) valid against `schema`.

    `schema` is a decoded JSON Schema (e.g. ``msgspec.json.decode(tool.parameters_json)``).
    The result is valid against every schema in the subset described in the module
    docstring (the tests check it with the `jsonschema` library); a schema that admits no
    value (``false``, ``minimum > maximum``, ``minItems > maxItems``) raises
    `ValueError`. `target_chars` is the wanted length of the compact JSON
    encoding; see the module docstring for how it is shared out. Deterministic
    given the state of `rng`.
    """
    return _sample(schema, "", _Rand(rng), max(int(target_chars), 1), 0)


# --- the oneOf check -------------------------------------------------------------------------


def _json_equal(a: object, b: object) -> bool:
    """JSON equality: unlike Python, ``true != 1`` and ``1 == 1.0``."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_json_equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_json_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, int | float) and isinstance(b, int | float):
        return a == b
    return type(a) is type(b) and a == b


def _type_matches(type_name: str, value: object) -> bool:
    if type_name == "object":
        return isinstance(value, dict)
    if type_name == "array":
        return isinstance(value, list)
    if type_name == "string":
        return isinstance(value, str)
    if type_name == "boolean":
        return isinstance(value, bool)
    if type_name == "null":
        return value is None
    if type_name == "integer":
        return not isinstance(value, bool) and (
            isinstance(value, int) or (isinstance(value, float) and value.is_integer())
        )
    if type_name == "number":
        return not isinstance(value, bool) and isinstance(value, int | float)
    return True  # an unknown type name is not checked (see the module docstring)


def _matches(schema: object, value: object, depth: int = 0) -> bool:
    """Whether `value` is valid against `schema`, as far as the subset the sampler understands
    tells (keywords outside it pass). A sampled ``oneOf`` value must match exactly one branch,
    and this decides which do: the sampler's retries, and so its output for a seed, follow it.
    Tests check the sampler against the `jsonschema` library instead."""
    if schema is False:
        return False
    if not isinstance(schema, dict) or depth > _DEPTH_LIMIT:
        return True
    if "const" in schema and not _json_equal(schema["const"], value):
        return False
    enum = schema.get("enum")
    if isinstance(enum, list) and not any(_json_equal(e, value) for e in enum):
        return False
    types = schema.get("type")
    if isinstance(types, str | list):
        names = [types] if isinstance(types, str) else [t for t in types if isinstance(t, str)]
        if names and not any(_type_matches(t, value) for t in names):
            return False
    all_of = schema.get("allOf")
    if isinstance(all_of, list) and not all(_matches(sub, value, depth + 1) for sub in all_of):
        return False
    # A branch of anyOf or oneOf is checked from depth 0: the depth limit counts within a branch.
    any_of = schema.get("anyOf")
    if isinstance(any_of, list) and any_of and not any(_matches(b, value) for b in any_of):
        return False
    one_of = schema.get("oneOf")
    if isinstance(one_of, list) and one_of and sum(_matches(b, value) for b in one_of) != 1:
        return False
    if isinstance(value, str):
        min_len, max_len = schema.get("minLength"), schema.get("maxLength")
        return not (
            (isinstance(min_len, int) and len(value) < min_len) or (isinstance(max_len, int) and len(value) > max_len)
        )
    if isinstance(value, int | float) and not isinstance(value, bool):
        lo, lo_x, hi, hi_x = _bounds(schema)
        return not (
            (lo is not None and (value < lo or (lo_x and value == lo)))
            or (hi is not None and (value > hi or (hi_x and value == hi)))
        )
    if isinstance(value, dict):
        props_raw = schema.get("properties")
        props: dict[str, object] = props_raw if isinstance(props_raw, dict) else {}
        required = schema.get("required")
        if isinstance(required, list) and any(isinstance(name, str) and name not in value for name in required):
            return False
        additional = schema.get("additionalProperties", True)
        for key, item in value.items():
            if key in props:
                if not _matches(props[key], item, depth + 1):
                    return False
            elif additional is False or not _matches(additional, item, depth + 1):
                return False
        return True
    if isinstance(value, list):
        min_items, max_items = schema.get("minItems"), schema.get("maxItems")
        if (isinstance(min_items, int) and len(value) < min_items) or (
            isinstance(max_items, int) and len(value) > max_items
        ):
            return False
        items = schema.get("items")
        return not isinstance(items, dict | bool) or all(_matches(items, item, depth + 1) for item in value)
    return True
