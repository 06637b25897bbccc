"""A real llama.cpp engine behind the model seam: the simulator's words, the engine's time.

`EngineModel` is a `prototype.model.TokenModel`, so the API path in front of it is the same
code as in front of the simulator. Each turn:

1. **Plan.** The turn's items and their o200k token ids come from the simulator's own planner
   (`SimulatedModel.plan_tokens`, same seed, same policy): the tokens are those the simulator
   would say, in every design.
2. **Map.** The engine (Gemma 3, a 262,144-token vocabulary) reads and writes longrun's token
   sequence under a fixed injective map, ``engine_id = ID_OFFSET + o200k_id`` (ids above
   Gemma's control and unused tokens, below its image tokens), with Gemma's BOS in front. The
   engine therefore prefills and decodes exactly as many tokens as longrun counts, and the KV a
   slot keeps after a turn (prompt + output) is the prefix of the conversation the next turn
   sends, in every design. The engine's text is meaningless; longrun's is the plan's.
3. **Force.** ``decode="forced"``: a token-id grammar (``root ::= <[id]> <[id]> …``) makes the
   engine sample exactly the planned ids; each returned id is checked (a mismatch fails the
   turn). ``decode="length"`` (what-if): free decoding of the planned length, faster, but the KV
   then holds the engine's tokens, not the plan's.
4. **Slot.** `SlotTable` picks the slot (a paused response's pinned slot, or a free one by
   affinity or LRU; ``on_full``: wait, drop or swap).
5. **Stream.** ``POST /completion`` with ``stream``, ``cache_prompt``, ``id_slot`` and
   ``timings_per_token``; ``Prefilled`` is yielded when the first token arrives, carrying the
   engine's own ``cache_n`` (cached tokens), ``prompt_ms`` (prefill) and the slot wait.

The engine's per-turn counters (``prompt_n``, ``cache_n``, ``prompt_ms``, ``predicted_n``,
``predicted_ms``) are kept in `turns` for the validation (docs/validation.md).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any, Final

import aiohttp
import msgspec
import numpy as np

from prototype.clock import Clock
from prototype.model import (
    ContextWindowExceeded,
    ItemFinished,
    ItemStarted,
    ModelEvent,
    ModelRequest,
    Prefilled,
    SamplingFinished,
    TokensSampled,
)
from sim.model.accelerator import ItemText, SimulatedModel

from .config import EngineConfig
from .process import LlamaServer
from .slots import Grant, SlotAction, SlotTable

__all__ = ["BOS_ID", "ID_OFFSET", "EngineError", "EngineModel", "EngineTurn", "engine_ids"]

BOS_ID: Final = 2  # Gemma's <bos>: llama.cpp adds it only to string prompts
ID_OFFSET: Final = 1000  # past Gemma's control/unused ids; o200k's ~200k ids end below its image tokens


class EngineError(RuntimeError):
    """The engine failed a turn (unreachable, died mid-stream, answered with an error)."""


def engine_ids(ids: np.ndarray[Any, Any] | list[int]) -> list[int]:
    return (np.asarray(ids, dtype=np.int64) + ID_OFFSET).tolist()  # type: ignore[no-any-return]


@dataclass(frozen=True, slots=True)
class EngineTurn:
    """One turn as the engine served it (its own counters, milliseconds as it reports them)."""

    conversation_key: int
    turn_index: int
    slot: int
    resident: bool  # ran on a slot its response held (or restored)
    prompt_tokens: int  # longrun's count (the engine read one more: its BOS)
    prompt_n: int  # tokens the engine prefilled
    cache_n: int  # tokens it reused from the slot's KV
    prompt_ms: float
    predicted_n: int
    predicted_ms: float
    queued_s: float  # waited for a slot
    ttft_s: float  # request sent to the engine -> first token back
    total_s: float  # request sent -> last token back


class _Chunk(msgspec.Struct):
    content: str = ""
    tokens: list[int] = []
    stop: bool = False
    timings: dict[str, float] | None = None
    error: dict[str, Any] | None = None


_decode_chunk = msgspec.json.Decoder(_Chunk).decode


@dataclass(slots=True)
class EngineModel:
    """A `TokenModel` served by a llama.cpp server at `url` (module docstring)."""

    planner: SimulatedModel
    url: str
    config: EngineConfig
    clock: Clock
    slots: SlotTable = field(init=False)
    turns: list[EngineTurn] = field(default_factory=list)
    server: LlamaServer | None = None  # the process, when this run owns it (fault tests restart it)
    _session: aiohttp.ClientSession | None = None
    _waiters: list[asyncio.Future[None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        c = self.config
        self.slots = SlotTable(c.engine_slots, affinity=c.engine_affinity, on_full=c.engine_on_full)
        self.url = self.url.rstrip("/")

    # -- the seam ----------------------------------------------------------------------------------

    def release(self, conversation_id: str) -> None:
        self.slots.unpin(conversation_id)
        self._wake()

    def decodes_on(self, request: ModelRequest, outstanding: tuple[int, ...]) -> bool:
        return self.planner.decodes_on(request, outstanding)

    async def sample(self, request: ModelRequest) -> AsyncGenerator[ModelEvent, None]:
        items, truncated = self.planner.plan_tokens(request)
        planned = [i for _, ids in items for i in ids]
        prompt = [BOS_ID, *engine_ids(np.concatenate(request.prompt) if request.prompt else [])]
        if len(prompt) + len(planned) > self.config.engine_ctx_per_slot:
            raise ContextWindowExceeded(f"{len(prompt)} + {len(planned)} tokens > {self.config.engine_ctx_per_slot}")
        body: dict[str, Any] = {
            "prompt": prompt,
            "n_predict": len(planned),
            "cache_prompt": True,
            "stream": True,
            "timings_per_token": True,
            "return_tokens": True,
            "temperature": 0.0,
        }
        forced = engine_ids(planned)
        if self.config.engine_decode == "forced" and forced:
            body["grammar"] = "root ::= " + " ".join(f"<[{t}]>" for t in forced)
        else:
            body["ignore_eos"] = True

        waited_from = self.clock.now()
        grant = await self._acquire(request)
        queued_s = self.clock.now() - waited_from
        body["id_slot"] = grant.slot
        session = self._client()
        pin = request.conversation_id if request.hold_kv else None
        token_bytes = self.planner.tokenizer.token_bytes
        try:
            for action in grant.actions:
                await self._slot_action(session, action)
            sent = self.clock.now()
            first_at = 0.0
            timings: dict[str, float] = {}
            got: list[int] = []
            pending = iter(items)
            item, ids = next(pending, (None, []))
            text = ItemText(ids, token_bytes, {}).text if ids else None
            position = 0
            started = False
            try:
                response = await session.post(f"{self.url}/completion", json=body)
            except aiohttp.ClientError as err:
                raise EngineError(f"llama.cpp at {self.url} is unreachable: {err}") from err
            async with response:
                if response.status != 200:
                    raise _error_of(response.status, await response.read())
                async for line in response.content:
                    if not line.startswith(b"data: "):
                        continue
                    chunk = _decode_chunk(line[6:])
                    if chunk.error is not None:
                        raise _error_of(500, msgspec.json.encode({"error": chunk.error}))
                    if chunk.timings:
                        timings = chunk.timings
                    for token in chunk.tokens:
                        if not first_at:
                            first_at = self.clock.now()
                            yield self._prefilled(request, timings, queued_s)
                        k = len(got)
                        if k >= len(planned):
                            raise EngineError("the engine decoded past the planned tokens")
                        if self.config.engine_decode == "forced" and token != forced[k]:
                            raise EngineError(f"forced decoding diverged at token {k}: {token} != {forced[k]}")
                        got.append(token)
                        while item is not None and not ids:  # an empty item: no token of its own
                            yield ItemStarted(item.kind, item.name)
                            yield ItemFinished()
                            item, ids = next(pending, (None, []))
                            text = ItemText(ids, token_bytes, {}).text if ids else None
                        assert item is not None and text is not None
                        if not started:
                            yield ItemStarted(item.kind, item.name)
                            started = True
                        yield TokensSampled((ids[position],), text(position))
                        position += 1
                        if position == len(ids):
                            yield ItemFinished()
                            item, ids = next(pending, (None, []))
                            text = ItemText(ids, token_bytes, {}).text if ids else None
                            position, started = 0, False
                    if chunk.stop:
                        break
            if len(got) != len(planned):
                raise EngineError(f"the engine stopped after {len(got)} of {len(planned)} tokens")
            if not first_at:  # nothing to decode (a warm-up): prefilled only
                first_at = self.clock.now()
                yield self._prefilled(request, timings, queued_s)
            done = self.clock.now()
            self.turns.append(
                EngineTurn(
                    conversation_key=request.conversation_key,
                    turn_index=request.turn_index,
                    slot=grant.slot,
                    resident=grant.resident,
                    prompt_tokens=request.prompt_tokens,
                    prompt_n=int(timings.get("prompt_n", 0)),
                    cache_n=int(timings.get("cache_n", 0)),
                    prompt_ms=float(timings.get("prompt_ms", 0.0)),
                    predicted_n=int(timings.get("predicted_n", 0)),
                    predicted_ms=float(timings.get("predicted_ms", 0.0)),
                    queued_s=queued_s,
                    ttft_s=first_at - sent,
                    total_s=done - sent,
                )
            )
            # Items with no tokens (empty text) still stand in the output.
            while item is not None:
                yield ItemStarted(item.kind, item.name)
                yield ItemFinished()
                item, ids = next(pending, (None, []))
            yield SamplingFinished("max_output_tokens" if truncated else "stop")
        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as err:
            raise EngineError(f"the engine's stream broke: {err}") from err
        finally:
            self.slots.release(grant.slot, pin_for=pin)
            self._wake()

    # -- parts -------------------------------------------------------------------------------------

    def _prefilled(self, request: ModelRequest, timings: dict[str, float], queued_s: float) -> Prefilled:
        # The engine counts its BOS among the cached tokens; longrun's prompt has none.
        cached = max(0, min(int(timings.get("cache_n", 0)) - 1, request.prompt_tokens - 1))
        return Prefilled(cached_tokens=cached, queued_s=queued_s, prefill_s=float(timings.get("prompt_ms", 0.0)) / 1e3)

    async def _acquire(self, request: ModelRequest) -> Grant:
        owner = request.conversation_id if request.hold_kv else ""
        while True:
            grant = self.slots.acquire(request.conversation_key, owner)
            if grant is not None:
                return grant
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            await waiter

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for w in waiters:
            if not w.done():
                w.set_result(None)

    async def _slot_action(self, session: aiohttp.ClientSession, action: SlotAction) -> None:
        url = f"{self.url}/slots/{action.slot}?action={action.action}"
        payload = {"filename": action.filename} if action.filename else {}
        try:
            async with session.post(url, json=payload) as reply:
                if reply.status != 200:
                    raise _error_of(reply.status, await reply.read())
        except aiohttp.ClientError as err:
            raise EngineError(f"slot {action.action} failed: {err}") from err

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=5))
        return self._session

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def statistics(self) -> dict[str, float]:
        turns = self.turns
        return {
            "requests": len(turns),
            "prompt_tokens": sum(t.prompt_tokens for t in turns),
            "cached_tokens": sum(t.cache_n for t in turns),
            "prefilled_tokens": sum(t.prompt_n for t in turns),
            "output_tokens": sum(t.predicted_n for t in turns),
            "prompt_ms": sum(t.prompt_ms for t in turns),
            "predicted_ms": sum(t.predicted_ms for t in turns),
        }


def _error_of(status: int, payload: bytes) -> Exception:
    """llama.cpp's error reply as the seam's exception: its context limit is the API's
    context-window error, anything else an engine failure."""
    try:
        error = msgspec.json.decode(payload).get("error", {})
    except (msgspec.DecodeError, AttributeError):
        error = {}
    message = str(error.get("message", payload[:200]))
    if error.get("type") == "exceed_context_size_error" or "context" in message.lower():
        return ContextWindowExceeded(message)
    return EngineError(f"llama.cpp answered {status}: {message}")

