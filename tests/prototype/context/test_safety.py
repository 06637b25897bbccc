"""The stand-in safety classifier: determinism, exact incremental == batch, linear work, flagging."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prototype.context.safety import DEFAULT_THRESHOLD, FLAG_SIGMA, ClassifierState, SafetyClassifier, Verdict

VOCAB = 200_019
"""o200k_base vocabulary size: random streams draw ids from the real id range."""

SMALL_FEATURES = 1 << 12
"""A small table keeps the many-classifier tests fast; collisions do not affect exactness."""

HYPOTHESIS = settings(max_examples=150, deadline=None, database=None)
"""No example database: the test must not write files into the repository."""

Tokens = npt.NDArray[np.uint32]


@pytest.fixture(scope="module")
def clf() -> SafetyClassifier:
    return SafetyClassifier(seed=0)


def random_tokens(n: int, seed: int = 0, vocab: int = VOCAB) -> Tokens:
    return np.random.default_rng(seed).integers(0, vocab, n, dtype=np.uint32)


def feed(clf: SafetyClassifier, chunks: list[Tokens]) -> ClassifierState:
    state = clf.begin()
    for chunk in chunks:
        state = clf.update(state, chunk)
    return state


def split_at(tokens: Tokens, cuts: list[int]) -> list[Tokens]:
    bounds = [0, *sorted(cuts), tokens.size]
    return [tokens[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


# --- determinism -------------------------------------------------------------------------------------------


def test_same_seed_same_scores() -> None:
    tokens = random_tokens(5000, seed=3)
    a, b = SafetyClassifier(seed=7), SafetyClassifier(seed=7)
    assert a.classify(tokens) == b.classify(tokens)
    assert a.score(tokens) == a.score(tokens.copy())


def test_different_seeds_differ() -> None:
    streams = [random_tokens(n, seed=n) for n in (1, 2, 3, 50, 1000)]
    a, b = SafetyClassifier(seed=0), SafetyClassifier(seed=1)
    for tokens in streams:
        assert a.score(tokens) != b.score(tokens)


def test_score_depends_on_content_and_order(clf: SafetyClassifier) -> None:
    tokens = random_tokens(200, seed=5)
    assert clf.score(tokens) != clf.score(random_tokens(200, seed=6))
    assert clf.score(tokens) != clf.score(tokens[::-1].copy())  # bigrams and trigrams see order


# --- incremental == batch ----------------------------------------------------------------------------------


@pytest.mark.parametrize("ngram", [1, 2, 3, 5])
def test_incremental_equals_batch_over_random_splits(ngram: int) -> None:
    clf = SafetyClassifier(seed=11, ngram=ngram, n_features=SMALL_FEATURES)
    rng = np.random.default_rng(ngram)
    for trial in range(60):
        n = int(rng.integers(0, 300))
        tokens = random_tokens(n, seed=trial, vocab=int(rng.choice([5, 1000, VOCAB])))
        cuts = [int(c) for c in rng.integers(0, n + 1, int(rng.integers(0, 12)))]  # repeats give empty chunks
        state = feed(clf, split_at(tokens, cuts))
        assert clf.verdict(state) == clf.classify(tokens)
        assert state == feed(clf, [tokens])


def test_token_by_token_equals_batch(clf: SafetyClassifier) -> None:
    tokens = random_tokens(257, seed=9, vocab=50)
    empty = np.empty(0, dtype=np.uint32)
    chunks = [c for t in tokens for c in (empty, np.array([t], dtype=np.uint32))]
    state = feed(clf, chunks)
    assert clf.verdict(state) == clf.classify(tokens)
    assert state.tokens_read == tokens.size


TOKEN_IDS = st.one_of(st.integers(0, 4), st.integers(0, 2**32 - 1))
"""Mostly-repeating small ids (repeated n-grams) mixed with the full uint32 range (edges of the hash input)."""


@settings(HYPOTHESIS)
@given(chunks=st.lists(st.lists(TOKEN_IDS, max_size=6), max_size=10), ngram=st.integers(1, 5))
def test_incremental_equals_batch_property(chunks: list[list[int]], ngram: int) -> None:
    """Short chunks (0..6 tokens) put boundaries inside n-grams and make the carried tail outgrow each chunk."""
    clf = SafetyClassifier(seed=2, ngram=ngram, n_features=SMALL_FEATURES, flag_tokens=[7])
    arrays = [np.asarray(c, dtype=np.uint32) for c in chunks]
    whole = np.concatenate([np.empty(0, dtype=np.uint32), *arrays])
    state = feed(clf, arrays)
    assert state == feed(clf, [whole])
    assert clf.verdict(state) == clf.classify(whole)


def test_update_does_not_mutate_state(clf: SafetyClassifier) -> None:
    start = clf.begin()
    after = clf.update(start, random_tokens(10))
    assert start == ClassifierState()
    assert after.tokens_read == 10
    assert clf.update(after, np.empty(0, dtype=np.uint32)) == after


def test_chunk_boundary_ngrams_are_counted_once(clf: SafetyClassifier) -> None:
    # 5 tokens with ngram=3: 5 unigrams + 4 bigrams + 3 trigrams, however the stream is cut.
    tokens = random_tokens(5)
    for cut in range(6):
        state = feed(clf, split_at(tokens, [cut]))
        assert state.ngrams == 12
        assert state.tail == tuple(int(t) for t in tokens[-2:])


# --- work done ---------------------------------------------------------------------------------------------


def test_tokens_read_is_linear(clf: SafetyClassifier) -> None:
    small, large = clf.classify(random_tokens(10_000)), clf.classify(random_tokens(40_000))
    assert small.tokens_read == 10_000
    assert large.tokens_read == 4 * small.tokens_read


def test_incremental_reads_only_new_tokens(clf: SafetyClassifier) -> None:
    """WebSocket mode: per-turn work is flat; re-classifying the whole conversation grows."""
    turns = [random_tokens(500, seed=i) for i in range(8)]
    state = clf.begin()
    flat, growing = [], []
    history = np.empty(0, dtype=np.uint32)
    for turn in turns:
        before = state.tokens_read
        state = clf.update(state, turn)
        flat.append(state.tokens_read - before)
        history = np.concatenate([history, turn])
        growing.append(clf.classify(history).tokens_read)
        assert clf.verdict(state) == clf.classify(history)
    assert flat == [500] * 8
    assert growing == [500 * (i + 1) for i in range(8)]


def test_ngram_count_grows_with_tokens(clf: SafetyClassifier) -> None:
    """The model sums one weight per n-gram: 3n - 3 lookups for n >= 2 tokens with ngram=3."""
    for n in (0, 1, 2, 3, 1000, 4000):
        assert clf.update(clf.begin(), random_tokens(n)).ngrams == sum(max(0, n - k + 1) for k in (1, 2, 3))


# --- scores and flagging -----------------------------------------------------------------------------------


def test_scores_are_in_unit_interval_and_random_streams_are_not_flagged(clf: SafetyClassifier) -> None:
    rng = np.random.default_rng(42)
    for trial in range(300):
        n = int(rng.integers(0, 2000))
        verdict = clf.classify(random_tokens(n, seed=trial, vocab=int(rng.choice([2, 100, VOCAB]))))
        assert 0.0 <= verdict.score <= 1.0
        assert verdict.score < DEFAULT_THRESHOLD
        assert not verdict.flagged


def test_repetitive_streams_are_not_flagged(clf: SafetyClassifier) -> None:
    """A mean over n-grams, not a sqrt(n)-normalised sum: repetition cannot inflate the score."""
    for token in range(0, VOCAB, 997):
        assert not clf.classify(np.full(5000, token, dtype=np.uint32)).flagged


def test_no_stream_can_exceed_the_best_single_token() -> None:
    """The score is sigmoid(bias + mean weight) <= sigmoid(bias + max weight); for seed 0 that is below threshold."""
    clf = SafetyClassifier(seed=0, ngram=1, n_features=SMALL_FEATURES)
    singles = [clf.score(np.array([t], dtype=np.uint32)) for t in range(20_000)]
    best = int(np.argmax(singles))
    assert max(singles) < DEFAULT_THRESHOLD
    assert clf.score(random_tokens(1000, seed=1)) <= max(singles)
    assert clf.score(np.array([best, best, best], dtype=np.uint32)) == pytest.approx(max(singles))


def test_empty_stream_scores_the_prior(clf: SafetyClassifier) -> None:
    verdict = clf.classify(np.empty(0, dtype=np.uint32))
    assert verdict.score == pytest.approx(1 / (1 + np.exp(4.0)))
    assert (verdict.flagged, verdict.tokens_read) == (False, 0)


def test_default_threshold_is_six_sigma_above_the_prior() -> None:
    assert FLAG_SIGMA == 6.0
    assert DEFAULT_THRESHOLD == pytest.approx(1 / (1 + np.exp(-2.0)))


def test_threshold_controls_model_flags() -> None:
    tokens = random_tokens(100)
    assert SafetyClassifier(threshold=0.0).classify(tokens).flagged
    assert not SafetyClassifier(threshold=1.0).classify(tokens).flagged
    score = SafetyClassifier().score(tokens)
    assert SafetyClassifier(threshold=score).classify(tokens).flagged


def test_blocklisted_token_flags_with_score_one() -> None:
    tokens = random_tokens(1000, seed=4)
    blocked = int(tokens[617])
    clf = SafetyClassifier(flag_tokens=[blocked])
    assert clf.classify(tokens) == Verdict(score=1.0, flagged=True, tokens_read=1000)
    assert not clf.classify(tokens[tokens != blocked].copy()).flagged
    assert clf.flag_tokens == (blocked,)


def test_blocklisted_token_in_a_later_chunk_flags_and_stays_flagged() -> None:
    clf = SafetyClassifier(flag_tokens=[123_456, 5])
    clean = random_tokens(300, seed=8, vocab=100_000)
    state = clf.update(clf.begin(), clean)
    assert not clf.verdict(state).flagged
    state = clf.update(state, np.array([1, 2, 5, 3], dtype=np.uint32))
    assert clf.verdict(state) == Verdict(score=1.0, flagged=True, tokens_read=304)
    state = clf.update(state, clean)
    assert clf.verdict(state) == Verdict(score=1.0, flagged=True, tokens_read=604)


@pytest.mark.parametrize("blocked", [0, 2**32 - 1])
def test_blocklist_edges_of_the_id_range(blocked: int) -> None:
    clf = SafetyClassifier(flag_tokens=[blocked])
    assert clf.classify(np.array([blocked], dtype=np.uint32)).flagged
    assert not clf.classify(np.array([1, 2**32 - 2], dtype=np.uint32)).flagged


def test_blocklist_does_not_change_the_model_score() -> None:
    tokens = random_tokens(100)
    assert SafetyClassifier(flag_tokens=[VOCAB + 1]).score(tokens) == SafetyClassifier().score(tokens)


# --- input validation --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.int64, np.uint64, np.int32, np.uint16, np.float64])
def test_non_uint32_arrays_are_rejected(clf: SafetyClassifier, dtype: type[np.generic]) -> None:
    with pytest.raises(TypeError, match="uint32"):
        clf.score(np.arange(10, dtype=dtype))
    with pytest.raises(TypeError, match="uint32"):
        clf.update(clf.begin(), np.arange(10, dtype=dtype))


def test_non_arrays_are_rejected(clf: SafetyClassifier) -> None:
    with pytest.raises(TypeError, match="ndarray"):
        clf.score([1, 2, 3])  # type: ignore[arg-type]


def test_non_1d_arrays_are_rejected(clf: SafetyClassifier) -> None:
    with pytest.raises(ValueError, match="one-dimensional"):
        clf.score(np.zeros((2, 3), dtype=np.uint32))


def test_non_contiguous_views_are_read_correctly(clf: SafetyClassifier) -> None:
    tokens = random_tokens(1001)
    assert clf.classify(tokens[::2]) == clf.classify(tokens[::2].copy())


@pytest.mark.parametrize(
    "kwargs",
    [
        {"n_features": 0},
        {"n_features": 2**32 + 1},
        {"ngram": 0},
        {"threshold": -0.1},
        {"threshold": 1.5},
        {"flag_tokens": [-1]},
        {"flag_tokens": [2**32]},
    ],
)
def test_bad_parameters_are_rejected(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        SafetyClassifier(**kwargs)  # type: ignore[arg-type]


def test_foreign_state_is_rejected() -> None:
    state = SafetyClassifier(ngram=4, n_features=SMALL_FEATURES).update(ClassifierState(), random_tokens(10))
    with pytest.raises(ValueError, match="state"):
        SafetyClassifier(ngram=2, n_features=SMALL_FEATURES).update(state, random_tokens(3))
