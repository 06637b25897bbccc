"""A vLLM-style automatic prefix cache over token ids: which prompt tokens skip prefill.

Theory of operation (after vLLM's automatic prefix caching, v1 ``KVCacheManager``; design notes at
https://docs.vllm.ai/en/latest/design/prefix_caching/, and docs/simulator.md):

* **Blocks.** The KV of a prompt is cut into blocks of ``block_tokens`` tokens
  (vLLM's default is 16). Only *full* blocks are cached; a trailing partial
  block is always recomputed.
* **Chained keys.** A block's key identifies the block's tokens *and its whole
  prefix* (vLLM hashes ``(parent_hash, block_tokens)``), so a hit on block ``i``
  means tokens ``0 .. (i+1)*block_tokens`` are identical. A lookup walks the
  prompt's blocks from the start and stops at the first miss.
* **At least one token is recomputed.** The model needs the logits of the last
  prompt token, so a fully cached prompt still prefills its last token: the
  hit is capped at ``prompt_len - 1`` and then rounded *down* to a block
  boundary (a 32-token prompt with both blocks cached hits 16 tokens, not 31).
* **Eviction.** Capacity is counted in blocks (``capacity_tokens //
  block_tokens``). Unpinned blocks are evicted least recently used first. A
  prompt's blocks are (re)queued tail block first, head block last, as vLLM
  v1 frees a request's blocks ("in reverse order so that the tail blocks are
  evicted first"), so under pressure a prompt loses its tail before its head and
  what survives is still a usable prefix.
* **Pins.** ``insert(..., owner=...)`` pins the prompt's blocks for that owner
  (the KV a conversation holds across an append-mode pause, like vLLM blocks
  with ``ref_cnt > 0``), replacing the owner's previous pins; ``release`` unpins
  them and they become ordinary, evictable cache (most recently used). Pinned
  blocks are never evicted: if only pinned blocks remain and the cache is over
  capacity, the overflow is allowed and counted (``overflow_blocks``): held KV
  that a real server would have had to preempt or refuse.
* **Deferred touches.** A touch is applied when the next operation begins, and dropped when
  that operation is the same conversation's next step touching the same blocks again (a turn's
  insert after its match, its output's insert, the next turn's match): the recency order is
  exactly that of touching every time, at the cost of the turn's new blocks.
* **Idle KV.** ``kv_idle_token_s`` is Σ pinned tokens × seconds pinned, each
  owner's pinned tokens accumulated from its ``insert(owner=...)`` to its next
  ``insert`` or ``release`` (the ``now`` arguments; this module reads no clock).
  It is the KV-memory cost of holding a conversation (Continuum, arXiv
  2511.02230): only closed intervals are counted.

Keys are computed with numpy, without a Python loop over blocks. A block's
content hash is the dot product of its tokens (widened to uint64) with fixed
odd per-offset multipliers ``a_j`` (mod 2^64), passed through the splitmix64
finalizer. Two blocks whose token difference ``d`` has lowest 2-adic valuation
``v`` (``v`` <= 31: tokens are uint32) collide before finalizing only if
``2^v · Σ a_j d'_j ≡ 0 (mod 2^64)``, probability about ``2^-(64-v)`` <= 2^-33
for random ``a_j`` and never for a single-token difference (an odd multiple of
a non-zero number below 2^32 is non-zero mod 2^64). The chained key of block
``i`` is ``Σ_{b<=i} h_b · m_b + p_i`` (mod 2^64, one ``cumsum``) over the
finalized hashes ``h_b``, with odd per-position multipliers ``m_b`` and
per-position offsets ``p_i`` (splitmix64 of the position), so the key depends
on every block of the prefix, on their order and on the prefix length (an
all-zero block hashes to splitmix64(0) != 0, so runs of identical blocks still
differ by length). Treating ``h_b`` as random words, two different prefixes
share a key with probability about 2^-64 (2^-33 in the worst case above), far
below anything a simulation run can hit. Not cryptographic: a simulator has
no adversary. Since key ``i`` depends on blocks ``0 .. i`` only, a prompt followed
by more tokens (a turn's output, cached behind its prompt) keeps the prompt's keys
and hashes only the blocks from its partial last block on (`extended_keys`), as
vLLM hashes only a request's new blocks.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt

__all__ = [
    "DEFAULT_BLOCK_TOKENS",
    "DEFAULT_CAPACITY_TOKENS",
    "PrefixCache",
    "PrefixCacheStatistics",
    "PreparedPrompt",
    "Prompt",
    "block_keys",
    "extended_keys",
]

DEFAULT_BLOCK_TOKENS: Final = 16  # tokens per KV block: vLLM's default block size
# KV tokens the cache holds. D (derived, sweep it): 4M tokens x ~70 KB/token (DeepSeek-V3 MLA: 576 bf16
# values x 61 layers) = ~280 GB, the order of an 8-GPU node's HBM left after the weights.
DEFAULT_CAPACITY_TOKENS: Final = 4_000_000

_U64 = npt.NDArray[np.uint64]
_GOLDEN: Final = np.uint64(0x9E3779B97F4A7C15)  # splitmix64 increment (2^64 / golden ratio)
_MIX1: Final = np.uint64(0xBF58476D1CE4E5B9)  # splitmix64 finalizer multipliers
_MIX2: Final = np.uint64(0x94D049BB133111EB)
_ONE: Final = np.uint64(1)
# Salts that make the per-offset multipliers, per-position multipliers and
# per-position offsets three independent splitmix64 streams.
_OFFSET_SALT: Final = np.uint64(0x5851F42D4C957F2D)
_POSITION_SALT: Final = np.uint64(0x14057B7EF767814F)
_LENGTH_SALT: Final = np.uint64(0x2545F4914F6CDD1D)


def _mix64(x: _U64) -> _U64:
    """splitmix64 (Steele, Lea, Flood 2014) over an array: a bijection of uint64, wrapping arithmetic."""
    z = x + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    result: _U64 = z ^ (z >> np.uint64(31))
    return result


def _stream(salt: np.uint64, n: int) -> _U64:
    """The first `n` words of a fixed pseudo-random stream (a pure function of the index)."""
    return _mix64(np.arange(n, dtype=np.uint64) ^ salt)


class _Multipliers:
    """Per-position constants, grown on demand; entry ``i`` never changes once made."""

    def __init__(self) -> None:
        self.block: _U64 = np.empty(0, dtype=np.uint64)  # m_b, odd
        self.length: _U64 = np.empty(0, dtype=np.uint64)  # p_i

    def ensure(self, n_blocks: int) -> None:
        if n_blocks <= len(self.block):
            return
        size = max(n_blocks, 2 * len(self.block), 1024)
        self.block = _stream(_POSITION_SALT, size) | _ONE
        self.length = _stream(_LENGTH_SALT, size)


_POSITIONS = _Multipliers()
_OFFSET_MULTIPLIERS: dict[int, _U64] = {}  # block_tokens -> odd per-offset multipliers


def _concatenate(prompt_chunks: Sequence[npt.NDArray[np.uint32]]) -> npt.NDArray[np.uint32]:
    if not prompt_chunks:
        return np.empty(0, dtype=np.uint32)
    return np.concatenate(prompt_chunks)


def block_keys(prompt_chunks: Sequence[npt.NDArray[np.uint32]], block_tokens: int = DEFAULT_BLOCK_TOKENS) -> _U64:
    """The chained keys of the prompt's full blocks (``len // block_tokens`` of them).

    Key ``i`` is a function of tokens ``0 .. (i+1)*block_tokens`` only (see the
    module docstring for the construction and the collision argument).
    """
    return _chained(_concatenate(prompt_chunks), block_tokens, np.empty(0, dtype=np.uint64))


def extended_keys(
    keys: _U64,
    prompt_chunks: Sequence[npt.NDArray[np.uint32]],
    more: npt.NDArray[np.uint32],
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
    *,
    prompt_tokens: int | None = None,
) -> _U64:
    """``block_keys((*prompt_chunks, more))`` given ``keys == block_keys(prompt_chunks)``: a key
    depends on its prefix only, so the prompt's full blocks keep theirs and only the blocks from
    its partial last block on are hashed (the chain goes on from the last key). `prompt_tokens`:
    the chunks' total length, if known."""
    if prompt_tokens is None:
        prompt_tokens = sum(map(len, prompt_chunks))
    rest = prompt_tokens - len(keys) * block_tokens
    tail: list[npt.NDArray[np.uint32]] = []
    for chunk in reversed(prompt_chunks):  # the prompt's last `rest` tokens: its partial block
        if rest <= 0:
            break
        tail.append(chunk[-rest:] if len(chunk) > rest else chunk)
        rest -= len(chunk)
    return _chained(np.concatenate((*reversed(tail), more)), block_tokens, keys)


def _chained(tokens: npt.NDArray[np.uint32], block_tokens: int, head: _U64) -> _U64:
    """`head` (the keys of the blocks before `tokens`) followed by the keys of `tokens`' full blocks."""
    n_blocks = len(tokens) // block_tokens
    if n_blocks == 0:
        return head
    offsets = _OFFSET_MULTIPLIERS.get(block_tokens)
    if offsets is None:
        offsets = _OFFSET_MULTIPLIERS.setdefault(block_tokens, _stream(_OFFSET_SALT, block_tokens) | _ONE)
    words = tokens[: n_blocks * block_tokens].astype(np.uint64).reshape(n_blocks, block_tokens)
    content = _mix64(words @ offsets)
    done = len(head)
    _POSITIONS.ensure(done + n_blocks)
    keys: _U64 = np.cumsum(content * _POSITIONS.block[done : done + n_blocks], dtype=np.uint64)
    if done:  # the chain's sum so far: the last key without its position's offset (wrapping, as arrays)
        keys += head[done - 1 :] - _POSITIONS.length[done - 1 : done]
        keys += _POSITIONS.length[done : done + n_blocks]
        return np.concatenate((head, keys))
    keys += _POSITIONS.length[:n_blocks]
    return keys


@dataclass(frozen=True, slots=True, eq=False)
class PreparedPrompt:
    """A prompt's block keys, computed once for a `match` and the `insert` that follows it (compared by identity)."""

    block_tokens: int
    prompt_tokens: int
    keys: _U64  # chained keys of the full blocks, head first


Prompt = Sequence[npt.NDArray[np.uint32]] | PreparedPrompt


@dataclass(frozen=True, slots=True)
class PrefixCacheStatistics:
    """Counters of a `PrefixCache` (a snapshot)."""

    lookups: int = 0  # `match` calls
    hit_tokens: int = 0  # Σ tokens `match` returned
    miss_tokens: int = 0  # Σ (prompt tokens - hit tokens) over `match` calls
    resident_blocks: int = 0  # blocks cached now, pinned or not
    pinned_blocks: int = 0  # blocks pinned by at least one owner now
    evicted_blocks: int = 0  # blocks evicted so far
    overflow_blocks: int = 0  # blocks admitted beyond capacity because every resident block was pinned
    kv_idle_token_s: float = 0.0  # Σ pinned tokens × seconds pinned, over closed pin intervals


@dataclass(frozen=True, slots=True)
class _Pin:
    prompt: PreparedPrompt  # whose full blocks the owner pins
    since: float  # `now` of the insert that pinned them


def _common_prefix(a: _U64, b: _U64) -> int:
    """Length of the common prefix of two key arrays. Chained keys never re-converge, so equal
    last keys mean equal prefixes (the usual case: a conversation's prompt grew)."""
    n = min(len(a), len(b))
    if n == 0 or a[n - 1] == b[n - 1]:
        return n
    equal = a[:n] == b[:n]
    return int(np.argmin(equal))


_I64 = npt.NDArray[np.int64]
_NO_SLOTS: Final[_I64] = np.empty(0, dtype=np.int64)
_NO_SLOTS.flags.writeable = False


def _joined(source: _I64 | None, known: int, rest: _I64 | None) -> _I64:
    """``source[:known]`` (None: nothing) followed by `rest` (None: nothing), copying only to join."""
    if rest is None:
        return _NO_SLOTS if source is None else source[:known]
    return rest if source is None or not known else np.concatenate((source[:known], rest))


_MIN_SLOTS: Final = 1 << 12  # block slots allocated at least (the arrays double when full)
_MIN_LOG: Final = 1 << 12  # recency-log entries allocated at least
_EVICT_WINDOW: Final = 256  # recency-log entries examined at least per eviction step
_LOG_GROWTH: Final = 4  # log entries allocated per live entry at a compaction (compactions amortize over 3x)


class _BlockTable:
    """Resident blocks: a dict from key to slot, and per-slot numpy arrays (pin count, recency
    stamp) that every operation updates vectorised over a batch of slots.

    Recency is exact LRU through an append-only log of (slot, stamp): stamps
    only grow, so the log is in recency order, and an entry is live while its
    slot still carries that stamp (a slot's stamp is -1 unless it is resident
    and unpinned, so one comparison decides). Every unpinned resident block has
    exactly one live entry (a touch stamps it anew; pinning kills its entry;
    unpinning touches it), so the least recently used unpinned blocks are the
    first live entries of the log. Dead entries are skipped and dropped when the
    log is compacted.

    Why a dict: a turn looks up and adds a few dozen keys (its new blocks). A numpy
    call has a fixed cost that dwarfs the work on a few dozen elements, so a
    vectorised open-addressing table would spend tens of calls per turn on probing,
    while a dict does each key in one cheap step. A whole cold prompt of thousands
    of keys is the one case where a vectorised probe would win, and it is rare: a
    conversation's next turn reuses its last insert's slots and looks up only its
    new blocks. Slots are taken from a free stack and never move; the arrays double
    when it runs out. Log compaction is O(resident blocks) and amortized over many
    calls.
    """

    def __init__(self) -> None:
        self.index: dict[int, int] = {}  # resident key -> its slot
        self._allocate(_MIN_SLOTS)
        # Bumped whenever a resident key is deleted (evict): its slot may then hold another key.
        # Adding keys never moves others, so a key's slot found under one count stays its slot
        # while the count lasts.
        self.moves = 0
        self.pinned = 0  # resident blocks with pins > 0
        self._clock = 0  # the last recency stamp handed out
        self._log_slot: _I64 = np.empty(_MIN_LOG, dtype=np.int64)
        self._log_stamp: _I64 = np.empty(_MIN_LOG, dtype=np.int64)
        self._log_head = 0  # entries before it are consumed
        self._log_size = 0

    def _allocate(self, slots: int) -> None:
        self.keys: _U64 = np.zeros(slots, dtype=np.uint64)
        self.pins = np.zeros(slots, dtype=np.int32)
        self.stamp: _I64 = np.full(slots, -1, dtype=np.int64)  # -1 unless resident and unpinned
        self._free: _I64 = np.arange(slots - 1, -1, -1, dtype=np.int64)  # a stack of free slots, top at the end
        self._free_top = slots

    @property
    def full(self) -> int:
        """Resident blocks."""
        return len(self.index)

    def lookup(self, keys: _U64) -> _I64:
        """The slot of each key, -1 where it is not resident."""
        n = len(keys)
        if not n:
            return np.empty(0, dtype=np.int64)
        return np.fromiter(map(self.index.get, keys.tolist(), itertools.repeat(-1, n)), dtype=np.int64, count=n)

    def reserve(self, n: int) -> None:
        """Make room for `n` more keys: the slot arrays double (or more) when too few slots are free.
        Resident keys keep their slots."""
        if n <= self._free_top:
            return
        old = len(self.pins)
        size = max(2 * old, old + n)
        keys, pins, stamp, free = self.keys, self.pins, self.stamp, self._free[: self._free_top]
        self._allocate(size)
        self.keys[:old], self.pins[:old], self.stamp[:old] = keys, pins, stamp
        self._free[: size - old] = np.arange(size - 1, old - 1, -1, dtype=np.int64)
        self._free[size - old : size - old + free.size] = free
        self._free_top = size - old + free.size

    def place(self, keys: _U64, key_list: list[int] | None = None) -> _I64:
        """Insert distinct non-resident keys, unpinned and never touched; their slots. `key_list`:
        ``keys.tolist()``, if the caller has it."""
        if len(keys) > self._free_top:
            self.reserve(len(keys))
        top = self._free_top - len(keys)
        slots = self._free[top : self._free_top].copy()
        self._free_top = top
        # A free slot already has pins 0 and stamp -1 (it was allocated so, or evicted unpinned
        # with its stamp reset), so it is unpinned and matches no log entry.
        self.keys[slots] = keys
        self.index.update(zip(keys.tolist() if key_list is None else key_list, slots.tolist(), strict=True))
        return slots

    def resolve(self, keys: _U64) -> _I64:
        """The slot of each of `keys` (distinct), placing the non-resident ones (`place`)."""
        n = len(keys)
        if not n:
            return np.empty(0, dtype=np.int64)
        key_list = keys.tolist()
        found = list(map(self.index.get, key_list, itertools.repeat(-1, n)))
        absent = found.count(-1)
        if absent == n:  # the usual case: an insert's new blocks
            return self.place(keys, key_list)
        slots = np.array(found, dtype=np.int64)
        if absent:
            missing = slots < 0
            slots[missing] = self.place(keys[missing])
        return slots

    def touch(self, slots: _I64) -> None:
        """Make the unpinned ones of `slots` (distinct) most recently used, in order: the last one most."""
        if self.pinned:
            slots = slots[self.pins[slots] == 0]
        n = slots.size
        if n == 0 or self._is_recent(slots):
            return
        stamps = np.arange(self._clock + 1, self._clock + n + 1, dtype=np.int64)
        self._clock += n
        self.stamp[slots] = stamps
        if self._log_size + n > len(self._log_slot):
            self._compact_log(n)
        self._log_slot[self._log_size : self._log_size + n] = slots
        self._log_stamp[self._log_size : self._log_size + n] = stamps
        self._log_size += n

    def _is_recent(self, slots: _I64) -> bool:
        """Whether `slots` (distinct, unpinned) are the most recently used already, in this order:
        the log's last entries (a conversation's next turn matching the prompt its last turn
        inserted). Touching them again would move no block in the recency order.

        Those entries are live: an entry from the log head on is dead only if its slot was
        touched again (a later entry of the same slot, but `slots` are distinct), pinned
        (`slots` are unpinned) or evicted (eviction moves the head past the victims' entries).
        """
        start = self._log_size - slots.size
        log = self._log_slot
        return (
            start >= self._log_head
            and log[start] == slots[0]  # two cheap rejections first: a grown prompt differs at its tail
            and log[self._log_size - 1] == slots[-1]
            and bool((log[start : self._log_size] == slots).all())
        )

    def pin(self, slots: _I64) -> None:
        """One more pin on each of `slots` (distinct)."""
        self.pinned += int(np.count_nonzero(self.pins[slots] == 0))
        self.pins[slots] += 1
        self.stamp[slots] = -1  # kills its log entry; `unpin` stamps it anew

    def unpin(self, slots: _I64) -> None:
        """One pin fewer on each of `slots` (distinct, head first); freed blocks become most recently used,
        tail first, so the head is the most recent."""
        self.pins[slots] -= 1
        freed = slots[self.pins[slots] == 0]
        self.pinned -= freed.size
        self.touch(freed[::-1])

    def evict(self, n: int) -> None:
        """Delete the `n` least recently used unpinned blocks (there must be that many)."""
        self.moves += 1
        while n:
            end = min(self._log_size, self._log_head + max(2 * n, _EVICT_WINDOW))
            if end == self._log_head:
                raise RuntimeError("recency log has no entry for an unpinned block")
            window = self._log_slot[self._log_head : end]
            stamps = self._log_stamp[self._log_head : end]
            live = (self.stamp[window] == stamps).nonzero()[0]
            taken = live[:n]
            self._log_head = self._log_head + int(taken[-1]) + 1 if taken.size == n else end
            victims = window[taken]
            self.stamp[victims] = -1
            index = self.index
            for key in self.keys[victims].tolist():
                del index[key]
            self._free[self._free_top : self._free_top + victims.size] = victims
            self._free_top += victims.size
            n -= victims.size

    def _live_log(self) -> _I64:
        """Indices of the live log entries, oldest first."""
        index: _I64 = np.arange(self._log_head, self._log_size, dtype=np.int64)
        slots = self._log_slot[index]
        result: _I64 = index[self.stamp[slots] == self._log_stamp[index]]
        return result

    def _compact_log(self, extra: int) -> None:
        """Drop dead entries, growing the log so that `extra` more fit with room to spare."""
        live = self._live_log()
        size = max(_MIN_LOG, _LOG_GROWTH * (live.size + extra))
        log_slot, log_stamp = np.empty(size, dtype=np.int64), np.empty(size, dtype=np.int64)
        log_slot[: live.size] = self._log_slot[live]
        log_stamp[: live.size] = self._log_stamp[live]
        self._log_slot, self._log_stamp = log_slot, log_stamp
        self._log_head, self._log_size = 0, live.size


class PrefixCache:
    """Automatic prefix caching over token ids; see the module docstring.

    ``block_tokens`` >= 1; ``capacity_tokens`` >= ``block_tokens`` (capacity
    is ``capacity_tokens // block_tokens`` blocks). A prompt is a sequence of
    uint32 token-id arrays whose concatenation is the prompt
    (`prototype.model.ModelRequest.prompt`), or a `PreparedPrompt` from
    `prepare` (to hash once for a `match` and its `insert`). Hashing and the
    recency bookkeeping are vectorised over the prompt's blocks; keys are found
    and added through a dict (`_BlockTable`, which states costs), and a
    conversation's next turn looks up only its new blocks. Not thread-safe; no
    I/O, no clock.
    """

    def __init__(
        self, block_tokens: int = DEFAULT_BLOCK_TOKENS, capacity_tokens: int = DEFAULT_CAPACITY_TOKENS
    ) -> None:
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        if capacity_tokens < block_tokens:
            raise ValueError(f"capacity_tokens must be >= block_tokens={block_tokens}, got {capacity_tokens}")
        self.block_tokens = block_tokens
        self.capacity_blocks = capacity_tokens // block_tokens
        self._table = _BlockTable()
        self._owners: dict[str, _Pin] = {}
        self._lookups = 0
        self._hit_tokens = 0
        self._miss_tokens = 0
        self._evicted = 0
        self._overflow = 0
        self._kv_idle_token_s = 0.0
        # The last `match`: its prompt, the table's move count then, the slots it found and its
        # hits, so the `insert` after a prefill reuses them if no resident block went or moved in
        # between.
        self._matched: tuple[PreparedPrompt, int, _I64, int] | None = None
        # The last `insert`: its keys, the table's move count before its evictions, and their
        # slots (all resident then), so the next `match` (a conversation's next turn, usually)
        # looks up only the keys past their common prefix.
        self._inserted: tuple[_U64, int, _I64] | None = None
        # The last touch, not applied yet: the first `n` slots of an array (head first) and the
        # table's move count then. The next operation applies it first, unless it is the same
        # conversation's next step (its turn's insert after the match, the output's insert after
        # the prompt's, the next turn's match), which touches those slots again, head first,
        # before anything reads the recency order: applying the earlier touch would leave no live
        # trace (see `_supersede`).
        self._deferred: tuple[_I64, int, int] | None = None

    def prepare(self, prompt: Prompt) -> PreparedPrompt:
        """The prompt's chained block keys (see `block_keys`); a `PreparedPrompt` is returned as is."""
        if isinstance(prompt, PreparedPrompt):
            if prompt.block_tokens != self.block_tokens:
                raise ValueError(
                    f"prompt prepared for {prompt.block_tokens}-token blocks, cache uses {self.block_tokens}"
                )
            return prompt
        keys = block_keys(prompt, self.block_tokens)
        return PreparedPrompt(self.block_tokens, sum(map(len, prompt)), keys)

    def extend(
        self, prepared: PreparedPrompt, prompt: Sequence[npt.NDArray[np.uint32]], more: npt.NDArray[np.uint32]
    ) -> PreparedPrompt:
        """The prompt followed by `more`, prepared, given `prepared` (`prompt`'s, from `prepare`):
        only the blocks past the prompt's full ones are hashed (`extended_keys`)."""
        self._prepared(prepared)  # its block size checked
        keys = extended_keys(prepared.keys, prompt, more, self.block_tokens, prompt_tokens=prepared.prompt_tokens)
        return PreparedPrompt(self.block_tokens, prepared.prompt_tokens + len(more), keys)

    def match(self, prompt: Prompt) -> int:
        """Leading prompt tokens whose KV is cached: a multiple of ``block_tokens``, < prompt length.

        Looks up the blocks of the first ``prompt_tokens - 1`` tokens and counts
        the hits before the first miss; those become most recently used (head
        block last). Counts one lookup, its hit and miss tokens.
        """
        prepared = self._prepared(prompt)
        limit = max(prepared.prompt_tokens - 1, 0) // self.block_tokens  # >= 1 token recomputed, whole blocks
        keys = prepared.keys[:limit]
        source, known = self._after_insert(keys)
        index = self._table.index
        found: list[int] = []  # the slots of the hits past the first `known`, up to the first miss
        for key in keys[known:].tolist():
            slot = index.get(key)
            if slot is None:
                break
            found.append(slot)
        hits = known + len(found)
        slots = _joined(source, known, np.array(found, dtype=np.int64) if found else None)
        self._matched = (prepared, self._table.moves, slots, hits)
        self._supersede(source, known)
        self._deferred = (slots, hits, self._table.moves)
        matched = hits * self.block_tokens
        self._lookups += 1
        self._hit_tokens += matched
        self._miss_tokens += prepared.prompt_tokens - matched
        return matched

    def insert(self, prompt: Prompt, *, owner: str | None = None, now: float) -> None:
        """Cache every full block of the prompt (most recently used), then evict down to capacity.

        With ``owner``, pin the prompt's blocks for that owner and unpin the
        blocks of the owner's previous insert, closing its `kv_idle_token_s`
        interval at `now` (`ValueError`, before any change, if `now` is before
        that insert's). Eviction takes unpinned blocks, least recently used
        first; if none is left the cache stays over capacity and the blocks
        admitted beyond it are counted in ``overflow_blocks``.
        """
        previous = None if owner is None else self._owners.get(owner)
        if previous is not None:
            self._check_time(previous, now)
        prepared = self._prepared(prompt)
        table = self._table
        resident_before = len(table.index)
        # The slots of a leading run of the prompt's blocks, known resident: the last `match`'s
        # hits if it was this prompt's and no resident block went or moved since (keys are only
        # added by an insert, and every insert clears the last match), else the prefix shared
        # with the last insert (a turn's output inserted behind its prompt); the rest looked up.
        matched, self._matched = self._matched, None
        source: _I64 | None
        if matched is not None and matched[0] is prepared and matched[1] == table.moves:
            source, known = matched[2], matched[3]
        else:
            source, known = self._after_insert(prepared.keys)
        slots = _joined(source, known, table.resolve(prepared.keys[known:]) if known < prepared.keys.size else None)
        if owner is None:
            self._supersede(source, known)
            self._deferred = (slots, slots.size, table.moves)  # tail first: the head ends most recently used
        else:
            self._flush()
            kept = 0 if previous is None else _common_prefix(previous.prompt.keys, prepared.keys)
            table.pin(slots[kept:])  # only the difference to the owner's previous pin changes counts
            self._owners[owner] = _Pin(prepared, now)
            if previous is not None:
                self._close_pin(previous, now, kept)
        self._inserted = (prepared.keys, table.moves, slots)  # an eviction just below voids it
        if len(table.index) > self.capacity_blocks:  # over capacity: evict, counting what stays over
            self._overflow += max(0, self._evict() - max(0, resident_before - self.capacity_blocks))

    def _flush(self) -> None:
        """Apply the deferred touch, if any."""
        deferred, self._deferred = self._deferred, None
        if deferred is not None:
            self._table.touch(deferred[0][: deferred[1]][::-1])

    def _supersede(self, source: _I64 | None, copied: int) -> None:
        """Before a touch whose slots (head first, touched tail first) begin with `source[:copied]`:
        drop the deferred touch if it is of `source[:n]` with ``n <= copied`` and no block moved
        since, else apply it. The touch to come stamps each of those slots again, later than the
        deferred one would have, in the same tail-first order, so the deferred touch's log entries
        would all be dead: the least recently used order, the `_is_recent` test and every eviction
        come out the same without it."""
        deferred, self._deferred = self._deferred, None
        if deferred is None:
            return
        done, n, moves = deferred
        if done is source and n <= copied and moves == self._table.moves:
            return
        self._table.touch(done[:n][::-1])

    def release(self, owner: str, now: float) -> None:
        """Unpin the owner's blocks (they stay cached, most recently used) and evict down to capacity.

        Closes the owner's `kv_idle_token_s` interval at `now` (`ValueError`,
        before any change, if `now` is before the pinning insert's). Unknown
        owners are ignored.
        """
        pin = self._owners.get(owner)
        if pin is None:
            return
        self._check_time(pin, now)
        self._flush()
        del self._owners[owner]
        self._close_pin(pin, now, 0)
        self._evict()

    def statistics(self) -> PrefixCacheStatistics:
        return PrefixCacheStatistics(
            lookups=self._lookups,
            hit_tokens=self._hit_tokens,
            miss_tokens=self._miss_tokens,
            resident_blocks=self._table.full,
            pinned_blocks=self._table.pinned,
            evicted_blocks=self._evicted,
            overflow_blocks=self._overflow,
            kv_idle_token_s=self._kv_idle_token_s,
        )

    def _prepared(self, prompt: Prompt) -> PreparedPrompt:
        """`prepare`, without the call for a prompt prepared for this cache's blocks already."""
        if isinstance(prompt, PreparedPrompt) and prompt.block_tokens == self.block_tokens:
            return prompt
        return self.prepare(prompt)

    def _after_insert(self, keys: _U64) -> tuple[_I64 | None, int]:
        """The leading keys `keys` shares with the last insert's prompt, if no resident key moved
        or went since: (that insert's slots, whose head holds theirs, resident; how many), else
        (None, 0)."""
        inserted = self._inserted
        if inserted is not None and inserted[1] == self._table.moves:
            common = _common_prefix(inserted[0], keys)
            if common:
                return inserted[2], common
        return None, 0

    @staticmethod
    def _check_time(pin: _Pin, now: float) -> None:
        if not now >= pin.since:
            raise ValueError(f"now={now} is before the owner's pin at {pin.since}")

    def _close_pin(self, pin: _Pin, now: float, kept: int) -> None:
        """Account the pin's idle KV up to `now` and unpin its blocks after the first `kept` (still pinned)."""
        self._kv_idle_token_s += len(pin.prompt.keys) * self.block_tokens * (now - pin.since)
        slots = self._table.lookup(pin.prompt.keys[kept:])  # pinned blocks are never evicted: all resident
        self._table.unpin(slots)

    def _excess(self) -> int:
        return max(0, self._table.full - self.capacity_blocks)

    def _evict(self) -> int:
        """Evict unpinned blocks, least recently used first, down to capacity as far as they go;
        the blocks still over capacity (`evict` takes exactly the `n` asked)."""
        excess = self._excess()
        n = min(excess, self._table.full - self._table.pinned)
        if n:
            self._flush()  # eviction reads the recency order
            self._table.evict(n)
            self._evicted += n
        return excess - n
