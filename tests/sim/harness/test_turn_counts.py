"""The comparison's per-turn counts (`RolloutResult.model_tokens`): for every turn the server's
model sampled, the prompt tokens it found cached and the tokens it decoded, as its stream carried
them however the stream ended: run out, closed early by the service, failed in the middle or
before its first event. Read through the comparison's model log, as `run_compare` reads it."""

from __future__ import annotations

import contextlib
import itertools

import numpy as np
import pytest

from prototype.context.conversation import conversation_key
from prototype.model import ModelEvent, ModelRequest, Prefilled, TokensSampled
from sim.harness.experiment import _PromptLog
from sim.model.accelerator import SimulatedModel
from sim.model.policy import DefaultPolicy
from sim.rollout.spec import RolloutSpec
from sim.runtime.clock import ManualClock

TASK = "count what the model said"
SPEC = RolloutSpec(0, 0, TASK, (), ())


class _BreakingClock(ManualClock):
    """A clock whose sleeps after the first `sleeps` raise: the model's stream fails there."""

    def __init__(self, sleeps: int) -> None:
        super().__init__()
        self.sleeps = sleeps

    async def sleep_until(self, deadline: float) -> None:
        if self.sleeps == 0:
            raise RuntimeError("the clock broke")
        self.sleeps -= 1
        await super().sleep_until(deadline)


def _log(clock: ManualClock | None = None, *, pace_by_turn: bool = False) -> _PromptLog:
    model = SimulatedModel(clock=clock or ManualClock(), policy=DefaultPolicy(tool_calls=2), pace_by_turn=pace_by_turn)
    log = _PromptLog(model)
    log.mode = "ws"
    return log


def _request(turn: int = 0, prompt_tokens: int = 96) -> ModelRequest:
    return ModelRequest(
        prompt=(np.arange(prompt_tokens, dtype=np.uint32),),
        prompt_tokens=prompt_tokens,
        resident_tokens=0,
        turn_index=turn,
        conversation_key=conversation_key(TASK),
    )


def _counts(events: list[ModelEvent]) -> tuple[int, int]:
    """What the consumer saw: the cached tokens `Prefilled` said (0 without it), the tokens sampled."""
    cached = next((e.cached_tokens for e in events if isinstance(e, Prefilled)), 0)
    return cached, sum(len(e.token_ids) for e in events if isinstance(e, TokensSampled))


async def _read(log: _PromptLog, request: ModelRequest, seen: list[ModelEvent], stop: int | None = None) -> None:
    """One turn through `log`, as the service reads it: closed after `stop` events (None: all)."""
    async with contextlib.aclosing(log.sample(request)) as events:
        async for event in events:
            seen.append(event)
            if len(seen) == stop:
                break


@pytest.mark.parametrize("pace_by_turn", [False, True])
async def test_each_turn_counts_what_its_stream_carried(pace_by_turn: bool) -> None:
    log = _log(pace_by_turn=pace_by_turn)
    first: list[ModelEvent] = []
    second: list[ModelEvent] = []
    await _read(log, _request(0), first)
    await _read(log, _request(1), second)  # the same prompt: the first turn's is cached
    prompts, counts = log.take("ws", SPEC)
    assert prompts == [96, 96]
    assert counts == [_counts(first), _counts(second)]
    assert counts[0][1] > 0 and counts[1][0] > 0
    assert log.take("ws", SPEC) == ([], [])  # taken once


@pytest.mark.parametrize("pace_by_turn", [False, True])
async def test_a_stream_closed_early_counts_what_it_yielded(pace_by_turn: bool) -> None:
    whole: list[ModelEvent] = []
    await _read(_log(pace_by_turn=pace_by_turn), _request(), whole)
    assert len(whole) > 4
    for stop in range(1, len(whole) + 1):
        log = _log(pace_by_turn=pace_by_turn)
        seen: list[ModelEvent] = []
        await _read(log, _request(), seen, stop)
        assert seen == whole[:stop]
        assert log.take("ws", SPEC) == ([96], [_counts(seen)])


async def test_a_stream_closed_before_it_started_counts_nothing() -> None:
    log = _log()
    await log.sample(_request()).aclose()
    assert log.take("ws", SPEC) == ([96], [])


async def test_a_stream_that_fails_counts_what_it_yielded_before() -> None:
    whole: list[ModelEvent] = []
    await _read(_log(), _request(), whole)
    failed_after = []  # events seen before the failure, for each sleep the clock fails at
    for sleeps in itertools.count():
        log = _log(_BreakingClock(sleeps))
        seen: list[ModelEvent] = []
        try:
            await _read(log, _request(), seen)
        except RuntimeError as exc:
            assert str(exc) == "the clock broke"
        else:
            break  # the turn slept fewer times
        assert seen == whole[: len(seen)]
        assert log.take("ws", SPEC) == ([96], [_counts(seen)])
        failed_after.append(len(seen))
    assert seen == whole
    assert failed_after[0] == 0 and len(failed_after) > 3  # before the first event, and at tokens further on


async def test_a_request_refused_before_its_first_event_counts_nothing_sampled() -> None:
    log = _log()
    bad = ModelRequest(
        prompt=(np.arange(8, dtype=np.uint32),), prompt_tokens=9, resident_tokens=0, turn_index=0,
        conversation_key=conversation_key(TASK),
    )  # fmt: skip
    with pytest.raises(ValueError, match="prompt chunks hold 8 tokens"):
        await _read(log, bad, [])
    assert log.take("ws", SPEC) == ([9], [(0, 0)])
