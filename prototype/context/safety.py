"""A stand-in safety classifier that really reads every token it is given.

The real Responses API runs safety classifiers over the conversation on every
turn; in WebSocket mode it classifies only the new input. This module is the CPU
half of that: a linear model over hashed token n-grams whose cost is linear in
the tokens read, with an incremental form that is *exactly* equal to the batch
form, so the service may classify only what it has not classified before.

Theory
------
* Features. Every n-gram of token ids of order 1..``ngram`` is hashed with a
  multiply-xor chain over fixed odd 64-bit constants (``h_1 = (t ^ SALT) * M``,
  ``h_k = (h_{k-1} ^ t_k) * M``), finalised with one xor-shift-multiply round and
  mapped to one of ``n_features`` buckets by the high bits (Lemire's
  multiply-shift range reduction). Order ``k`` is derived from order ``k-1`` by
  one vectorised pass, so the work is ``O(ngram * tokens)`` numpy element
  operations and no Python loop runs per token.
* Model. Each bucket has a weight ``w_b ~ N(0, 1)`` (logit units) drawn once from
  ``np.random.default_rng(seed)``. With ``S`` the sum of the weights of all
  n-grams read and ``m`` their number, ``logit = BIAS + S / m`` and
  ``score = sigmoid(logit)``.
* Why the mean and not ``S / sqrt(m)``: ``S / m = sum_b p_b w_b`` with ``p_b``
  the share of n-grams in bucket ``b``, so over the draw of the weights it is
  Gaussian with variance ``sum_b p_b**2 <= 1`` for *any* token stream chosen
  independently of the seed. ``S / sqrt(m)`` has variance ``sum_b c_b**2 / m``,
  which grows without bound on repetitive text (one token repeated ``n`` times
  gives variance ~``n``), so long real conversations would be flagged at random.
  Also ``S / m <= max_b w_b``: a stream can never score above its best bucket.
* Exactness. Weights are stored as fixed-point integers and summed in integer
  arithmetic, which is associative; the state carries the last ``ngram - 1``
  tokens, the integer sum and the n-gram count, so ``update`` over any split of a
  stream gives bit-identical verdicts to ``score`` over the whole stream.
* Flagging. ``flagged = score >= threshold``. The default threshold is the logit
  ``BIAS + FLAG_SIGMA``: for a stream independent of the seed the probability of
  a flag is at most ``P(N(0, 1) >= 6) ~ 1e-9``, and for a fixed seed no stream at
  all can be flagged unless some bucket weight is >= 6 (expected number of such
  buckets in a 2**18 table: ~2.6e-4). Model flags are thus essentially never
  raised; deterministic refusals come from ``flag_tokens``: if any of those ids
  is read, the verdict is flagged with score 1.0.
* Input. Token arrays must be one-dimensional ``numpy.uint32`` (what
  `prototype.context.tokenizer` produces); anything else is rejected with `TypeError`
  (or `ValueError` for the wrong shape) rather than converted, because silently
  wrapping int64 or negative ids would change n-gram identity.

Nothing here does I/O.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt

__all__ = [
    "BIAS",
    "DEFAULT_THRESHOLD",
    "FLAG_SIGMA",
    "ClassifierState",
    "SafetyClassifier",
    "Verdict",
    "check_tokens",
]

TokenArray = npt.NDArray[np.uint32]

BIAS: Final = -4.0
"""Prior logit: with no evidence the score is sigmoid(-4) ~ 0.018, i.e. content is presumed safe."""

FLAG_SIGMA: Final = 6.0
"""How many weight standard deviations above the prior the mean weight must reach to flag.
The mean weight has standard deviation <= 1 for any stream independent of the seed, so
P(flag) <= P(N(0, 1) >= 6) ~ 9.9e-10 per stream."""

DEFAULT_THRESHOLD: Final = 1.0 / (1.0 + math.exp(-(BIAS + FLAG_SIGMA)))
"""sigmoid(BIAS + FLAG_SIGMA) = sigmoid(2) ~ 0.881."""

WEIGHT_FRAC_BITS: Final = 20
"""Fixed-point fraction bits of the weights (resolution ~1e-6 logit). Weights stay far inside
int32 (|w| < 2**11 sigma), and int64 per-chunk sums cannot overflow below ~10**12 n-grams."""

WEIGHT_SCALE: Final = float(1 << WEIGHT_FRAC_BITS)

SALT: Final = np.uint64(0x9E3779B97F4A7C15)
"""Xored into unigram ids so token 0 does not hash to 0 (2**64 / golden ratio)."""

CHAIN_MULTIPLIER: Final = np.uint64(0xC2B2AE3D27D4EB4F)
"""Odd multiplier of the n-gram chain (xxHash64 PRIME64_2): a bijection on uint64 that
carries every input bit into the high bits used for bucketing."""

FINAL_SHIFT: Final = np.uint64(29)
FINAL_MULTIPLIER: Final = np.uint64(0x165667B19E3779F9)
"""One xor-shift-multiply finaliser round (xxHash64 PRIME64_3) folds high bits back down before
the final multiply, so the bucket bits depend on every bit of the chain state."""

HIGH_SHIFT: Final = np.uint64(32)
"""Range reduction uses the top 32 bits: bucket = (h >> 32) * n_features >> 32, exact in uint64."""

MAX_FEATURES: Final = 1 << 32
"""Upper bound on n_features for the multiply-shift range reduction to stay within uint64."""


@dataclass(frozen=True, slots=True)
class ClassifierState:
    """What the classifier remembers between chunks of one stream (immutable; `update` returns a new one).

    ``tail`` holds the last ``ngram - 1`` tokens read, so n-grams spanning a chunk boundary are
    counted exactly once; ``weight_sum`` is in fixed-point units (exact integer arithmetic).
    """

    tail: tuple[int, ...] = ()
    weight_sum: int = 0
    ngrams: int = 0
    tokens_read: int = 0
    blocked: bool = False


@dataclass(frozen=True, slots=True)
class Verdict:
    """The classifier's judgement of everything read so far."""

    score: float
    flagged: bool
    tokens_read: int


def check_tokens(tokens: object) -> TokenArray:
    """`tokens` if it is a one-dimensional uint32 array, else `TypeError`/`ValueError`."""
    if not isinstance(tokens, np.ndarray):
        raise TypeError(f"tokens must be a numpy.ndarray of uint32, got {type(tokens).__name__}")
    if tokens.dtype != np.uint32:
        raise TypeError(
            f"tokens must have dtype uint32, got {tokens.dtype}; convert explicitly with "
            "np.asarray(tokens, dtype=np.uint32) after checking the ids are in range"
        )
    if tokens.ndim != 1:
        raise ValueError(f"tokens must be one-dimensional, got shape {tokens.shape}")
    return tokens


def _sigmoid(x: float) -> float:
    if x >= 0.0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)
    return e / (1.0 + e)


class SafetyClassifier:
    """Hashed n-gram linear model; see the module docstring. Deterministic for a seed; thread-safe reads."""

    __slots__ = ("_blocklist", "_n_features", "_ngram", "_seed", "_threshold", "_weights")

    def __init__(
        self,
        *,
        seed: int = 0,
        n_features: int = 1 << 18,
        ngram: int = 3,
        threshold: float = DEFAULT_THRESHOLD,
        flag_tokens: Iterable[int] = (),
    ) -> None:
        if not 1 <= n_features <= MAX_FEATURES:
            raise ValueError(f"n_features must be in [1, 2**32], got {n_features}")
        if ngram < 1:
            raise ValueError(f"ngram must be >= 1, got {ngram}")
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"threshold must be in [0, 1], got {threshold}")
        blocked = sorted({int(t) for t in flag_tokens})
        if blocked and not (0 <= blocked[0] and blocked[-1] <= np.iinfo(np.uint32).max):
            raise ValueError("flag_tokens must be uint32 token ids")
        self._seed = seed
        self._n_features = np.uint64(n_features)
        self._ngram = ngram
        self._threshold = threshold
        self._blocklist: TokenArray = np.asarray(blocked, dtype=np.uint32)
        rng = np.random.default_rng(seed)
        self._weights: npt.NDArray[np.int32] = np.rint(rng.standard_normal(n_features) * WEIGHT_SCALE).astype(np.int32)

    @property
    def seed(self) -> int:
        return self._seed

    @property
    def ngram(self) -> int:
        return self._ngram

    @property
    def n_features(self) -> int:
        return int(self._n_features)

    @property
    def threshold(self) -> float:
        return self._threshold

    @property
    def flag_tokens(self) -> tuple[int, ...]:
        return tuple(int(t) for t in self._blocklist)

    def begin(self) -> ClassifierState:
        """The state of a stream with nothing read yet."""
        return ClassifierState()

    def update(self, state: ClassifierState, tokens: TokenArray) -> ClassifierState:
        """Read only ``tokens`` (the new input) and return the state after them. O(len(tokens))."""
        tokens = check_tokens(tokens)
        if len(state.tail) >= self._ngram:
            raise ValueError("state does not belong to this classifier (tail longer than ngram - 1)")
        if tokens.size == 0:
            return state
        weight_sum, ngrams = self._read(state.tail, tokens)
        keep = self._ngram - 1
        tail = (state.tail + tuple(tokens[-keep:].tolist()))[-keep:] if keep else ()
        return ClassifierState(
            tail=tail,
            weight_sum=state.weight_sum + weight_sum,
            ngrams=state.ngrams + ngrams,
            tokens_read=state.tokens_read + int(tokens.size),
            blocked=state.blocked or self._contains_blocked(tokens),
        )

    def update_all(self, state: ClassifierState, chunks: Iterable[TokenArray]) -> ClassifierState:
        """`update` with each of `chunks` in turn (a context's new chunks, in one call)."""
        for tokens in chunks:
            state = self.update(state, tokens)
        return state

    def verdict(self, state: ClassifierState) -> Verdict:
        """Score and flag of everything read into ``state``. A blocked token forces score 1.0."""
        if state.blocked:
            return Verdict(score=1.0, flagged=True, tokens_read=state.tokens_read)
        mean = state.weight_sum / (WEIGHT_SCALE * state.ngrams) if state.ngrams else 0.0
        score = _sigmoid(BIAS + mean)
        return Verdict(score=score, flagged=score >= self._threshold, tokens_read=state.tokens_read)

    def classify(self, tokens: TokenArray) -> Verdict:
        """Batch form: the verdict over a whole stream."""
        return self.verdict(self.update(self.begin(), tokens))

    def score(self, tokens: TokenArray) -> float:
        """Probability-like score in [0, 1] of a whole stream."""
        return self.classify(tokens).score

    def _contains_blocked(self, tokens: TokenArray) -> bool:
        blocklist = self._blocklist
        if blocklist.size == 0:
            return False
        idx = np.searchsorted(blocklist, tokens)
        np.minimum(idx, blocklist.size - 1, out=idx)
        return bool(np.any(blocklist[idx] == tokens))

    def _read(self, tail: tuple[int, ...], tokens: TokenArray) -> tuple[int, int]:
        """Sum of weights and count of the n-grams that end inside ``tokens`` (``tail`` precedes them)."""
        t0 = len(tail)
        x = np.empty(t0 + tokens.size, dtype=np.uint64)
        x[:t0] = tail
        x[t0:] = tokens
        n = x.size
        weights = self._weights
        h = x ^ SALT
        h *= CHAIN_MULTIPLIER
        f = np.empty_like(h)
        total = 0
        count = 0
        for k in range(1, min(self._ngram, n) + 1):
            if k > 1:
                # k-grams starting at i: fold token i + k - 1 into the (k-1)-gram hash at i.
                h = h[:-1] ^ x[k - 1 :]
                h *= CHAIN_MULTIPLIER
            start = max(0, t0 - k + 1)  # k-grams lying wholly inside the tail were read before
            seg = h[start:]
            g = f[: seg.size]
            np.right_shift(seg, FINAL_SHIFT, out=g)
            g ^= seg
            g *= FINAL_MULTIPLIER
            g >>= HIGH_SHIFT
            g *= self._n_features
            g >>= HIGH_SHIFT
            total += int(np.take(weights, g.view(np.int64)).sum(dtype=np.int64))
            count += seg.size
        return total, count
