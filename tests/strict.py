"""Strict checks of what the server sends: the official SDK's models with validation on,
and the Responses schemas of the published OpenAPI spec (a pinned extract in tests/data/).

The SDK parses replies without validation (pydantic's `construct`), so an SDK test alone
never notices a missing required field; these checks validate every payload against
both oracles. `Checker` keeps a count per kind, so a test can assert that a check ran,
and the violations it found (conftest.py fails the test that saw one).

Where the spec is stricter than the real API (its own examples break the rule) the
exception is data, in tests/data/strict-exceptions.json, with its reason; nothing else
is excused.
"""

from __future__ import annotations

import fnmatch
import json
import typing
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import pydantic
import referencing
import referencing.jsonschema
from jsonschema.exceptions import ValidationError, relevance  # type: ignore[import-untyped]
from openai.types.beta.beta_responses_server_event import BetaResponsesServerEvent
from openai.types.responses import CompactedResponse, Response, ResponsesServerEvent, ResponseStreamEvent
from openai.types.shared import ErrorObject

DATA = Path(__file__).parent / "data"
SPEC_FILE = DATA / "openapi-responses.json"
EXCEPTIONS_FILE = DATA / "strict-exceptions.json"
SPEC_URI = "urn:openai-openapi:responses"
BETA_SPEC_FILE = DATA / "openapi-beta.json"  # the beta's inject events, extracted apart (extract_openapi.py)
BETA_SPEC_URI = "urn:openai-openapi:beta"

# Kinds of payload, named after the spec schema each is checked against.
RESPONSE = "Response"  # HTTP 200 body of POST/GET /v1/responses, and `response` in events
STREAM_EVENT = "ResponseStreamEvent"  # one SSE `data:` payload
WS_EVENT = "ResponsesServerEvent"  # one WebSocket text frame
# One text frame of a connection opted into the responses_multi_agent beta (docs/beta.md): the
# SDK's beta union; the spec's Beta* component where it has one, else its ResponsesServerEvent
# branch (with the beta's own values listed in strict-exceptions.json), else the SDK alone.
BETA_WS_EVENT = "BetaResponsesServerEvent"
BETA_SPEC_EVENTS = {
    "response.inject.created": "BetaResponseInjectCreatedEvent",
    "response.inject.failed": "BetaResponseInjectFailedEvent",
}
ERROR = "ErrorResponse"  # HTTP 4xx/5xx body
COMPACTED = "CompactResource"  # HTTP 200 body of POST /v1/responses/compact


def _members(union: Any) -> dict[str, type[pydantic.BaseModel]]:
    """`type` -> model of an SDK event union. The SDK marks its unions' discriminator in
    its own metadata, which pydantic does not read; dispatching on it here checks the one
    model the event names (and reports that model's errors, not every member's)."""
    (members, *_) = typing.get_args(union)  # Annotated[Union[...], PropertyInfo]
    out: dict[str, type[pydantic.BaseModel]] = {}
    for model in typing.get_args(members):
        (name,) = typing.get_args(model.model_fields["type"].annotation)
        assert name not in out, f"two SDK models take type {name!r}"
        out[name] = model
    return out


_SDK_UNIONS: dict[str, dict[str, type[pydantic.BaseModel]]] = {
    STREAM_EVENT: _members(ResponseStreamEvent),
    WS_EVENT: _members(ResponsesServerEvent),
    BETA_WS_EVENT: _members(BetaResponsesServerEvent),
}


class WireViolation(AssertionError):
    """A payload the server sent that an oracle rejects."""


@cache
def spec() -> dict[str, Any]:
    document: dict[str, Any] = json.loads(SPEC_FILE.read_text(encoding="utf-8"))
    return document


@cache
def beta_spec() -> dict[str, Any]:
    document: dict[str, Any] = json.loads(BETA_SPEC_FILE.read_text(encoding="utf-8"))
    return document


@cache
def beta_validator(component: str) -> jsonschema.Draft202012Validator:
    """A validator for one component of the beta extract (its own registry: the GA one stays small)."""
    resource = referencing.Resource.from_contents(beta_spec(), default_specification=referencing.jsonschema.DRAFT202012)
    registry: referencing.Registry[Any] = referencing.Registry().with_resource(BETA_SPEC_URI, resource)
    schema = {"$ref": f"{BETA_SPEC_URI}#/components/schemas/{component}"}
    return jsonschema.Draft202012Validator(schema, registry=registry)


@cache
def exceptions() -> dict[str, Any]:
    table: dict[str, Any] = json.loads(EXCEPTIONS_FILE.read_text(encoding="utf-8"))
    return table


@cache
def _registry() -> referencing.Registry[Any]:
    resource = referencing.Resource.from_contents(spec(), default_specification=referencing.jsonschema.DRAFT202012)
    registry: referencing.Registry[Any] = referencing.Registry().with_resource(SPEC_URI, resource)
    return registry


@cache
def validator(component: str) -> jsonschema.Draft202012Validator:
    """A JSON Schema 2020-12 validator for one `components.schemas` entry."""
    schema = {"$ref": f"{SPEC_URI}#/components/schemas/{component}"}
    return jsonschema.Draft202012Validator(schema, registry=_registry())


def _resolve(node: dict[str, Any]) -> dict[str, Any]:
    schemas = spec()["components"]["schemas"]
    while "$ref" in node:
        node = schemas[node["$ref"].rsplit("/", 1)[1]]
    return node


def _event_types(node: dict[str, Any]) -> list[str]:
    """The `type` values a union branch accepts (through `$ref` and `allOf`)."""
    node = _resolve(node)
    found = list(node.get("properties", {}).get("type", {}).get("enum", []))
    for part in node.get("allOf", []):
        found.extend(_event_types(part))
    return found


@cache
def _branches(union: str) -> dict[str, jsonschema.Draft202012Validator]:
    """`type` -> a validator of the one branch of a discriminated union that takes it.

    Validating the branch the discriminator names is what the union means (each `type`
    value belongs to exactly one branch, checked here) and reports the branch's own
    errors instead of "not valid under any of the given schemas"."""
    out: dict[str, jsonschema.Draft202012Validator] = {}
    for i, branch in enumerate(spec()["components"]["schemas"][union]["anyOf"]):
        pointer = {"$ref": f"{SPEC_URI}#/components/schemas/{union}/anyOf/{i}"}
        for name in _event_types(branch):
            assert name not in out, f"{union}: two branches take type {name!r}"
            out[name] = jsonschema.Draft202012Validator(pointer, registry=_registry())
    return out


def event_types(union: str) -> frozenset[str]:
    return frozenset(_branches(union))


def _dotted(error: ValidationError) -> str:
    return ".".join(str(part) for part in error.absolute_path)


def _innermost(error: ValidationError) -> ValidationError:
    """The most telling cause of an `anyOf`/`oneOf` failure: an error from the branch the
    instance meant (one whose `type` tag, or JSON type, is not what failed), else the most
    relevant error of all branches."""
    while error.context:
        by_branch: dict[Any, list[ValidationError]] = {}
        for sub in error.context:
            by_branch.setdefault(sub.relative_schema_path[0], []).append(sub)
        meant = [errs for errs in by_branch.values() if not any(_wrong_branch(e) for e in errs)]
        candidates = meant[0] if len(meant) == 1 else list(error.context)
        error = max(candidates, key=relevance)
    return error


def _wrong_branch(error: ValidationError) -> bool:
    """The error says the instance is not this branch's kind at all."""
    path = list(error.relative_path)
    return (path == ["type"] and error.validator in ("enum", "const")) or (not path and error.validator == "type")


def _excused(kind: str, path: str, value: Any) -> bool:
    """Listed in tests/data/strict-exceptions.json: the spec is stricter than the API there, older
    than the pinned SDK's types, or the value is one of the server's documented extensions."""
    table = exceptions()
    kinds = {kind, WS_EVENT} if kind == BETA_WS_EVENT else {kind}  # a beta frame is a WebSocket frame too
    rules = (*table["spec_stricter_than_api"], *table["spec_older_than_sdk"], *table["extension_values"])
    for rule in (*rules, *table["beta_values"]):
        if kinds & set(rule["kinds"]) and fnmatch.fnmatchcase(path, rule["path"]) and value in rule["values"]:
            return True
    return False


def spec_errors(kind: str, payload: Any, *, excuse: bool = True) -> list[str]:
    """What the spec's schema for `kind` rejects in `payload`, less the listed exceptions."""
    if kind == BETA_WS_EVENT and isinstance(payload, dict):
        tag = str(payload.get("type"))
        if tag in BETA_SPEC_EVENTS:
            errors: Iterator[ValidationError] = beta_validator(BETA_SPEC_EVENTS[tag]).iter_errors(payload)
        elif tag in _branches(WS_EVENT):
            errors = _branches(WS_EVENT)[tag].iter_errors(payload)
        else:
            return []  # no spec schema (the steer events): the SDK's beta model is the oracle
    elif kind in (STREAM_EVENT, WS_EVENT) and isinstance(payload, dict):
        branch = _branches(kind).get(payload.get("type"))  # type: ignore[arg-type]
        if branch is None and payload.get("type") in exceptions()["sdk_only_events"]:
            return []  # listed: the SDK types it, the spec has no branch (sdk_errors checks it)
        if branch is None:
            return [f"{kind}: no branch takes type {payload.get('type')!r}"]
        errors = branch.iter_errors(payload)
    else:
        errors = validator(kind).iter_errors(payload)
    out = []
    for error in errors:
        shown = _innermost(error)
        listed = _excused(kind, _dotted(shown), shown.instance) or _excused(kind, _dotted(error), error.instance)
        if excuse and listed:
            continue
        out.append(f"{kind} at {_dotted(shown) or '<root>'}: {shown.message[:300]}")
    return out


def sdk_errors(kind: str, payload: Any, *, excuse: bool = True) -> list[str]:
    """What the openai SDK's pydantic model for `kind` rejects (validation on, strict types)."""
    try:
        if kind == ERROR:
            if not isinstance(payload, dict) or set(payload) != {"error"}:
                return [f"{kind}: the body is not an `error` envelope: {str(payload)[:200]}"]
            ErrorObject.model_validate(payload["error"], strict=True)
        elif kind == RESPONSE:
            Response.model_validate(payload, strict=True)
        elif kind == COMPACTED:
            CompactedResponse.model_validate(_sdk_view(kind, payload), strict=True)
        else:
            tag = payload.get("type") if isinstance(payload, dict) else None
            if kind == BETA_WS_EVENT and _refused_steer_input(payload):
                # A steer refused as `invalid_input` echoes what the client sent (the beta returns
                # the original input), which need not fit the type of a valid steer input; the rest
                # of the event is checked as usual (docs/beta.md).
                payload = {**payload, "steer": {**payload["steer"], "input": ""}}
            model = _SDK_UNIONS[kind].get(tag)  # type: ignore[arg-type]
            if model is None:
                return [f"SDK {kind}: no model takes type {tag!r}"]
            model.model_validate(payload, strict=True)
    except pydantic.ValidationError as exc:
        return [f"SDK {kind} at {path or '<root>'}: {msg}" for path, msg in _sdk_problems(kind, exc, excuse)]
    return []


def _refused_steer_input(payload: Any) -> bool:
    return (
        isinstance(payload, dict)
        and payload.get("type") == "response.steer.failed"
        and isinstance(payload.get("error"), dict)
        and payload["error"].get("code") == "invalid_input"
        and isinstance(payload.get("steer"), dict)
    )


def _sdk_view(kind: str, payload: Any) -> Any:
    """`payload` less the output items the SDK's model is listed as narrower than the API on."""
    skip = [rule["output_items"] for rule in exceptions()["sdk_narrower_than_api"] if kind in rule["kinds"]]
    if not skip or not isinstance(payload, dict) or not isinstance(payload.get("output"), list):
        return payload
    kept = [
        item
        for item in payload["output"]
        if not (isinstance(item, dict) and any(all(item.get(k) == v for k, v in rule.items()) for rule in skip))
    ]
    return {**payload, "output": kept}


def _sdk_problems(kind: str, exc: pydantic.ValidationError, excuse: bool) -> list[tuple[str, str]]:
    """pydantic's errors less the union members the payload did not mean (those whose
    `type` literal it fails) and less the listed exceptions; locations without member names."""
    errors = exc.errors()
    wrong = {e["loc"][:-1] for e in errors if e["type"] == "literal_error" and e["loc"][-1:] == ("type",)}
    kept = [e for e in errors if not any(e["loc"][: len(p)] == p for p in wrong)] or errors
    out = []
    for e in kept:
        path = ".".join(str(part) for part in e["loc"] if not (isinstance(part, str) and part[:1].isupper()))
        if not (excuse and _excused(kind, path, e.get("input"))):
            out.append((path, f"{e['msg']} (got {str(e.get('input'))[:120]})"))
    return out[:12]


@dataclass
class Checker:
    """Validates payloads, counts them per kind, keeps what it rejected."""

    counts: Counter[str] = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)
    # Off for a test marked `wire_unchecked`: one that times the client, where validating every
    # event (a few ms of pydantic and JSON Schema each) would be measured as transport time.
    enabled: bool = True

    def check(self, kind: str, payload: Any, *, where: str) -> None:
        """Validate one decoded payload; raise `WireViolation` (and keep it) if rejected."""
        if not self.enabled:
            return
        if kind in (STREAM_EVENT, WS_EVENT) and isinstance(payload, dict):
            extension = exceptions()["extension_events"].get(str(payload.get("type")))
            if extension is not None:
                self.counts[f"{kind}:extension"] += 1
                return
        self.counts[kind] += 1
        problems = sdk_errors(kind, payload) + spec_errors(kind, payload)
        if problems:
            message = f"{where}: the server sent a payload the API's schemas reject:\n  " + "\n  ".join(problems)
            self.violations.append(message)
            raise WireViolation(message)

    def check_json(self, kind: str, raw: bytes | str, *, where: str) -> None:
        if not self.enabled:
            return
        try:
            payload = json.loads(raw)
        except ValueError as exc:
            message = f"{where}: {kind} is not JSON ({exc}): {raw[:200]!r}"
            self.violations.append(message)
            raise WireViolation(message) from None
        self.check(kind, payload, where=where)

    def check_http_body(self, method: str, path: str, status: int, content_type: str, body: bytes) -> None:
        """An HTTP reply of the Responses routes (anything else is not an API payload)."""
        if not self.enabled:
            return
        route = route_of(method, path)
        if route is None or content_type.startswith("text/event-stream"):
            return
        where = f"{method} {path} -> {status}"
        if status >= 400:
            if content_type.startswith("application/json"):
                self.check_json(ERROR, body, where=where)
            else:
                message = f"{where}: an error without a JSON body ({content_type}): {body[:200]!r}"
                self.violations.append(message)
                raise WireViolation(message)
        elif route in ("create", "retrieve"):
            self.check_json(RESPONSE, body, where=where)
        elif route == "compact":
            self.check_json(COMPACTED, body, where=where)
        else:
            self.counts[f"{route}:no-schema"] += 1


def route_of(method: str, path: str) -> str | None:
    """Which Responses operation an HTTP request is (None: not one of them)."""
    parts = path.rstrip("/").split("/")
    if parts[-2:] == ["v1", "responses"]:
        return "create" if method == "POST" else None
    if parts[-3:] == ["v1", "responses", "compact"] and method == "POST":
        return "compact"
    if len(parts) >= 3 and parts[-3:-1] == ["v1", "responses"]:
        return {"GET": "retrieve", "DELETE": "delete"}.get(method)
    return None


def is_beta_socket(beta_header: str, query: str) -> bool:
    """A socket opted into the responses_multi_agent beta (header, or `mode=beta` on the URL)."""
    return "responses_multi_agent=v1" in beta_header or "mode=beta" in query.split("&")


def is_responses_socket(path: str) -> bool:
    """A WebSocket on the Responses endpoint (the only one the server has)."""
    return path.rstrip("/").endswith("/v1/responses")


class SSETap:
    """Splits an SSE byte stream into events as it is read and checks each one."""

    def __init__(self, checker: Checker, where: str) -> None:
        self.checker = checker
        self.where = where
        self.pending = b""

    def feed(self, data: bytes) -> None:
        if not self.checker.enabled:
            return
        self.pending += data
        *frames, self.pending = self.pending.replace(b"\r\n", b"\n").split(b"\n\n")
        for frame in frames:
            self._frame(frame)

    def _frame(self, frame: bytes) -> None:
        name, data = None, []
        for line in frame.split(b"\n"):
            field_name, _, value = line.partition(b":")
            value = value[1:] if value.startswith(b" ") else value
            if field_name == b"event":
                name = value.decode()
            elif field_name == b"data":
                data.append(value)
        if not data:
            return  # a comment or keep-alive
        raw = b"\n".join(data)
        if raw == b"[DONE]":
            self.checker.counts["sse:[DONE]"] += 1
            return
        self.checker.check_json(STREAM_EVENT, raw, where=self.where)
        decoded = json.loads(raw)
        if name is not None and name != decoded.get("type"):
            message = f"{self.where}: SSE `event: {name}` does not match data type {decoded.get('type')!r}"
            self.checker.violations.append(message)
            raise WireViolation(message)
