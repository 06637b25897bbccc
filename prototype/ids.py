"""Object ids. One `IdFactory` per server (or per simulation), seeded, so that a
seeded run produces the same ids; never a class-level counter shared across runs."""

from __future__ import annotations

import random

__all__ = ["IdFactory"]


class IdFactory:
    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def new(self, prefix: str) -> str:
        """`resp_`, `msg_`, `fc_`, `call_`: a prefix and 32 hex digits (SGLang wants `resp_`)."""
        return f"{prefix}_{self._rng.getrandbits(128):032x}"
