"""llama.cpp's own completion API as an engine `Dialect` (sim/engine/model.py).

``POST /completion`` with a token-id prompt, ``stream``, ``cache_prompt``, ``id_slot``,
``return_tokens`` and ``timings_per_token`` (so the first streamed token already carries the
engine's ``cache_n`` and ``prompt_ms``); the planned output forced by a token-id grammar
(``root ::= <[id]> <[id]> …``), verified (the prompt and the framed ids so far sent as a prompt
with ``n_predict`` 1, a chunk at a time) or, as a what-if, decoded freely to the same length with
``ignore_eos``. Its slots (``/slots/{id}?action=save|restore|erase``) give each design its KV
semantics (sim/engine/slots.py).
"""

from __future__ import annotations

from typing import Any, Final

import msgspec

from prototype.model import ContextWindowExceeded

from .model import Chunk, EngineError

__all__ = ["LLAMACPP", "LlamaCppDialect", "llamacpp_error"]


class _Piece(msgspec.Struct):
    content: str = ""
    tokens: list[int] = []
    stop: bool = False
    timings: dict[str, float] | None = None
    error: dict[str, Any] | None = None


_decode_piece = msgspec.json.Decoder(_Piece).decode


def token_grammar(forced: list[int]) -> str:
    """A GBNF grammar that admits exactly the token ids `forced`, in order."""
    return "root ::= " + " ".join(f"<[{t}]>" for t in forced)


class LlamaCppDialect:
    name = "llama.cpp"
    slotted = True

    def request(self, prompt: list[int], forced: list[int], *, force: bool, slot: int | None) -> tuple[str, Any]:
        body: dict[str, Any] = {
            "prompt": prompt,
            "n_predict": len(forced),
            "cache_prompt": True,
            "stream": True,
            "timings_per_token": True,
            "return_tokens": True,
            "temperature": 0.0,
        }
        if force:
            body["grammar"] = token_grammar(forced)
        else:
            body["ignore_eos"] = True
        if slot is not None:
            body["id_slot"] = slot
        return "/completion", body

    def verify(self, prompt: list[int], *, slot: int | None) -> tuple[str, Any]:
        # n_predict 0 samples one token all the same (b11434: the slot stops at its limit after
        # the first sample); 1 says so. The sampled token is never fed back, so the KV holds
        # `prompt` alone.
        path, body = self.request(prompt, [], force=False, slot=slot)
        body["n_predict"] = 1
        return path, body

    def parse(self, line: bytes) -> Chunk | None:
        if not line.startswith(b"data: "):
            return None
        piece = _decode_piece(line[6:])
        if piece.error is not None:
            raise llamacpp_error(500, msgspec.json.encode({"error": piece.error}))
        return Chunk(tuple(piece.tokens), piece.timings or {}, piece.stop)

    def error(self, status: int, payload: bytes) -> Exception:
        return llamacpp_error(status, payload)

    def reset_paths(self, slots: int) -> tuple[str, ...]:
        return tuple(f"/slots/{slot}?action=erase" for slot in range(slots))


LLAMACPP: Final = LlamaCppDialect()


def llamacpp_error(status: int, payload: bytes) -> Exception:
    """A llama.cpp error reply (either API) as the seam's exception: its context limit is the
    API's context-window error, anything else an engine failure."""
    try:
        error = msgspec.json.decode(payload).get("error", {})
    except (msgspec.DecodeError, AttributeError):
        error = {}
    message = str(error.get("message", payload[:200]))
    if error.get("type") == "exceed_context_size_error" or "context" in message.lower():
        return ContextWindowExceeded(message)
    return EngineError(f"llama.cpp answered {status}: {message}")
