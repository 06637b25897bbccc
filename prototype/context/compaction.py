"""Compaction: the history of a long conversation replaced by one item that stands for it.

The public material (the compaction guide, the API reference of `POST /v1/responses/compact`,
the `CompactResource` example of the openai-openapi spec) says what the client sees: the user
messages of the history, then one `compaction` item with an opaque `encrypted_content`; the
next turn reads that instead of the history. What the item holds, and how much it keeps, is
the model's business and unpublished; longrun's choices (docs/compaction.md):

* The summary is model-visible text of `ceil(ratio × dropped tokens)` tokens, taken evenly
  from the dropped history's own tokens (deterministic: the same history gives the same
  summary, in every mode). `ratio` is `CostProfile.compaction_ratio`.
* `encrypted_content` carries the summary and what the simulator's model needs to go on as if
  nothing had been dropped (the count of model turns and the conversation's key), encoded
  (zlib + base64), not encrypted: opaque to a client, as the real one is.
* Rule for an input that holds a compaction item: the item stands for every item before it
  except user messages, which stay (that is the shape `/responses/compact` returns, and it
  makes a client that resends its whole history, compaction item included, see the same
  context as one that chains with `previous_response_id`).
"""

from __future__ import annotations

import base64
import binascii
import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, TypeVar

import msgspec
import numpy as np

from ..wire.errors import ProtocolError
from ..wire.requests import InputItemView
from ..wire.schemas import CompactionItem
from .tokenizer import TokenArray, Tokenizer

__all__ = [
    "COMPACTION_TYPE",
    "Compaction",
    "ENCRYPTED_CONTENT_MAX",
    "TRIGGER_TYPE",
    "Payload",
    "decode_payload",
    "encode_payload",
    "is_kept",
    "prune",
    "summary_text",
]

COMPACTION_TYPE: Final = "compaction"
TRIGGER_TYPE: Final = "compaction_trigger"  # an input item: compact now (`CompactionTriggerItemParam`)
ENCRYPTED_CONTENT_MAX: Final = 20_971_520  # `CompactionSummaryItemParam.encrypted_content.maxLength` in the spec
_VERSION: Final = 1
T = TypeVar("T")


class Payload(msgspec.Struct, array_like=True, frozen=True):
    """What a compaction item carries (inside `encrypted_content`)."""

    version: int
    turns: int  # model turns in the history the item stands for
    conversation_key: int  # the conversation's key (conversation.conversation_key), 0 if none
    summary: str  # the model-visible text that replaces the dropped items


_encode: Final = msgspec.msgpack.Encoder().encode
_decode: Final = msgspec.msgpack.Decoder(Payload).decode


def encode_payload(turns: int, conversation_key: int, summary: str) -> str:
    packed = zlib.compress(_encode(Payload(_VERSION, turns, conversation_key, summary)), 1)
    return base64.b64encode(packed).decode("ascii")


def _decoded(encrypted_content: str) -> Payload | None:
    try:
        return _decode(zlib.decompress(base64.b64decode(encrypted_content, validate=True)))
    except (binascii.Error, zlib.error, msgspec.DecodeError, msgspec.ValidationError, ValueError):
        return None


def decode_payload(encrypted_content: str, param: str) -> Payload:
    """The payload of a compaction item; a content this server did not make is a 400."""
    payload = _decoded(encrypted_content)
    if payload is None or payload.version != _VERSION:
        raise ProtocolError(
            "The encrypted content could not be decrypted or parsed.", code="invalid_encrypted_content", param=param
        )
    return payload


def is_kept(view: InputItemView) -> bool:
    """Items a compaction keeps verbatim: user messages."""
    return view.type == "message" and view.role == "user"


def prune(items: Sequence[T], views: Sequence[InputItemView]) -> list[T]:
    """`items` as the model reads them: before the last compaction item, only user messages."""
    last = max((i for i, v in enumerate(views) if v.type == COMPACTION_TYPE), default=-1)
    if last < 0:
        return list(items)
    return [item for item, view in zip(items[:last], views[:last], strict=True) if is_kept(view)] + list(items[last:])


def summary_text(dropped: Sequence[TokenArray], ratio: float, tokenizer: Tokenizer) -> tuple[str, int]:
    """The summary of the dropped chunks: `ceil(ratio × n)` of their `n` tokens, evenly spaced,
    as text. Returns the text and the number of tokens taken."""
    if not dropped:
        return "", 0
    tokens = np.concatenate(dropped)
    n = min(len(tokens), math.ceil(ratio * len(tokens)))
    if n <= 0:
        return "", 0
    picked = tokens[np.linspace(0, len(tokens) - 1, n).astype(np.int64)]
    return tokenizer.decode(picked), n


@dataclass(frozen=True, slots=True)
class Compaction:
    """One compaction pass, done: the item, and the tokens it read and wrote."""

    item: CompactionItem
    tokens_read: int  # the prompt the summarisation call read
    summary_tokens: int  # the summary's tokens (what the call wrote)
    dropped_tokens: int  # history tokens the item stands for
