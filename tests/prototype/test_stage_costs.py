"""The stage-cost table (prototype/pipeline.py): one statement of which wait each design pays.

The live path, the fleet's per-turn formula and calibration's design matrix read it; these
tests check the table is well formed, that every design the harness runs has a path, that the
rows a path pays are the documented rules (docs/pipeline.md, "What each mode touches"), and that
a fit file is refused where it leaves open what a run pays.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from prototype.pipeline import (
    DESIGNS,
    MODEL_COSTS,
    PROFILES,
    STAGE_COSTS,
    STAGE_ROWS,
    STAGE_SWITCH,
    CostProfile,
    Count,
    Occasion,
    Stage,
    load_profile,
    pays,
    profile_gaps,
    turn_s,
)
from sim.model.config import ModelConfig
from sim.rollout.result import ALL_MODES

HOSTED = PROFILES["hosted"]


def test_rows_name_fields_and_one_switch_and_occasion_per_stage() -> None:
    profile_fields = {f.name for f in msgspec.structs.fields(CostProfile)}
    assert all(r.field in profile_fields for r in STAGE_COSTS)
    assert all(r.field in {f.name for f in msgspec.structs.fields(ModelConfig)} for r in MODEL_COSTS)
    for stage in Stage:
        rows = [r for r in STAGE_COSTS if r.stage is stage]
        assert len({r.occasion for r in rows}) <= 1 and len({r.switch for r in rows}) <= 1, stage
    assert STAGE_SWITCH[Stage.ROUTING] == "reuse_routing" and STAGE_SWITCH[Stage.POST] == "async_billing"
    # Every field that is a wait or a rate has a row; the compaction ratio is not a cost.
    costed = {r.field for r in STAGE_COSTS}
    assert profile_fields - costed == {"name", "compaction_ratio"}


def test_every_mode_the_harness_runs_is_a_design() -> None:
    assert set(ALL_MODES) <= set(DESIGNS)


def _paid(mode: str, k: int, **kw: bool) -> set[str]:
    path = DESIGNS[mode].path(k, **kw)
    return {r.field for r in STAGE_COSTS if pays(r, path)}


def test_the_rules_each_design_pays() -> None:
    every = {"rtt_s", "uplink_bytes_per_s", "validate_s_per_token", "safety_call_s", "safety_s_per_token"}
    request = {"auth_s", "routing_s", "inference_hop_s"}
    assert _paid("http", 3) == every | request | {"billing_s"}
    assert _paid("http_prev", 0) == every | request | {"billing_s"}
    assert _paid("http_prev", 3) == every | request | {"billing_s", "state_load_s"}
    assert _paid("ws", 0) == every | request
    assert _paid("ws", 3) == every | {"inference_hop_s"}  # routing reused, state cached, billing overlapped
    assert _paid("ws", 3, fresh=True) == every | request  # a reconnect is a first turn again
    for held in ("append", "inject", "async", "steer"):
        assert _paid(held, 0) == every | request
        assert _paid(held, 3) == every  # a resume: no routing, no hop
    # Switched off, a WebSocket connection pays what HTTP pays.
    path = DESIGNS["ws"].path(3)
    unswitched = {r.field for r in STAGE_COSTS if pays(r, path, frozenset())}
    assert unswitched == every | request | {"billing_s", "state_load_s"}


def test_turn_s_sums_the_rows_before_and_after_the_first_token() -> None:
    counts = {Count.BYTES: 30_000.0, Count.TOKENS_RENDERED: 700.0, Count.TOKENS_CLASSIFIED: 800.0}
    pre, post = turn_s(HOSTED, DESIGNS["http"].path(2), counts)
    h = HOSTED
    want = (
        h.rtt_s
        + 30_000 / h.uplink_bytes_per_s
        + h.validate_s_per_token * 700
        + h.safety_call_s
        + h.safety_s_per_token * 800
        + h.auth_s
        + h.routing_s
        + h.inference_hop_s
    )
    assert pre == pytest.approx(want, rel=1e-12) and post == h.billing_s
    assert HOSTED.stage_s(Stage.NETWORK, {Count.BYTES: 1000.0}) == HOSTED.upload_s(1000)
    with pytest.raises(ValueError, match="needs the count bytes"):
        HOSTED.stage_s(Stage.NETWORK)
    assert all(r.occasion is Occasion.COMPACTION for r in STAGE_COSTS if r.stage is Stage.COMPACTION)


def test_a_fit_file_is_refused_where_it_leaves_open_what_the_run_pays(tmp_path: Path) -> None:
    sums = [["rtt_s", "safety_call_s", "inference_hop_s", "model_latency_s"], ["auth_s", "routing_s"]]
    fitted = {"name": "fitted", "rtt_s": 0.04, "safety_call_s": 0.04, "inference_hop_s": 0.04, "auth_s": 0.05}
    path = tmp_path / "fit.json"
    path.write_text(json.dumps({"cost_profile": fitted, "unidentified": ["state_load_s"], "sums": sums}))
    assert load_profile(str(path), ["http", "ws"]).rtt_s == 0.04  # they pay each sum whole
    with pytest.raises(ValueError, match="state_load_s is not identified"):
        load_profile(str(path), ["http", "http_prev"])
    with pytest.raises(ValueError, match="identified only as a sum"):
        load_profile(str(path), ["http", "append"])  # a resume skips the hop: the split matters
    assert profile_gaps([], [["auth_s", "routing_s"]], DESIGNS) == []  # always paid together
    zero = tmp_path / "zero.json"
    zero.write_text(json.dumps({"cost_profile": {"name": "fitted"}, "unidentified": [], "sums": []}))
    with pytest.raises(ValueError, match="identified no API wait"):
        load_profile(str(zero), ["http"])


def test_each_stage_sums_its_own_rows_in_the_tables_order() -> None:
    assert sorted((r for rows in STAGE_ROWS.values() for r in rows), key=STAGE_COSTS.index) == list(STAGE_COSTS)
    for stage, rows in STAGE_ROWS.items():
        assert rows == tuple(r for r in STAGE_COSTS if r.stage is stage)
    hosted = PROFILES["hosted"]
    counts = {c: 3.0 for c in Count}
    expected = sum(hosted.row_s(r, counts) for r in STAGE_COSTS if r.stage is Stage.NETWORK)
    assert hosted.stage_s(Stage.NETWORK, counts) == expected > 0
