"""Explicit prompt-cache breakpoints, as the Responses API states their rules.

From openai-python 3.63 (`types/responses/response_create_params.py`, `PromptCacheOptions` and the
content parts' `PromptCacheBreakpoint`), in our words:

* A breakpoint marks the exact end of a reusable prefix; its boundary is not rounded to a block.
* `mode: "implicit"` (the default): the API picks one implicit breakpoint and writes up to the
  latest three explicit ones. `mode: "explicit"`: no implicit breakpoint, up to the latest four
  explicit ones written; none at all and the request does not use prompt caching.
* Matching considers up to the latest 80 breakpoints of the conversation.
* A written breakpoint lives at least its `ttl` (`30m` or `12h`), its own or else the request's;
  "the backend may retain cache entries for longer". This cache keeps each exactly its TTL, the
  lifetime the API promises, on the injected clock (`now`), and models no capacity pressure
  within it: a breakpoint the API promises to keep is kept. Writing a breakpoint again renews it.

The implicit breakpoint is the accelerator's own prefix cache (kv.py); this module holds the
explicit ones. A breakpoint's key is its prefix: the chained key of the prefix's last full KV
block (kv.block_keys, computed once per turn for the prefix cache anyway) with the boundary and
the tokens after that block, so two prompts share a key only if they share the prefix. No I/O,
no clock of its own.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal

import numpy as np
import numpy.typing as npt

from prototype.model import CacheBreakpoint

__all__ = ["WRITTEN", "BreakpointCache", "BreakpointStatistics", "written"]

# Explicit breakpoints a request writes, by `prompt_cache_options.mode`.
WRITTEN: Final = {"implicit": 3, "explicit": 4}


def written(mode: Literal["implicit", "explicit"], breakpoints: Sequence[CacheBreakpoint]) -> Sequence[CacheBreakpoint]:
    """The breakpoints a request writes: the latest `WRITTEN[mode]` of the prompt's."""
    return breakpoints[-WRITTEN[mode] :] if breakpoints else breakpoints


@dataclass(frozen=True, slots=True)
class BreakpointStatistics:
    """Counters of a `BreakpointCache` (a snapshot)."""

    writes: int = 0  # breakpoints written (new or renewed)
    hits: int = 0  # lookups that reused a breakpoint's prefix
    expired: int = 0  # breakpoints dropped when their TTL ran out
    resident: int = 0  # breakpoints alive at the last call


class BreakpointCache:
    """Written explicit breakpoints, each until its expiry; see the module docstring."""

    def __init__(self, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self._expires: dict[int, float] = {}  # prefix key -> when it expires
        self._heap: list[tuple[float, int]] = []  # (expiry, key); stale entries skipped
        self._writes = 0
        self._hits = 0
        self._expired = 0

    def _key(self, keys: npt.NDArray[np.uint64], tokens: npt.NDArray[np.uint32], boundary: int) -> int:
        full = boundary // self.block_tokens
        base = int(keys[full - 1]) if full else 0
        return hash((base, boundary, tokens[full * self.block_tokens : boundary].tobytes()))

    def _expire(self, now: float) -> None:
        heap, expires = self._heap, self._expires
        while heap and heap[0][0] <= now:
            at, key = heapq.heappop(heap)
            if expires.get(key) == at:
                del expires[key]
                self._expired += 1

    def match(
        self,
        keys: npt.NDArray[np.uint64],
        tokens: npt.NDArray[np.uint32],
        breakpoints: Sequence[CacheBreakpoint],
        now: float,
    ) -> int:
        """The longest prefix, among `breakpoints` (the conversation's latest 80), that a live written
        breakpoint covers; 0 if none. `keys`: the prompt's chained block keys; `tokens`: the prompt.
        At least the prompt's last token is recomputed, as the prefix cache does."""
        self._expire(now)
        for bp in reversed(breakpoints):  # prompt order: the latest is the longest
            if 0 < bp.tokens < len(tokens) and self._key(keys, tokens, bp.tokens) in self._expires:
                self._hits += 1
                return bp.tokens
        return 0

    def write(
        self,
        keys: npt.NDArray[np.uint64],
        tokens: npt.NDArray[np.uint32],
        breakpoints: Sequence[CacheBreakpoint],
        now: float,
    ) -> None:
        """Write `breakpoints` (those `written` picked) at `now`: each lives `ttl_s` from now, or
        longer if it already did."""
        self._expire(now)
        for bp in breakpoints:
            if not 0 < bp.tokens <= len(tokens):
                continue
            key = self._key(keys, tokens, bp.tokens)
            at = now + bp.ttl_s
            if self._expires.get(key, -np.inf) < at:
                self._expires[key] = at
                heapq.heappush(self._heap, (at, key))
            self._writes += 1

    def statistics(self) -> BreakpointStatistics:
        return BreakpointStatistics(self._writes, self._hits, self._expired, len(self._expires))
