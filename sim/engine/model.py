"""A real engine behind the model seam: the simulator's words, the engine's time.

`EngineModel` is a `prototype.model.TokenModel`, so the API path in front of it is the same
code as in front of the simulator. It speaks to the engine through a `Dialect`: llama.cpp's own
``/completion`` (sim/engine/llamacpp.py: slots, slot save/restore, a token-id grammar) or an
OpenAI-compatible ``/v1/completions`` (sim/engine/completions.py: vLLM, SGLang, llama.cpp's own).
Each turn:

1. **Plan.** The turn's items and their o200k token ids come from the simulator's own planner
   (`SimulatedModel.plan_tokens`, same seed, same policy): the tokens are those the simulator
   would say, in every design.
2. **Map.** The engine (Gemma 3, a 262,144-token vocabulary) reads and writes longrun's token
   sequence under a fixed injective map, ``engine_id = ID_OFFSET + o200k_id`` (ids above
   Gemma's control and unused tokens, below its image tokens), with Gemma's BOS in front: it
   prefills exactly the prompt longrun counts. Its text is meaningless; longrun's is the plan's.
3. **Frame.** Each item is decoded as it will stand in the next turn's prompt
   (`framed_output_ids`: the rendering less the generation header the prompt ends with), so the
   KV the engine keeps after a turn is the prefix of the conversation the next turn sends, in
   every design. The framing is decoded work the API does not stream (usage counts the item's tokens).
4. **Force.** ``engine_decode="forced"``: a token-id grammar (``root ::= <[id]> <[id]> …``) makes
   the engine sample exactly those ids; each returned id is checked (a mismatch fails the turn).
   ``"verified"``: speculative decoding with a draft that is always accepted. A prefill pass of
   the prompt stands for the first token (as it yields forced decoding's first), then the framed
   ids go to the same slot ``engine_verify_k`` per pass through the dialect's prompt path (the
   prompt + the framed ids so far, its cached prefix reused); each pass samples one token at a
   planned position, which is ignored and never enters the KV (`verify_ends`). The slot ends the
   turn holding what forced decoding leaves: the prompt and every framed id but the last.
   ``"length"`` (what-if): free decoding of the same length, faster, but the KV then holds the
   engine's tokens, not the plan's.
5. **Slot** (a dialect with slots). `SlotTable` picks the slot (a paused response's pinned slot,
   or a free one by affinity or LRU; ``engine_on_full``: wait, drop or swap). Without slots the
   engine schedules and its prefix cache is all a paused response keeps.
6. **Stream.** ``Prefilled`` is yielded when the first token arrives (verified: at the prefill
   pass's end), carrying the engine's own cached-token count, prefill time and the slot wait; the
   API's tokens go out in proportion to the engine's progress through each item (`_Pacer`;
   verified: a pass's tokens at its end).

The engine's per-turn counters (``prompt_n``, ``cache_n``, ``prompt_ms``, ``predicted_n``,
``predicted_ms``; verified: the prefill pass's, then the framed ids and the passes' summed engine
time, each pass in ``passes``) are kept in `turns` for the run folder and the validation
(docs/validation.md).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

import aiohttp
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
from sim.model.accelerator import ItemText, SimulatedModel, framed_output_ids
from sim.model.policy import PlannedItem
from sim.model.receipt import Receipt, counted

from .config import EngineConfig
from .process import LlamaServer
from .slots import Grant, SlotAction, SlotTable

__all__ = [
    "BOS_ID",
    "ID_OFFSET",
    "Chunk",
    "Dialect",
    "EngineError",
    "EngineModel",
    "EnginePass",
    "EngineTurn",
    "engine_ids",
    "verify_ends",
]

BOS_ID: Final = 2  # Gemma's <bos>: llama.cpp adds it only to string prompts
ID_OFFSET: Final = 1000  # past Gemma's control/unused ids; o200k's ~200k ids end below its image tokens


class EngineError(RuntimeError):
    """The engine failed a turn (unreachable, died mid-stream, answered with an error)."""


def engine_ids(ids: np.ndarray[Any, Any] | list[int]) -> list[int]:
    return (np.asarray(ids, dtype=np.int64) + ID_OFFSET).tolist()  # type: ignore[no-any-return]


def verify_ends(n: int, k: int) -> list[int]:
    """Verified decoding of `n` framed ids, `k` a pass: how many of them each pass's prompt
    carries after the turn's prompt. The first pass is the prompt alone (its sampled token stands
    for framed id 0); a pass ending at `e` computes the KV of the ids before `e` and stands for
    ids up to `e`. The last pass ends at `n - 1`: forced decoding never feeds back its last
    sampled id either, so both leave the slot holding the prompt and `n - 1` framed ids."""
    return [0] if n <= 1 else [0, *range(k, n - 1, k), n - 1]


@dataclass(frozen=True, slots=True)
class EnginePass:
    """One forward pass of verified decoding, as the engine reported it."""

    prompt_n: int  # tokens it computed (the chunk)
    cache_n: int  # tokens it found in the slot (the prompt and the chunks before)
    engine_ms: float  # the engine's own time for the pass (its prompt_ms and sampling)
    wall_ms: float  # request sent -> reply read, as the API saw it


@dataclass(frozen=True, slots=True)
class EngineTurn:
    """One turn as the engine served it (its own counters, milliseconds as it reports them)."""

    tag: str  # what the caller was running (a comparison: the mode)
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
    passes: tuple[EnginePass, ...] = ()  # verified decoding: each pass after the prefill


@dataclass(frozen=True, slots=True)
class Chunk:
    """One streamed piece of the engine's reply, in the dialect's terms made common."""

    tokens: tuple[int, ...] = ()  # engine token ids decoded in this piece
    timings: dict[str, float] = field(default_factory=dict)  # llama.cpp's names: cache_n, prompt_ms, ...
    stop: bool = False  # the stream is over


UNSLOTTED: Final = Grant(slot=-1)  # a dialect without slots: the engine schedules


class Dialect(Protocol):
    """How one engine API is spoken: the request of a turn, its stream's pieces, its errors."""

    name: str
    slotted: bool  # a slot id per request and slot save/restore/erase (llama.cpp's own API)

    def request(self, prompt: list[int], forced: list[int], *, force: bool, slot: int | None) -> tuple[str, Any]:
        """The path and JSON body of a turn that prefills `prompt` and decodes `len(forced)` tokens."""
        ...

    def verify(self, prompt: list[int], *, slot: int | None) -> tuple[str, Any]:
        """The path and JSON body of a pass that computes `prompt`'s KV (its cached prefix reused)
        and samples one token after it, no more (verified decoding)."""
        ...

    def parse(self, line: bytes) -> Chunk | None:
        """One line of the streamed reply: a piece, or None (not a data line). Raises the
        seam's exception for an error the stream carries."""
        ...

    def error(self, status: int, payload: bytes) -> Exception:
        """The seam's exception for an error reply."""
        ...

    def reset_paths(self, slots: int) -> tuple[str, ...]:
        """The paths to POST, in order, that empty the engine's whole KV cache (`slots`: the
        engine's slot count); raises `EngineError` when the engine offers none."""
        ...


@dataclass(slots=True)
class EngineModel:
    """A `TokenModel` served by an engine at `url`, spoken to in `dialect` (module docstring)."""

    planner: SimulatedModel
    url: str
    config: EngineConfig
    clock: Clock
    dialect: Dialect
    slots: SlotTable = field(init=False)
    turns: list[EngineTurn] = field(default_factory=list)
    tag: str = ""  # stamped on each `EngineTurn` (a comparison sets the mode it runs)
    server: LlamaServer | None = None  # the process, when this run owns it (fault tests restart it)
    _session: aiohttp.ClientSession | None = None
    _waiters: list[asyncio.Future[None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.slots = self._empty_slots()
        self.url = self.url.rstrip("/")

    def _empty_slots(self) -> SlotTable:
        c = self.config
        return SlotTable(c.engine_slots, affinity=c.engine_affinity, on_full=c.engine_on_full)

    # -- the seam ----------------------------------------------------------------------------------

    @property
    def cache_name(self) -> str:
        """`prototype.model.ImplicitCacheOnly`: the engine reuses a prompt prefix its own way (a
        slot's KV, or its automatic prefix cache), so explicit breakpoints are refused."""
        return f"{self.dialect.name}'s prefix cache"

    def release(self, conversation_id: str) -> None:
        self.slots.unpin(conversation_id)
        self._wake()

    def decodes_on(self, request: ModelRequest, outstanding: tuple[int, ...]) -> bool:
        return self.planner.decodes_on(request, outstanding)

    def sample(self, request: ModelRequest, receipt: Receipt | None = None) -> AsyncGenerator[ModelEvent, None]:
        """One turn's events (`_turn`); with `receipt`, its counts as `counted` takes them."""
        events = self._turn(request)
        return events if receipt is None else counted(events, receipt)

    async def _turn(self, request: ModelRequest) -> AsyncGenerator[ModelEvent, None]:
        items, truncated = self.planner.plan_tokens(request)
        framed = [engine_ids(ids) for ids in framed_output_ids(self.planner.tokenizer, items, truncated=truncated)]
        forced = [t for ids in framed for t in ids]
        prompt = [BOS_ID, *engine_ids(np.concatenate(request.prompt) if request.prompt else [])]
        if len(prompt) + len(forced) > self.config.ctx_per_slot:
            raise ContextWindowExceeded(f"{len(prompt)} + {len(forced)} tokens > {self.config.ctx_per_slot}")
        waited_from = self.clock.now()
        grant = await self._acquire(request) if self.dialect.slotted else UNSLOTTED
        queued_s = self.clock.now() - waited_from
        pin = request.conversation_id if request.hold_kv else None
        try:
            session = self._client()
            for action in grant.actions:
                await self._slot_action(session, action)
            slot = grant.slot if self.dialect.slotted else None
            run = _Run(request, prompt, forced, slot, queued_s, sent=self.clock.now())
            pace = _Pacer(items, framed, self.planner.tokenizer.token_bytes)
            decode = self._verified if self.config.engine_decode == "verified" else self._decoded
            async for event in decode(session, run, pace):
                yield event
            if not run.first_at:  # nothing to decode (a warm-up): prefilled only
                yield self._first(run)
            end = self.clock.now()
            run.timings.setdefault("predicted_n", len(forced))  # not reported: counted and measured
            run.timings.setdefault("predicted_ms", 1e3 * (end - run.first_at))
            self._record(request, grant, run, end)
            for event in pace.rest():
                yield event
            yield SamplingFinished("max_output_tokens" if truncated else "stop")
        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as err:
            raise EngineError(f"the engine's stream broke: {err}") from err
        finally:
            if self.dialect.slotted:
                self.slots.release(grant.slot, pin_for=pin)
                self._wake()

    async def _decoded(
        self, session: aiohttp.ClientSession, run: _Run, pace: _Pacer
    ) -> AsyncGenerator[ModelEvent, None]:
        """Forced (or free, ``length``) decoding: one request that prefills the prompt and
        decodes the framed ids, each streamed id checked against the plan."""
        forced = run.forced
        force = self.config.engine_decode == "forced" and bool(forced)
        path, body = self.dialect.request(run.prompt, forced, force=force, slot=run.slot)
        got = 0  # engine tokens received
        async with await self._send(session, path, body) as response:
            async for line in response.content:
                chunk = self.dialect.parse(line)
                if chunk is None:
                    continue
                run.timings.update(chunk.timings)
                for token in chunk.tokens:
                    if not run.first_at:
                        yield self._first(run)
                    if not forced:  # a prefill alone (a warm-up): the engine still samples one token
                        break
                    if got >= len(forced):
                        raise EngineError("the engine decoded past the planned tokens")
                    if force and token != forced[got]:
                        raise EngineError(f"forced decoding diverged at token {got}: {token} != {forced[got]}")
                    got += 1
                    for event in pace.advance():
                        yield event
                if chunk.stop:
                    break
        if got != len(forced):
            raise EngineError(f"the engine stopped after {got} of {len(forced)} tokens")

    async def _verified(
        self, session: aiohttp.ClientSession, run: _Run, pace: _Pacer
    ) -> AsyncGenerator[ModelEvent, None]:
        """Verified decoding (module docstring, `verify_ends`): the prefill pass yields the first
        token, each later pass the planned tokens it computed, at its end."""
        forced, passes, ms = run.forced, [], 0.0
        done = 0  # planned tokens delivered
        for end in verify_ends(len(forced), self.config.engine_verify_k):
            path, body = self.dialect.verify(run.prompt + forced[:end], slot=run.slot)
            started = self.clock.now()
            timings: dict[str, float] = {}
            sampled = 0
            async with await self._send(session, path, body) as response:
                async for line in response.content:
                    chunk = self.dialect.parse(line)
                    if chunk is not None:
                        timings.update(chunk.timings)
                        sampled += len(chunk.tokens)
                        if chunk.stop:
                            break
            if sampled > 1:
                raise EngineError(f"the engine sampled {sampled} tokens in a verify pass (one was asked)")
            wall_ms = 1e3 * (self.clock.now() - started)
            engine_ms = timings.get("prompt_ms", wall_ms) + timings.get("predicted_ms", 0.0)
            if end == 0:
                run.timings.update(timings)
                yield self._first(run)
            else:
                n, cached = int(timings.get("prompt_n", -1)), int(timings.get("cache_n", -1))
                passes.append(EnginePass(prompt_n=n, cache_n=cached, engine_ms=engine_ms, wall_ms=wall_ms))
                ms += engine_ms
            for _ in range(done, min(end + 1, len(forced))):
                for event in pace.advance():
                    yield event
            done = min(end + 1, len(forced))
        run.passes = tuple(passes)
        run.timings["predicted_n"] = len(forced)
        run.timings["predicted_ms"] = ms

    async def reset(self) -> None:
        """A cold engine, as each mode of a comparison starts with (a shared cache would favour
        whichever mode runs later): the dialect's cache reset (every slot erased, for llama.cpp)
        and the slot table cleared."""
        session = self._client()
        for path in self.dialect.reset_paths(self.config.engine_slots):
            await self._post(session, path, {}, "cache reset")
        self.slots = self._empty_slots()

    def _record(self, request: ModelRequest, grant: Grant, run: _Run, end: float) -> None:
        timings = run.timings
        self.turns.append(
            EngineTurn(
                tag=self.tag,
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
                queued_s=run.queued_s,
                ttft_s=run.first_at - run.sent,
                total_s=end - run.sent,
                passes=run.passes,
            )
        )

    # -- parts -------------------------------------------------------------------------------------

    async def _send(self, session: aiohttp.ClientSession, path: str, body: Any) -> aiohttp.ClientResponse:
        """A turn's (or a pass's) request sent: its 200 response, to be read, or the seam's error."""
        try:
            response = await session.post(f"{self.url}{path}", json=body)
        except aiohttp.ClientError as err:
            raise EngineError(f"{self.dialect.name} at {self.url} is unreachable: {err}") from err
        if response.status != 200:
            async with response:
                raise self.dialect.error(response.status, await response.read())
        return response

    def _first(self, run: _Run) -> Prefilled:
        """The first token is back: the turn's prefill is over."""
        run.first_at = self.clock.now()
        run.timings.setdefault("prompt_ms", 1e3 * (run.first_at - run.sent))  # not reported: measured
        return self._prefilled(run.request, run.timings, run.queued_s)

    def _prefilled(self, request: ModelRequest, timings: dict[str, float], queued_s: float) -> Prefilled:
        # The engine counts its BOS among the cached tokens; longrun's prompt has none.
        if "cache_n" not in timings:  # refused: usage and the validation need it, and 0 would be a guess
            raise EngineError(
                f"{self.dialect.name} reported no cached-token count with the first token "
                "(docs/engine.md#other-engines: the server options that report it)"
            )
        cached = max(0, min(int(timings["cache_n"]) - 1, request.prompt_tokens - 1))
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
        payload = {"filename": action.filename} if action.filename else {}
        await self._post(session, f"/slots/{action.slot}?action={action.action}", payload, f"slot {action.action}")

    async def _post(self, session: aiohttp.ClientSession, path: str, payload: dict[str, str], what: str) -> None:
        """A control request to the engine (a slot action, a cache reset): 200 or the seam's error."""
        try:
            async with session.post(f"{self.url}{path}", json=payload) as reply:
                if reply.status != 200:
                    raise self.dialect.error(reply.status, await reply.read())
        except aiohttp.ClientError as err:
            raise EngineError(f"{what} failed ({path}): {err}") from err

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # A connection per request: llama.cpp's server may close a kept-alive connection just
            # as the next request is written to it (seen as "Can not write request body").
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(force_close=True),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
            )
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


@dataclass(slots=True)
class _Run:
    """One turn on the engine as it goes: what was asked, and what came back so far."""

    request: ModelRequest
    prompt: list[int]  # engine ids, BOS first
    forced: list[int]  # the framed planned ids
    slot: int | None  # the dialect's slot (None: the engine schedules)
    queued_s: float
    sent: float  # the first request went out
    first_at: float = 0.0  # the first token came back
    timings: dict[str, float] = field(default_factory=dict)  # the engine's, in llama.cpp's names
    passes: tuple[EnginePass, ...] = ()


class _Pacer:
    """The API's events of a turn, paced by the engine's tokens: item k's planned tokens go
    out in proportion to the engine's progress through item k's framed ids (the first with the
    item's first engine token, the last with its last), so the API streams the plan's tokens
    (usage counts them) at the engine's speed."""

    def __init__(
        self, items: list[tuple[PlannedItem, list[int]]], framed: list[list[int]], token_bytes: Callable[[int], bytes]
    ) -> None:
        self.items, self.framed, self.token_bytes = items, framed, token_bytes
        self.k = 0  # the item being decoded
        self.engine_done = 0  # its engine tokens so far
        self.sent = 0  # its planned tokens streamed so far
        self.text: Callable[[int], str] | None = None

    def advance(self) -> list[ModelEvent]:
        """One engine token arrived."""
        events: list[ModelEvent] = []
        while self.k < len(self.items) and not self.framed[self.k]:
            events += self._finish_item()  # an item without engine ids cannot happen; kept total
        if self.k == len(self.items):
            return events
        item, ids = self.items[self.k]
        if self.engine_done == 0:
            events.append(ItemStarted(item.kind, item.name))
            self.text = ItemText(ids, self.token_bytes, {}).text
        self.engine_done += 1
        total = len(self.framed[self.k])
        due = -(-self.engine_done * len(ids) // total)  # ceil: the first engine token brings the first token
        events += self._tokens(due)
        if self.engine_done == total:
            events += self._finish_item()
        return events

    def rest(self) -> list[ModelEvent]:
        """Items the engine has no tokens left for (only ever empty items)."""
        events: list[ModelEvent] = []
        while self.k < len(self.items):
            if self.engine_done == 0:
                item, ids = self.items[self.k]
                events.append(ItemStarted(item.kind, item.name))
                self.text = ItemText(ids, self.token_bytes, {}).text
            events += self._finish_item()
        return events

    def _tokens(self, upto: int) -> list[ModelEvent]:
        _, ids = self.items[self.k]
        assert self.text is not None
        events: list[ModelEvent] = []
        while self.sent < min(upto, len(ids)):
            events.append(TokensSampled((ids[self.sent],), self.text(self.sent)))
            self.sent += 1
        return events

    def _finish_item(self) -> list[ModelEvent]:
        events = self._tokens(len(self.items[self.k][1]))
        events.append(ItemFinished())
        self.k += 1
        self.engine_done = self.sent = 0
        return events
