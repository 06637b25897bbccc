"""The spec's constraints on request values, walked generically: input items and tools.

The request schemas of the pinned OpenAI spec (`prototype/data/openapi-request.json`, extracted by
tests/data/extract_openapi.py) state `minimum`, `maximum`, `minLength`, `maxLength`, `minItems`,
`maxItems` and `enum` on the fields of every input item and tool. `violation` walks a decoded
value against its schema and returns the first constraint it breaks, as the real API names it
(code by the kind of constraint, `param` the value's path), or None. It checks constraints only:
types, required and unknown fields are the decoders' and `context/conversation.py`'s rules. A union's
`type` is an enum too: a `type` no variant has is `invalid_value` at `….type`; item and tool
types the spec lists but the simulator does not implement pass (docs/contract.md). Where a
union's variants differ, the value passes if one plausible variant accepts it (`_candidates`):
the spec is stricter than the API about which fields a replayed item carries.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any, Final

from .errors import ProtocolError

__all__ = ["SCHEMAS", "violation"]

_PREFIX: Final = "#/components/schemas/"
_JSON_TYPES: Final = {
    "object": dict,
    "array": list,
    "string": str,
    "boolean": bool,
    "null": type(None),
}


def _load() -> dict[str, Any]:
    text = resources.files("prototype").joinpath("data/openapi-request.json").read_text(encoding="utf-8")
    schemas: dict[str, Any] = json.loads(text)["components"]["schemas"]
    return schemas


SCHEMAS: Final = _load()


def _resolve(node: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in node:
        node = SCHEMAS[node["$ref"][len(_PREFIX) :]]
    return node


def _fits(node: dict[str, Any], value: object) -> bool:
    """Whether `value`'s JSON type is one `node` allows (no `type`: any)."""
    kind = node.get("type")
    if kind is None:
        return True
    kinds = kind if isinstance(kind, list) else [kind]
    for k in kinds:
        if k == "integer" and isinstance(value, int) and not isinstance(value, bool):
            return True
        if k == "number" and isinstance(value, int | float) and not isinstance(value, bool):
            return True
        if k in _JSON_TYPES and isinstance(value, _JSON_TYPES[k]):  # a bool is none of the others
            return True
    return False


def _tag_values(tag: dict[str, Any] | None) -> frozenset[str] | None:
    if tag is None:
        return None
    tag = _resolve(tag)
    if "const" in tag:
        return frozenset({tag["const"]})
    if "enum" in tag:
        return frozenset(v for v in tag["enum"] if isinstance(v, str))
    values = [_tag_values(a) for a in tag.get("anyOf") or tag.get("oneOf") or ()]  # e.g. an enum or null
    found = frozenset().union(*(v for v in values if v))
    return found or None


# The schemas never change: what is derived from a node is kept by the node's identity.
_PROPERTIES: dict[int, dict[str, Any]] = {}
_REQUIRED: dict[int, frozenset[str]] = {}
_FLAT: dict[int, list[dict[str, Any]]] = {}
_TAGS: dict[int, frozenset[str] | None] = {}


def _properties(node: dict[str, Any]) -> dict[str, Any]:
    found = _PROPERTIES.get(id(node))
    if found is None:
        inner = _resolve(node)
        found = dict(inner.get("properties", {}))
        for part in inner.get("allOf", []):
            found.update(_properties(part))
        _PROPERTIES[id(node)] = found
    return found


def _tags(node: dict[str, Any]) -> frozenset[str] | None:
    """The `type` values a variant admits (its `type` property's const or enum)."""
    key = id(node)
    if key not in _TAGS:
        _TAGS[key] = _tag_values(_properties(node).get("type"))  # `_properties` follows a `$ref`
    return _TAGS[key]


def _flatten(alternatives: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A union's variants, nested unions spread out (their `$ref`s kept, for the tags)."""
    found = _FLAT.get(id(alternatives))
    if found is None:
        found = _FLAT[id(alternatives)] = _spread(alternatives)
    return found


def _spread(alternatives: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for alt in alternatives:
        inner = _resolve(alt)
        nested = inner.get("anyOf") or inner.get("oneOf")
        if nested and not inner.get("properties"):
            out.extend(_flatten(nested))
        else:
            out.append(alt)
    return out


def _required(node: dict[str, Any]) -> frozenset[str]:
    found = _REQUIRED.get(id(node))
    if found is None:
        inner = _resolve(node)
        need = set(inner.get("required", []))
        for part in inner.get("allOf", []):
            need |= _required(part)
        found = _REQUIRED[id(node)] = frozenset(need)
    return found


# A union's candidates depend on the value's shape only (JSON types, field names and their types,
# its `type`), and a conversation sends the same few shapes again and again: kept by the shape.
# Module state in the sans-IO core, on purpose: a memo of a pure function of the pinned schemas
# (loaded once per process, never changed) and the shape, so no caller can see another's entries
# except through speed, every connection and test shares the same answers, and a size bound keeps
# it from growing with what clients invent (as `re` keeps its compiled patterns).
_CANDIDATES: dict[tuple[int, object], list[dict[str, Any]] | None] = {}
_CANDIDATES_MAX: Final = 4096  # shapes kept at most (a request may invent new ones; the table is cleared then)


def _shape(value: object) -> object:
    """What `_candidates` reads of `value`: its JSON type and, for an object, its `type` (a string)
    and its fields with their JSON types."""
    if not isinstance(value, dict):
        return type(value)
    tag = value.get("type")
    return (tag if isinstance(tag, str) else None, frozenset((k, type(v)) for k, v in value.items()))


def _candidates(alternatives: list[dict[str, Any]], value: object) -> list[dict[str, Any]] | None:
    key = (id(alternatives), _shape(value))  # `alternatives` are the schema's, alive as long as it is
    if key in _CANDIDATES:
        return _CANDIDATES[key]
    if len(_CANDIDATES) >= _CANDIDATES_MAX:
        _CANDIDATES.clear()
    found = _CANDIDATES[key] = _find_candidates(alternatives, value)
    return found


def _find_candidates(alternatives: list[dict[str, Any]], value: object) -> list[dict[str, Any]] | None:
    """The variants `value` may be: those of its JSON type and, for an object, of its `type`,
    whose fields' types its fields have, and that name at least one of its other fields. Any of
    them may accept it (the API does not hold a replayed item to every field its variant lists
    or requires); the likeliest first, whose error is the one reported: those that name all its
    fields, then those whose required fields it has. None: its `type` names no variant."""
    tag = value.get("type") if isinstance(value, dict) else None
    if isinstance(tag, str):
        by_tag, any_tag = _tag_index(alternatives)
        tagged = by_tag.get(tag)
        if tagged is None and any_tag:
            return None
        alternatives = tagged or alternatives
    fitting = [a for a in alternatives if _fits(_resolve(a), value)]
    if not isinstance(value, dict):
        return fitting
    fitting = [a for a in fitting if _fields_fit(a, value)] or fitting
    own = value.keys() - {"type"}
    if own:
        fitting = [a for a in fitting if own & _properties(a).keys()] or fitting

    def rank(a: dict[str, Any]) -> int:
        named = value.keys() <= _properties(a).keys()
        return (0 if named else 2) + (0 if _required(a) <= value.keys() else 1)

    return sorted(fitting, key=rank)


_TAG_INDEX: dict[int, tuple[dict[str, list[dict[str, Any]]], bool]] = {}


def _tag_index(alternatives: list[dict[str, Any]]) -> tuple[dict[str, list[dict[str, Any]]], bool]:
    """A union's variants by the `type` values they admit, and whether any admits one."""
    found = _TAG_INDEX.get(id(alternatives))
    if found is None:
        index: dict[str, list[dict[str, Any]]] = {}
        for alt in alternatives:
            for tag in _tags(alt) or ():
                index.setdefault(tag, []).append(alt)
        found = _TAG_INDEX[id(alternatives)] = (index, bool(index))
    return found


def _fields_fit(node: dict[str, Any], value: dict[str, Any]) -> bool:
    """Whether each field of `value` that `node` names has a JSON type the field's schema allows."""
    props = _properties(node)
    for key, field in value.items():
        sub = props.get(key)
        if sub is None:
            continue
        sub = _resolve(sub)
        alts = (
            _flatten(sub["anyOf"] if "anyOf" in sub else sub["oneOf"]) if ("anyOf" in sub or "oneOf" in sub) else [sub]
        )
        if not any(_fits(_resolve(a), field) for a in alts):
            return False
    return True


def _supported(values: list[object]) -> str:
    quoted = [f"'{v}'" for v in values]
    return " and ".join(quoted) if len(quoted) <= 2 else ", ".join(quoted[:-1]) + ", and " + quoted[-1]


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(value)


def _length(node: dict[str, Any], n: int, path: str, noun: str, keys: tuple[str, str]) -> ProtocolError | None:
    """A string's or an array's length against `minLength`/`maxLength` or `minItems`/`maxItems`."""
    a = "an" if noun == "array" else "a"
    low, high = (node.get(k) for k in keys)
    if high is not None and n > high:
        return ProtocolError(
            f"Invalid '{path}': {noun} too long. Expected {a} {noun} with maximum length {high}, "
            f"but got {a} {noun} with length {n} instead.",
            code=f"{noun}_above_max_length",
            param=path,
        )
    if low is not None and n < low:
        if low == 1:
            return ProtocolError(
                f"Invalid '{path}': empty {noun}. Expected {a} {noun} with minimum length 1, "
                f"but got an empty {noun} instead.",
                code=f"empty_{noun}",
                param=path,
            )
        return ProtocolError(
            f"Invalid '{path}': {noun} too short. Expected {a} {noun} with minimum length {low}, "
            f"but got {a} {noun} with length {n} instead.",
            code=f"{noun}_below_min_length",
            param=path,
        )
    return None


def _own(node: dict[str, Any], value: object, path: str) -> ProtocolError | None:
    """`node`'s own constraints on `value` (one level, no descent)."""
    if "enum" in node and value not in node["enum"]:
        return ProtocolError(
            f"Invalid value: '{value}'. Supported values are: {_supported(node['enum'])}.",
            code="invalid_value",
            param=path,
        )
    if isinstance(value, str):
        return _length(node, len(value), path, "string", ("minLength", "maxLength"))
    if isinstance(value, list):
        return _length(node, len(value), path, "array", ("minItems", "maxItems"))
    if isinstance(value, int | float) and not isinstance(value, bool):
        kind = "integer" if node.get("type") == "integer" else "decimal"
        if "minimum" in node and value < node["minimum"]:
            return ProtocolError(
                f"Invalid '{path}': {kind} below minimum value. Expected a value >= {_num(node['minimum'])}, "
                f"but got {_num(value)} instead.",
                code=f"{kind}_below_min_value",
                param=path,
            )
        if "maximum" in node and value > node["maximum"]:
            return ProtocolError(
                f"Invalid '{path}': {kind} above maximum value. Expected a value <= {_num(node['maximum'])}, "
                f"but got {_num(value)} instead.",
                code=f"{kind}_above_max_value",
                param=path,
            )
    return None


def violation(node: dict[str, Any], value: object, path: str, depth: int = 0) -> ProtocolError | None:
    """The first constraint of `node` that `value` breaks, named at `path`; None if it meets them."""
    if depth > 64:
        return None  # deeper than any schema of the spec: a value only (the decoders bound nesting)
    node = _resolve(node)
    alternatives = node.get("anyOf") or node.get("oneOf")
    if alternatives:
        variants = _flatten(alternatives)
        candidates = _candidates(variants, value)
        if candidates is None:  # a `type` no variant has: the union's discriminator is an enum too
            assert isinstance(value, dict)
            tags = sorted({t for a in variants for t in (_tags(a) or ())})
            return _own({"enum": tags}, value["type"], f"{path}.type")
        first: ProtocolError | None = None
        for alt in candidates:
            err = violation(alt, value, path, depth + 1)
            if err is None:
                return None
            first = first or err
        return first
    for part in node.get("allOf", []):
        err = violation(part, value, path, depth + 1)
        if err is not None:
            return err
    err = _own(node, value, path)
    if err is not None:
        return err
    if isinstance(value, dict):
        for key, sub in node.get("properties", {}).items():
            if key in value:
                err = violation(sub, value[key], f"{path}.{key}", depth + 1)
                if err is not None:
                    return err
        extra = node.get("additionalProperties")
        if isinstance(extra, dict):
            known = node.get("properties", {})
            for key, item in value.items():
                if key not in known:
                    err = violation(extra, item, f"{path}.{key}", depth + 1)
                    if err is not None:
                        return err
    elif isinstance(value, list) and isinstance(node.get("items"), dict):
        for index, item in enumerate(value):
            err = violation(node["items"], item, f"{path}[{index}]", depth + 1)
            if err is not None:
                return err
    return None
