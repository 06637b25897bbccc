"""Structural checks of a function tool's `parameters` JSON Schema.

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
  levels of nesting; this is looser), and arguments that the schema *forces*
  to be large (`minLength`, `minItems` of required parts) stay under
  `MAX_FORCED_CHARS`.

Everything else (`$ref`, `format`, `pattern`, unknown keywords) passes through.
"""

from __future__ import annotations

import math
from typing import Final

from .errors import ProtocolError

__all__ = ["MAX_BOUND", "MAX_DEPTH", "MAX_FORCED_CHARS", "check_parameters"]

JSON_TYPES: Final = frozenset({"object", "string", "integer", "number", "boolean", "array", "null"})
MAX_DEPTH: Final = 32
MAX_BOUND: Final = 1e15  # numeric bounds beyond this are refused (the sampler works in int64 / float)
MAX_FORCED_CHARS: Final = 1 << 20  # the smallest valid arguments may be at most 1 MiB of JSON
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
        forced = _check(schema, "", 0)
        if forced > MAX_FORCED_CHARS:
            raise _Invalid("", f"the smallest valid arguments would exceed {MAX_FORCED_CHARS} characters")
    except _Invalid as bad:
        at = f" at '{bad.where}'" if bad.where else ""
        raise ProtocolError(
            f"Invalid schema for function '{function}'{at}: {bad.reason}.",
            code="invalid_function_parameters",
            param=param,
        ) from None


def _check(node: object, where: str, depth: int) -> int:
    """Check one subschema; return a lower bound on its values' JSON length."""
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
    forced = _forced_by_branches(node, at, depth)
    props = node.get("properties", {})
    if not isinstance(props, dict):
        raise _Invalid(f"{at}properties", "'properties' must be an object of schemas")
    required = set(node.get("required", ()))
    object_size = 2
    for name, sub in props.items():
        size = _check(sub, f"{at}properties.{name}", depth + 1)
        if name in required:
            object_size += len(name) + 4 + size
    items = node.get("items", True)
    subs = items if isinstance(items, list) else [items]
    item_size = max((_check(sub, f"{at}items", depth + 1) for sub in subs), default=1)
    if "enum" in node or "const" in node:
        return forced
    kind = types if isinstance(types, str) else None
    if kind == "object" or (kind is None and ("properties" in node or "required" in node)):
        forced = max(forced, object_size)
    elif kind == "array" or (kind is None and "items" in node):
        forced = max(forced, 2 + (_count(node, "minItems", at) or 0) * (item_size + 1))
    elif kind == "string":
        forced = max(forced, 2 + (_count(node, "minLength", at) or 0))
    return min(forced, MAX_FORCED_CHARS + 1)


def _forced_by_branches(node: dict[str, object], at: str, depth: int) -> int:
    forced = 1
    for key in _SCHEMA_LISTS:
        if key not in node:
            continue
        branches = node[key]
        if not isinstance(branches, list) or not branches:
            raise _Invalid(f"{at}{key}", f"'{key}' must be a non-empty list of schemas")
        sizes = [_check(sub, f"{at}{key}[{i}]", depth + 1) for i, sub in enumerate(branches)]
        forced = max(forced, max(sizes) if key == "allOf" else min(sizes))
    return forced


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
