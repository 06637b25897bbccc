"""Structural checks of a function tool's `parameters` JSON Schema, and the tools as a response
echoes them (`echo_tools`).

The real API refuses a broken schema with 400 `invalid_function_parameters`
before any inference; so does this server, instead of letting the simulator
trip over it mid-stream (a 500). Checked, at every subschema:

* a subschema is an object (or `true`); `false` only as `additionalProperties`;
* `type` is one of the seven JSON types, or a non-empty list of them; the root
  is `type: "object"` (or untyped);
* `properties` is an object of subschemas; `required` a list of strings;
  `items` a subschema or a list of them; `anyOf`/`oneOf`/`allOf` non-empty lists;
  `enum` a non-empty list;
* size bounds (`minLength`, `maxItems`, …) are non-negative integers, numeric
  bounds finite numbers within ±`MAX_BOUND`, each min no greater than its max,
  and an integer range holds an integer;
* at most `MAX_DEPTH` nested subschemas (the real API's strict-mode limit is 10
  levels of nesting; this is looser), the schema's JSON (unknown keywords included)
  at most `MAX_NESTING` arrays and objects deep (so every later reader, the
  simulator's included, decodes it at any stack depth), and the arguments the simulator may write
  for the schema (every property, `minLength`, `minItems` plus a few items, the
  largest branch) stay under `MAX_ARGUMENT_CHARS`: a schema that asks for more
  would make the model write megabytes.

Everything else (`$ref`, `format`, `pattern`, unknown keywords) passes through.
"""

from __future__ import annotations

import math
from typing import Final

import msgspec
from msgspec import Raw

from .errors import ProtocolError
from .schemas import encode

__all__ = [
    "EXTRA_ITEMS",
    "MAX_ARGUMENT_CHARS",
    "MAX_BOUND",
    "MAX_DEPTH",
    "MAX_NESTING",
    "check_parameters",
    "echo_tools",
    "strict_compatible",
]

JSON_TYPES: Final = frozenset({"object", "string", "integer", "number", "boolean", "array", "null"})
MAX_DEPTH: Final = 32
MAX_NESTING: Final = 128  # JSON arrays/objects inside `parameters`, wherever they are
MAX_BOUND: Final = 1e15  # numeric bounds beyond this are refused (the sampler works in int64 / float)
MAX_ARGUMENT_CHARS: Final = 1 << 20  # the arguments the simulator may write for a schema: at most 1 MiB of JSON
# How the simulator samples (sim/model/schema_values.py), for the size estimate: a string leaf is about
# this long past its `minLength`, and an array holds at most this many items past `minItems`.
_LEAF_CHARS: Final = 26
EXTRA_ITEMS: Final = 3
_SIZE_PAIRS: Final = (("minLength", "maxLength"), ("minItems", "maxItems"), ("minProperties", "maxProperties"))
_SCHEMA_LISTS: Final = ("anyOf", "oneOf", "allOf")


class _Invalid(Exception):
    def __init__(self, where: str, reason: str) -> None:
        super().__init__(reason)
        self.where = where
        self.reason = reason


def check_parameters(schema: object, *, function: str, param: str) -> None:
    """Raise a 400 `invalid_function_parameters` naming the broken keyword."""
    try:
        if not isinstance(schema, dict):
            raise _Invalid("", "schema must be a JSON Schema of 'type: \"object\"'")
        if schema.get("type", "object") != "object":
            raise _Invalid("type", "schema must be a JSON Schema of 'type: \"object\"'")
        if _nesting(schema) > MAX_NESTING:
            raise _Invalid("", f"its JSON nests deeper than {MAX_NESTING} arrays and objects")
        if _check(schema, "", 0) > MAX_ARGUMENT_CHARS:
            raise _Invalid("", f"arguments for it can be longer than {MAX_ARGUMENT_CHARS} characters")
    except _Invalid as bad:
        at = f" at '{bad.where}'" if bad.where else ""
        raise ProtocolError(
            f"Invalid schema for function '{function}'{at}: {bad.reason}.",
            code="invalid_function_parameters",
            param=param,
        ) from None


def _nesting(value: object) -> int:
    """How many arrays and objects deep `value` goes (without recursion: it may be deep)."""
    deepest = 0
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        if deepest > MAX_NESTING:
            break
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return deepest


def _check(node: object, where: str, depth: int) -> int:
    """Check one subschema; return an estimate of the longest JSON the simulator writes for it."""
    if node is True:
        return 1
    if node is False:
        raise _Invalid(where, "a 'false' schema admits no value")
    if not isinstance(node, dict):
        raise _Invalid(where, "a schema must be a JSON object")
    if depth > MAX_DEPTH:
        raise _Invalid(where, f"schemas nest deeper than {MAX_DEPTH} levels")
    at = f"{where}." if where else ""
    types = node.get("type")
    if types is not None:
        names = types if isinstance(types, list) else [types]
        if not names or not all(isinstance(t, str) and t in JSON_TYPES for t in names):
            raise _Invalid(f"{at}type", "'type' must be one of " + ", ".join(sorted(JSON_TYPES)) + ", or a list")
    for lo_key, hi_key in _SIZE_PAIRS:
        lo = _count(node, lo_key, at)
        hi = _count(node, hi_key, at)
        if lo is not None and hi is not None and lo > hi:
            raise _Invalid(f"{at}{lo_key}", f"'{lo_key}' is greater than '{hi_key}'")
    _check_numbers(node, at, types)
    if "enum" in node and not (isinstance(node["enum"], list) and node["enum"]):
        raise _Invalid(f"{at}enum", "'enum' must be a non-empty list")
    if "required" in node and not (
        isinstance(node["required"], list) and all(isinstance(r, str) for r in node["required"])
    ):
        raise _Invalid(f"{at}required", "'required' must be a list of property names")
    extra = node.get("additionalProperties", True)
    if isinstance(extra, dict):
        _check(extra, f"{at}additionalProperties", depth + 1)
    elif not isinstance(extra, bool):
        raise _Invalid(f"{at}additionalProperties", "'additionalProperties' must be a boolean or a schema")
    size = _branches_size(node, at, depth)
    props = node.get("properties", {})
    if not isinstance(props, dict):
        raise _Invalid(f"{at}properties", "'properties' must be an object of schemas")
    object_size = 2 + sum(
        len(name) + 4 + _check(sub, f"{at}properties.{name}", depth + 1) for name, sub in props.items()
    )
    object_size += sum(len(name) + 4 + _LEAF_CHARS for name in set(node.get("required", ())) - set(props))
    items = node.get("items", True)
    subs = items if isinstance(items, list) else [items]
    item_size = max((_check(sub, f"{at}items", depth + 1) for sub in subs), default=1)
    if "enum" in node or "const" in node:
        return size  # a value from the schema itself: bounded by the request
    names = types if isinstance(types, list) else [types]
    size = max(size, _LEAF_CHARS + (_count(node, "minLength", at) or 0))
    if "object" in names or "properties" in node or "required" in node:
        size = max(size, object_size)
    if "array" in names or "items" in node:
        most = max(_count(node, "minItems", at) or 0, 1) + EXTRA_ITEMS
        size = max(size, 2 + most * (item_size + 1))
    return min(size, MAX_ARGUMENT_CHARS + 1)


def _branches_size(node: dict[str, object], at: str, depth: int) -> int:
    size = 1
    for key in _SCHEMA_LISTS:
        if key not in node:
            continue
        branches = node[key]
        if not isinstance(branches, list) or not branches:
            raise _Invalid(f"{at}{key}", f"'{key}' must be a non-empty list of schemas")
        size = max(size, *(_check(sub, f"{at}{key}[{i}]", depth + 1) for i, sub in enumerate(branches)))
    return size


def _count(node: dict[str, object], key: str, at: str) -> int | None:
    value = node.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value) or value < 0:
        raise _Invalid(f"{at}{key}", f"'{key}' must be a non-negative integer")
    return int(value)


def _check_numbers(node: dict[str, object], at: str, types: object) -> None:
    bounds: dict[str, float] = {}
    for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
        value = node.get(key)
        if value is None or (isinstance(value, bool) and key.startswith("exclusive")):
            continue  # draft-4 exclusive flags are booleans
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _Invalid(f"{at}{key}", f"'{key}' must be a number")
        if not math.isfinite(value) or abs(value) > MAX_BOUND:
            raise _Invalid(f"{at}{key}", f"'{key}' must be a finite number within ±{MAX_BOUND:g}")
        bounds[key] = float(value)
    lo, hi = bounds.get("minimum"), bounds.get("maximum")
    lo_x = node.get("exclusiveMinimum") is True
    hi_x = node.get("exclusiveMaximum") is True
    if (x := bounds.get("exclusiveMinimum")) is not None and (lo is None or x >= lo):
        lo, lo_x = x, True
    if (x := bounds.get("exclusiveMaximum")) is not None and (hi is None or x <= hi):
        hi, hi_x = x, True
    if lo is None or hi is None:
        return
    if lo > hi or (lo == hi and (lo_x or hi_x)):
        raise _Invalid(f"{at}minimum", "the numeric bounds admit no value")
    if types == "integer" or (isinstance(types, list) and "integer" in types):
        lo_i = math.floor(lo) + 1 if lo_x else math.ceil(lo)
        hi_i = math.ceil(hi) - 1 if hi_x else math.floor(hi)
        if lo_i > hi_i:
            raise _Invalid(f"{at}minimum", "the numeric bounds admit no integer")


def strict_compatible(schema: object) -> bool:
    """Whether a function's `parameters` can be enforced strictly, as the Structured Outputs
    guide states strict mode's rules: every object schema sets `additionalProperties: false` and
    requires each of its properties. The spec's `FunctionToolParam.strict`: omitted, the API
    uses strict validation when the schema allows it and non-strict otherwise. Only a schema
    `check_parameters` accepted reaches here."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        props = node.get("properties")
        if node.get("type") == "object" or isinstance(props, dict):
            if node.get("additionalProperties", True) is not False:
                return False
            if isinstance(props, dict):
                if set(node.get("required") or ()) != set(props):
                    return False
                stack.extend(props.values())
        items = node.get("items")
        stack.extend(items if isinstance(items, list) else [items])
        for key in _SCHEMA_LISTS:
            stack.extend(node.get(key) or ())
        for key in ("$defs", "definitions"):
            defs = node.get(key)
            if isinstance(defs, dict):
                stack.extend(defs.values())
    return True


def echo_tools(tools_raw: tuple[Raw, ...]) -> tuple[Raw, ...]:
    """The tools as a response echoes them: as sent, except that a function tool gets the
    fields the spec's `FunctionTool` requires and a client may omit, with the values the API
    states: `parameters` null, `strict` whether the schema allows strict mode
    (`strict_compatible`; null without a schema). The list is already validated."""
    out = []
    for raw in tools_raw:
        data = bytes(raw)
        if b'"strict"' in data and b'"parameters"' in data:
            out.append(raw)  # nothing to fill in (a false hit only costs the decode below)
            continue
        tool = msgspec.json.decode(data)
        if not isinstance(tool, dict) or tool.get("type") != "function":
            out.append(raw)
            continue
        tool.setdefault("parameters", None)
        if tool.get("strict") is None and tool["parameters"] is not None:
            tool["strict"] = strict_compatible(tool["parameters"])
        tool.setdefault("strict", None)
        out.append(Raw(encode(tool)))
    return tuple(out)
