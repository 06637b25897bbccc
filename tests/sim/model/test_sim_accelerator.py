"""Tests for `sim.model.accelerator` (with `sim.runtime.clock.ManualClock`) and the server's wall clock
(`prototype.serve.wallclock.AsyncioClock`).

Every timing assertion runs on virtual time: `ManualClock.sleep_until` jumps,
so 5 s of paced decoding takes milliseconds and the numbers are exact.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import re
import time
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt
import pytest

from prototype.context.tokenizer import get_tokenizer
from prototype.model import (
    FunctionTool,
    ItemFinished,
    ItemStarted,
    ModelEvent,
    ModelRequest,
    Prefilled,
    SamplingFinished,
    TokensSampled,
)
from prototype.serve.wallclock import AsyncioClock
from sim.model.accelerator import LatenessRecorder, ModelStatistics, SimulatedModel, _due_by, jitter_rng, turn_rng
from sim.model.kv import PrefixCache, PrefixCacheStatistics
from sim.model.policy import DefaultPolicy, PlannedItem, Policy, ScriptPolicy
from sim.runtime.clock import MANUAL_CLOCK_EPOCH_S, ManualClock, Wakeup
from tests.support import EXEC_COMMAND_SCHEMA

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
    resident_tokens: int = 0,
    turn_index: int = 0,
    conversation_key: int = 42,
    max_output_tokens: int | None = None,
    tools: tuple[FunctionTool, ...] = (EXEC_COMMAND,),
    prompt: tuple[npt.NDArray[np.uint32], ...] | None = None,
    conversation_id: str = "",
    hold_kv: bool = False,
) -> ModelRequest:
    """A request; the default prompt is two `arange` chunks, so prompts of different lengths share no block."""
    if prompt is None:
        half = prompt_tokens // 2
        prompt = (
            np.arange(half, dtype=np.uint32),
            np.arange(prompt_tokens - half, dtype=np.uint32),
        )
    else:
        prompt_tokens = sum(len(chunk) for chunk in prompt)
    return ModelRequest(
        prompt=prompt,
        prompt_tokens=prompt_tokens,
        resident_tokens=resident_tokens,
        turn_index=turn_index,
        conversation_key=conversation_key,
        tools=tools,
        max_output_tokens=max_output_tokens,
        conversation_id=conversation_id,
        hold_kv=hold_kv,
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


GRAMMAR = re.compile(r"P(S(T)*F)*D")


def assert_grammar(events: list[ModelEvent]) -> None:
    """``Prefilled (ItemStarted TokensSampled* ItemFinished)* SamplingFinished``, one token per TokensSampled."""
    letters = {Prefilled: "P", ItemStarted: "S", TokensSampled: "T", ItemFinished: "F", SamplingFinished: "D"}
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
    assert events_of(await collect(model, make_request())) == [Prefilled(0), SamplingFinished("stop")]
    model = SimulatedModel(clock=ManualClock(), policy=script(message("")))
    assert events_of(await collect(model, make_request())) == [
        Prefilled(0),
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
        b = ids(await collect(other, make_request(turn_index=turn, prompt_tokens=5000, resident_tokens=100)))
        assert a == b
    seeded = SimulatedModel(clock=ManualClock(), policy=policy, seed=6)
    assert ids(await collect(seeded, make_request())) != ids(await collect(reference, make_request()))
    other_key = make_request(conversation_key=43)
    assert ids(await collect(reference, other_key)) != ids(await collect(reference, make_request()))


async def test_each_plan_draws_from_its_turns_rng() -> None:
    """The model reuses one generator, reset for each turn to `turn_rng(seed, conversation, turn)`:
    a plan's draws are that rng's, whatever turns came before (the same key twice included)."""
    drawn: list[int] = []

    class Recording:
        def plan(self, request: ModelRequest, rng: np.random.Generator) -> list[PlannedItem]:
            drawn.append(int(rng.integers(1 << 62)))
            return [message("ok")]

    model = SimulatedModel(clock=ManualClock(), policy=Recording(), seed=9)
    keys = [(42, 0), (43, 0), (42, 1), (42, 0), (-5, 3)]
    for conversation, turn in keys:
        await collect(model, make_request(conversation_key=conversation, turn_index=turn))
    assert drawn == [int(turn_rng(9, c, t).integers(1 << 62)) for c, t in keys]


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
    request = make_request(prompt_tokens=8000, resident_tokens=6000)  # held KV; nothing in the prefix cache
    prefill_s = 0.25 + 2000 / 20_000.0
    assert model.prefill_s(8000, 6000) == prefill_s
    t0 = 100.0 + 0.0 + prefill_s  # start + queued_s + prefill_s
    timed = await collect(model, request)
    assert clock.wakeups == [Wakeup(t0, t0)]
    assert [t for t, _ in timed] == [t0] * len(timed)
    assert timed[0][1] == Prefilled(cached_tokens=6000, queued_s=0.0, prefill_s=prefill_s)


async def test_the_attention_term_prices_each_uncached_token_over_the_context_before_it() -> None:
    """`prefill_s_per_token_ctx`: 2,000 uncached tokens after 6,000 held attend to 7,000 on average."""
    clock = ManualClock(start=0.0)
    model = SimulatedModel(
        clock=clock,
        policy=script(message("hello world")),
        model_latency_s=0.25,
        prefill_tok_per_s=20_000.0,
        prefill_s_per_token_ctx=1e-8,
        decode_tok_per_s=math.inf,
    )
    prefill_s = 0.25 + 2000 / 20_000.0 + 1e-8 * 2000 * 7000
    assert model.prefill_s(8000, 6000) == pytest.approx(prefill_s)
    timed = await collect(model, make_request(prompt_tokens=8000, resident_tokens=6000))
    assert timed[0][1] == Prefilled(cached_tokens=6000, queued_s=0.0, prefill_s=pytest.approx(prefill_s))
    # The same uncached tokens after a longer context cost more; a cold prompt pays n² / 2.
    assert model.prefill_s(10_000, 8000) > model.prefill_s(8000, 6000)
    assert model.prefill_s(2000, 0) == pytest.approx(0.25 + 0.1 + 1e-8 * 2000 * 1000)


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
    token_times = [t for t, e in timed if isinstance(e, TokensSampled) for _ in e.token_ids]
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
    # ... and each batch is one event (one delta on the wire), unless coalescing is off.
    assert sum(isinstance(e, TokensSampled) for _, e in timed) == len(batch_starts)
    clock = ManualClock(start=10.0, wake_lateness_s=lateness)
    model = SimulatedModel(
        clock=clock,
        policy=script(message(HELLO_5000)),
        decode_tok_per_s=rate,
        model_latency_s=0.5,
        coalesce_due=False,
    )
    separate = await collect(model, make_request())
    assert [len(e.token_ids) for _, e in separate if isinstance(e, TokensSampled)] == [1] * n
    assert [t for t, e in separate if isinstance(e, TokensSampled)] == token_times
    assert "".join(e.text for _, e in separate if isinstance(e, TokensSampled)) == "".join(
        e.text for _, e in timed if isinstance(e, TokensSampled)
    )


async def test_coalesced_late_tokens_keep_ids_and_text_across_multibyte_characters() -> None:
    text = "日本語のテキスト ✓ résumé — naïve café; " * 40  # characters split across tokens
    got = []
    for coalesce in (True, False):
        clock = ManualClock(wake_lateness_s=0.0037)
        model = SimulatedModel(
            clock=clock, policy=script(message(text)), decode_tok_per_s=1000.0, coalesce_due=coalesce
        )
        sampled = [e for _, e in await collect(model, make_request()) if isinstance(e, TokensSampled)]
        got.append(sampled)
        assert "".join(e.text for e in sampled) == text
    coalesced, separate = got
    assert [t for e in coalesced for t in e.token_ids] == [t for e in separate for t in e.token_ids]
    assert len(coalesced) < len(separate) / 2


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


# --------------------------------------------------------------------------- prefix cache and held KV


class Fixed:
    """The same message every turn, whatever the turn index (a policy for timing tests)."""

    def __init__(self, text: str = " ok") -> None:
        self.text = text

    def plan(self, request: ModelRequest, rng: np.random.Generator) -> list[PlannedItem]:
        return [message(self.text)]


def random_tokens(n: int, seed: int = 3) -> npt.NDArray[np.uint32]:
    return np.random.default_rng(seed).integers(0, 200_000, size=n, dtype=np.uint32)


async def test_prefix_cache_hits_turn_over_turn() -> None:
    """A growing conversation resent in full (http mode): each turn hits the previous prompt's full blocks."""
    clock = ManualClock(start=5.0)
    model = SimulatedModel(
        clock=clock,
        policy=Fixed(),
        model_latency_s=0.3,
        prefill_tok_per_s=20_000.0,
        decode_tok_per_s=math.inf,
        cache_generated=False,  # prompt blocks only: the prompts here are random tokens, not a rendered chat
    )
    conversation = random_tokens(2_000)
    turns = [  # (prompt chunks, cached tokens expected)
        ((conversation[:1_000],), 0),
        ((conversation[:1_000], conversation[1_000:1_300]), 992),  # 62 full blocks of the first prompt
        ((conversation[:1_300], conversation[1_300:2_000]), 1_296),
        ((conversation[:2_000],), 1_984),  # the same prompt again: the last block is recomputed
    ]
    for turn, (prompt, cached) in enumerate(turns):
        start = clock.now()
        timed = await collect(model, make_request(prompt=prompt, turn_index=turn))
        prompt_tokens = sum(len(chunk) for chunk in prompt)
        prefill_s = 0.3 + (prompt_tokens - cached) / 20_000.0
        assert timed[0] == (start + 0.0 + prefill_s, Prefilled(cached_tokens=cached, queued_s=0.0, prefill_s=prefill_s))
        clock.advance(1.0)  # a tool call
    statistics = model.statistics()
    assert statistics.cached_tokens == 992 + 1_296 + 1_984
    assert statistics.prefilled_tokens == 1_000 + 1_300 + 2_000 + 2_000 - statistics.cached_tokens
    assert statistics.kv.hit_tokens == statistics.cached_tokens
    assert statistics.kv.resident_blocks == 2_000 // 16


async def test_resident_hint_and_prefix_cache_combine_by_max() -> None:
    model = SimulatedModel(clock=ManualClock(), policy=Fixed())
    prompt = random_tokens(1_000)

    async def cached(resident: int, n: int = 1_000) -> int:
        event = (await collect(model, make_request(prompt=(prompt[:n],), resident_tokens=resident)))[0][1]
        assert isinstance(event, Prefilled)
        return event.cached_tokens

    assert await cached(0) == 0
    assert await cached(0) == 992  # prefix cache
    assert await cached(995) == 995  # held KV beyond the cache's blocks: the hint is trusted as is
    assert await cached(1_000) == 999  # ... but the last token is always recomputed
    assert await cached(0, n=0) == 0  # an empty prompt


async def test_prefix_caching_off_counts_only_the_hint() -> None:
    model = SimulatedModel(clock=ManualClock(), policy=Fixed(), prefix_caching=False)
    assert model.prefix_cache is None
    prompt = (random_tokens(1_000),)
    for resident in (0, 0, 500, 1_000):
        event = (await collect(model, make_request(prompt=prompt, resident_tokens=resident)))[0][1]
        assert event == Prefilled(cached_tokens=min(resident, 999))
    assert model.statistics().kv == PrefixCacheStatistics()
    assert model.statistics().cached_tokens == 500 + 999
    model.release("anything")  # no cache: nothing to unpin


async def test_hold_kv_pins_the_prompt_until_release() -> None:
    clock = ManualClock()
    cache = PrefixCache(capacity_tokens=4 * 16)
    model = SimulatedModel(clock=clock, policy=Fixed(), prefix_cache=cache, decode_tok_per_s=math.inf)
    held = make_request(prompt=(random_tokens(49, seed=1),), conversation_id="resp_1", hold_kv=True)
    await collect(model, held)  # 3 blocks, pinned at t=0 (the end of its prefill)
    for seed in (2, 3, 4):  # pressure through a 4-block cache
        await collect(model, make_request(prompt=(random_tokens(33, seed=seed),)))
    assert model.statistics().kv.pinned_blocks == 3
    assert cache.match(held.prompt) == 48
    clock.advance(2.5)  # the pause
    model.release("resp_1")
    model.release("resp_1")  # twice, or unknown: ignored
    kv = model.statistics().kv
    assert (kv.pinned_blocks, kv.kv_idle_token_s) == (0, 48 * 2.5)
    assert model.statistics() == dataclasses.replace(model.statistics(), kv=cache.statistics())


async def test_a_shared_cache_serves_every_model() -> None:
    cache = PrefixCache()
    first = SimulatedModel(clock=ManualClock(), policy=Fixed(), prefix_cache=cache)
    second = SimulatedModel(clock=ManualClock(), policy=Fixed(), prefix_cache=cache)
    prompt = (random_tokens(100),)
    await collect(first, make_request(prompt=prompt))
    event = (await collect(second, make_request(prompt=prompt)))[0][1]
    assert event == Prefilled(cached_tokens=96)


# --------------------------------------------------------------------------- decode slots, slowdown, jitter


async def test_decode_slots_queue_fifo() -> None:
    clock = ManualClock()
    rate, latency = 10.0, 0.1
    model = SimulatedModel(
        clock=clock, policy=Fixed(" hello" * 5), decode_tok_per_s=rate, model_latency_s=latency, decode_slots=1
    )
    a = model.sample(make_request(conversation_key=1))
    b = model.sample(make_request(conversation_key=2))
    c = model.sample(make_request(conversation_key=3))
    assert await anext(a) == Prefilled(0, queued_s=0.0, prefill_s=latency)  # A holds the slot
    t0_a = 0.0 + 0.0 + latency
    end_a = t0_a + 5 / rate  # A's 5 tokens decoded
    arrival_b = clock.now()  # 0.1: B arrives while A holds the slot
    assert await anext(b) == Prefilled(0, queued_s=end_a - arrival_b, prefill_s=latency)
    t0_b = arrival_b + (end_a - arrival_b) + latency
    assert clock.now() == t0_b
    arrival_c = clock.now()
    assert await anext(c) == Prefilled(0, queued_s=t0_b + 5 / rate - arrival_c, prefill_s=latency)  # behind B
    assert model.statistics().queued_s_total == (end_a - arrival_b) + (t0_b + 5 / rate - arrival_c)
    for stream in (a, b, c):
        assert [e async for e in stream][-1] == SamplingFinished("stop")  # queued turns still complete


async def test_decode_slots_take_the_earliest_free() -> None:
    clock = ManualClock()
    model = SimulatedModel(clock=clock, policy=Fixed(" hello" * 5), decode_tok_per_s=10.0, decode_slots=2)
    a = model.sample(make_request(conversation_key=1))
    b = model.sample(make_request(conversation_key=2, max_output_tokens=2))  # shorter: frees its slot first
    c = model.sample(make_request(conversation_key=3))
    assert await anext(a) == Prefilled(0)
    assert await anext(b) == Prefilled(0)
    assert await anext(c) == Prefilled(0, queued_s=2 / 10.0)
    for stream in (a, b, c):
        await stream.aclose()


async def test_closing_early_frees_the_slot() -> None:
    async def three_tokens_then(close: bool) -> Prefilled:
        """A (50 tokens at 10/s, slot busy until 5.0) yields 3 tokens; then B arrives at 0.2."""
        clock = ManualClock()
        model = SimulatedModel(clock=clock, policy=Fixed(" hello" * 50), decode_tok_per_s=10.0, decode_slots=1)
        a = model.sample(make_request(conversation_key=1))
        seen = 0
        async for event in a:
            seen += isinstance(event, TokensSampled)
            if seen == 3:
                break
        assert clock.now() == 2 / 10.0
        if close:
            await a.aclose()  # the consumer went away: the slot is free from now on
        b = model.sample(make_request(conversation_key=2))
        first = await anext(b)
        assert isinstance(first, Prefilled)
        await b.aclose()
        await a.aclose()
        return first

    assert await three_tokens_then(close=False) == Prefilled(0, queued_s=50 / 10.0 - 2 / 10.0)
    assert await three_tokens_then(close=True) == Prefilled(0, queued_s=0.0)


async def test_closing_a_queued_turn_frees_its_reservation() -> None:
    clock = ManualClock()
    model = SimulatedModel(clock=clock, policy=Fixed(" hello" * 10), decode_tok_per_s=10.0, decode_slots=1)
    a = model.sample(make_request(conversation_key=1))
    assert await anext(a) == Prefilled(0)  # A holds the slot until 1.0
    b = model.sample(make_request(conversation_key=2))
    assert await anext(b) == Prefilled(0, queued_s=1.0)  # B queued behind A; it would hold the slot until 2.0
    assert clock.now() == 1.0
    await b.aclose()  # ... but is closed before its first token
    c = model.sample(make_request(conversation_key=3))
    assert await anext(c) == Prefilled(0, queued_s=0.0)
    for stream in (a, c):
        await stream.aclose()


async def test_concurrency_slowdown() -> None:
    clock = ManualClock()
    rate, slowdown = 10.0, 0.5
    model = SimulatedModel(
        clock=clock, policy=Fixed(" hello" * 10), decode_tok_per_s=rate, concurrency_slowdown=slowdown
    )
    a = model.sample(make_request(conversation_key=1))
    assert await anext(a) == Prefilled(0)  # A decodes over [0, 1.0) at the full rate
    timed = await collect(model, make_request(conversation_key=2))  # starts at 0: 2 turns decoding
    slowed = rate / (1 + slowdown * 1)
    assert [t for t, e in timed if isinstance(e, TokensSampled)] == [i / slowed for i in range(10)]
    assert [e async for e in a][-1] == SamplingFinished("stop")
    clock.advance(1.0)  # past every planned end
    start = clock.now()
    timed = await collect(model, make_request(conversation_key=3))
    assert [t for t, e in timed if isinstance(e, TokensSampled)] == [start + i / rate for i in range(10)]


async def test_decode_jitter_moves_timing_not_tokens() -> None:
    def ids(timed: list[tuple[float, ModelEvent]]) -> list[int]:
        return [t for _, e in timed if isinstance(e, TokensSampled) for t in e.token_ids]

    def times(timed: list[tuple[float, ModelEvent]]) -> list[float]:
        return [t for t, e in timed if isinstance(e, TokensSampled)]

    policy = DefaultPolicy(tool_calls=2)
    plain = SimulatedModel(clock=ManualClock(), policy=policy, seed=5, decode_tok_per_s=65.0)
    jittered = SimulatedModel(clock=ManualClock(), policy=policy, seed=5, decode_tok_per_s=65.0, decode_jitter=0.3)
    for turn in range(4):
        request = make_request(turn_index=turn)
        a, b = await collect(plain, request), await collect(jittered, request)
        assert ids(a) == ids(b)
        start = b[0][0]
        factor = float(jitter_rng(5, request.conversation_key, turn).lognormal(0.0, 0.3))
        assert times(b) == [start + i / (65.0 * factor) for i in range(len(times(b)))]
        assert times(b)[1:] != [start + t - a[0][0] for t in times(a)][1:]
        again = SimulatedModel(
            clock=ManualClock(start), policy=policy, seed=5, decode_tok_per_s=65.0, decode_jitter=0.3
        )
        assert times(await collect(again, request)) == times(b)  # the jitter is a function of the turn


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
    model = SimulatedModel(clock=ManualClock(), policy=script(message(" hello" * 7)), cache_generated=False)
    assert model.statistics() == ModelStatistics()
    await collect(model, make_request(prompt_tokens=100, resident_tokens=60))
    await collect(model, make_request(prompt_tokens=30, turn_index=5))  # "(script exhausted)"; no common block
    exhausted = len(TOKENIZER.encode("(script exhausted)"))
    assert model.statistics() == ModelStatistics(
        requests=2,
        prompt_tokens=130,
        prefilled_tokens=70,
        output_tokens=7 + exhausted,
        cached_tokens=60,
        kv=PrefixCacheStatistics(lookups=2, hit_tokens=0, miss_tokens=130, resident_blocks=6 + 1),
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


async def test_bad_requests_rejected_before_any_event() -> None:
    model = SimulatedModel(clock=ManualClock(), policy=script(message("x")))
    with pytest.raises(ValueError, match=r"^resident_tokens=13 outside \[0, prompt_tokens=12\]$"):
        await collect(model, make_request(prompt_tokens=12, resident_tokens=13))
    with pytest.raises(ValueError, match="^max_output_tokens must be >= 0, got -1$"):
        await collect(model, make_request(max_output_tokens=-1))
    mismatched = dataclasses.replace(make_request(prompt_tokens=12), prompt_tokens=13)
    with pytest.raises(ValueError, match="^prompt chunks hold 12 tokens, prompt_tokens=13$"):
        await collect(model, mismatched)
    assert model.statistics() == ModelStatistics()


@pytest.mark.parametrize(
    ("kwargs", "message_re"),
    [
        ({"decode_tok_per_s": 0.0}, "^decode_tok_per_s must be > 0, got 0.0$"),
        ({"prefill_tok_per_s": -1.0}, "^prefill_tok_per_s must be > 0, got -1.0$"),
        ({"prefill_s_per_token_ctx": -1e-9}, "^prefill_s_per_token_ctx must be finite and >= 0, got -1e-09$"),
        ({"model_latency_s": -0.1}, r"^model_latency_s must be finite and >= 0, got -0.1$"),
        ({"model_latency_s": math.nan}, "^model_latency_s must be finite and >= 0, got nan$"),
        ({"prefix_cache": PrefixCache(), "prefix_caching": False}, "^prefix_cache given with prefix_caching=False$"),
        ({"decode_slots": 0}, "^decode_slots must be >= 1 or None, got 0$"),
        ({"concurrency_slowdown": -0.5}, "^concurrency_slowdown must be finite and >= 0, got -0.5$"),
        ({"decode_jitter": math.inf}, "^decode_jitter must be finite and >= 0, got inf$"),
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


# --------------------------------------------------------------------------- late tokens, lateness


def test_due_by_counts_exactly_the_tokens_the_pacing_calls_due() -> None:
    rng = np.random.default_rng(5)
    for _ in range(2_000):
        t0 = float(rng.uniform(0, 1e6))
        rate = float(rng.choice([65.0, 1000.0, 3999.7, 4000.0, 1e5]))
        index = int(rng.integers(0, 5_000))
        most = int(rng.integers(1, 50))
        now = t0 + (index + float(rng.uniform(-1, most + 3))) / rate
        if rng.random() < 0.3:
            now = t0 + (index + int(rng.integers(0, most + 3))) / rate  # exactly on a token's due time
        brute = 1
        while brute < most and t0 + (index + brute) / rate <= now:
            brute += 1
        assert _due_by(now, t0, rate, index, most) == brute, (t0, rate, index, most, now)


def test_lateness_recorder_expands_groups_in_order() -> None:
    times = iter([10.0, 10.5, 11.0])
    rec = LatenessRecorder(now=lambda: next(times))
    assert rec.token(9.0) == 10.0
    assert rec.tokens(10.0, 3, 0.25) == 10.5
    assert rec.tokens(11.0, 1, 0.25) == 11.0
    assert rec.late_s.tolist() == [1.0, 0.5, 0.25, 0.0, 0.0]
    rec.clear()
    assert rec.late_s.size == 0


async def test_recorded_lateness_is_each_tokens_hand_on_minus_due() -> None:
    clock = ManualClock(start=3.0, wake_lateness_s=0.0025)
    rec = LatenessRecorder(now=clock.now)
    model = SimulatedModel(clock=clock, policy=script(message(" hello" * 300)), decode_tok_per_s=1000.0, lateness=rec)
    timed = await collect(model, make_request())
    handed = [t for t, e in timed if isinstance(e, TokensSampled) for _ in e.token_ids]
    due = [3.0 + i / 1000.0 for i in range(len(handed))]
    assert np.allclose(rec.late_s, np.subtract(handed, due), atol=1e-12)
    assert rec.turns == [(300, 1000.0, handed[0], handed[-1])]


async def test_a_turns_output_joins_the_cache_as_the_next_prompt_renders_it() -> None:
    """With `cache_generated` (the default) a continuation that sends the previous prompt, the
    output as the context renders it and new input finds all of it cached but the last partial
    block; prompt-only caching stops at the previous prompt."""
    from prototype.context.conversation import generation_header, render_model_output

    header = generation_header(TOKENIZER)
    said = " hello" * 40
    prompt = np.concatenate([random_tokens(320), header])
    rendered = TOKENIZER.encode(render_model_output("message", "", said))
    follow_up = (prompt, rendered[len(header) :], random_tokens(50))
    cached = {}
    for keep in (True, False):
        model = SimulatedModel(clock=ManualClock(), policy=script(message(said)), cache_generated=keep)
        await collect(model, make_request(prompt=(prompt,), turn_index=0))
        timed = await collect(model, make_request(prompt=follow_up, turn_index=1))
        cached[keep] = timed[0][1].cached_tokens
    whole = len(prompt) + len(rendered) - len(header)
    assert cached[True] == whole // 16 * 16
    assert cached[False] == len(prompt) // 16 * 16
