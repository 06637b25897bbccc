"""`SimulatedModel(pace_by_turn=True)`, what sweeps run on: same tokens, same first token and turn end,
no clock wake-up per token; and a sweep point's summary equals the per-token-paced run's."""

from __future__ import annotations

import dataclasses

import msgspec
import numpy as np

from prototype.model import ItemStarted, ModelEvent, ModelRequest, TokensSampled
from sim.harness.experiment import CompareConfig, run_compare
from sim.harness.sweep import run_point
from sim.model.accelerator import SimulatedModel
from sim.model.policy import PlannedItem, ScriptPolicy
from sim.runtime.clock import ManualClock
from sim.runtime.virtual import VirtualClock, run_virtual

TEXT = " hello" * 200  # 200 o200k tokens


def _request() -> ModelRequest:
    prompt = (np.arange(8, dtype=np.uint32),)
    return ModelRequest(prompt=prompt, prompt_tokens=8, resident_tokens=0, turn_index=0, conversation_key=1)


async def _timed(pace_by_turn: bool) -> tuple[list[tuple[float, ModelEvent]], int]:
    clock = ManualClock(start=5.0)
    policy = ScriptPolicy([[PlannedItem("function_call", "f", '{"a": 1}'), PlannedItem("message", "", TEXT)]])
    model = SimulatedModel(
        clock=clock, policy=policy, decode_tok_per_s=100.0, model_latency_s=0.5, pace_by_turn=pace_by_turn
    )
    timed = [(clock.now(), event) async for event in model.sample(_request())]
    return timed, len(clock.wakeups)


def _items(timed: list[tuple[float, ModelEvent]]) -> list[tuple[tuple[int, ...], str]]:
    """Per item: its token ids and text, however they were split into events."""
    out: list[tuple[tuple[int, ...], str]] = []
    for _, e in timed:
        if isinstance(e, ItemStarted):
            out.append(((), ""))
        elif isinstance(e, TokensSampled):
            ids, text = out[-1]
            out[-1] = (ids + e.token_ids, text + e.text)
    return out


async def test_same_tokens_first_token_and_end_with_two_waits_and_few_events() -> None:
    per_token, token_waits = await _timed(False)
    by_turn, turn_waits = await _timed(True)
    assert _items(by_turn) == _items(per_token)  # same tokens, same texts
    assert [type(e) for _, e in by_turn if not isinstance(e, TokensSampled)] == [
        type(e) for _, e in per_token if not isinstance(e, TokensSampled)
    ]
    t0 = 5.5
    sampled = [(t, e) for t, e in by_turn if isinstance(e, TokensSampled)]
    n = sum(len(e.token_ids) for _, e in sampled)
    assert len(sampled) == 3  # the call's arguments; the message's tokens but the last; the last
    assert all(t == t0 for t, _ in sampled[:-1]) and len(sampled[-1][1].token_ids) == 1
    assert sampled[-1][0] == t0 + (n - 1) / 100.0 == [t for t, e in per_token if isinstance(e, TokensSampled)][-1]
    assert per_token[-1][0] == by_turn[-1][0]  # SamplingFinished at the same time
    assert turn_waits == 2 and token_waits == n  # prefill + last token, against one per token


async def test_multibyte_text_decodes_whole_when_coalesced() -> None:
    clock = ManualClock()
    text = "résumé ✓ 日本語テキスト"
    policy = ScriptPolicy([[PlannedItem("message", "", text)]])
    model = SimulatedModel(clock=clock, policy=policy, decode_tok_per_s=100.0, pace_by_turn=True)
    timed = [(clock.now(), e) async for e in model.sample(_request())]
    assert _items(timed)[0][1] == text


async def test_a_turn_cut_by_max_output_tokens_keeps_the_same_tokens_and_text() -> None:
    text = "résumé ✓ 日本語テキスト and more words after it"
    script = [[PlannedItem("function_call", "f", '{"a": "✓✓"}'), PlannedItem("message", "", text)]]
    n_call = len(SimulatedModel(clock=ManualClock(), policy=ScriptPolicy([])).tokenizer.encode_list('{"a": "✓✓"}'))
    for budget in (n_call - 1, n_call, n_call + 1, n_call + 5, n_call + 100):
        got = []
        for by_turn in (False, True):
            model = SimulatedModel(
                clock=ManualClock(), policy=ScriptPolicy(script), decode_tok_per_s=100.0, pace_by_turn=by_turn
            )
            request = dataclasses.replace(_request(), max_output_tokens=budget)
            got.append(_items([(0.0, e) async for e in model.sample(request)]))
        assert got[1] == got[0], budget


def test_a_sweep_point_summarises_like_per_token_pacing() -> None:
    config = CompareConfig.of(rollouts=1, tool_calls=3, tps=500.0, system_prompt_tokens=200, tool_time_s=0.2)
    per_token = run_virtual(run_compare(config, VirtualClock(), virtual=True), charge_cpu=False)
    rows = run_point(config)
    assert rows == [{**rows[i], **msgspec.to_builtins(s)} for i, s in enumerate(per_token.summary)]
