"""Memoized pure work, for virtual runs whose CPU time is free (sweeps, `compare(free_cpu=True)`).

Scenario: a sweep runs the same seeded rollouts at every grid point and every mode,
so the model plans the same turns, the server tokenizes the same tool outputs, and the
`http` modes re-tokenize and re-classify the same history, hundreds of times. That work
is honest in a live run and in virtual time with `charge_cpu=True`, where its duration
is part of what is measured. With CPU free its duration is not measured at all, only its
results are used, and those are pure functions of the input: tokenizing a text, reading
a token chunk into the classifier, planning a turn from the request and the turn's rng,
hashing a prompt's KV blocks, validating an input item and rendering it, checking a
context's items and extending it. `MemoTokenizer`, `MemoClassifier`, `MemoPolicy`,
`MemoPrefixCache`, `MemoItems`, `MemoRendered` and `MemoContexts` return the same results
from a per-process table instead of recomputing them, so every count, token and verdict is
identical (tests/sim/runtime/test_memo.py compares whole results) and a sweep point costs a
fraction of the wall time.

Never use them where CPU is charged or the run is live: the re-processing a mode does is
then exactly what the comparison measures. `run_compare(memoize=True)` refuses a live run.

The tables are bounded (least recently used out first) and shared by everything in the
process, so consecutive sweep points in one worker reuse each other's work. What is kept per
conversation (its last input, its context) is each memoizing object's own.
"""

from __future__ import annotations

import functools
import itertools
import operator
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any, Final

import numpy as np
import numpy.typing as npt
from msgspec import Raw

from prototype.context.conversation import Context, Item, parse_item, parse_items
from prototype.context.safety import ClassifierState, SafetyClassifier, check_tokens
from prototype.context.tokenizer import ENCODING_NAME, TokenArray, Tokenizer
from prototype.model import ModelRequest
from sim.model.kv import PrefixCache, PreparedPrompt, Prompt
from sim.model.policy import PlannedItem, Policy

__all__ = [
    "MemoClassifier",
    "MemoContexts",
    "MemoItems",
    "MemoRendered",
    "MemoPolicy",
    "MemoPrefixCache",
    "MemoTokenizer",
    "memo_classifier",
    "memo_tokenizer",
]

TOKENIZER_BUDGET: Final = 4_000_000  # cached tokens (≈ 16 MB of arrays, plus their texts)
CLASSIFIER_BUDGET: Final = 16_000_000  # bytes of token chunks used as keys
CHAIN_ENTRIES: Final = 200_000  # classifier steps kept by (state, chunk) identity (≈ 40 MB at most)
PLAN_BUDGET: Final = 16_000_000  # characters of planned text (≈ 16-32 MB)
PREPARED_BUDGET: Final = 4_000_000  # block keys of prepared prompts (32 MB)
RENDERED_BUDGET: Final = 4_000_000  # tokens of rendered items (≈ 16 MB of arrays)
ITEMS_BUDGET: Final = 32_000_000  # bytes of item JSON used as keys (≈ 2-3 x that with the parsed items)
HINT_LISTS: Final = 256  # conversations whose last input (items, context, classifier read) is kept
_writeable: Final = operator.attrgetter("flags.writeable")
is_: Final = operator.is_
_BUDGETS: Final = {
    "plans": PLAN_BUDGET,
    "prepared": PREPARED_BUDGET,
    "rendered": RENDERED_BUDGET,
    "items": ITEMS_BUDGET,
}


class _Lru:
    """An `OrderedDict` bounded by a sum of per-entry costs."""

    __slots__ = ("_budget", "_cost", "_table", "hits", "misses")

    def __init__(self, budget: int) -> None:
        self._table: OrderedDict[object, tuple[object, int]] = OrderedDict()
        self._budget = budget
        self._cost = 0
        self.hits = 0
        self.misses = 0

    def get(self, key: object) -> object | None:
        entry = self._table.get(key)
        if entry is None:
            self.misses += 1
            return None
        self.hits += 1
        self._table.move_to_end(key)
        return entry[0]

    def get_many(self, keys: Iterable[object]) -> list[object | None]:
        """`get` of each key in turn: the same values, hits, misses and order of use."""
        table, hits = self._table, 0
        found: list[object | None] = []
        for key in keys:
            entry = table.get(key)
            if entry is None:
                found.append(None)
            else:
                hits += 1
                table.move_to_end(key)
                found.append(entry[0])
        self.hits += hits
        self.misses += len(found) - hits
        return found

    @property
    def hit_rate(self) -> float:
        seen = self.hits + self.misses
        return self.hits / seen if seen else 0.0

    def put(self, key: object, value: object, cost: int) -> None:
        if cost > self._budget:
            return
        self._table[key] = (value, cost)
        self._cost += cost
        while self._cost > self._budget:
            _, (_, dropped) = self._table.popitem(last=False)
            self._cost -= dropped


class MemoTokenizer(Tokenizer):
    """A `Tokenizer` that looks up texts it has encoded before (read-only arrays)."""

    def __init__(self, name: str = ENCODING_NAME, budget_tokens: int = TOKENIZER_BUDGET) -> None:
        super().__init__(name)
        self._memo = _Lru(budget_tokens)

    def encode(self, text: str) -> TokenArray:
        tokens = self._memo.get(text)
        if tokens is None:
            tokens = super().encode(text)
            tokens.flags.writeable = False  # shared by every caller: nobody may change it
            self._memo.put(text, tokens, max(1, tokens.size))
        return tokens  # type: ignore[return-value]

    def encode_list(self, text: str) -> list[int]:
        return self.encode(text).tolist()  # type: ignore[no-any-return]

    @property
    def hit_rate(self) -> float:
        return self._memo.hit_rate


class MemoClassifier(SafetyClassifier):
    """A `SafetyClassifier` (default settings) that looks up chunks it has read before.

    Reading a chunk changes a state by amounts that depend only on the tail carried over
    from the previous chunk and the chunk's tokens: the weight sum and n-gram count grow
    by what the chunk adds, the blocked flag is or-ed with the chunk's, the tail becomes
    a function of both. So `update` looks those up keyed on (tail, chunk) and adds them to
    any state. A read-only chunk (`MemoTokenizer`'s arrays) is keyed on its identity and
    kept alive by its entry; any other chunk on its bytes.

    States are immutable, so the state after a read-only chunk is also kept by the
    identities of (state, chunk): the history an `http` request resends is read again from
    the same `begin()` state through the same chunks each turn, and each step is then one
    dict lookup that returns the very state object of last time. That chain table holds
    up to `chain_entries` steps (it starts over when full) and keeps its states and chunks
    alive, so an identity is never reused while its entry lasts. A read of several read-only
    chunks is also kept whole, by the identities of its state and first chunk: the next
    request's history starts with the same chunks (compared by identity in C), so the state
    after them is taken at once and only the chunks after them are stepped through."""

    def __init__(self, budget_bytes: int = CLASSIFIER_BUDGET, chain_entries: int = CHAIN_ENTRIES) -> None:
        super().__init__()
        self._memo = _Lru(budget_bytes)
        self._start = ClassifierState()
        self._chain: dict[tuple[int, int], tuple[ClassifierState, TokenArray, ClassifierState]] = {}
        self._chain_entries = chain_entries
        # The last `HINT_LISTS` reads of more than one chunk, by (state, first chunk) identity:
        # (that state, the chunks read, the state after them).
        self._runs: dict[tuple[int, int], tuple[ClassifierState, list[TokenArray], ClassifierState]] = {}

    def begin(self) -> ClassifierState:
        return self._start  # one object, so every stream's chain starts at the same identity

    def update(self, state: ClassifierState, tokens: TokenArray) -> ClassifierState:
        return self.update_all(state, (tokens,))

    def update_all(self, state: ClassifierState, chunks: Iterable[TokenArray]) -> ClassifierState:
        chunks = list(chunks)
        start, done, key = state, 0, None
        if len(chunks) > 1:
            key = (id(state), id(chunks[0]))
            run = self._runs.pop(key, None)  # re-added below: the newest
            if (
                run is not None
                and run[0] is state
                and len(run[1]) <= len(chunks)
                and all(map(is_, run[1], chunks))
                and not any(map(_writeable, run[1]))  # still read-only, as the chain asks of each step
            ):
                done, state = len(run[1]), run[2]  # this run's chunks again, and maybe more after them
        chain, shared = self._chain, True
        for tokens in itertools.islice(chunks, done, None):  # the chain's steps inline: one call, not one per chunk
            if not isinstance(tokens, np.ndarray) or tokens.flags.writeable:
                state = self._step(state, tokens)  # its content may change under its identity: never chained
                shared = False
                continue
            link = (id(state), id(tokens))
            entry = chain.get(link)
            if entry is not None and entry[0] is state and entry[1] is tokens:
                state = entry[2]
                continue
            after = self._step(state, tokens)
            if len(chain) >= self._chain_entries:
                chain.clear()
            chain[link] = (state, tokens, after)
            state = after
        if shared and key is not None:
            self._runs[key] = (start, chunks, state)
            if len(self._runs) > HINT_LISTS:
                del self._runs[next(iter(self._runs))]
        return state

    def _step(self, state: ClassifierState, tokens: TokenArray) -> ClassifierState:
        tokens = check_tokens(tokens)
        if len(state.tail) >= self.ngram or tokens.size == 0:
            return super().update(state, tokens)  # its error, or the state unchanged
        shared = not tokens.flags.writeable
        key = (state.tail, id(tokens) if shared else tokens.tobytes())
        found = self._memo.get(key)
        if found is None:
            found = (super().update(ClassifierState(tail=state.tail), tokens), tokens if shared else None)
            self._memo.put(key, found, tokens.nbytes + 64)
        step: ClassifierState = found[0]  # type: ignore[index]
        return ClassifierState(
            tail=step.tail,
            weight_sum=state.weight_sum + step.weight_sum,
            ngrams=state.ngrams + step.ngrams,
            tokens_read=state.tokens_read + step.tokens_read,
            blocked=state.blocked or step.blocked,
        )


class MemoPolicy:
    """A `Policy` that looks up turns it has planned before, for policies that say what a plan
    depends on: ``plan_key(request)`` (hashable, or None for "do not memoize this turn").

    The key is that, the policy's type, and the state of the turn's rng before the plan: a
    plan is a function of the request fields its key names and of the draws it makes. A hit
    leaves the rng as the real plan would have (its state after is stored too). Policies
    without ``plan_key`` (a replayed trace) are always planned.
    """

    def __init__(self, policy: Policy, table: _Lru | None = None) -> None:
        self.policy = policy
        self._key_of = getattr(policy, "plan_key", None)
        self._memo = table if table is not None else _shared("plans")

    def plan(self, request: ModelRequest, rng: np.random.Generator) -> list[PlannedItem]:
        if self._key_of is None:
            return self.policy.plan(request, rng)
        own = self._key_of(request)
        if own is None:
            return self.policy.plan(request, rng)
        bits = rng.bit_generator
        before = bits.state
        key = (type(self.policy), own, _frozen(before))
        found = self._memo.get(key)
        if found is None:
            items = tuple(self.policy.plan(request, rng))
            found = (items, bits.state)
            self._memo.put(key, found, 64 + sum(len(i.text) + len(i.name) for i in items))
        else:
            bits.state = found[1]  # type: ignore[index]
        return list(found[0])  # type: ignore[index]

    @property
    def hit_rate(self) -> float:
        return self._memo.hit_rate


def _frozen(state: Mapping[str, Any]) -> Hashable:
    """A bit generator's state dict (nested dicts of names and ints) as a hashable value."""
    return tuple((k, _frozen(v) if isinstance(v, Mapping) else v) for k, v in sorted(state.items()))


class MemoItems:
    """An `ItemParser` (`prototype.context.conversation`) that looks up items by their JSON bytes: an
    item that validated once parses to the same `Item` wherever it comes again (the history
    every `http` request resends, every context `http_prev` loads). Misses are validated by
    `parse_item`, so an invalid item raises exactly as without the table.

    An `http` request resends the conversation's previous list, then adds to it. So each
    conversation's last list (by its first item's bytes) is kept with its items: a list that
    starts with it, compared in C item by item on their bytes, takes those items as they are
    (the same objects, valid in the same places) and only its new items are looked up."""

    def __init__(self, table: _Lru | None = None) -> None:
        self._memo = table if table is not None else _shared("items")
        # A list and its items, by its first item, for the last `HINT_LISTS` lists (oldest out).
        self._lists: dict[bytes, tuple[list[Raw], tuple[Item, ...]]] = {}

    def __call__(self, value: str | list[Raw]) -> tuple[Item, ...]:
        if isinstance(value, str):
            return parse_items(value)
        if not value:
            return ()
        first = bytes(value[0])
        last = self._lists.pop(first, None)  # re-added below: the newest
        out: list[Item] = []
        if last is not None and len(last[0]) <= len(value) and value[: len(last[0])] == last[0]:
            out.extend(last[1])
        get, put = self._memo.get, self._memo.put
        for index in range(len(out), len(value)):
            data = bytes(value[index]) if index else first  # the first item's bytes and hash once
            item = get(data)
            if item is None:
                item = parse_item(data, index)
                put(data, item, len(data))
            out.append(item)  # type: ignore[arg-type]
        items = tuple(out)
        self._lists[first] = (list(value), items)
        if len(self._lists) > HINT_LISTS:
            del self._lists[next(iter(self._lists))]
        return items

    @property
    def hit_rate(self) -> float:
        return self._memo.hit_rate


class MemoRendered:
    """`prototype.response.engine.RenderedItems`: an item's tokens, keyed on the item's identity (the
    table keeps the item alive, so an identity is never reused while its entry lasts). With
    `MemoItems` an item that comes again is the same object, so the history an `http` request
    resends is neither decoded to text again nor looked up by its text; the tokens are the
    tokenizer's, made read-only."""

    def __init__(self, table: _Lru | None = None) -> None:
        self._memo = table if table is not None else _shared("rendered")

    def get(self, item: Item) -> TokenArray | None:
        return self.get_all((item,))[0]

    def get_all(self, items: Sequence[Item]) -> list[TokenArray | None]:
        """Each item's tokens, None where not recorded, in one pass over the table (the history an
        `http` request resends)."""
        entries = self._memo.get_many(map(id, items))
        return [
            entry[1] if entry is not None and entry[0] is item else None  # type: ignore[index]
            for entry, item in zip(entries, items, strict=True)
        ]

    def put(self, item: Item, tokens: TokenArray) -> None:
        tokens.flags.writeable = False
        self._memo.put(id(item), (item, tokens), max(1, tokens.size))

    @property
    def hit_rate(self) -> float:
        return self._memo.hit_rate


class MemoContexts:
    """`prototype.response.services.KnownContexts`: each conversation's latest fresh context, by
    its first item's identity (the last `HINT_LISTS` conversations, oldest out). With `MemoItems`
    the history an `http` request resends is the same item objects, so the previous request's
    context is found by comparing identities in C and copied (its lists, sets and dict, in C);
    only the new items are checked and extended. An entry keeps its items alive, so an identity
    is never reused while it lasts; it is a copy, and so is what `known` returns, so no live
    context shares anything with it."""

    def __init__(self, conversations: int = HINT_LISTS) -> None:
        self._conversations = conversations
        self._kept: dict[int, Context] = {}

    def known(self, items: Sequence[Item]) -> Context | None:
        if not items:
            return None
        kept = self._kept.get(id(items[0]))
        if kept is None or len(kept.items) > len(items) or not all(map(is_, kept.items, items)):
            return None
        return kept.copy()

    def keep(self, context: Context) -> None:
        if not context.items:
            return
        key = id(context.items[0])
        self._kept.pop(key, None)  # re-added: the newest
        self._kept[key] = context.copy()
        if len(self._kept) > self._conversations:
            del self._kept[next(iter(self._kept))]


class MemoPrefixCache(PrefixCache):
    """A `PrefixCache` whose `prepare` looks up prompts made of the same read-only chunks.

    With `MemoTokenizer` every rendered item, preamble and header is a shared read-only
    array, so the same prompt (every mode of a sweep point renders the same tokens, and
    every point with the same seed) is the same tuple of array objects. The table keys on
    their identities and keeps the arrays alive, so an identity is never reused while its
    entry lasts; a prompt with a writeable chunk is hashed every time. Matching, inserting
    and eviction are this cache's own, as in `PrefixCache`.
    """

    def __init__(self, *args: Any, table: _Lru | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._memo = table if table is not None else _shared("prepared")

    def prepare(self, prompt: Prompt) -> PreparedPrompt:
        if isinstance(prompt, PreparedPrompt) or any(map(_writeable, prompt)):
            return super().prepare(prompt)
        key = (self.block_tokens, tuple(map(id, prompt)))
        found = self._memo.get(key)
        if found is None:
            prepared = super().prepare(prompt)
            self._memo.put(key, (prepared, tuple(prompt)), len(prepared.keys) + len(prompt))
            return prepared
        return found[0]  # type: ignore[index,no-any-return]

    def extend(
        self, prepared: PreparedPrompt, prompt: Sequence[npt.NDArray[np.uint32]], more: npt.NDArray[np.uint32]
    ) -> PreparedPrompt:
        """`PrefixCache.extend`, looked up by the prepared prompt's identity and `more`'s tokens
        (a turn's output behind the same prepared prompt, in every run with the same seed); the
        entry keeps `prepared` alive, so its identity is never reused while the entry lasts."""
        key = ("extend", id(prepared), more.tobytes())
        found = self._memo.get(key)
        if found is not None and found[1] is prepared:  # type: ignore[index]
            return found[0]  # type: ignore[index,no-any-return]
        extended = super().extend(prepared, prompt, more)
        self._memo.put(key, (extended, prepared), len(extended.keys) + 1)
        return extended


@functools.cache
def _shared(kind: str) -> _Lru:
    """The process's table for one kind of work, shared by every memoizing object of that
    kind that is not given its own table."""
    return _Lru(_BUDGETS[kind])


@functools.cache
def memo_tokenizer() -> MemoTokenizer:
    """The process's memoizing tokenizer (o200k_base)."""
    return MemoTokenizer()


@functools.cache
def memo_classifier() -> MemoClassifier:
    """The process's memoizing classifier (the engine's default settings)."""
    return MemoClassifier()
