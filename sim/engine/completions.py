"""An OpenAI-compatible completions server as an engine `Dialect` (sim/engine/model.py).

``POST /v1/completions`` with the token-id prompt (the OpenAI completions API takes a list of
ids), ``max_tokens`` the planned length, ``temperature`` 0, ``ignore_eos`` and a stream. What a
generic server offers, and what longrun reads of it (docs/engine.md#other-engines):

* **Token ids back.** ``logprobs: 1`` with ``return_tokens_as_token_ids`` (vLLM's extension:
  each token comes back as ``token_id:N``); llama.cpp's server gives each token's ``id`` in
  ``logprobs.content``. A stream that names no ids is refused: the check that every design decodes
  the same tokens needs them.
* **Forcing.** ``engine_decode="forced"`` sends llama.cpp's token-id ``grammar`` field, which
  llama.cpp's own OpenAI-compatible endpoint honours; a server that ignores it decodes freely, and
  the first id that differs from the plan fails the turn (``--engine-decode length`` is the what-if
  for such servers).
* **Cached tokens.** llama.cpp's ``timings`` (asked per token), or the OpenAI usage's
  ``prompt_tokens_details.cached_tokens`` streamed with every chunk
  (``stream_options.continuous_usage_stats``, vLLM's extension; vLLM reports the count with
  ``--enable-prompt-tokens-details``). A first token without either is refused.
* **Verified.** ``engine_decode="verified"``: each pass is a completion of the prompt and the
  framed ids so far with ``max_tokens`` 1 (the one sampled token is ignored); the server's prefix
  cache keeps the passes before, as llama.cpp's slot does.
* **No slots.** The server schedules; a paused response's KV is whatever its prefix cache keeps
  (there is no pin), and the cache is emptied between modes by the ``engine_reset`` paths.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import msgspec

from prototype.model import ContextWindowExceeded

from .llamacpp import token_grammar
from .model import Chunk, EngineError

__all__ = ["CompletionsDialect", "completions_error", "served_model"]


class _Choice(msgspec.Struct):
    text: str = ""
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None


class _Piece(msgspec.Struct):
    choices: list[_Choice] = []
    usage: dict[str, Any] | None = None
    timings: dict[str, float] | None = None
    error: dict[str, Any] | None = None


_decode_piece = msgspec.json.Decoder(_Piece).decode
_DONE = b"[DONE]"


def _ids(logprobs: dict[str, Any] | None) -> tuple[int, ...] | None:
    """The token ids a choice's logprobs name: llama.cpp's `content[].id`, or vLLM's
    `tokens` rendered as `token_id:N`; None when they name none."""
    if not logprobs:
        return None
    if isinstance(content := logprobs.get("content"), list):
        ids = [entry.get("id") for entry in content if isinstance(entry, dict)]
        return tuple(i for i in ids if isinstance(i, int)) if all(isinstance(i, int) for i in ids) else None
    if isinstance(tokens := logprobs.get("tokens"), list):
        try:
            return tuple(int(str(t).removeprefix("token_id:")) for t in tokens)
        except ValueError:  # text tokens: the server does not render ids
            return None
    return None


def _usage_timings(usage: dict[str, Any] | None) -> dict[str, float]:
    """The OpenAI usage in llama.cpp's timing names (cache_n, prompt_n, predicted_n)."""
    if not usage:
        return {}
    out: dict[str, float] = {}
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens")
    if isinstance(cached, int):
        out["cache_n"] = cached
        if isinstance(prompt := usage.get("prompt_tokens"), int):
            out["prompt_n"] = prompt - cached
    if isinstance(completion := usage.get("completion_tokens"), int):
        out["predicted_n"] = completion
    return out


class CompletionsDialect:
    """The OpenAI completions API, spoken to the server at hand (`model`: the id it serves)."""

    slotted = False

    def __init__(self, model: str, resets: tuple[str, ...] = ()) -> None:
        self.model = model
        self.resets = resets
        self.name = "the OpenAI-compatible engine"

    def request(self, prompt: list[int], forced: list[int], *, force: bool, slot: int | None) -> tuple[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max(1, len(forced)),
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "logprobs": 1,
            "return_tokens_as_token_ids": True,  # vLLM
            "timings_per_token": True,  # llama.cpp
            "ignore_eos": True,
        }
        if force:
            body["grammar"] = token_grammar(forced)
        return "/v1/completions", body

    def verify(self, prompt: list[int], *, slot: int | None) -> tuple[str, Any]:
        # max_tokens 1: the one token sampled stands at the next planned position, is ignored, and
        # never enters the KV (no forward pass feeds it back).
        return self.request(prompt, [], force=False, slot=slot)

    def parse(self, line: bytes) -> Chunk | None:
        if not line.startswith(b"data: "):
            return None
        data = line[6:].strip()
        if data == _DONE:
            return Chunk(stop=True)
        piece = _decode_piece(data)
        if piece.error is not None:
            raise completions_error(500, msgspec.json.encode({"error": piece.error}))
        timings = {**_usage_timings(piece.usage), **(piece.timings or {})}
        tokens: tuple[int, ...] = ()
        for choice in piece.choices:
            ids = _ids(choice.logprobs)
            if ids is None:
                if choice.text:
                    raise EngineError(
                        f"{self.name} streamed text without token ids (docs/engine.md#other-engines: "
                        "it needs logprobs with ids, e.g. vLLM's return_tokens_as_token_ids)"
                    )
                continue
            tokens += ids
        return Chunk(tokens, timings)

    def error(self, status: int, payload: bytes) -> Exception:
        return completions_error(status, payload)

    def reset_paths(self, slots: int) -> tuple[str, ...]:
        if not self.resets:
            raise EngineError(
                "the OpenAI-compatible engine's prefix cache cannot be emptied between modes: name the paths "
                "that do it with --engine-reset (docs/engine.md#other-engines)"
            )
        return self.resets


def completions_error(status: int, payload: bytes) -> Exception:
    """An OpenAI-shaped error reply (``{"error": {...}}``, or vLLM's flat ``{"object": "error",
    "message": ...}``) as the seam's exception: a context-length refusal is the API's
    context-window error, anything else an engine failure."""
    try:
        data = msgspec.json.decode(payload)
    except msgspec.DecodeError:
        data = {}
    error = data.get("error", data) if isinstance(data, dict) else {}
    if not isinstance(error, dict):
        error = {"message": str(error)}
    message = str(error.get("message", payload[:200]))
    kind = str(error.get("type", "")) + str(error.get("code", ""))
    if "context" in message.lower() or "exceed_context" in kind or "context_length" in kind:
        return ContextWindowExceeded(message)
    return EngineError(f"the OpenAI-compatible engine answered {status}: {message}")


async def served_model(session: aiohttp.ClientSession, url: str) -> str:
    """The first model id the server's ``GET /v1/models`` lists."""
    try:
        async with session.get(f"{url}/v1/models") as reply:
            data = msgspec.json.decode(await reply.read()) if reply.status == 200 else {}
    except (aiohttp.ClientError, msgspec.DecodeError) as err:
        raise EngineError(f"the OpenAI-compatible engine at {url} lists no models: {err}") from err
    models = data.get("data") if isinstance(data, dict) else None
    if not models or not isinstance(models[0], dict) or "id" not in models[0]:
        raise EngineError(f"the OpenAI-compatible engine at {url} lists no models (GET /v1/models)")
    return str(models[0]["id"])
