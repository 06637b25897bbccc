"""`prototype.wire.constraints`: a union's candidates are kept by the value's shape, so a value
of a shape seen before is judged by its own values, and a new shape by its own variants."""

from __future__ import annotations

import pytest

from prototype.wire import constraints
from prototype.wire.constraints import SCHEMAS, violation

ITEM = SCHEMAS["InputItem"]


def _output(call_id: str, output: object) -> dict[str, object]:
    return {"type": "function_call_output", "call_id": call_id, "output": output}


def test_a_shape_seen_before_is_judged_by_its_own_values() -> None:
    assert violation(ITEM, _output("call_1", "ok"), "input[0]") is None
    err = violation(ITEM, _output("c" * 70_000, "ok"), "input[1]")  # the same shape, a call_id too long
    assert err is not None and (err.code, err.param) == ("string_above_max_length", "input[1].call_id")
    assert violation(ITEM, _output("call_2", "fine"), "input[2]") is None


def test_a_new_shape_gets_its_own_candidates() -> None:
    assert violation(ITEM, _output("call_1", "ok"), "input[0]") is None
    err = violation(ITEM, {"type": "not_a_type", "x": 1}, "input[0]")
    assert err is not None and (err.code, err.param) == ("invalid_value", "input[0].type")
    listed = violation(ITEM, _output("call_1", [{"type": "input_text", "text": "ok"}]), "input[0]")
    assert listed is None  # an output as a list of parts: another shape, another variant


def test_the_table_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(constraints, "_CANDIDATES_MAX", 3)
    monkeypatch.setattr(constraints, "_CANDIDATES", {})
    for n in range(10):
        assert violation(ITEM, {"type": "message", "role": "user", "content": "hi", f"f{n}": n}, "input[0]") is None
        assert len(constraints._CANDIDATES) <= 3
