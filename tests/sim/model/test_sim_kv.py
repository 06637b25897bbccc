"""Tests for `sim.model.kv.PrefixCache`: block granularity, chained keys, LRU, pins, overflow, idle KV.

Most tests use 16-token blocks and a capacity of a few blocks so every eviction
can be written out by hand. `test_matches_a_reference_model` checks the cache
against a slow, obviously-correct model keyed by the prefix tuples themselves.
"""

from __future__ import annotations

import time

import numpy as np
import numpy.typing as npt
import pytest

from sim.model import kv
from sim.model.kv import PrefixCache, PrefixCacheStatistics, PreparedPrompt, block_keys, extended_keys

B = 16  # block tokens in these tests
Tokens = npt.NDArray[np.uint32]


def tokens(n: int, *, seed: int = 0) -> Tokens:
    return np.random.default_rng(seed).integers(0, 200_000, size=n, dtype=np.uint32)


def chunks(array: Tokens, *cuts: int) -> tuple[Tokens, ...]:
    """`array` split at `cuts` (the chunking must not matter)."""
    return tuple(np.split(array, list(cuts)))


# --------------------------------------------------------------------------- keys


def test_keys_ignore_chunking_and_cover_full_blocks_only() -> None:
    prompt = tokens(100)
    whole = block_keys((prompt,), B)
    assert len(whole) == 6  # 96 tokens in full blocks; the last 4 are never cached
    assert np.array_equal(whole, block_keys(chunks(prompt, 1, 17, 50, 99), B))
    assert np.array_equal(whole[:2], block_keys((prompt[:40],), B))  # key i depends on tokens < (i+1)*B only
    assert len(block_keys((), B)) == 0
    assert len(block_keys((prompt[:15],), B)) == 0


def test_keys_chain_the_prefix() -> None:
    prompt = tokens(64)
    keys = block_keys((prompt,), B)
    changed = prompt.copy()
    changed[20] += 1  # in block 1
    other = block_keys((changed,), B)
    assert keys[0] == other[0]
    assert (keys[1:] != other[1:]).all()  # every later block differs: the key carries the prefix
    # The same block content at another position, or after another prefix, is another key.
    shifted = np.concatenate([prompt[16:32], prompt[16:32]])
    assert not set(block_keys((shifted,), B).tolist()) & set(keys.tolist())


@pytest.mark.parametrize("block", [1, 5, B])
@pytest.mark.parametrize(("prompt_n", "more_n"), [(0, 40), (15, 1), (32, 0), (37, 60), (100, 3), (250, 250)])
def test_extended_keys_are_the_keys_of_the_whole(block: int, prompt_n: int, more_n: int) -> None:
    """Hashing only the blocks past a prompt's full ones gives the whole's keys, bit for bit, for
    any chunking (its partial last block split over chunks too) and near the uint64 wrap."""
    for low, high in ((0, 200_000), (2**32 - 4, 2**32)):
        rng = np.random.default_rng(prompt_n * 1000 + more_n)
        prompt = rng.integers(low, high, size=prompt_n, dtype=np.uint64).astype(np.uint32)
        more = rng.integers(low, high, size=more_n, dtype=np.uint64).astype(np.uint32)
        parts = chunks(prompt, *sorted({min(prompt_n, c) for c in (1, prompt_n - 3, prompt_n - 1)}))
        whole = block_keys((*parts, more), block)
        extended = extended_keys(block_keys(parts, block), parts, more, block)
        assert extended.dtype == whole.dtype and np.array_equal(extended, whole)
        given = extended_keys(block_keys(parts, block), parts, more, block, prompt_tokens=prompt_n)
        assert np.array_equal(given, whole)


def test_an_extended_prompt_is_the_prepared_whole() -> None:
    cache = PrefixCache(B)
    prompt, said = chunks(tokens(70), 30), tokens(41, seed=1)
    extended = cache.extend(cache.prepare(prompt), prompt, said)
    assert extended.prompt_tokens == 111
    assert np.array_equal(extended.keys, cache.prepare((*prompt, said)).keys)
    with pytest.raises(ValueError, match="^prompt prepared for 16-token blocks, cache uses 32$"):
        PrefixCache(32).extend(extended, prompt, said)


def test_keys_are_distinct_for_repetitive_and_long_prompts() -> None:
    for prompt in (np.zeros(4096, dtype=np.uint32), np.tile(np.arange(B, dtype=np.uint32), 256), tokens(60_000)):
        keys = block_keys((prompt,), B).tolist()
        assert len(set(keys)) == len(keys)
    # Single-token differences anywhere in a block never collide (odd multipliers).
    base = np.zeros(B, dtype=np.uint32)
    seen = {int(block_keys((base,), B)[0])}
    for offset in range(B):
        for value in (1, 2, 1 << 31, (1 << 32) - 1):
            variant = base.copy()
            variant[offset] = value
            seen.add(int(block_keys((variant,), B)[0]))
    assert len(seen) == 1 + 4 * B


# --------------------------------------------------------------------------- match


def test_block_granularity_and_one_token_recomputed() -> None:
    cache = PrefixCache(B)
    longer = tokens(33)
    prompt = longer[:32]
    assert cache.match((prompt,)) == 0
    cache.insert((prompt,), now=0.0)
    assert cache.statistics().resident_blocks == 2
    assert cache.match((prompt,)) == 16  # both blocks cached, but the last token is recomputed
    assert cache.match((prompt[:31],)) == 16
    assert cache.match((prompt[:17],)) == 16
    assert cache.match((prompt[:16],)) == 0  # a one-block prompt recomputes its last token: no hit
    assert cache.match((longer,)) == 32  # one more token: both blocks hit
    assert cache.match(()) == 0
    assert cache.match((prompt[:1],)) == 0


def test_extension_matches_the_old_full_blocks() -> None:
    cache = PrefixCache(B)
    conversation = tokens(1_000)
    cache.insert((conversation[:100],), now=0.0)
    assert cache.match(chunks(conversation[:150], 100)) == 96  # the 6 full blocks of the first prompt
    cache.insert(chunks(conversation[:150], 100), now=0.0)
    assert cache.match((conversation[:400],)) == 144


@pytest.mark.parametrize(("position", "expected"), [(0, 0), (15, 0), (16, 16), (40, 32), (47, 32), (48, 48)])
def test_an_early_difference_matches_only_the_blocks_before_it(position: int, expected: int) -> None:
    cache = PrefixCache(B)
    prompt = tokens(160)
    cache.insert((prompt,), now=0.0)
    changed = prompt.copy()
    changed[position] ^= 1
    assert cache.match((changed,)) == expected


def test_statistics_count_lookups_hits_and_misses() -> None:
    cache = PrefixCache(B)
    assert cache.statistics() == PrefixCacheStatistics()
    prompt = tokens(100)
    cache.match((prompt,))
    cache.insert((prompt,), now=0.0)
    cache.match((prompt,))
    assert cache.statistics() == PrefixCacheStatistics(lookups=2, hit_tokens=96, miss_tokens=100 + 4, resident_blocks=6)


def test_prepared_prompt_is_reused_and_checked() -> None:
    cache = PrefixCache(B)
    prepared = cache.prepare(chunks(tokens(50), 10))
    assert isinstance(prepared, PreparedPrompt)
    assert (prepared.prompt_tokens, len(prepared.keys)) == (50, 3)
    assert cache.prepare(prepared) is prepared
    cache.insert(prepared, now=0.0)
    assert cache.match(prepared) == 48
    with pytest.raises(ValueError, match="^prompt prepared for 16-token blocks, cache uses 32$"):
        PrefixCache(32).match(prepared)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((0, 100), "^block_tokens must be >= 1, got 0$"),
        ((16, 15), "^capacity_tokens must be >= block_tokens=16, got 15$"),
    ],
)
def test_constructor_checks(args: tuple[int, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PrefixCache(*args)


# --------------------------------------------------------------------------- eviction


def prompt_of(blocks: int, seed: int) -> tuple[Tokens]:
    """A prompt of `blocks` full blocks plus one token, so `match` can hit every block."""
    return (tokens(blocks * B + 1, seed=seed),)


def test_lru_eviction_at_capacity() -> None:
    cache = PrefixCache(B, capacity_tokens=4 * B + 5)  # 4 blocks
    a, b, c = prompt_of(2, 1), prompt_of(2, 2), prompt_of(2, 3)
    cache.insert(a, now=0.0)
    cache.insert(b, now=0.0)
    assert cache.match(a) == 32  # a becomes most recently used
    cache.insert(c, now=0.0)  # 6 blocks > 4: b's two blocks go
    assert (cache.match(a), cache.match(b), cache.match(c)) == (32, 0, 32)
    statistics = cache.statistics()
    assert (statistics.resident_blocks, statistics.evicted_blocks, statistics.overflow_blocks) == (4, 2, 0)


def test_a_prompt_loses_its_tail_first() -> None:
    cache = PrefixCache(B, capacity_tokens=3 * B)
    long = prompt_of(5, 1)
    cache.insert(long, now=0.0)  # 5 blocks into 3: the last two go, the head survives as a usable prefix
    assert cache.match(long) == 3 * B
    assert cache.statistics().evicted_blocks == 2
    # A touch keeps the order: the head of an older prompt outlives its own tail.
    cache = PrefixCache(B, capacity_tokens=4 * B)
    a, b = prompt_of(3, 1), prompt_of(1, 2)
    cache.insert(a, now=0.0)
    cache.insert(b, now=0.0)
    cache.insert(prompt_of(1, 3), now=0.0)  # one over: a's last block, not its first
    assert cache.match(a) == 2 * B
    assert cache.match(b) == B


def test_pinned_blocks_survive_pressure_until_released() -> None:
    cache = PrefixCache(B, capacity_tokens=4 * B)
    held = prompt_of(2, 1)
    cache.insert(held, owner="resp_1", now=0.0)
    for seed in range(2, 6):  # 8 more blocks through a 4-block cache
        cache.insert(prompt_of(2, seed), now=0.0)
    assert cache.match(held) == 32  # least recently used of all, but pinned
    assert cache.statistics().pinned_blocks == 2
    cache.release("resp_1", now=1.0)
    assert cache.statistics().pinned_blocks == 0
    assert cache.match(held) == 32  # still cached: release only unpins
    cache.insert(prompt_of(2, 6), now=1.0)
    cache.insert(prompt_of(2, 7), now=1.0)
    assert cache.match(held) == 0  # now ordinary LRU victims
    assert cache.statistics().overflow_blocks == 0


def test_overflow_when_only_pinned_blocks_remain() -> None:
    cache = PrefixCache(B, capacity_tokens=2 * B)
    cache.insert(prompt_of(2, 1), owner="x", now=0.0)
    cache.insert(prompt_of(2, 2), owner="y", now=0.0)  # nothing evictable: 2 blocks over
    statistics = cache.statistics()
    assert (statistics.resident_blocks, statistics.pinned_blocks, statistics.overflow_blocks) == (4, 4, 2)
    cache.insert(prompt_of(1, 3), now=0.0)  # unpinned: evicted at once, no new overflow
    statistics = cache.statistics()
    assert (statistics.resident_blocks, statistics.evicted_blocks, statistics.overflow_blocks) == (4, 1, 2)
    cache.insert(prompt_of(3, 4), owner="z", now=0.0)
    assert cache.statistics().overflow_blocks == 5
    cache.release("x", now=1.0)  # x's blocks become evictable and go at once
    statistics = cache.statistics()
    assert (statistics.resident_blocks, statistics.pinned_blocks, statistics.evicted_blocks) == (5, 5, 3)
    assert cache.match(prompt_of(2, 2)) == 32


def test_shared_blocks_stay_pinned_while_any_owner_holds_them() -> None:
    cache = PrefixCache(B, capacity_tokens=2 * B)
    system = tokens(2 * B + 1)
    cache.insert((system,), owner="a", now=0.0)
    cache.insert((system,), owner="b", now=0.0)
    assert cache.statistics().pinned_blocks == 2
    cache.release("a", now=1.0)
    cache.insert(prompt_of(2, 9), now=1.0)  # pressure: only the new blocks can go
    assert cache.match((system,)) == 32
    cache.release("b", now=2.0)
    cache.insert(prompt_of(2, 9), now=2.0)
    assert cache.match((system,)) == 0


def test_an_owner_repin_replaces_its_previous_pins() -> None:
    cache = PrefixCache(B, capacity_tokens=100 * B)
    conversation = tokens(10 * B)
    cache.insert((conversation[: 4 * B],), owner="x", now=0.0)
    cache.insert((conversation[: 6 * B + 3],), owner="x", now=1.0)  # append mode: the prompt grows
    assert cache.statistics().pinned_blocks == 6
    other = conversation.copy()
    other[2 * B] ^= 1  # a rewrite from block 2 on: blocks 2..5 of the old pin are unpinned
    cache.insert((other[: 3 * B],), owner="x", now=2.0)
    statistics = cache.statistics()
    assert (statistics.pinned_blocks, statistics.resident_blocks) == (3, 7)


# --------------------------------------------------------------------------- idle KV


def test_kv_idle_token_seconds_use_the_given_times() -> None:
    cache = PrefixCache(B)
    conversation = tokens(5 * B)
    cache.insert((conversation[: 2 * B + 7],), owner="x", now=10.0)  # 2 blocks pinned
    cache.insert((conversation[: 3 * B],), owner="x", now=12.5)  # closes 32 tokens x 2.5 s
    assert cache.statistics().kv_idle_token_s == 32 * 2.5
    cache.insert((conversation,), owner="y", now=13.0)
    cache.release("x", now=15.0)  # closes 48 tokens x 2.5 s
    assert cache.statistics().kv_idle_token_s == 32 * 2.5 + 48 * 2.5
    cache.release("x", now=16.0)  # no longer pinned: ignored
    cache.release("nobody", now=16.0)
    cache.insert((conversation,), now=20.0)  # unowned inserts pin nothing
    assert cache.statistics().kv_idle_token_s == 32 * 2.5 + 48 * 2.5  # y's interval is still open
    cache.release("y", now=21.0)
    assert cache.statistics().kv_idle_token_s == 32 * 2.5 + 48 * 2.5 + 80 * 8.0


def test_time_going_back_is_rejected_without_changes() -> None:
    cache = PrefixCache(B)
    cache.insert(prompt_of(2, 1), owner="x", now=5.0)
    before = cache.statistics()
    with pytest.raises(ValueError, match=r"^now=4\.0 is before the owner's pin at 5\.0$"):
        cache.insert(prompt_of(3, 2), owner="x", now=4.0)
    with pytest.raises(ValueError, match="before the owner's pin"):
        cache.release("x", now=4.0)
    assert cache.statistics() == before
    cache.release("x", now=5.0)
    assert cache.statistics().pinned_blocks == 0


# --------------------------------------------------------------------------- against a reference


class ReferenceCache:
    """The contract written the slow way: blocks keyed by their whole prefix as a tuple."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity = capacity_blocks
        self.order: list[tuple[int, ...]] = []  # unpinned, least recently used first
        self.pins: dict[tuple[int, ...], int] = {}  # pinned blocks -> owners
        self.owners: dict[str, list[tuple[int, ...]]] = {}
        self.evicted = self.overflow = 0

    @staticmethod
    def blocks(prompt: list[int], n: int) -> list[tuple[int, ...]]:
        return [tuple(prompt[: (i + 1) * B]) for i in range(n)]

    def resident(self, block: tuple[int, ...]) -> bool:
        return block in self.pins or block in self.order

    def to_mru(self, blocks: list[tuple[int, ...]]) -> None:
        for block in reversed(blocks):
            if block not in self.pins:
                if block in self.order:
                    self.order.remove(block)
                self.order.append(block)

    def match(self, prompt: list[int]) -> int:
        hits = 0
        for block in self.blocks(prompt, max(len(prompt) - 1, 0) // B):
            if not self.resident(block):
                break
            hits += 1
        self.to_mru(self.blocks(prompt, hits))
        return hits * B

    def excess(self) -> int:
        return max(0, len(self.order) + len(self.pins) - self.capacity)

    def insert(self, prompt: list[int], owner: str | None) -> None:
        before = self.excess()
        blocks = self.blocks(prompt, len(prompt) // B)
        if owner is None:
            self.to_mru(blocks)
        else:
            for block in blocks:
                if block in self.order:
                    self.order.remove(block)
                self.pins[block] = self.pins.get(block, 0) + 1
            previous = self.owners.get(owner, [])
            self.owners[owner] = blocks
            self.unpin(previous)
        self.evict()
        self.overflow += max(0, self.excess() - before)

    def unpin(self, blocks: list[tuple[int, ...]]) -> None:
        for block in reversed(blocks):
            self.pins[block] -= 1
            if self.pins[block] == 0:
                del self.pins[block]
                self.order.append(block)

    def release(self, owner: str) -> None:
        self.unpin(self.owners.pop(owner, []))
        self.evict()

    def evict(self) -> None:
        while self.excess() and self.order:
            self.order.pop(0)
            self.evicted += 1


def test_the_table_keeps_every_key_in_its_slot_through_growth_and_eviction(monkeypatch: pytest.MonkeyPatch) -> None:
    """The table alone against a dict: slots are distinct, never move while resident, are
    reused after eviction, and survive the arrays growing."""
    monkeypatch.setattr(kv, "_MIN_SLOTS", 4)
    rng = np.random.default_rng(3)
    table = kv._BlockTable()
    pool = rng.integers(0, 2**64, size=80, dtype=np.uint64).tolist()
    resident: dict[int, int] = {}
    for step in range(300):
        absent = [k for k in pool if k not in resident]
        batch = rng.choice(len(absent), size=min(len(absent), int(rng.integers(0, 9))), replace=False)
        keys = np.array([absent[i] for i in batch], dtype=np.uint64)
        slots = table.place(keys)
        assert len(set(slots.tolist())) == len(keys) and not set(slots.tolist()) & set(resident.values()), step
        resident.update(zip(keys.tolist(), slots.tolist(), strict=True))
        table.touch(slots)
        if len(resident) > 40:
            table.evict(int(rng.integers(1, 12)))
        probe = np.array(pool, dtype=np.uint64)
        found = table.lookup(probe)
        live = {int(k): int(s) for k, s in zip(probe, found, strict=True) if s >= 0}
        assert all(resident[k] == s for k, s in live.items()), step  # a resident key never moves
        assert len(live) == table.full and all(table.keys[s] == k for k, s in live.items()), step
        resident = live
    assert len(table.pins) > 4  # the arrays grew


def test_touching_the_most_recent_blocks_again_keeps_the_order() -> None:
    """A conversation's next turn matches the blocks its last insert made most recent, in the
    same order: the order stays, and the next eviction still takes the oldest blocks."""
    cache = PrefixCache(B, capacity_tokens=6 * B)
    old, conversation = tokens(3 * B, seed=1), tokens(3 * B + 1, seed=2)
    cache.insert((old,), now=0.0)
    cache.insert((conversation[: 3 * B],), now=1.0)
    cache._flush()  # the insert's touch, deferred until the next operation (see `_supersede`)
    log_size = cache._table._log_size
    assert cache.match((conversation,)) == 3 * B  # already the 3 most recent, in this order
    cache._flush()
    assert cache._table._log_size == log_size
    assert cache.match((old[: 2 * B + 1],)) == 2 * B  # not: the old prompt's head moves up
    cache._flush()
    assert cache._table._log_size == log_size + 2
    cache.insert((tokens(2 * B, seed=3),), now=2.0)  # 2 over capacity: the oldest two go
    assert cache.match((conversation,)) == 2 * B  # its tail block was the oldest
    assert cache.match((old[: 2 * B + 1],)) == 2 * B
    assert cache.statistics().evicted_blocks == 2


def test_a_conversation_s_next_step_supersedes_its_last_touch(monkeypatch: pytest.MonkeyPatch) -> None:
    """A turn's match, its insert, its output's insert and the next turn's match and insert each
    touch the blocks of the step before again, head first: no touch is applied until another
    conversation's operation needs the recency order, and then only the last one."""
    touched: list[int] = []
    touch = kv._BlockTable.touch

    def counted(table: kv._BlockTable, slots: np.ndarray) -> None:
        touched.append(len(slots))
        touch(table, slots)

    monkeypatch.setattr(kv._BlockTable, "touch", counted)
    cache = PrefixCache(B, capacity_tokens=64 * B)
    prompt, output = tokens(3 * B + 1, seed=1), tokens(2 * B, seed=2)
    first = cache.prepare((prompt,))
    cache.match(first)
    cache.insert(first, now=0.0)
    cache.insert(cache.extend(first, (prompt,), output), now=1.0)
    second = cache.prepare((np.concatenate((prompt, output, tokens(B, seed=3))),))
    assert cache.match(second) == 5 * B
    cache.insert(second, now=2.0)
    assert touched == []
    assert cache.match((tokens(2 * B + 1, seed=4),)) == 0  # another conversation
    assert touched == [6]  # the second insert's 6 blocks, before that match


def test_blocks_placed_where_evicted_ones_were_are_touched_anew() -> None:
    """New keys in the slots of evicted ones, touched in the same order as those were: the old
    entries are behind the log's head, so the touch is not taken for a repeat."""
    table = kv._BlockTable()
    slots = table.place(np.array([1, 2], dtype=np.uint64))
    table.touch(slots)
    table.evict(2)
    again = table.place(np.array([3, 4], dtype=np.uint64))
    assert sorted(again.tolist()) == sorted(slots.tolist())  # the freed slots, taken again
    by_slot = dict(zip(again.tolist(), (3, 4), strict=True))
    table.touch(slots)  # the same slots in the same order as the evicted blocks' entries
    table.evict(1)  # the new blocks have log entries: the older of them goes
    assert table.lookup(np.array([by_slot[int(slots[0])], by_slot[int(slots[1])]], dtype=np.uint64)).tolist() == [
        -1,
        slots[1],
    ]


def test_growing_between_a_match_and_its_insert_moves_no_block(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model turn matches, then inserts the same prepared prompt; here the insert's new blocks
    outgrow the slot arrays, which moves no resident block, so the match's slots stay valid.
    (An eviction in between does void them: the next test.)"""
    monkeypatch.setattr(kv, "_MIN_SLOTS", 8)
    cache = PrefixCache(B, capacity_tokens=1_000 * B)
    prompt = tokens(12 * B + 1)
    cache.insert((prompt[: 6 * B],), owner="a", now=0.0)  # 6 blocks in 8 slots
    prepared = cache.prepare((prompt,))
    assert cache.match(prepared) == 6 * B
    moves = cache._table.moves
    cache.insert(prepared, owner="b", now=1.0)  # 6 more keys: the arrays grow
    assert cache._table.moves == moves and len(cache._table.pins) > 8
    assert cache.statistics().pinned_blocks == 12
    cache.release("a", now=2.0)
    cache.release("b", now=2.0)
    assert (cache.statistics().pinned_blocks, cache.statistics().resident_blocks) == (0, 12)
    assert cache.match((prompt,)) == 12 * B


def test_an_insert_after_its_match_sees_the_blocks_evicted_between() -> None:
    """The match found the prompt's blocks; a release in between evicts them (their slots are
    free again): the insert must place them anew, not trust the match's slots."""
    cache = PrefixCache(B, capacity_tokens=8 * B)
    prompt = tokens(4 * B + 1, seed=1)
    cache.insert((prompt[: 4 * B],), owner="x", now=0.0)
    cache.insert((tokens(4 * B, seed=2),), owner="y", now=0.0)
    cache.insert((tokens(4 * B, seed=3),), owner="z", now=0.0)  # 12 pinned blocks: 4 over capacity
    prepared = cache.prepare((prompt,))
    assert cache.match(prepared) == 4 * B
    cache.release("x", now=1.0)  # the prompt's blocks are the only unpinned ones: evicted
    assert cache.statistics().evicted_blocks == 4
    cache.insert(prepared, now=1.0)  # back in, 4 over capacity again: evicted again
    statistics = cache.statistics()
    assert (statistics.evicted_blocks, statistics.resident_blocks) == (8, 8)
    assert cache.match((prompt,)) == 0


def test_a_match_after_an_insert_sees_the_blocks_evicted_since() -> None:
    """The next match reuses the last insert's slots for their common prefix, unless a
    resident block went in between: here the inserted blocks themselves, at a release."""
    cache = PrefixCache(B, capacity_tokens=8 * B)
    other, prompt = tokens(8 * B, seed=1), tokens(4 * B + 1, seed=2)
    cache.insert((other,), owner="b", now=0.0)
    cache.insert((prompt[: 4 * B],), owner="a", now=0.0)  # 12 blocks pinned: over capacity, admitted
    cache.release("a", now=1.0)  # its 4 blocks are the only unpinned ones: evicted
    assert cache.statistics().evicted_blocks == 4
    assert cache.match((prompt,)) == 0


def test_a_match_after_an_insert_that_evicted_its_own_tail() -> None:
    cache = PrefixCache(B, capacity_tokens=8 * B)
    cache.insert((tokens(6 * B, seed=1),), owner="x", now=0.0)
    prompt = tokens(4 * B + 1, seed=2)
    cache.insert((prompt[: 4 * B],), now=0.0)  # 10 blocks: its own 2 tail blocks go at once
    assert cache.statistics().evicted_blocks == 2
    assert cache.match((prompt,)) == 2 * B


@pytest.mark.parametrize("tiny_table", [False, True], ids=["default-table", "tiny-table"])
def test_matches_a_reference_model(tiny_table: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if tiny_table:  # growth, log compaction and multi-window eviction on almost every call
        monkeypatch.setattr(kv, "_MIN_SLOTS", 2)
        monkeypatch.setattr(kv, "_MIN_LOG", 4)
        monkeypatch.setattr(kv, "_EVICT_WINDOW", 1)
    rng = np.random.default_rng(7)
    cache, reference = PrefixCache(B, capacity_tokens=24 * B), ReferenceCache(24)
    # Prompts from a small alphabet sharing prefixes: conversations that grow, fork and repeat.
    trunks = [rng.integers(0, 3, size=12 * B).astype(np.uint32) for _ in range(4)]
    for step in range(1_500):
        trunk = trunks[int(rng.integers(len(trunks)))]
        prompt = trunk[: int(rng.integers(0, len(trunk) + 1))].copy()
        if rng.random() < 0.3 and len(prompt):
            prompt[int(rng.integers(len(prompt)))] ^= 1  # a fork
        listed = prompt.tolist()
        cuts = sorted(rng.integers(0, len(prompt) + 1, size=2).tolist())
        operation = rng.random()
        owner = f"o{int(rng.integers(4))}"
        if operation < 0.4:
            assert cache.match(chunks(prompt, *cuts)) == reference.match(listed), step
        elif operation < 0.7:
            cache.insert(chunks(prompt, *cuts), now=float(step))
            reference.insert(listed, None)
        elif operation < 0.85:
            cache.insert(chunks(prompt, *cuts), owner=owner, now=float(step))
            reference.insert(listed, owner)
        elif operation < 0.93:  # a model turn: match, maybe another turn's insert, then insert (one prepare)
            prepared = cache.prepare(chunks(prompt, *cuts))
            assert cache.match(prepared) == reference.match(listed), step
            if rng.random() < 0.5:  # another owner lets go between the two: evictions move the table
                other = f"o{int(rng.integers(4))}"
                cache.release(other, now=float(step))
                reference.release(other)
            holder = owner if rng.random() < 0.5 else None
            cache.insert(prepared, owner=holder, now=float(step))
            reference.insert(listed, holder)
            if rng.random() < 0.5:  # its output joins the cache behind the prompt (cache_generated)
                more = trunk[len(prompt) : len(prompt) + int(rng.integers(0, 3 * B))].copy()
                cache.insert(cache.extend(prepared, chunks(prompt, *cuts), more), now=float(step))
                reference.insert(listed + more.tolist(), None)
        else:
            cache.release(owner, now=float(step))
            reference.release(owner)
        statistics = cache.statistics()
        assert statistics.resident_blocks == len(reference.order) + len(reference.pins), step
        assert statistics.pinned_blocks == len(reference.pins), step
        assert (statistics.evicted_blocks, statistics.overflow_blocks) == (reference.evicted, reference.overflow)
    assert reference.evicted > 100 and reference.overflow > 0  # the walk did exercise pressure and overflow


# --------------------------------------------------------------------------- speed


def test_sixty_thousand_token_prompt_exercise() -> None:
    """Benchmark-style, no timing assertion: a 60K-token agent prompt, cold, warm, grown and pinned.

    Run with ``-s`` to see the figures; the report quotes them.
    """
    cache = PrefixCache()
    conversation = tokens(61_200)
    timings: dict[str, float] = {}

    def timed(label: str, prompt: tuple[Tokens, ...], owner: str | None = None) -> int:
        started = time.perf_counter()
        prepared = cache.prepare(prompt)
        hit = cache.match(prepared)
        cache.insert(prepared, owner=owner, now=0.0)
        timings[label] = (time.perf_counter() - started) * 1e3
        return hit

    assert timed("cold", (conversation[:60_000],)) == 0
    assert timed("warm", chunks(conversation[:60_000], 6_000, 30_000)) == 59_984
    assert timed("grown by 1,200", (conversation[:60_000], conversation[60_000:])) == 60_000
    assert timed("pinned", (conversation,), owner="x") == 61_184
    print(" ".join(f"{label}: {ms:.2f} ms" for label, ms in timings.items()))
