"""Object ids. One `IdFactory` per server (or per simulation), seeded, so that a
seeded run produces the same ids; never a class-level counter shared across runs."""

from __future__ import annotations

import random

__all__ = ["IdFactory"]


class IdFactory:
    """Seeded: the same ids for a seed (a simulation, or a store that dies with the process).
    Unseeded: random ids, wherever a store outlives the process (a restart or a second process
    must never reissue a stored id)."""

    def __init__(self, seed: int | str | None = None) -> None:
        self._seed = seed
        self._rng = random.Random(seed)

    def fork(self, name: str) -> IdFactory:
        """A second stream of ids for `name` that leaves this one's sequence as it is: seeded from
        this factory's seed and `name` when this one is seeded, random when it is random."""
        return IdFactory(None if self._seed is None else f"{self._seed}/{name}")

    def new(self, prefix: str) -> str:
        """`resp_`, `msg_`, `fc_`, `call_`: a prefix and 32 hex digits (SGLang wants `resp_`)."""
        return f"{prefix}_{self._rng.getrandbits(128):032x}"
