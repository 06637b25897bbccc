"""The simulated accelerator: a `prototype.model.TokenModel` that paces real tokens on a `Clock`.

Theory of operation. One `sample` call is one model turn, planned in full when
it starts (so every time below is known up front and nothing here needs
asyncio: concurrent turns interact only through bookkeeping made at their
start):

1. **Plan.** The `Policy` decides the turn's items from the request and an rng
   seeded by ``SeedSequence([seed, conversation_key, turn_index])``: the output
   depends only on (seed, conversation, turn), never on the transport, the
   timing options or what else the model is doing (the "same tokens in every
   mode" invariant).
2. **Tokenize.** Each item's text is encoded with the real o200k_base
   vocabulary, so `usage` counts are real counts. ``max_output_tokens`` caps the
   turn's total (message text and function-call arguments alike): the item
   that crosses the cap is cut at the cap, later items are dropped, and the turn
   ends with ``SamplingFinished("max_output_tokens")``.
3. **Cached prefix.** ::

       cached = max(prefix_cache.match(prompt), min(resident_tokens, prompt_tokens - 1))

   `sim.model.kv.PrefixCache` is vLLM-style automatic prefix caching: block-granular
   hits, at least one token recomputed (docs/simulator.md). ``resident_tokens``
   is KV the conversation holds across an append-mode pause; the hint is
   trusted as is (it is block-exact already), clipped so the last token is
   still prefilled. With ``prefix_caching=False``
   only the hint counts. After its prefill a turn inserts its prompt into the
   cache, pinned for ``conversation_id`` when ``hold_kv`` (until `release`, or
   until that conversation's next insert replaces the pin).
4. **Queue.** With ``decode_slots=N`` at most N turns run at once. Each slot
   keeps the time it is busy until; an arriving turn takes the slot that frees
   first, in arrival order (FIFO), and waits ``queued_s = max(0, free_at -
   start)``. It holds the slot through prefill and decode, until ``t0 +
   n_tokens / rate``; a turn closed early frees its slot at the close time
   (for turns arriving later: a queued turn's wait is fixed when it arrives).
5. **Prefill.** The first token is due at::

       t0 = start + queued_s + prefill_s
       prefill_s = model_latency_s + u / prefill_tok_per_s + prefill_s_per_token_ctx * u * (cached + u / 2)

   with ``u = prompt_tokens - cached``: queueing, a fixed model-side latency, the
   uncached suffix at the prefill rate (cached tokens skip prefill; the operating
   points and their sources are in docs/pipeline.md, "Calibration") and its
   attention over the context before each of its tokens (0 by default). Latency and
   prefill default to "free" here; the caller picks the operating point. The
   turn's first event, ``Prefilled(cached, queued_s, prefill_s)``, comes at t0.
6. **Decode.** The turn's rate is fixed at t0::

       rate = decode_tok_per_s * exp(N(0, decode_jitter)) / (1 + concurrency_slowdown * (k - 1))

   where ``k`` counts the turns decoding at t0, this one included (batching
   slows every sequence; Continuum, arXiv 2511.02230),
   and the lognormal jitter comes from its own rng,
   ``SeedSequence([seed, conversation_key, turn_index, 1])``, so jitter never
   changes the tokens. Token i of the turn (0-based, across items) is due at
   the absolute time ``t0 + i / rate`` (65 tok/s for GPT-5-class, 1,000 tok/s
   for the fast tier, as OpenAI's post on WebSocket mode gives them; see
   docs/pipeline.md). At each wake-up the model
   yields every token already due, back to back with no await between them,
   then sleeps until the next one is due. Because deadlines are absolute, a
   late wake-up makes the next batch larger instead of shifting every later
   token: the long-run rate is exact whatever the loop's lateness. Relative
   sleeps (``sleep(1 / rate)`` per token) would lose the lateness on every
   token. ``decode_tok_per_s = math.inf`` means unpaced: after the prefill wait
   all tokens come at once with no further sleep.

Async tools (the beta's `async: true` function tools, docs/beta.md): after a turn that ends
in async calls the service asks `decodes_on` whether the next turn may be sampled before
their outputs arrive. The answer is the model's: the turn made at ``turn_index`` k has
outputs the following turns do not need with probability ``async_independent``, drawn
from its own rng ``SeedSequence([seed, conversation_key, k, 2])`` (so the answer never
changes the tokens, and a larger ``async_independent`` only adds turns that decode on);
a final answer (a planned turn without a function call) always waits, and so does every
turn of a request with ``parallel_tool_calls`` off (one call in flight at a time).

Token text: one `TokensSampled` per token, whose ``text`` comes from an
incremental UTF-8 decoder over the token's bytes. A token that ends inside a
multi-byte character carries "" and the completing token carries the
character, so an item's texts concatenate to exactly its text (the last token
of an item flushes the decoder, so a cut inside a character yields U+FFFD
rather than losing bytes).

Parts: `TurnPlanner` decides what a turn says (steps 1-2) and the async draw, `DecodeSchedule`
keeps the slots and decode intervals the turns share (steps 4 and 6); `SimulatedModel` runs a turn.

`statistics()` counts requests, prompt, cached and prefilled tokens and queue
time when sampling starts, output tokens as they are yielded (a cancelled turn
counts what it produced), and carries the prefix cache's own statistics.
"""

from __future__ import annotations

import codecs
import functools
import itertools
import math
import time
from array import array
from collections.abc import AsyncGenerator, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from prototype.clock import Clock
from prototype.context.conversation import generation_header, render_model_output
from prototype.context.tokenizer import TokenArray, Tokenizer, get_tokenizer
from prototype.model import (
    ItemFinished,
    ItemStarted,
    ModelEvent,
    ModelRequest,
    Prefilled,
    SamplingFinished,
    TokensSampled,
)
from sim.model.breakpoints import BreakpointCache, written
from sim.model.kv import PrefixCache, PrefixCacheStatistics
from sim.model.policy import PlannedItem, Policy
from sim.model.receipt import Receipt

__all__ = [
    "ItemText",
    "LatenessRecorder",
    "ModelStatistics",
    "DecodeSchedule",
    "SimulatedModel",
    "TurnPlanner",
    "framed_output_ids",
    "jitter_rng",
    "prefill_time_s",
    "turn_rng",
]

_U64_MASK: Final = (1 << 64) - 1
_JITTER_STREAM: Final = 1  # 4th SeedSequence word of the decode-jitter rng (the token rng has 3 words)
_ASYNC_STREAM: Final = 2  # 4th SeedSequence word of the draw "the next turn needs this turn's async outputs"
_Utf8Decoder: Final = codecs.getincrementaldecoder("utf-8")  # looked up once, not per item
_NO_TOKENS: Final = np.empty(0, dtype=np.uint32)


@dataclass(frozen=True, slots=True)
class ModelStatistics:
    """Counters of a `SimulatedModel` (a snapshot; the module docstring says when each one counts)."""

    requests: int = 0  # `sample` calls started
    prompt_tokens: int = 0  # sum of request.prompt_tokens
    prefilled_tokens: int = 0  # sum of uncached prompt tokens (prompt_tokens - cached_tokens)
    output_tokens: int = 0  # tokens yielded
    cached_tokens: int = 0  # sum of Prefilled.cached_tokens (prefix-cache hits or held KV)
    queued_s_total: float = 0.0  # sum of Prefilled.queued_s (waits for a decode slot), seconds
    kv: PrefixCacheStatistics = PrefixCacheStatistics()  # the prefix cache's counters (zeros when off)


def _entropy(value: int) -> int:
    # SeedSequence takes non-negative ints; map a negative hash to its 64-bit
    # two's complement, which cannot collide with a non-negative 64-bit hash.
    return value if value >= 0 else value & _U64_MASK


def turn_rng(seed: int, conversation_key: int, turn_index: int) -> np.random.Generator:
    """The rng of one model turn's tokens; a function of (seed, conversation, turn) only."""
    entropy = [_entropy(seed), _entropy(conversation_key), _entropy(turn_index)]
    return np.random.default_rng(np.random.SeedSequence(entropy))


@functools.lru_cache(maxsize=1 << 16)
def _turn_state(seed: int, conversation_key: int, turn_index: int) -> Mapping[str, Any]:
    """`turn_rng`'s initial bit-generator state: building a SeedSequence per turn costs far more
    than setting a saved state."""
    return turn_rng(seed, conversation_key, turn_index).bit_generator.state


def jitter_rng(seed: int, conversation_key: int, turn_index: int) -> np.random.Generator:
    """The rng of one turn's decode-rate jitter: independent of `turn_rng`, so timing never moves tokens."""
    entropy = [_entropy(seed), _entropy(conversation_key), _entropy(turn_index), _JITTER_STREAM]
    return np.random.default_rng(np.random.SeedSequence(entropy))


def prefill_time_s(
    model_latency_s: float, prefill_tok_per_s: float, prefill_s_per_token_ctx: float, cached: int, uncached: int
) -> float:
    """The model's time to the first token once it runs (the stage-cost table's prefill rows):
    its fixed latency, the uncached tokens at the prefill rate (0 or inf: free) and their
    attention over the context before each (`Count.PREFILL_CONTEXT`). The simulator and the
    fleet's free compute both price a prefill with it."""
    linear = uncached / prefill_tok_per_s if 0 < prefill_tok_per_s < math.inf else 0.0
    return model_latency_s + linear + prefill_s_per_token_ctx * uncached * (cached + uncached / 2)


class LatenessRecorder:
    """Per-token lateness of paced decoding, for benchmarks: when each token was handed on
    (its consumer, i.e. the writer, done with it) minus when it was due; and per turn the
    tokens, the planned rate and the first and last hand-on times.

    ``now`` must read the time base of the model's clock at full resolution: the asyncio
    loop's ``time()`` is ``time.monotonic()`` (uvloop's truncated to the millisecond), so
    the default fits both. Off (``lateness=None``, the default) it costs one test per event.
    """

    __slots__ = ("_groups", "now", "turns")

    def __init__(self, now: Callable[[], float] = time.monotonic) -> None:
        self.now = now
        self._groups = array("d")  # per hand-on: (time, first token's due time, tokens, interval)
        self.turns: list[tuple[int, float, float, float]] = []  # (tokens, planned rate, first, last hand-on)

    def token(self, due: float) -> float:
        """Record one token due at `due`; returns its hand-on time."""
        return self.tokens(due, 1, 0.0)

    def tokens(self, first_due: float, count: int, interval: float) -> float:
        """Record `count` tokens handed on together, due at `first_due` + k x `interval`; returns the hand-on time."""
        now = self.now()
        self._groups.extend((now, first_due, count, interval))
        return now

    @property
    def late_s(self) -> npt.NDArray[np.float64]:
        """Every recorded token's lateness (hand-on minus due), in order."""
        g = np.frombuffer(self._groups, dtype=np.float64).reshape(-1, 4) if self._groups else np.empty((0, 4))
        counts = g[:, 2].astype(np.int64)
        k = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)  # index within group
        return np.repeat(g[:, 0] - g[:, 1], counts) - k * np.repeat(g[:, 3], counts)

    def clear(self) -> None:
        self._groups = array("d")
        self.turns = []


class ItemText:
    """The texts of one item's tokens, in order: an incremental UTF-8 decoder over their
    bytes, with the texts of tokens that decode whole on their own taken from `texts`
    (shared by the model's turns) while no character is pending."""

    __slots__ = ("_decoder", "_ids", "_last", "_pending", "_texts", "_token_bytes")

    def __init__(self, ids: list[int], token_bytes: Callable[[int], bytes], texts: dict[int, str]) -> None:
        self._ids, self._token_bytes, self._texts = ids, token_bytes, texts
        self._decoder = _Utf8Decoder(errors="replace")
        self._pending = False  # the decoder holds the start of a multi-byte character
        self._last = len(ids) - 1

    def text(self, position: int) -> str:
        """Token `position`'s text; call for positions 0, 1, ... in order."""
        token_id = self._ids[position]
        text = None if self._pending else self._texts.get(token_id)
        if text is None:
            last = position == self._last
            text = self._decoder.decode(self._token_bytes(token_id), final=last)
            was_pending, self._pending = self._pending, bool(self._decoder.getstate()[0])
            if not (was_pending or self._pending or last):
                self._texts[token_id] = text  # whole characters on its own: same text from a clean state
        return text


def _due_by(now: float, t0: float, rate: float, index: int, most: int) -> int:
    """How many tokens from `index` on (at least 1, at most `most`) are due by `now`: token i is
    due at exactly ``t0 + i / rate``, the expression the pacing uses, so none is early."""
    j = max(index, int((now - t0) * rate))  # the last token due, give or take rounding
    while j + 1 < index + most and t0 + (j + 1) / rate <= now:
        j += 1
    while j > index and t0 + j / rate > now:
        j -= 1
    return min(most, j - index + 1)


@dataclass(slots=True)
class _Decoding:
    """One turn's planned decode interval ``[start, end)``; ``end`` moves earlier if it is closed early."""

    start: float
    end: float


def framed_output_ids(
    tokenizer: Tokenizer, items: list[tuple[PlannedItem, list[int]]], *, truncated: bool
) -> list[TokenArray]:
    """The ids each item of a turn stands for in the next turn's prompt: its rendering in the
    context (`render_model_output`), less the generation header the turn's prompt already ends
    with for its first item. A model that keeps these in its KV (an engine's slot, a prefix cache
    of generated blocks) holds exactly the prefix the next prompt starts with. `truncated`: the
    cap cut the last item (`plan_tokens`), whose text is then its ids' text."""
    header = len(generation_header(tokenizer))
    framed = []
    for k, (item, ids) in enumerate(items):
        text = tokenizer.decode(ids) if truncated and k == len(items) - 1 else item.text
        rendered = tokenizer.encode(render_model_output(item.kind, item.name, text))
        framed.append(rendered[header:] if k == 0 else rendered)
    return framed


class TurnPlanner:
    """What a turn says (steps 1-2) and whether the turns after it need its async outputs (the
    module docstring's "Async tools"): each a function of (seed, conversation, turn) and the
    model-visible request only, never of timing or of what else the model is doing."""

    __slots__ = ("_bits", "_rng", "async_independent", "policy", "seed", "tokenizer")

    def __init__(self, policy: Policy, tokenizer: Tokenizer, seed: int, async_independent: float) -> None:
        self.policy = policy
        self.tokenizer = tokenizer
        self.seed = seed
        self.async_independent = async_independent
        self._bits = np.random.PCG64(0)
        self._rng = np.random.Generator(self._bits)

    def plan_tokens(self, request: ModelRequest) -> tuple[list[tuple[PlannedItem, list[int]]], bool]:
        """The turn's items with their token ids, ``max_output_tokens`` applied, and whether the
        cap cut them: a function of (seed, conversation, turn) and the model-visible request only.
        A real engine behind the seam (`sim.engine`) decodes exactly these tokens."""
        self._bits.state = _turn_state(self.seed, request.conversation_key, request.turn_index)  # type: ignore[assignment]
        return self._cut(self.policy.plan(request, self._rng), request.max_output_tokens)

    def _cut(self, planned: list[PlannedItem], budget: int | None) -> tuple[list[tuple[PlannedItem, list[int]]], bool]:
        """Tokenize the plan and apply ``max_output_tokens``: (items with their ids, whether cut)."""
        items: list[tuple[PlannedItem, list[int]]] = []
        left = budget
        for item in planned:
            ids = self.tokenizer.encode_list(item.text)
            if left is not None:
                if left == 0 and ids:
                    return items, True  # nothing of this item fits
                if len(ids) > left:
                    items.append((item, ids[:left]))
                    return items, True
                left -= len(ids)
            items.append((item, ids))
        return items, False

    def decodes_on(self, request: ModelRequest, outstanding: tuple[int, ...]) -> bool:
        """`prototype.model.DecidesAsync`: sample `request`'s turn now, without the outputs of the
        async calls made at the turns `outstanding`, iff none of those turns drew "needed next"
        and the turn is planned to call a tool (a final answer waits for every output)."""
        if self.async_independent <= 0 or not request.parallel_tool_calls:
            return False
        if not all(self.independent(request.conversation_key, k) for k in outstanding):
            return False
        # The turn's plan, from the same rng state `sample` starts it from: the plan is the turn's.
        self._bits.state = _turn_state(self.seed, request.conversation_key, request.turn_index)  # type: ignore[assignment]
        return any(item.kind == "function_call" for item in self.policy.plan(request, self._rng))

    def independent(self, conversation_key: int, turn_index: int) -> bool:
        """Whether the async outputs of turn `turn_index` are not needed by the turns after it
        (only by the final answer): a draw of its own, below `async_independent`."""
        entropy = [_entropy(self.seed), _entropy(conversation_key), _entropy(turn_index), _ASYNC_STREAM]
        u = float(np.random.default_rng(np.random.SeedSequence(entropy)).random())
        return u < self.async_independent


class DecodeSchedule:
    """The turns' shared timing state (steps 4 and 6): the decode slots, each busy until a time (an
    arriving turn takes the one that frees first, in arrival order), and the turns' decode
    intervals, whose overlap with a turn's first token slows its rate."""

    __slots__ = ("_decoding", "_free_at", "_holder", "concurrency_slowdown", "slots")

    def __init__(self, slots: int | None, concurrency_slowdown: float) -> None:
        self.slots = slots
        self.concurrency_slowdown = concurrency_slowdown
        self._free_at: list[float] = [-math.inf] * (slots or 0)  # per slot: busy until
        self._holder: list[int] = [-1] * (slots or 0)  # per slot: the turn that reserved it last
        self._decoding: dict[int, _Decoding] = {}  # turn serial -> decode interval, pruned as turns end

    def queue(self, start: float) -> tuple[int, float]:
        """The slot a turn arriving at `start` takes (-1: slots unlimited) and its wait for it."""
        if self.slots is None:
            return -1, 0.0
        slot = min(range(self.slots), key=self._free_at.__getitem__)  # earliest free, lowest index
        return slot, max(0.0, self._free_at[slot] - start)

    def batched(self, rate: float, start: float, t0: float) -> float:
        """`rate` slowed by the turns decoding at `t0` (a turn arriving at `start`)."""
        if not self.concurrency_slowdown > 0:
            return rate  # no slowdown: the intervals are not kept (`book`)
        for serial in [s for s, d in self._decoding.items() if d.end <= start]:
            del self._decoding[serial]  # over before this turn started: cannot overlap any later t0
        others = sum(1 for d in self._decoding.values() if d.start <= t0 < d.end)
        return rate / (1 + self.concurrency_slowdown * others)

    def book(self, serial: int, slot: int, start: float, end: float) -> _Decoding:
        """Turn `serial` decodes over ``[start, end)``, holding `slot` until `end`."""
        decoding = _Decoding(start, end)
        if self.concurrency_slowdown > 0:  # kept for the turns that start while it decodes (`batched`)
            self._decoding[serial] = decoding
        if slot >= 0:
            self._free_at[slot] = end
            self._holder[slot] = serial
        return decoding

    def close(self, serial: int, slot: int, decoding: _Decoding, now: float) -> None:
        """The turn was closed early at `now`: the slot and the batch lose it now."""
        decoding.end = min(decoding.end, now)
        if slot >= 0 and self._holder[slot] == serial:
            self._free_at[slot] = min(self._free_at[slot], now)


class SimulatedModel:
    """A `TokenModel` whose words come from a `Policy` and whose timing from a `Clock`.

    Parameters (units in the names): ``decode_tok_per_s`` > 0 (``math.inf`` =
    unpaced), ``model_latency_s`` >= 0 (fixed part of TTFT), ``prefill_tok_per_s``
    > 0 (``math.inf`` = free prefill). ``tokenizer`` defaults to the shared
    o200k_base instance. Realism options (module docstring, steps 3-6):
    ``prefix_cache`` (default: a fresh `PrefixCache()`; pass one to size it or
    to share it), ``prefix_caching=False`` to switch caching off (then only
    ``resident_tokens`` counts; passing a cache too is an error),
    ``decode_slots`` >= 1 or None (unlimited), ``concurrency_slowdown`` >= 0,
    ``decode_jitter`` >= 0 (sigma of the lognormal rate factor). With the
    defaults, timing is as before the options existed except that prefix-cache
    hits shorten prefill. One instance serves any number of concurrent turns;
    they share the cache, the slots and the slowdown. ``pace_by_turn=True`` (for
    virtual-time sweeps) waits only for a turn's first and last token: every token
    but the last comes at once with the first, one `TokensSampled` per item (so one
    delta event, not one per token), so the tokens, their text, the first token, the
    turn's end and everything planned at its start are as with per-token pacing, with
    two clock wake-ups and a few events per turn instead of one of each per token.
    ``coalesce_due=True`` (the default): a paced token's wake-up that comes late also
    takes the item's next tokens already due, in one `TokensSampled` (one delta event),
    as a server that fell behind sends what it has; the tokens, their texts and the
    times they were due do not change, only how many events carry them. A wake-up on
    time carries one token, so on a virtual clock with free CPU nothing changes; with
    ``False`` every token is its own event however late. ``async_independent`` in [0, 1]:
    the share of turns ending in async calls whose outputs the next turn does not need
    (`decodes_on`; 0: the model always waits for them).
    """

    def __init__(
        self,
        *,
        clock: Clock,
        policy: Policy,
        tokenizer: Tokenizer | None = None,
        seed: int = 0,
        decode_tok_per_s: float = 1000.0,
        model_latency_s: float = 0.0,
        prefill_tok_per_s: float = math.inf,
        prefill_s_per_token_ctx: float = 0.0,
        prefix_cache: PrefixCache | None = None,
        prefix_caching: bool = True,
        decode_slots: int | None = None,
        concurrency_slowdown: float = 0.0,
        decode_jitter: float = 0.0,
        lateness: LatenessRecorder | None = None,
        pace_by_turn: bool = False,
        coalesce_due: bool = True,
        async_independent: float = 0.0,
        cache_generated: bool = True,
    ) -> None:
        if not decode_tok_per_s > 0:
            raise ValueError(f"decode_tok_per_s must be > 0, got {decode_tok_per_s}")
        if not prefill_tok_per_s > 0:
            raise ValueError(f"prefill_tok_per_s must be > 0, got {prefill_tok_per_s}")
        if not (prefill_s_per_token_ctx >= 0 and math.isfinite(prefill_s_per_token_ctx)):
            raise ValueError(f"prefill_s_per_token_ctx must be finite and >= 0, got {prefill_s_per_token_ctx}")
        if not (model_latency_s >= 0 and math.isfinite(model_latency_s)):
            raise ValueError(f"model_latency_s must be finite and >= 0, got {model_latency_s}")
        if prefix_cache is not None and not prefix_caching:
            raise ValueError("prefix_cache given with prefix_caching=False")
        if decode_slots is not None and decode_slots < 1:
            raise ValueError(f"decode_slots must be >= 1 or None, got {decode_slots}")
        if not (concurrency_slowdown >= 0 and math.isfinite(concurrency_slowdown)):
            raise ValueError(f"concurrency_slowdown must be finite and >= 0, got {concurrency_slowdown}")
        if not (decode_jitter >= 0 and math.isfinite(decode_jitter)):
            raise ValueError(f"decode_jitter must be finite and >= 0, got {decode_jitter}")
        if not 0 <= async_independent <= 1:
            raise ValueError(f"async_independent must be in [0, 1], got {async_independent}")
        self.clock = clock
        self.tokenizer = tokenizer if tokenizer is not None else get_tokenizer()
        self.seed = seed
        self.planner = TurnPlanner(policy, self.tokenizer, seed, async_independent)
        self.decode_tok_per_s = decode_tok_per_s
        self.model_latency_s = model_latency_s
        self.prefill_tok_per_s = prefill_tok_per_s
        self.prefill_s_per_token_ctx = prefill_s_per_token_ctx
        self.prefix_cache: PrefixCache | None = (
            (prefix_cache if prefix_cache is not None else PrefixCache()) if prefix_caching else None
        )
        self.breakpoint_cache = None if self.prefix_cache is None else BreakpointCache(self.prefix_cache.block_tokens)
        self.schedule = DecodeSchedule(decode_slots, concurrency_slowdown)
        self.decode_jitter = decode_jitter
        self.lateness = lateness
        self.pace_by_turn = pace_by_turn
        self.coalesce_due = coalesce_due
        self.cache_generated = cache_generated
        self._serials = itertools.count()
        self._requests = 0
        self._prompt_tokens = 0
        self._prefilled_tokens = 0
        self._cached_tokens = 0
        self._queued_s = 0.0
        self._output_tokens = 0
        self._texts: dict[int, str] = {}  # token id -> its text, for tokens that decode whole on their own

    def statistics(self) -> ModelStatistics:
        return ModelStatistics(
            requests=self._requests,
            prompt_tokens=self._prompt_tokens,
            prefilled_tokens=self._prefilled_tokens,
            output_tokens=self._output_tokens,
            cached_tokens=self._cached_tokens,
            queued_s_total=self._queued_s,
            kv=self.prefix_cache.statistics() if self.prefix_cache is not None else PrefixCacheStatistics(),
        )

    def release(self, conversation_id: str) -> None:
        """Unpin the KV a ``hold_kv`` turn pinned for `conversation_id`; it stays cached, evictable."""
        if self.prefix_cache is not None:
            self.prefix_cache.release(conversation_id, self.clock.now())

    def decodes_on(self, request: ModelRequest, outstanding: tuple[int, ...]) -> bool:
        """`prototype.model.DecidesAsync`: the planner's answer (`TurnPlanner.decodes_on`)."""
        return self.planner.decodes_on(request, outstanding)

    def prefill_s(self, prompt_tokens: int, cached_tokens: int) -> float:
        """Seconds from getting a slot to the first token (step 5): latency + uncached / prefill
        rate + the attention term, each uncached token over the context before it
        (`Count.PREFILL_CONTEXT`, the stage-cost table's row)."""
        return prefill_time_s(
            self.model_latency_s,
            self.prefill_tok_per_s,
            self.prefill_s_per_token_ctx,
            cached_tokens,
            prompt_tokens - cached_tokens,
        )

    async def sample(self, request: ModelRequest, receipt: Receipt | None = None) -> AsyncGenerator[ModelEvent, None]:
        """Stream one turn: ``Prefilled (ItemStarted TokensSampled* ItemFinished)* SamplingFinished``.

        Raises `ValueError` (before any event, touching no state) if the prompt
        chunks do not add up to ``prompt_tokens``, ``resident_tokens`` is
        outside ``[0, prompt_tokens]`` or ``max_output_tokens`` is negative.
        With `receipt`, the turn's (cached, decoded) go to it when the stream
        ends, however it ends (sim/model/receipt.py).
        """
        # The receipt's counts (sim/model/receipt.py): the cached tokens `Prefilled` told and
        # `index`, the turn's tokens yielded so far (each event's are counted before its yield).
        told = index = 0
        try:
            prompt_len = sum(map(len, request.prompt))
            if prompt_len != request.prompt_tokens:
                raise ValueError(f"prompt chunks hold {prompt_len} tokens, prompt_tokens={request.prompt_tokens}")
            if not 0 <= request.resident_tokens <= request.prompt_tokens:
                raise ValueError(
                    f"resident_tokens={request.resident_tokens} outside [0, prompt_tokens={request.prompt_tokens}]"
                )
            budget = request.max_output_tokens
            if budget is not None and budget < 0:
                raise ValueError(f"max_output_tokens must be >= 0, got {budget}")
            serial = next(self._serials)

            # Step 3: the cached prefix: the prefix cache (the implicit breakpoint: not in `explicit`
            # mode) and the explicit breakpoints (breakpoints.py), on the same switch.
            cache = self.prefix_cache
            prepared = None
            cached = max(0, min(request.resident_tokens, request.prompt_tokens - 1))  # held KV, last token recomputed
            implicit = request.cache_mode == "implicit"
            if cache is not None:
                prepared = cache.prepare(request.prompt)  # hashed once for the match now and the insert after prefill
                if implicit:
                    cached = max(cache.match(prepared), cached)
            marks = self.breakpoint_cache is not None and prepared is not None and bool(request.breakpoints)
            tokens = np.concatenate(request.prompt) if marks else _NO_TOKENS
            if marks:
                assert self.breakpoint_cache is not None and prepared is not None
                hit = self.breakpoint_cache.match(prepared.keys, tokens, request.breakpoints, self.clock.now())
                cached = max(hit, cached)
            self._requests += 1
            self._prompt_tokens += request.prompt_tokens
            self._cached_tokens += cached
            self._prefilled_tokens += request.prompt_tokens - cached

            # Steps 1-2: the plan, fixed up front (max_output_tokens cut included).
            # `turn_rng(seed, conversation, turn)`, as one generator reset to that state: the plan
            # draws from it before anything else runs, and a policy keeps no rng past `plan`.
            items, truncated = self.planner.plan_tokens(request)
            cut_item = items[-1][0] if truncated and items else None  # only the last item can be cut
            n_tokens = sum([len(ids) for _, ids in items])

            # Steps 4-6: queue, prefill, decode rate; every time known now. The turn starts once
            # planned: the simulator's own work (hashing, planning, tokenizing) is not model time.
            start = self.clock.now()
            slot, queued_s = self.schedule.queue(start)
            ctx = self.model_latency_s, self.prefill_tok_per_s, self.prefill_s_per_token_ctx  # as `self.prefill_s`
            prefill_s = prefill_time_s(*ctx, cached, request.prompt_tokens - cached)
            t0 = start + queued_s + prefill_s
            if self.decode_jitter > 0:
                rate = self._decode_rate(request, t0, start)
            else:
                rate = self.schedule.batched(self.decode_tok_per_s, start, t0)
            paced = math.isfinite(rate)
            decoding = self.schedule.book(serial, slot, t0, t0 + n_tokens / rate if paced else t0)
            self._queued_s += queued_s

            finished = False
            try:
                await self.clock.sleep_until(t0)
                if cache is not None and prepared is not None and (implicit or request.hold_kv):
                    owner = request.conversation_id if request.hold_kv else None
                    cache.insert(prepared, owner=owner, now=self.clock.now())
                if marks:
                    assert self.breakpoint_cache is not None and prepared is not None
                    chosen = written(request.cache_mode, request.breakpoints)
                    self.breakpoint_cache.write(prepared.keys, tokens, chosen, self.clock.now())
                told = cached
                yield Prefilled(cached_tokens=cached, queued_s=queued_s, prefill_s=prefill_s)
                lateness = self.lateness if paced else None
                by_turn, coalesce = self.pace_by_turn, self.coalesce_due
                handed_first = handed_last = 0.0
                clock_now, sleep_until = self.clock.now, self.clock.sleep_until
                token_bytes, decode_bytes, texts = self.tokenizer.token_bytes, self.tokenizer.decode_bytes, self._texts
                due = t0
                for item, ids in items:
                    yield ItemStarted(item.kind, item.name)
                    if by_turn:  # every token but the turn's last in one event, at once; the last at the end
                        count = len(ids)
                        if index + count < n_tokens:  # not the turn's last item, so not cut: the text's tokens
                            if count:
                                self._output_tokens += count
                                index += count
                                yield TokensSampled(tuple(ids), item.text)
                        elif count:
                            # The ids' bytes (the text's, a prefix if cut): the head's whole characters, then the rest.
                            data = decode_bytes(ids) if truncated and item is cut_item else item.text.encode()
                            head_text = data[: len(data) - len(token_bytes(ids[-1]))].decode("utf-8", "ignore")
                            if count > 1:
                                self._output_tokens += count - 1
                                index += count - 1
                                yield TokensSampled(tuple(ids[:-1]), head_text)
                            if paced:
                                due = t0 + index / rate
                                if due > clock_now():
                                    await sleep_until(due)
                            index += 1
                            self._output_tokens += 1
                            yield TokensSampled((ids[-1],), data[len(head_text.encode()) :].decode("utf-8", "replace"))
                        yield ItemFinished()
                        continue
                    last = len(ids) - 1
                    token_text = ItemText(ids, token_bytes, texts).text
                    position = 0
                    while position <= last:
                        end = position + 1  # this event's tokens: ids[position:end]
                        if paced:
                            due = t0 + index / rate
                            now = clock_now()
                            if due > now:
                                await sleep_until(due)
                                now = clock_now()
                            if coalesce and position < last and t0 + (index + 1) / rate <= now:
                                # Woke late: the item's tokens due by now go in this event too.
                                end = position + _due_by(now, t0, rate, index, last - position + 1)
                        if end == position + 1:  # the per-token path
                            group: tuple[int, ...] = (ids[position],)
                            text = token_text(position)
                        else:
                            group = tuple(ids[position:end])
                            text = "".join([token_text(p) for p in range(position, end)])
                        n = len(group)
                        self._output_tokens += n
                        index += n
                        yield TokensSampled(group, text)
                        if lateness is not None:  # resumed: the consumer has written these tokens
                            handed_last = lateness.tokens(due, n, 1.0 / rate)
                            handed_first = handed_first or handed_last
                        position = end
                    yield ItemFinished()
                if lateness is not None and index:
                    lateness.turns.append((index, rate, handed_first, handed_last))
                if cache is not None and self.cache_generated and items:
                    # The turn's output, as the next prompt renders it, joins the cache behind its prompt.
                    framed = framed_output_ids(self.tokenizer, items, truncated=truncated)
                    said = framed[0] if len(framed) == 1 else np.concatenate(framed)
                    assert prepared is not None
                    cache.insert(cache.extend(prepared, request.prompt, said), now=self.clock.now())
                finished = True
                yield SamplingFinished("max_output_tokens" if truncated else "stop")
            finally:
                if not finished:  # closed early: the slot and the batch lose this turn now
                    self.schedule.close(serial, slot, decoding, self.clock.now())
        finally:
            if receipt is not None:
                receipt((told, index))

    def plan_tokens(self, request: ModelRequest) -> tuple[list[tuple[PlannedItem, list[int]]], bool]:
        """The turn's items with their token ids and whether the cap cut them (`TurnPlanner.plan_tokens`)."""
        return self.planner.plan_tokens(request)

    def _decode_rate(self, request: ModelRequest, t0: float, start: float) -> float:
        """This turn's tokens/s (step 6): jitter, then slowdown by the turns decoding at `t0`."""
        rate = self.decode_tok_per_s
        if self.decode_jitter > 0:
            factor = float(
                jitter_rng(self.seed, request.conversation_key, request.turn_index).lognormal(0.0, self.decode_jitter)
            )
            rate *= factor
        return self.schedule.batched(rate, start, t0)
