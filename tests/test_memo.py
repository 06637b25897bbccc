"""`sim.memo`: memoized tokenizing and classifying for virtual runs with free CPU. Same results as
the real work, bounded tables, and never in a live run."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from prototype.safety import SafetyClassifier
from prototype.tokenizer import get_tokenizer
from sim.experiment import CompareConfig, run_compare
from sim.memo import MemoClassifier, MemoTokenizer
from sim.realtime import AsyncioClock
from sim.virtual import VirtualClock, run_virtual

CONFIG = CompareConfig(rollouts=2, tool_calls=4, tps=1000.0, system_prompt_tokens=300, tool_time_s=0.2)


def _run(memoize: bool) -> object:
    result = run_virtual(
        run_compare(CONFIG, VirtualClock(), virtual=True, pace_by_turn=True, memoize=memoize), charge_cpu=False
    )
    return msgspec.json.decode(msgspec.json.encode({"summary": result.summary, "rollouts": result.rollouts}))


def test_a_memoized_run_equals_the_real_work_cold_and_warm() -> None:
    plain = _run(False)
    assert _run(True) == plain  # cold or warm, whatever earlier tests left in the tables
    assert _run(True) == plain  # warm: every text and chunk seen before


def test_tokens_equal_and_shared_arrays_are_read_only() -> None:
    memo, real = MemoTokenizer(), get_tokenizer()
    text = "def parse(x):\n    return x.split(',')  # ✓ résumé"
    first, again = memo.encode(text), memo.encode(text)
    assert again is first and np.array_equal(first, real.encode(text))
    assert memo.encode_list(text) == real.encode_list(text)
    with pytest.raises(ValueError):
        first[0] = 1  # a caller changing a shared array would change everyone's tokens
    assert memo.hit_rate == pytest.approx(2 / 3)  # one miss (the first), two hits


def test_classifier_verdicts_equal_over_any_split() -> None:
    rng = np.random.default_rng(3)
    real, memo = SafetyClassifier(), MemoClassifier()
    stream = rng.integers(0, 200_000, size=5_000).astype(np.uint32)
    for cuts in ([], [1], [7, 2_000], [2, 3, 4, 4_999]):
        a, b = real.begin(), memo.begin()
        for chunk in np.split(stream, cuts):
            a, b = real.update(a, chunk), memo.update(b, chunk)
        assert a == b and real.verdict(a) == memo.verdict(b)
        b2 = memo.begin()
        for chunk in np.split(stream, cuts):  # the same chunks again: looked up, same state
            b2 = memo.update(b2, chunk)
        assert b2 == b
    chunk = stream[:100]
    for head in (stream[200:203], stream[300:303]):  # the same chunk after different tokens
        a = real.update(real.update(real.begin(), head), chunk)
        b = memo.update(memo.update(memo.begin(), head), chunk)
        assert a == b


def test_tables_are_bounded() -> None:
    memo = MemoTokenizer(budget_tokens=50)
    texts = [f"line {i} of some tool output with words" for i in range(40)]
    for text in texts:
        memo.encode(text)
    for text in texts[-3:]:
        memo.encode(text)  # the most recent are kept...
    assert memo.hit_rate == pytest.approx(3 / 43)
    memo.encode(texts[0])  # ...the oldest went
    assert memo.hit_rate == pytest.approx(3 / 44)


async def test_a_live_run_refuses_to_memoize() -> None:
    with pytest.raises(ValueError, match="memoize"):
        await run_compare(CONFIG, AsyncioClock(), virtual=False, memoize=True)
