"""Tests for `sim.model.schema_values`: sampled values are valid (by the `jsonschema` library, an independent
validator), plausible, sized, and deterministic."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import pytest

from sim.model.schema_values import sample_json, sample_prose
from tests.support import EXEC_COMMAND_SCHEMA, GET_WEATHER_SCHEMA, schema_errors

SEEDS = range(200)

EXEC_COMMAND = EXEC_COMMAND_SCHEMA
GET_WEATHER = GET_WEATHER_SCHEMA

SCHEMAS: dict[str, Any] = {
    "exec_command": EXEC_COMMAND,
    "get_weather": GET_WEATHER,
    "strict_optional": {
        "type": "object",
        "properties": {
            "path": {"type": "string"},
            "offset": {"type": ["integer", "null"], "minimum": 0},
            "mode": {"type": ["string", "null"], "enum": ["r", "w", None]},
        },
        "required": ["path", "offset", "mode"],
        "additionalProperties": False,
    },
    "update_plan": {
        "type": "object",
        "properties": {
            "explanation": {"type": "string"},
            "plan": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "step": {"type": "string"},
                        "status": {"type": "string", "enum": ["pending", "in_progress", "completed"]},
                    },
                    "required": ["step", "status"],
                    "additionalProperties": False,
                },
                "minItems": 1,
                "maxItems": 5,
            },
        },
        "required": ["plan"],
    },
    "bounds": {
        "type": "object",
        "properties": {
            "short": {"type": "string", "minLength": 3, "maxLength": 5},
            "long": {"type": "string", "minLength": 200},
            "pct": {"type": "number", "minimum": 0, "maximum": 1},
            "open": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 0.001},
            "neg": {"type": "integer", "maximum": -5},
            "flag": {"type": "boolean"},
            "nothing": {"type": "null"},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2},
            "exact": {"type": "array", "minItems": 4, "maxItems": 4},
        },
        "required": ["short", "long", "pct", "open", "neg", "flag", "nothing", "tags", "exact"],
    },
    # Draft 4's boolean exclusiveMinimum (draft 6 made it a number): validated as draft 4.
    "draft4_bounds": {
        "$schema": "http://json-schema.org/draft-04/schema#",
        "type": "object",
        "properties": {"draft4": {"type": "integer", "minimum": 3, "exclusiveMinimum": True, "maximum": 4}},
        "required": ["draft4"],
    },
    "combinators": {
        "type": "object",
        "properties": {
            "target": {
                "anyOf": [
                    {"type": "object", "properties": {"file": {"type": "string"}}, "required": ["file"]},
                    {"type": "integer", "minimum": 10, "maximum": 20},
                ]
            },
            "either": {"oneOf": [{"type": "string"}, {"type": "string", "enum": ["x"]}]},
            "version": {"const": 2},
            "level": {"enum": [1, "two", None, True]},
            "both": {
                "allOf": [
                    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                    {"properties": {"b": {"type": "boolean"}}, "required": ["b"]},
                ]
            },
            "ref": {"$ref": "#/$defs/Thing"},
            "untyped": {},
        },
        "required": ["target", "either", "version", "level", "both", "ref", "untyped"],
        "$defs": {"Thing": {"type": "string"}},  # the sampler writes a string for any $ref
    },
    # Every integer is also a number >= 0 or < 0: the value must fall in exactly one branch.
    "one_of_overlapping": {"oneOf": [{"type": "integer"}, {"type": "number", "minimum": 0}]},
    "top_level_array": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}},
    "top_level_string": {"type": "string"},
    "empty_object": {"type": "object", "properties": {}},
    "no_type_with_properties": {"properties": {"query": {"type": "string"}}, "required": ["query"]},
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_samples_validate_over_many_seeds(name: str) -> None:
    schema = SCHEMAS[name]
    for seed in SEEDS:
        rng = np.random.default_rng(seed)
        value = sample_json(schema, rng, target_chars=int(rng.integers(10, 600)))
        assert schema_errors(schema, value) == [], (seed, value)
        msgspec.json.encode(value)  # JSON-serialisable


def test_exec_command_is_shell_and_sized() -> None:
    lengths = []
    for seed in SEEDS:
        value = sample_json(EXEC_COMMAND, np.random.default_rng(seed), target_chars=400)
        assert isinstance(value, dict)
        assert isinstance(value["cmd"], str) and value["cmd"]
        assert value["cmd"].split()[0] in {
            "ls",
            "cat",
            "sed",
            "grep",
            "rg",
            "pytest",
            "python",
            "git",
            "find",
            "head",
            "wc",
            "mypy",
            "ruff",
            "cd",
        }
        if "workdir" in value:
            assert value["workdir"].startswith("/")
        if "timeout_ms" in value:
            assert value["timeout_ms"] >= 1000  # round, realistic timeouts
        lengths.append(len(msgspec.json.encode(value)))
    # Compact JSON size tracks the target (commands are whole, so not exactly).
    assert 300 <= float(np.median(lengths)) <= 500


@pytest.mark.parametrize("target", [40, 150, 1000, 4000])
def test_size_tracks_target(target: int) -> None:
    lengths = [
        len(msgspec.json.encode(sample_json(EXEC_COMMAND, np.random.default_rng(s), target_chars=target)))
        for s in range(100)
    ]
    assert 0.7 * target <= float(np.median(lengths)) <= 1.3 * target + 30


def test_get_weather_is_a_city() -> None:
    cities = {
        sample_json(GET_WEATHER, np.random.default_rng(s))["city"]  # type: ignore[index]
        for s in range(50)
    }
    assert len(cities) > 5
    assert all(c[0].isupper() for c in cities)


def test_optional_properties_sometimes_present() -> None:
    values = [sample_json(EXEC_COMMAND, np.random.default_rng(s)) for s in SEEDS]
    keys = [set(v) for v in values if isinstance(v, dict)]
    assert len(keys) == len(values)
    assert all("cmd" in k for k in keys)
    assert 0.3 < np.mean(["workdir" in k for k in keys]) < 0.7
    assert 0.3 < np.mean(["timeout_ms" in k for k in keys]) < 0.7


def test_type_list_with_null_gives_both() -> None:
    schema = {"type": ["string", "null"]}
    values = [sample_json(schema, np.random.default_rng(s)) for s in SEEDS]
    assert None in values
    assert any(isinstance(v, str) for v in values)


def test_deterministic_given_rng() -> None:
    for name, schema in SCHEMAS.items():
        a = sample_json(schema, np.random.default_rng(7), target_chars=300)
        b = sample_json(schema, np.random.default_rng(7), target_chars=300)
        assert a == b, name


def test_unsatisfiable_schemas_raise() -> None:
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="is false"):
        sample_json(False, rng)
    with pytest.raises(ValueError, match="admits no value"):
        sample_json({"type": "integer", "minimum": 5, "maximum": 4}, rng)
    with pytest.raises(ValueError, match="admits no value"):
        sample_json({"type": "array", "minItems": 3, "maxItems": 1}, rng)


def test_prose_is_sized_and_sentence_like() -> None:
    for target in (1, 30, 300, 3000):
        text = sample_prose(np.random.default_rng(target), target)
        assert text[0].isupper() and text.endswith(".")
        assert target <= len(text) <= target + 40


# --------------------------------------------------------------------------- the validator of these tests


def _property(name: str, key: str) -> object:
    return SCHEMAS[name]["properties"][key]


@pytest.mark.parametrize(
    ("schema", "value"),
    [
        (SCHEMAS["strict_optional"], {"path": "a", "offset": None, "mode": None, "extra": 1}),  # additionalProperties
        (_property("strict_optional", "offset"), -1),  # minimum
        (_property("update_plan", "plan"), [{"step": "x", "status": "done"}]),  # enum
        (_property("update_plan", "plan"), []),  # minItems
        (_property("bounds", "short"), "ab"),  # minLength
        (_property("bounds", "open"), 0),  # exclusiveMinimum (a number)
        (SCHEMAS["draft4_bounds"], {"draft4": 3}),  # exclusiveMinimum (draft 4's boolean)
        (_property("combinators", "target"), 9),  # anyOf
        (_property("combinators", "either"), "x"),  # oneOf: both branches
        (_property("combinators", "both"), {"a": 1}),  # allOf
        (SCHEMAS["one_of_overlapping"], 3),
        (SCHEMAS["top_level_array"], [10]),  # maximum of an item
    ],
)
def test_the_validator_of_these_tests_rejects_invalid_values(schema: object, value: object) -> None:
    """`schema_errors` reads every keyword the samples are checked for (draft 4 where the schema says so)."""
    assert schema_errors(schema, value)
