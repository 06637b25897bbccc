"""Tests for `sim.accelerator` (with `sim.clock.ManualClock`) and `sim.realtime.AsyncioClock`.

Every timing assertion runs on virtual time: `ManualClock.sleep_until` jumps,
so 5 s of paced decoding takes milliseconds and the numbers are exact.
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from typing import Any

import msgspec
import numpy as np
import pytest

from prototype.model import (
    FunctionTool,
    ItemFinished,
    ItemStarted,
    ModelEvent,
    ModelRequest,
    SamplingFinished,
    TokensSampled,
)
from prototype.tokenizer import get_tokenizer
from sim.accelerator import ModelStatistics, SimulatedModel, turn_rng
from sim.clock import MANUAL_CLOCK_EPOCH_S, ManualClock, Wakeup
from sim.policy import DefaultPolicy, PlannedItem, Policy, ScriptPolicy
from sim.realtime import AsyncioClock

from .support import EXEC_COMMAND_SCHEMA

TOKENIZER = get_tokenizer()
EXEC_COMMAND = FunctionTool(
    "exec_command",
    "Run a shell command.",
    msgspec.json.encode(EXEC_COMMAND_SCHEMA),
)
MULTIBYTE = "été 😀 日本語 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ✨ 🦜🦜"  # several tokens here end mid-character
HELLO_5000 = " hello" * 5000  # exactly 5000 o200k tokens


def make_request(
    *,
    prompt_tokens: int = 12,
    cached_tokens: int = 0,
    turn_index: int = 0,
    conversation_key: int = 42,
    max_output_tokens: int | None = None,
    tools: tuple[FunctionTool, ...] = (EXEC_COMMAND,),
) -> ModelRequest:
    half = prompt_tokens // 2
    prompt = (
        np.arange(half, dtype=np.uint32),
        np.arange(prompt_tokens - half, dtype=np.uint32),
    )
    return ModelRequest(
        prompt=prompt,
        prompt_tokens=prompt_tokens,
        cached_tokens=cached_tokens,
        turn_index=turn_index,
        conversation_key=conversation_key,
        tools=tools,
        max_output_tokens=max_output_tokens,
    )


def script(*turns: PlannedItem | list[PlannedItem]) -> ScriptPolicy:
    return ScriptPolicy(list(turns))


def message(text: str) -> PlannedItem:
    return PlannedItem("message", "", text)


def call(name: str, arguments: str) -> PlannedItem:
    return PlannedItem("function_call", name, arguments)


async def collect(model: SimulatedModel, request: ModelRequest) -> list[tuple[float, ModelEvent]]:
    """Every event with the clock time at which the consumer received it."""
    return [(model.clock.now(), event) async for event in model.sample(request)]


def events_of(timed: list[tuple[float, ModelEvent]]) -> list[ModelEvent]:
    return [event for _, event in timed]


GRAMMAR = re.compile(r"(S(T)*F)*D")


def assert_grammar(events: list[ModelEvent]) -> None:
    """``(ItemStarted TokensSampled* ItemFinished)* SamplingFinished``, one token per TokensSampled."""
    letters = {ItemStarted: "S", TokensSampled: "T", ItemFinished: "F", SamplingFinished: "D"}
    assert GRAMMAR.fullmatch("".join(letters[type(e)] for e in events))
    assert all(len(e.token_ids) == 1 for e in events if isinstance(e, TokensSampled))


def items_of(events: list[ModelEvent]) -> list[tuple[ItemStarted, list[int], str]]:
    """(start event, token ids, concatenated text) per item."""
    out: list[tuple[ItemStarted, list[int], str]] = []
    for event in events:
        if isinstance(event, ItemStarted):
            out.append((event, [], ""))
        elif isinstance(event, TokensSampled):
            start, ids, text = out[-1]
            out[-1] = (start, ids + list(event.token_ids), text + event.text)
    return out


# --------------------------------------------------------------------------- text and grammar


async def test_texts_concatenate_to_the_plan_and_reencode() -> None:
    planned = [message(MULTIBYTE), call("exec_command", '{"cmd":"rg -n \\"é\\" src"}'), message("ok")]
    model = SimulatedModel(clock=ManualClock(), policy=script(planned))
    events = events_of(await collect(model, make_request()))
    assert_grammar(events)
    assert events[-1] == SamplingFinished("stop")
    items = items_of(events)
    assert [(s.kind, s.name, text) for s, _, text in items] == [(p.kind, p.name, p.text) for p in planned]
    for _, ids, text in items:
        assert ids == TOKENIZER.encode_list(text)
    # Tokens ending mid-character carry "" and the completing token the character.
    texts = [e.text for e in events if isinstance(e, TokensSampled)]
    assert "" in texts
    assert "\ufffd" not in "".join(texts)


async def test_default_policy_turns_keep_the_grammar() -> None:
    model = SimulatedModel(clock=ManualClock(), policy=DefaultPolicy(tool_calls=3))
    for key in range(10):
        for turn in range(5):
            events = events_of(await collect(model, make_request(conversation_key=key, turn_index=turn)))
            assert_grammar(events)
            ((start, ids, text),) = items_of(events)
            assert start.kind == ("function_call" if turn < 3 else "message")
            assert ids == TOKENIZER.encode_list(text)
            if start.kind == "function_call":
                assert isinstance(msgspec.json.decode(text), dict)


async def test_empty_plan_and_empty_item() -> None:
    class Silent:
        def plan(self, request: ModelRequest, rng: np.random.Generator) -> list[PlannedItem]:
            return []

    silent: Policy = Silent()
    model = SimulatedModel(clock=ManualClock(), policy=silent)
    assert events_of(await collect(model, make_request())) == [SamplingFinished("stop")]
    model = SimulatedModel(clock=ManualClock(), policy=script(message("")))
    assert events_of(await collect(model, make_request())) == [
        ItemStarted("message"),
        ItemFinished(),
        SamplingFinished("stop"),
    ]


# --------------------------------------------------------------------------- determinism


async def test_tokens_depend_only_on_seed_conversation_turn() -> None:
    def ids(timed: list[tuple[float, ModelEvent]]) -> list[int]:
        return [t for _, e in timed if isinstance(e, TokensSampled) for t in e.token_ids]

    policy = DefaultPolicy(tool_calls=2)
    reference = SimulatedModel(clock=ManualClock(), policy=policy, seed=5)
    # Different clock, lateness, rates and history: same tokens.
    other = SimulatedModel(
        clock=ManualClock(start=1e6, wake_lateness_s=0.01),
        policy=policy,
        seed=5,
        decode_tok_per_s=65.0,
        model_latency_s=0.3,
        prefill_tok_per_s=20_000.0,
    )
    await collect(other, make_request(conversation_key=9, turn_index=3))  # unrelated earlier traffic
    for turn in range(4):
        a = ids(await collect(reference, make_request(turn_index=turn)))
        b = ids(await collect(other, make_request(turn_index=turn, prompt_tokens=5000, cached_tokens=100)))
        assert a == b
    seeded = SimulatedModel(clock=ManualClock(), policy=policy, seed=6)
    assert ids(await collect(seeded, make_request())) != ids(await collect(reference, make_request()))
    other_key = make_request(conversation_key=43)
    assert ids(await collect(reference, other_key)) != ids(await collect(reference, make_request()))


def test_turn_rng_accepts_negative_keys() -> None:
    a = turn_rng(0, -1, 0).integers(1 << 62)
    b = turn_rng(0, (1 << 64) - 1, 0).integers(1 << 62)
    assert a == b  # documented: two's complement mapping
    assert turn_rng(0, -1, 0).integers(1 << 62) != turn_rng(0, 1, 0).integers(1 << 62)


# --------------------------------------------------------------------------- timing


async def test_first_token_waits_for_latency_and_uncached_prefill() -> None:
    clock = ManualClock(start=100.0)
    model = SimulatedModel(
        clock=clock,
        policy=script(message("hello world")),
        model_latency_s=0.25,
        prefill_tok_per_s=20_000.0,
        decode_tok_per_s=math.inf,
    )
    request = make_request(prompt_tokens=8000, cached_tokens=6000)
    t0 = 100.0 + 0.25 + 2000 / 20_000.0
    assert model.first_token_delay_s(request) == 0.25 + 2000 / 20_000.0
    timed = await collect(model, request)
    assert clock.wakeups == [Wakeup(t0, t0)]
    assert [t for t, _ in timed] == [t0] * len(timed)


async def test_first_token_at_once_when_free() -> None:
    clock = ManualClock(start=3.0)
    model = SimulatedModel(clock=clock, policy=script(message("hello world")), decode_tok_per_s=math.inf)
    timed = await collect(model, make_request(prompt_tokens=10**6))
    assert clock.wakeups == []
    assert {t for t, _ in timed} == {3.0}


async def test_paced_decode_uses_absolute_deadlines_despite_late_wakeups() -> None:
    rate = 1000.0
    lateness = 0.003
    clock = ManualClock(start=10.0, wake_lateness_s=lateness)
    model = SimulatedModel(clock=clock, policy=script(message(HELLO_5000)), decode_tok_per_s=rate, model_latency_s=0.5)
    timed = await collect(model, make_request())
    t0 = 10.0 + 0.5
    token_times = [t for t, e in timed if isinstance(e, TokensSampled)]
    n = len(token_times)
    assert n == 5000
    due = [t0 + i / rate for i in range(n)]
    # Never early, and never more than one wake-up lateness late.
    assert all(d <= t <= d + lateness + 1e-9 for d, t in zip(due, token_times, strict=True))
    # The last token is due at exactly t0 + 4999/1000; lateness does not accumulate.
    assert due[-1] == t0 + 4999 / 1000
    assert due[-1] <= token_times[-1] <= due[-1] + lateness
    long_run_rate = (n - 1) / (token_times[-1] - t0)
    assert abs(long_run_rate / rate - 1) < 0.005
    # Each wake-up yields every token already due: tokens come in batches, one per
    # wake-up, and the token after a batch is not yet due when the batch ends.
    batch_starts = [0] + [i for i in range(1, n) if token_times[i] != token_times[i - 1]]
    assert len(clock.wakeups) == len(batch_starts)  # the first wake-up is the TTFT wait
    for k, start in enumerate(batch_starts):
        assert clock.wakeups[k].deadline == due[start]  # an absolute deadline, exactly
        end = batch_starts[k + 1] if k + 1 < len(batch_starts) else n
        assert due[end - 1] <= token_times[start]
        if end < n:
            assert due[end] > token_times[start]
    assert len(batch_starts) < n / 3  # ~4 tokens per wake-up at 3 ms lateness, 1 ms spacing


async def test_paced_decode_without_lateness_is_exact() -> None:
    clock = ManualClock()
    model = SimulatedModel(clock=clock, policy=script(message(" hello" * 100)), decode_tok_per_s=65.0)
    timed = await collect(model, make_request())
    token_times = [t for t, e in timed if isinstance(e, TokensSampled)]
    assert token_times == [i / 65.0 for i in range(100)]
    assert timed[-1][0] == 99 / 65.0  # SamplingFinished right after the last token


async def test_pacing_spans_items() -> None:
    """Token i of the turn is due at t0 + i/rate, counting across items."""
    clock = ManualClock()
    model = SimulatedModel(clock=clock, policy=script([message(" hello" * 3), call("f", "{}")]), decode_tok_per_s=10.0)
    timed = await collect(model, make_request())
    token_times = [t for t, e in timed if isinstance(e, TokensSampled)]
    n_call = len(TOKENIZER.encode("{}"))
    assert token_times == [i / 10.0 for i in range(3 + n_call)]


async def test_unpaced_decode_never_sleeps() -> None:
    clock = ManualClock(wake_lateness_s=0.003)
    model = SimulatedModel(
        clock=clock, policy=script(message(HELLO_5000)), decode_tok_per_s=math.inf, model_latency_s=0.05
    )
    timed = await collect(model, make_request())
    assert clock.wakeups == [Wakeup(0.05, 0.05 + 0.003)]  # the TTFT wait only
    assert {t for t, _ in timed} == {0.05 + 0.003}
    assert sum(isinstance(e, TokensSampled) for _, e in timed) == 5000


# --------------------------------------------------------------------------- max_output_tokens


async def test_max_output_tokens_truncates_text() -> None:
    text = " hello" * 50
    model = SimulatedModel(clock=ManualClock(), policy=script(message(text)))
    events = events_of(await collect(model, make_request(max_output_tokens=10)))
    assert_grammar(events)
    ((_, ids, got),) = items_of(events)
    assert ids == TOKENIZER.encode_list(text)[:10]
    assert got == " hello" * 10
    assert events[-1] == SamplingFinished("max_output_tokens")
    assert model.statistics().output_tokens == 10


def is_utf8(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True


async def test_max_output_tokens_cut_inside_a_character() -> None:
    ids_all = TOKENIZER.encode_list(MULTIBYTE)
    raw = [TOKENIZER.token_bytes(i) for i in ids_all]
    # Cut after the first token that ends inside a character.
    cut = next(k for k in range(1, len(raw)) if not is_utf8(b"".join(raw[:k])))
    model = SimulatedModel(clock=ManualClock(), policy=script(message(MULTIBYTE)))
    events = events_of(await collect(model, make_request(max_output_tokens=cut)))
    ((_, ids, got),) = items_of(events)
    assert ids == ids_all[:cut]
    assert got == b"".join(raw[:cut]).decode(errors="replace")
    assert got.endswith("\ufffd")  # the partial character is flushed, not lost


@pytest.mark.parametrize(
    ("budget", "expected_items", "reason"),
    [
        (0, [], "max_output_tokens"),
        (3, [" a b c"], "max_output_tokens"),  # exactly the first item: the second is dropped
        (5, [" a b c", " d e"], "max_output_tokens"),
        (6, [" a b c", " d e f"], "stop"),  # exactly everything
        (None, [" a b c", " d e f"], "stop"),
    ],
)
async def test_max_output_tokens_across_items(budget: int | None, expected_items: list[str], reason: str) -> None:
    assert len(TOKENIZER.encode(" a b c")) == 3
    planned = [message(" a b c"), message(" d e f")]
    model = SimulatedModel(clock=ManualClock(), policy=script(planned))
    events = events_of(await collect(model, make_request(max_output_tokens=budget)))
    assert_grammar(events)
    assert [text for _, _, text in items_of(events)] == expected_items
    assert events[-1] == SamplingFinished(reason)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- bookkeeping and checks


async def test_statistics() -> None:
    model = SimulatedModel(clock=ManualClock(), policy=script(message(" hello" * 7)))
    assert model.statistics() == ModelStatistics()
    await collect(model, make_request(prompt_tokens=100, cached_tokens=60))
    await collect(model, make_request(prompt_tokens=30, turn_index=5))  # "(script exhausted)"
    exhausted = len(TOKENIZER.encode("(script exhausted)"))
    assert model.statistics() == ModelStatistics(
        requests=2, prompt_tokens=130, prefilled_tokens=70, output_tokens=7 + exhausted
    )


async def test_closing_early_counts_only_yielded_tokens() -> None:
    model = SimulatedModel(clock=ManualClock(), policy=script(message(" hello" * 50)))
    stream = model.sample(make_request())
    seen = 0
    async for event in stream:
        seen += isinstance(event, TokensSampled)
        if seen == 4:
            break
    await stream.aclose()
    assert model.statistics().output_tokens == 4


async def test_bad_cached_tokens_rejected_before_any_event() -> None:
    model = SimulatedModel(clock=ManualClock(), policy=script(message("x")))
    with pytest.raises(ValueError, match=r"^cached_tokens=13 outside \[0, prompt_tokens=12\]$"):
        await collect(model, make_request(prompt_tokens=12, cached_tokens=13))
    with pytest.raises(ValueError, match="^max_output_tokens must be >= 0, got -1$"):
        await collect(model, make_request(max_output_tokens=-1))
    assert model.statistics().requests == 0


@pytest.mark.parametrize(
    ("kwargs", "message_re"),
    [
        ({"decode_tok_per_s": 0.0}, "^decode_tok_per_s must be > 0, got 0.0$"),
        ({"prefill_tok_per_s": -1.0}, "^prefill_tok_per_s must be > 0, got -1.0$"),
        ({"model_latency_s": -0.1}, r"^model_latency_s must be finite and >= 0, got -0.1$"),
        ({"model_latency_s": math.nan}, "^model_latency_s must be finite and >= 0, got nan$"),
    ],
)
def test_constructor_checks(kwargs: dict[str, Any], message_re: str) -> None:
    with pytest.raises(ValueError, match=message_re):
        SimulatedModel(clock=ManualClock(), policy=DefaultPolicy(), **kwargs)


# --------------------------------------------------------------------------- clocks


async def test_manual_clock() -> None:
    clock = ManualClock(start=2.0)
    assert clock.now() == 2.0
    assert clock.time() == MANUAL_CLOCK_EPOCH_S + 2.0
    clock.advance(0.5)
    assert clock.now() == 2.5
    with pytest.raises(ValueError, match="^cannot advance by -1$"):
        clock.advance(-1)
    await clock.sleep_until(1.0)  # in the past: no sleep, no lateness
    assert clock.now() == 2.5 and clock.wakeups == []
    clock.wake_lateness_s = 0.25
    await clock.sleep_until(4.0)
    assert clock.now() == 4.25
    assert clock.wakeups == [Wakeup(4.0, 4.25)]
    with pytest.raises(ValueError, match="wake_lateness_s must be >= 0"):
        ManualClock(wake_lateness_s=-1.0)


async def test_asyncio_clock_reads_the_loop() -> None:
    clock = AsyncioClock()
    loop = asyncio.get_running_loop()
    before = loop.time()
    assert before <= clock.now() <= loop.time()
    assert abs(clock.time() - time.time()) < 1.0
    await clock.sleep_until(clock.now())  # already due: returns at once, no timer


async def test_asyncio_clock_sleep_is_cancellable() -> None:
    clock = AsyncioClock()
    task = asyncio.create_task(clock.sleep_until(clock.now() + 3600.0))
    await asyncio.sleep(0)  # let the task arm its timer
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_model_runs_on_the_asyncio_clock_unpaced() -> None:
    model = SimulatedModel(clock=AsyncioClock(), policy=script(message(MULTIBYTE)), decode_tok_per_s=math.inf)
    events = [event async for event in model.sample(make_request())]
    assert_grammar(events)
    assert items_of(events)[0][2] == MULTIBYTE
