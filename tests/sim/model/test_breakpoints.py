"""Explicit prompt-cache breakpoints in the simulated accelerator (`sim.model.breakpoints`), on the
manual clock: what a request writes (the latest four in `explicit` mode, three in `implicit`),
what matches (the breakpoints the request names: the conversation's latest 80, placed by
`prototype.context.breakpoints`), no breakpoints in `explicit` mode meaning no prompt caching,
and each written breakpoint expiring after its own TTL."""

from __future__ import annotations

from typing import Literal

import numpy as np
import numpy.typing as npt
import pytest

from prototype.model import CacheBreakpoint, ModelRequest, Prefilled
from sim.model.accelerator import SimulatedModel
from sim.model.breakpoints import WRITTEN, BreakpointCache, written
from sim.model.kv import block_keys
from sim.model.policy import DefaultPolicy
from sim.runtime.clock import ManualClock

HALF_HOUR = 1800.0
TWELVE_HOURS = 43_200.0
PROMPT: npt.NDArray[np.uint32] = np.arange(10_000, 12_000, dtype=np.uint32)  # 2,000 tokens


def _model() -> SimulatedModel:
    return SimulatedModel(clock=ManualClock(), policy=DefaultPolicy(tool_calls=0))


def _request(
    prompt: npt.NDArray[np.uint32],
    marks: tuple[int, ...] = (),
    *,
    mode: Literal["implicit", "explicit"] = "explicit",
    ttl_s: float | tuple[float, ...] = HALF_HOUR,
) -> ModelRequest:
    ttls = ttl_s if isinstance(ttl_s, tuple) else (ttl_s,) * len(marks)
    return ModelRequest(
        prompt=(prompt,),
        prompt_tokens=len(prompt),
        resident_tokens=0,
        turn_index=0,
        conversation_key=7,
        cache_mode=mode,
        breakpoints=tuple(CacheBreakpoint(t, s) for t, s in zip(marks, ttls, strict=True)),
    )


async def _cached(model: SimulatedModel, request: ModelRequest) -> int:
    events = [event async for event in model.sample(request)]
    first = events[0]
    assert isinstance(first, Prefilled)
    return first.cached_tokens


def _diverged(at: int) -> npt.NDArray[np.uint32]:
    """`PROMPT`'s first `at` tokens, then other tokens."""
    return np.concatenate((PROMPT[:at], np.arange(50_000, 50_000 + len(PROMPT) - at, dtype=np.uint32)))


async def test_explicit_without_breakpoints_does_not_cache() -> None:
    model = _model()
    assert await _cached(model, _request(PROMPT)) == 0
    assert await _cached(model, _request(PROMPT)) == 0  # the same prompt again: still nothing reused
    # The implicit mode (the default) is the prefix cache: the repeat reuses whole blocks.
    implicit = _model()
    assert await _cached(implicit, _request(PROMPT, mode="implicit")) == 0
    assert await _cached(implicit, _request(PROMPT, mode="implicit")) == (len(PROMPT) - 1) // 16 * 16


async def test_explicit_breakpoint_reuses_its_exact_prefix() -> None:
    model = _model()
    assert await _cached(model, _request(PROMPT, (1_003,))) == 0  # written, nothing to reuse yet
    assert await _cached(model, _request(PROMPT, (1_003,))) == 1_003  # not rounded to a 16-token block
    # A prompt that diverges before the boundary does not share its prefix.
    assert await _cached(model, _request(_diverged(1_002), (1_003,))) == 0
    # One that diverges after it does: the breakpoint's prefix is all that is reused.
    assert await _cached(model, _request(_diverged(1_500), (1_003,))) == 1_003


@pytest.mark.parametrize("mode", ["explicit", "implicit"])
async def test_only_the_latest_breakpoints_are_written(mode: Literal["implicit", "explicit"]) -> None:
    marks = (100, 200, 300, 400, 500, 600)
    kept = WRITTEN[mode]
    model = _model()
    await _cached(model, _request(PROMPT, marks, mode=mode))
    oldest_written = marks[-kept]
    older = marks[-kept - 1]
    # A prompt that shares only the prefix up to a breakpoint (and names just those up to it):
    # reused up to the latest written one it still has. In implicit mode the prefix cache
    # (whole blocks) may reuse more, never less.
    same_to_older = await _cached(model, _request(_diverged(older + 5), marks[:-kept], mode=mode))
    same_to_written = await _cached(model, _request(_diverged(oldest_written + 5), marks[: -kept + 1], mode=mode))
    if mode == "explicit":
        assert same_to_older == 0  # the older breakpoints were never written
        assert same_to_written == oldest_written
    else:
        assert same_to_older == (older + 5) // 16 * 16  # the prefix cache's blocks, not a breakpoint
        assert same_to_written == oldest_written  # the breakpoint beats the block boundary below it


async def test_each_breakpoint_expires_after_its_own_ttl() -> None:
    model = _model()
    clock = model.clock
    assert isinstance(clock, ManualClock)
    marks = (700, 1_400)
    ttls = (TWELVE_HOURS, HALF_HOUR)  # a long-lived prefix, a short-lived turn
    await _cached(model, _request(PROMPT, marks, ttl_s=ttls))
    clock.advance(HALF_HOUR - 1)
    assert await _cached(model, _request(_diverged(1_900), marks, ttl_s=ttls)) == 1_400
    # That request wrote both again: their lives start over from its time.
    clock.advance(HALF_HOUR + 1)
    assert await _cached(model, _request(_diverged(1_900), marks[:1] + (1_401,), ttl_s=ttls)) == 700
    # That request renewed the 12 h one: 12 h after it, that one is gone too.
    clock.advance(TWELVE_HOURS + 1)
    assert await _cached(model, _request(_diverged(1_900), marks[:1], ttl_s=TWELVE_HOURS)) == 0
    assert model.breakpoint_cache is not None
    stats = model.breakpoint_cache.statistics()
    assert stats.expired >= 2 and stats.hits == 2


def test_cache_renews_and_expires_on_the_given_time() -> None:
    cache = BreakpointCache(block_tokens=16)
    keys = block_keys((PROMPT,), 16)
    bp = CacheBreakpoint(37, HALF_HOUR)
    cache.write(keys, PROMPT, [bp], now=0.0)
    assert cache.match(keys, PROMPT, [bp], now=HALF_HOUR - 0.5) == 37
    cache.write(keys, PROMPT, [bp], now=HALF_HOUR - 0.5)  # renewed
    assert cache.match(keys, PROMPT, [bp], now=2 * HALF_HOUR - 1) == 37
    assert cache.match(keys, PROMPT, [bp], now=2 * HALF_HOUR) == 0  # expired at its TTL exactly
    # A breakpoint at the prompt's very end is written, but a prompt's last token is never reused.
    end = CacheBreakpoint(len(PROMPT), HALF_HOUR)
    cache.write(keys, PROMPT, [end], now=0.0)
    assert cache.match(keys, PROMPT, [end], now=1.0) == 0


def test_written_takes_the_latest() -> None:
    marks = [CacheBreakpoint(t, HALF_HOUR) for t in range(1, 8)]
    assert [b.tokens for b in written("explicit", marks)] == [4, 5, 6, 7]
    assert [b.tokens for b in written("implicit", marks)] == [5, 6, 7]
    assert list(written("explicit", [])) == []
