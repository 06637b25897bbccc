"""Priced compute (sim/fleet/compute.py): the simulator's model rates as engine steps."""

from __future__ import annotations

import msgspec
import pytest

from sim.fleet.compute import model_step_cost
from sim.model.accelerator import prefill_time_s
from sim.model.config import ModelConfig
from tests.support import flat_step_cost


def test_a_model_costs_the_same_turn_as_engine_steps() -> None:
    """A fit's four model rates (latency, prefill rate, attention term, decode rate) become a
    `StepCost` whose prefill alone costs what the simulator's prefill does, latency once, and
    whose streams decode as the simulator's do: at `tps`, slowed by `concurrency_slowdown` for
    each other stream."""
    model = ModelConfig(model_latency_s=0.04, prefill_tok_per_s=300.0, prefill_s_per_token_ctx=2e-7, tps=80.0)
    cost = model_step_cost(model, slots=3, name="fitted")
    for cached, uncached in ((0, 700), (700, 330), (1500, 40), (0, 5000)):
        expected = prefill_time_s(0.04, 300.0, 2e-7, cached, uncached)
        assert cost.prefill_alone_s(cached, uncached) == pytest.approx(expected, rel=1e-12)
    # No slowdown: a step of 1, 2 or 3 streams gives each a token in 1 / tps.
    assert [cost.decode_s(d) for d in (1, 2, 3)] == pytest.approx([1 / 80] * 3)
    slowed = model_step_cost(msgspec.structs.replace(model, concurrency_slowdown=0.5), slots=3, name="s")
    assert [slowed.decode_s(d) for d in (1, 2, 3)] == pytest.approx([1 / 80, 1.5 / 80, 2 / 80])
    assert cost.step_s == 0.0 and cost.request_s == 0.04 and cost.token_budget == 2048
    # A free prefill (rate 0: the simulator's "free") costs its latency and attention only.
    free = model_step_cost(ModelConfig(model_latency_s=0.01, prefill_tok_per_s=0.0, tps=10.0), slots=1, name="f")
    assert free.prefill_alone_s(0, 100) == pytest.approx(0.01)
    with pytest.raises(ValueError, match="tps"):
        model_step_cost(ModelConfig(tps=0.0), slots=1, name="unpaced")


def test_a_step_cost_without_request_s_is_unchanged() -> None:
    """`request_s` defaults to 0: the named sets price a prefill as before."""
    cost = flat_step_cost("x")
    assert cost.prefill_s_per(0, 500) == pytest.approx(1e-3) and cost.prefill_alone_s(0, 500) == pytest.approx(0.5)
