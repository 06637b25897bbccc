"""`sim.runtime.memo`: memoized tokenizing and classifying for virtual runs with free CPU. Same results as
the real work, bounded tables, and never in a live run."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from prototype.context.safety import ClassifierState, SafetyClassifier
from prototype.context.tokenizer import get_tokenizer
from prototype.serve.wallclock import AsyncioClock
from sim.harness.experiment import CompareConfig, run_compare
from sim.model.accelerator import turn_rng
from sim.model.kv import PrefixCache
from sim.model.policy import DefaultPolicy, ScriptPolicy
from sim.runtime.memo import MemoClassifier, MemoPolicy, MemoPrefixCache, MemoTokenizer, _Lru
from sim.runtime.virtual import VirtualClock, run_virtual
from tests.support import EXEC_COMMAND, GET_WEATHER, make_request

CONFIG = CompareConfig.of(rollouts=2, tool_calls=4, tps=1000.0, system_prompt_tokens=300, tool_time_s=0.2)


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


def test_classifier_keys_read_only_chunks_on_identity_and_others_on_content() -> None:
    rng = np.random.default_rng(4)
    real, memo = SafetyClassifier(), MemoClassifier()
    chunks = [rng.integers(0, 200_000, size=n).astype(np.uint32) for n in (300, 1, 2_000)]
    for chunk in chunks:
        chunk.flags.writeable = False  # as MemoTokenizer's shared arrays
    passes = []
    for _ in range(2):  # the second pass: every step looked up by the identities of (state, chunk)
        a, b = real.begin(), memo.begin()
        states = []
        for chunk in chunks:
            a, b = real.update(a, chunk), memo.update(b, chunk)
            states.append(b)
        assert a == b
        passes.append(states)
    assert all(x is y for x, y in zip(*passes, strict=True))  # the very states of the first pass
    assert memo._memo.misses == len(chunks) and memo._memo.hits == 0  # the chain answered the second
    after_2 = memo.update(memo.begin(), chunks[2])  # a known chunk after another state: computed
    other = memo.update(after_2, chunks[1])
    assert other == real.update(real.update(real.begin(), chunks[2]), chunks[1])
    assert memo._memo.hits == 0 and memo._memo.misses == len(chunks) + 2
    again = memo.update(ClassifierState(tail=after_2.tail, tokens_read=7), chunks[1])  # same tail, new state
    assert memo._memo.hits == 1  # the step is looked up by (tail, chunk) and added to this state
    assert again == real.update(ClassifierState(tail=after_2.tail, tokens_read=7), chunks[1])

    reopened = chunks[1].copy()
    reopened.flags.writeable = False
    after = memo.update(memo.begin(), reopened)  # chained by identity...
    reopened.flags.writeable = True
    reopened[:] = 7
    assert memo.update(memo.begin(), reopened) == real.update(real.begin(), reopened) != after  # ...not any more

    mutable = chunks[0].copy()  # writeable: its content may change under the same identity
    before = memo.update(memo.begin(), mutable)
    mutable[:] = chunks[2][:300]
    assert memo.update(memo.begin(), mutable) == real.update(real.begin(), mutable) != before
    with pytest.raises(ValueError, match="tail"):  # a state from another classifier: the real check
        memo.update(ClassifierState(tail=tuple(range(memo.ngram))), chunks[0])


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


async def test_a_run_that_charges_cpu_refuses_to_memoize() -> None:
    with pytest.raises(ValueError, match="memoize"):
        await run_compare(CONFIG, VirtualClock(), virtual=True, memoize=True, charge_cpu=True)


async def test_a_live_run_refuses_the_in_process_run_mode() -> None:
    with pytest.raises(ValueError, match="charge_cpu"):
        await run_compare(CONFIG, AsyncioClock(), virtual=False, charge_cpu=True)


async def test_a_live_run_refuses_a_tap() -> None:
    with pytest.raises(ValueError, match="tap"):
        await run_compare(CONFIG, AsyncioClock(), virtual=False, tap=lambda direction, data: None)


def test_plans_equal_the_real_plan_and_leave_the_rng_where_it_would_be() -> None:
    real, table = DefaultPolicy(tool_calls=3), _Lru(1_000_000)
    memo = MemoPolicy(real, table)
    requests = [
        make_request(turn_index=turn, conversation_key=key, tools=tools, tool_choice=choice)
        for turn in (0, 2, 3, 5)  # calls on turns 0-2, then text
        for key in (1, 2)
        for tools in ((EXEC_COMMAND, GET_WEATHER), (GET_WEATHER,))
        for choice in ("auto", "required", "get_weather")
    ]
    for seed in (0, 1):
        for _ in range(2):  # cold, then every plan looked up
            for request in requests:
                rng_a = turn_rng(seed, request.conversation_key, request.turn_index)
                rng_b = turn_rng(seed, request.conversation_key, request.turn_index)
                assert memo.plan(request, rng_b) == real.plan(request, rng_a)
                assert rng_b.integers(1 << 62) == rng_a.integers(1 << 62)  # the same draws come next
    assert memo.hit_rate == pytest.approx(0.5)  # each (seed, request) planned once, looked up once

    other = MemoPolicy(DefaultPolicy(tool_calls=1), table)  # another setting, one table: its own plans
    request = make_request(turn_index=2)
    assert other.plan(request, turn_rng(0, 1234, 2))[0].kind == "message"
    assert memo.plan(request, turn_rng(0, 1234, 2))[0].kind == "function_call"


def test_a_policy_that_names_no_key_is_planned_every_time() -> None:
    script = ScriptPolicy([])  # no plan_key: nothing to memoize on
    memo = MemoPolicy(script, _Lru(1_000))
    for _ in range(3):
        assert memo.plan(make_request(), turn_rng(0, 1, 0)) == script.plan(make_request(), turn_rng(0, 1, 0))
    assert memo.hit_rate == 0.0


def test_prepared_prompts_are_looked_up_by_their_read_only_chunks() -> None:
    rng = np.random.default_rng(5)
    head, tail = (rng.integers(0, 200_000, size=n).astype(np.uint32) for n in (1_000, 37))
    head.flags.writeable = tail.flags.writeable = False  # as MemoTokenizer's arrays are
    table = _Lru(1_000_000)
    memo, plain = MemoPrefixCache(table=table), PrefixCache()
    first = memo.prepare((head, tail))
    assert np.array_equal(first.keys, plain.prepare((head, tail)).keys)
    assert first.prompt_tokens == plain.prepare((head, tail)).prompt_tokens
    assert MemoPrefixCache(table=table).prepare((head, tail)) is first  # another cache, same table: a hit
    assert np.array_equal(memo.prepare((head,)).keys, plain.prepare((head,)).keys)  # other chunks: hashed

    mutable = head.copy()  # writeable: its content may change under the same identity
    before = memo.prepare((mutable,))
    mutable[0] += 1
    after = memo.prepare((mutable,))
    assert not np.array_equal(before.keys, after.keys)
    assert np.array_equal(after.keys, plain.prepare((mutable,)).keys)


def test_an_extended_prompt_is_looked_up_by_its_prepared_prompt_and_tokens() -> None:
    rng = np.random.default_rng(6)
    head, more, other = (rng.integers(0, 200_000, size=n).astype(np.uint32) for n in (1_000, 45, 45))
    head.flags.writeable = False
    table = _Lru(1_000_000)
    memo, plain = MemoPrefixCache(table=table), PrefixCache()
    prepared = memo.prepare((head,))
    extended = memo.extend(prepared, (head,), more)
    assert np.array_equal(extended.keys, plain.extend(plain.prepare((head,)), (head,), more).keys)
    assert MemoPrefixCache(table=table).extend(prepared, (head,), more.copy()) is extended  # same tokens: a hit
    assert memo.extend(prepared, (head,), other).keys[-1] != extended.keys[-1]  # other tokens: hashed
    fresh = plain.prepare((head,))  # an equal prompt prepared elsewhere: another identity, hashed anew
    assert memo.extend(fresh, (head,), more) is not extended


def test_items_equal_the_validated_ones_and_errors_name_their_index() -> None:
    from msgspec import Raw

    from prototype.context.conversation import parse_items
    from prototype.wire.errors import ProtocolError
    from sim.runtime.memo import MemoItems

    good = Raw(b'{"type":"function_call_output","call_id":"c1","output":"ok \\u00e9"}')
    message = Raw(b'{"type":"message","role":"user","content":[{"type":"input_text","text":"hi"}]}')
    bad = Raw(b'{"type":"message","role":"robot","content":"x"}')
    memo = MemoItems(_Lru(1 << 20))
    assert memo([good, message]) == parse_items([good, message])
    assert memo([message, good, message]) == parse_items([message, good, message])
    assert memo._memo.hits == 3 and memo._memo.misses == 2
    assert memo("just text") == parse_items("just text")
    for value in ([good, bad], [bad, good]):  # a known good item before or after: the bad one still fails
        with pytest.raises(ProtocolError) as memoized:
            memo(value)
        with pytest.raises(ProtocolError) as plain:
            parse_items(value)
        assert memoized.value.body() == plain.value.body()
        assert memoized.value.param == plain.value.param == f"input[{value.index(bad)}].role"


def test_item_table_hints_find_what_the_table_finds() -> None:
    """A list that starts with its conversation's last list takes that list's items (the same
    objects, not looked up again) and looks up only the items after them; an item that changed
    in its place, another conversation in between, or a shorter list: every item looked up by
    its bytes. The items are those plain lookups find, and an invalid new item fails as plain."""
    from msgspec import Raw

    from prototype.context.conversation import parse_items
    from prototype.wire.errors import ProtocolError
    from sim.runtime.memo import MemoItems

    def item(call: str, output: str) -> Raw:
        return Raw(b'{"type":"function_call_output","call_id":"%s","output":"%s"}' % (call.encode(), output.encode()))

    a = [Raw(b'{"type":"message","role":"user","content":"task a"}'), item("c1", "one"), item("c2", "two")]
    b = [Raw(b'{"type":"message","role":"user","content":"task b"}'), item("c1", "one")]
    memo = MemoItems(_Lru(1 << 20))
    first = memo(a)
    assert memo(b)[1] is first[1]  # equal bytes: the same Item, whichever list it is in
    assert (memo._memo.hits, memo._memo.misses) == (1, 4)
    again = memo([*a, item("c3", "three")])
    assert again[:3] == first and all(x is y for x, y in zip(again, first, strict=False))
    assert (memo._memo.hits, memo._memo.misses) == (1, 5)  # only the new item was looked up
    changed = memo([a[0], item("c1", "uno"), a[2]])
    assert changed[0] is first[0] and changed[1] is not first[1] and changed[2] is first[2]
    assert (memo._memo.hits, memo._memo.misses) == (3, 6)
    assert changed == parse_items([a[0], item("c1", "uno"), a[2]])
    bad = Raw(b'{"type":"message","role":"robot","content":"x"}')
    longer = [a[0], item("c1", "uno"), a[2], bad]
    with pytest.raises(ProtocolError) as memoized:
        memo(longer)
    with pytest.raises(ProtocolError) as plain:
        parse_items(longer)
    assert memoized.value.body() == plain.value.body() and memoized.value.param == "input[3].role"
    assert memo([]) == ()


def test_rendered_items_are_looked_up_by_identity() -> None:
    from msgspec import Raw

    from prototype.context.conversation import parse_items
    from sim.runtime.memo import MemoRendered

    raw = Raw(b'{"type":"function_call_output","call_id":"c1","output":"ok"}')
    (item,) = parse_items([raw])
    (equal,) = parse_items([raw])  # equal, not the same object
    rendered = MemoRendered(_Lru(1 << 20))
    tokens = get_tokenizer().encode("<|start|>tool<|message|>ok<|end|>")
    assert rendered.get(item) is None
    rendered.put(item, tokens)
    assert rendered.get(item) is tokens and not tokens.flags.writeable
    assert rendered.get(equal) is None


def test_classifier_chain_table_is_bounded_and_still_exact() -> None:
    rng = np.random.default_rng(5)
    real, memo = SafetyClassifier(), MemoClassifier(chain_entries=3)
    chunks = [rng.integers(0, 200_000, size=n).astype(np.uint32) for n in (50, 60, 70, 80, 90)]
    for chunk in chunks:
        chunk.flags.writeable = False
    for _ in range(3):
        a, b = real.begin(), memo.begin()
        for chunk in chunks:
            a, b = real.update(a, chunk), memo.update(b, chunk)
            assert len(memo._chain) <= 3
        assert a == b


def test_classifier_runs_start_from_a_known_read_and_equal_the_real_reads() -> None:
    """A read of several read-only chunks is kept whole: a later read from the same state that
    starts with the same chunks takes its state and steps through the rest only. Whatever the
    order of reads, a caller's list changed afterwards or a writeable chunk changed under its
    identity, the state is the real classifier's."""
    rng = np.random.default_rng(8)
    real, memo = SafetyClassifier(), MemoClassifier()
    chunks = [rng.integers(0, 200_000, size=n).astype(np.uint32) for n in (40, 1, 70, 2, 90, 30)]
    for chunk in chunks:
        chunk.flags.writeable = False
    head = memo.update(memo.begin(), chunks[0])
    for end in (2, 4, 6, 3, 6, 5):  # growing reads, then shorter and longer ones
        want = real.update_all(real.update(real.begin(), chunks[0]), chunks[1:end])
        assert memo.update_all(head, chunks[1:end]) == want
        assert memo.update_all(memo.begin(), chunks[:end]) == real.update_all(real.begin(), chunks[:end])
    assert memo._runs  # the reads were kept
    history = chunks[:3]
    memo.update_all(memo.begin(), history)
    history.append(chunks[4])  # the caller's list grows after the read: the kept read does not
    assert memo.update_all(memo.begin(), history) == real.update_all(real.begin(), history)
    mutable = chunks[2].copy()  # writeable: its content may change under the same identity
    read = [chunks[0], chunks[1], mutable, chunks[3]]
    memo.update_all(memo.begin(), read)
    mutable[0] ^= 1
    assert memo.update_all(memo.begin(), read) == real.update_all(real.begin(), read)


def test_a_run_with_cpu_charged_does_the_real_work_and_never_reads_the_tables() -> None:
    from sim.runtime.memo import memo_classifier, memo_tokenizer

    def lookups() -> tuple[int, ...]:
        tables = [memo_tokenizer()._memo, memo_classifier()._memo]
        return tuple(n for t in tables for n in (t.hits, t.misses))

    seen = lookups()
    run_virtual(run_compare(CONFIG, VirtualClock(), virtual=True, pace_by_turn=True, charge_cpu=True), charge_cpu=True)
    assert lookups() == seen
    _run(True)  # the same config with CPU free does use them
    assert lookups() != seen
