"""Every constraint the spec states on a create's parameters is enforced, on both transports.

The cases come from the spec itself (prototype/data/openapi-request.json, extracted from the
pinned openai/openai-openapi spec by tests/data/extract_openapi.py), not from a list in this file: each
`minimum`, `maximum`, `minLength`, `maxLength`, `minItems`, `maxItems` and `enum` that a
top-level parameter of `CreateResponse` states, on the parameter itself, on a field of an object
it takes, or on the items of an array it takes. For each one a body is built from a minimal valid
instance of the parameter's schema with that one value broken, and `jsonschema` confirms that the
spec refuses it (a constraint an alternative of an `anyOf` does not share, such as `model`'s enum
beside a free string, binds nothing and yields no case). The server must answer 400 with the code
the real API uses for that kind of constraint and the parameter's path. A constraint added to the
spec is tested without editing this file.

Parameters of features the simulator refuses whole (`contract.UNSUPPORTED_FEATURES`) expect that
refusal instead. Input items and tools are checked by the rules of tests/prototype/wire/test_contract.py.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Final

import aiohttp
import jsonschema
import pytest

from prototype.wire.contract import UNSUPPORTED_FEATURES
from tests.support import REPO, Live, live_server

DATA: Final = REPO / "prototype" / "data"
SCHEMAS: Final[dict[str, Any]] = json.loads((DATA / "openapi-request.json").read_text())["components"]["schemas"]
# (the server's copy: prototype/wire/constraints.py walks the same schemas)
PREFIX: Final = "#/components/schemas/"
SKIPPED: Final = frozenset({"input", "tools"})  # walked per variant by `_part_cases`
CHECKED: Final = ("minimum", "maximum", "minLength", "maxLength", "minItems", "maxItems", "enum")
BAD_ENUM: Final = "longrun-not-a-value"
BASE: Final[dict[str, Any]] = {"model": "sim", "input": "hi"}
TERMINAL: Final = frozenset({"error", "response.completed", "response.incomplete", "response.failed"})
_ONLY: Final = re.compile(r"[Oo]nly '([^']+)' is supported")


def _resolve(node: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in node:
        node = SCHEMAS[node["$ref"][len(PREFIX) :]]
    return node


def _properties(node: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """An object schema's properties and required names, through `allOf`."""
    node = _resolve(node)
    props: dict[str, Any] = dict(node.get("properties", {}))
    required: list[str] = list(node.get("required", []))
    for part in node.get("allOf", []):
        more, need = _properties(part)
        props.update(more)
        required += need
    return props, required


def _alternatives(node: dict[str, Any]) -> list[dict[str, Any]]:
    """The non-null alternatives of a schema (itself when it has no `anyOf`/`oneOf`)."""
    node = _resolve(node)
    alts = node.get("anyOf") or node.get("oneOf")
    if not alts:
        return [node]
    out = []
    for alt in alts:
        for a in _alternatives(alt):
            if a.get("type") != "null":
                out.append({**{k: v for k, v in node.items() if k not in ("anyOf", "oneOf")}, **a})
    return out


def _minimal(node: dict[str, Any], depth: int = 0) -> Any:
    """A small instance of `node` (its first alternative, required fields only)."""
    alt = _alternatives(node)[0]
    if "const" in alt:
        return alt["const"]
    if "enum" in alt:
        return alt["enum"][0]
    kind = alt.get("type")
    if kind == "object" or "properties" in alt or "allOf" in alt:
        props, required = _properties(alt)
        return {name: _minimal(props[name], depth + 1) for name in required if name in props and depth < 6}
    if kind == "array":
        return [_minimal(alt["items"], depth + 1)] * alt.get("minItems", 0) if "items" in alt else []
    if kind == "integer":
        return int(alt.get("minimum", 0))
    if kind == "number":
        return alt.get("minimum", 0)
    if kind == "boolean":
        return False
    if stated := _ONLY.search(alt.get("description", "")):  # a value the spec states in prose only
        return stated.group(1)
    return "x" * max(1, int(alt.get("minLength", 1)))


def _broken(alt: dict[str, Any], keyword: str) -> Any:
    bound = alt[keyword]
    integer = alt.get("type") == "integer"
    return {
        "minimum": lambda: bound - 1 if integer else bound - 0.5,
        "maximum": lambda: bound + 1 if integer else bound + 0.5,
        "minLength": lambda: "x" * (bound - 1),
        "maxLength": lambda: "x" * (bound + 1),
        "minItems": lambda: [_minimal(alt["items"])] * (bound - 1),
        "maxItems": lambda: [_minimal(alt["items"])] * (bound + 1),
        "enum": lambda: BAD_ENUM,
    }[keyword]()


def _code(alt: dict[str, Any], keyword: str) -> str:
    kind = {"integer": "integer", "number": "decimal", "string": "string", "array": "array"}[alt["type"]]
    if keyword == "enum":
        return "invalid_value"
    if keyword in ("minItems", "minLength") and alt[keyword] == 1:  # "Invalid 'x': empty array. ..."
        return "empty_array" if kind == "array" else "empty_string"
    return {
        "minimum": f"{kind}_below_min_value",
        "maximum": f"{kind}_above_max_value",
        "minLength": f"{kind}_below_min_length",
        "maxLength": f"{kind}_above_max_length",
        "minItems": f"{kind}_below_min_length",
        "maxItems": f"{kind}_above_max_length",
    }[keyword]


@dataclass(frozen=True)
class Case:
    param: str  # the path the error names: `reasoning.summary`, `include[0]`
    keyword: str
    body: dict[str, Any]
    code: str
    variant: str = ""  # the item or tool type the case breaks a field of

    def __str__(self) -> str:
        return f"{self.variant + ':' if self.variant else ''}{self.param}:{self.keyword}"


def _with(root: str, value: Any) -> dict[str, Any]:
    return {**BASE, root: value}


def _cases() -> list[Case]:
    props, _ = _properties(SCHEMAS["CreateResponse"])
    found: dict[str, Case] = {}

    def site(root: str, param: str, alt: dict[str, Any], place: Any) -> None:
        """`place(value)` is the parameter's value with the constrained spot set to `value`."""
        for keyword in CHECKED:
            if keyword in alt and alt.get("type") in ("integer", "number", "string", "array"):
                case = Case(param, keyword, _with(root, place(_broken(alt, keyword))), _code(alt, keyword))
                found.setdefault(f"{param}:{keyword}", case)

    for root, schema in sorted(props.items()):
        if root in SKIPPED:
            continue
        for alt in _alternatives(schema):
            site(root, root, alt, lambda v: v)
            if alt.get("type") == "array" and "items" in alt:
                for item in _alternatives(alt["items"]):
                    site(root, f"{root}[0]", item, lambda v: [v])
                    fields, _ = _properties(item) if item.get("type") == "object" else ({}, [])
                    for name, sub in fields.items():
                        for leaf in _alternatives(sub):
                            base = _minimal(item)
                            site(root, f"{root}[0].{name}", leaf, lambda v, b=base, n=name: [{**b, n: v}])
            fields, _ = _properties(alt) if alt.get("type") == "object" or "properties" in alt else ({}, [])
            for name, sub in fields.items():
                base = _minimal(alt)
                for leaf in _alternatives(sub):
                    site(root, f"{root}.{name}", leaf, lambda v, b=base, n=name: {**b, n: v})
                    inner, _ = _properties(leaf) if leaf.get("type") == "object" else ({}, [])
                    for deep, deepest in inner.items():
                        mid = _minimal(leaf)
                        for last in _alternatives(deepest):
                            site(
                                root,
                                f"{root}.{name}.{deep}",
                                last,
                                lambda v, b=base, n=name, m=mid, d=deep: {**b, n: {**m, d: v}},
                            )
    # A case binds only if the spec refuses its body (an alternative without the constraint
    # would accept it).
    return [c for c in found.values() if not VALIDATOR.is_valid(c.body)] + _part_cases()


# The root document carries the components, so the spec's local `$ref`s resolve in it.
VALIDATOR: Final = jsonschema.Draft202012Validator(
    {"$ref": PREFIX + "CreateResponse", "components": {"schemas": SCHEMAS}}
)
PART_DEPTH: Final = 3  # fields of an item or tool, of their objects, and of those objects' objects
Path_ = tuple[str | int, ...]


def _variants(name: str) -> list[dict[str, Any]]:
    """The object variants of a union schema (nested unions spread out)."""
    out = []
    for alt in _alternatives(SCHEMAS[name]):
        nested = alt.get("anyOf") or alt.get("oneOf")
        out += _variants_of(nested) if nested else [alt] if alt.get("type") == "object" or "properties" in alt else []
    return out


def _variants_of(alts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for alt in alts:
        for a in _alternatives(alt):
            nested = a.get("anyOf") or a.get("oneOf")
            out += _variants_of(nested) if nested else [a]
    return out


def _put(value: Any, path: Path_, leaf: Any) -> Any:
    """`value` with the spot at `path` set to `leaf` (copies along the path)."""
    if not path:
        return leaf
    head, rest = path[0], path[1:]
    if isinstance(head, int):
        items = list(value)
        items[head] = _put(items[head], rest, leaf)
        return items
    return {**value, head: _put(value.get(head, {}), rest, leaf)}


def _param(path: Path_) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")


def _sites(node: dict[str, Any], root: Any, path: Path_, depth: int) -> list[tuple[Path_, dict[str, Any], Any]]:
    """(path, the constrained schema, a valid root holding the path's parents) of every field of
    `node` at `path` in `root`, and of the objects below it to `PART_DEPTH`."""
    fields, _ = _properties(node)
    out = []
    for name, sub in fields.items():
        here = (*path, name)
        for leaf in _alternatives(sub):
            out.append((here, leaf, root))
            if depth >= PART_DEPTH:
                continue
            if leaf.get("type") == "object" or "properties" in leaf:
                out += _sites(leaf, _put(root, here, _minimal(leaf)), here, depth + 1)
            elif leaf.get("type") == "array" and isinstance(leaf.get("items"), dict):
                for item in _alternatives(leaf["items"]):
                    if item.get("type") == "object" or "properties" in item:
                        out += _sites(item, _put(root, here, [_minimal(item)]), (*here, 0), depth + 1)
    return out


# Fields the spec leaves optional that the server's own item rules require (docs/contract.md):
# a minimal instance carries them, so that the case breaks the constraint and nothing else.
REQUIRED_BY_SERVER: Final = {"function_call_output": ("call_id",), "custom_tool_call_output": ("call_id",)}


def _part_cases() -> list[Case]:
    """Input items and tools: every variant of `InputItem` and `Tool`, its minimal instance in an
    otherwise valid body, each constrained field broken in turn."""
    found: dict[str, Case] = {}
    for root, union in (("input", "InputItem"), ("tools", "Tool")):
        for variant in _variants(union):
            instance = _minimal(variant)
            fields, _ = _properties(variant)
            for name in REQUIRED_BY_SERVER.get(instance.get("type", ""), ()):
                instance.setdefault(name, _minimal(fields[name]))
            base = {**BASE, root: [instance]}
            if not VALIDATOR.is_valid(base):
                continue  # a variant whose minimal instance the generator cannot build validly
            tag = base[root][0].get("type", "message")
            for path, leaf, holder in _sites(variant, base, (root, 0), 1):
                for keyword in CHECKED:
                    if keyword not in leaf or leaf.get("type") not in ("integer", "number", "string", "array"):
                        continue
                    if keyword == "maxLength" and leaf[keyword] > 1 << 16:
                        continue  # a 10 MB string per case is the size tests' (test_contract_sizes.py)
                    body = _put(holder, path, _broken(leaf, keyword))
                    if VALIDATOR.is_valid(body) or not VALIDATOR.is_valid(holder):
                        continue
                    case = Case(_param(path), keyword, body, _code(leaf, keyword), tag)
                    found.setdefault(f"{tag}:{case.param}:{keyword}", case)
    return list(found.values())


CASES: Final = _cases()


def test_the_spec_yields_cases() -> None:
    """The derivation finds the constraints the spec is known to state (a broken walk fails here)."""
    params = {c.param for c in CASES}
    assert {"temperature", "top_p", "top_logprobs", "max_output_tokens", "safety_identifier"} <= params
    assert {"include[0]", "truncation", "service_tier", "reasoning.effort", "text.verbosity"} <= params
    assert "model" not in params  # its enum sits beside a free string


@pytest.fixture
async def live() -> AsyncIterator[Live]:
    async with live_server() as server:
        yield server


def _expected(case: Case) -> tuple[str, str | None]:
    root = case.param.split(".")[0].split("[")[0]
    if root in UNSUPPORTED_FEATURES:
        return "unsupported_parameter", root
    return case.code, case.param


@pytest.mark.parametrize("transport", ["http", "ws"])
@pytest.mark.parametrize("case", CASES, ids=str)
async def test_each_spec_constraint_is_enforced(live: Live, case: Case, transport: str) -> None:
    code, param = _expected(case)
    async with aiohttp.ClientSession() as session:
        if transport == "http":
            async with session.post(f"{live.base_url}/responses", json=case.body) as reply:
                error = (await reply.json())["error"]
                assert reply.status == 400, error
        else:
            async with session.ws_connect(live.ws_url) as ws:
                await ws.send_json({"type": "response.create", **case.body})
                while (event := await ws.receive_json())["type"] not in TERMINAL:
                    pass
                assert event["type"] == "error" and event["status"] == 400, event
                error = event["error"]
    assert (error["code"], error["param"]) == (code, param), error
