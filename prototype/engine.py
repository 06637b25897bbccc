"""The API service's work for one response, shared by HTTP, SSE and WebSocket.

Order of a turn: resolve state (connection cache → store) → build the effective
context → render new items to tokens → sample from the model while streaming
events → post-inference (store write) → terminal event.

The store write happens *before* the terminal event, so a continuation sent the
moment `response.completed` arrives finds it (read-after-write; LiteLLM #28587
lost continuations for ~10 s because its write was asynchronous).

This layer awaits the model and the store but reads no clock itself except
through the injected `Clock`; protocol state lives in `connection.py` and
`stream.py`.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Final, Protocol

from .clock import Clock
from .conversation import (
    Context,
    CreateRequest,
    Item,
    Preamble,
    generation_header,
    item_from_output,
    parse_items,
    render_items,
    render_preamble,
)
from .errors import INTERNAL_ERROR, ProtocolError
from .ids import IdFactory
from .model import ModelRequest, SamplingFinished, TokenArray, TokenModel
from .schemas import (
    OutputItem,
    RequiredInput,
    Response,
    ServerEvent,
    StoredResponse,
    decode_stored,
    encode,
    is_null,
)
from .store import ResponseStore, StoreUnavailable
from .stream import Pause, ResponseStream, Resume, SequenceCounter, Start, StreamError
from .tokenizer import Tokenizer

__all__ = [
    "Aborted",
    "CacheEntry",
    "Emit",
    "Engine",
    "EngineStatistics",
    "Outcome",
    "PauseChannel",
    "Resumed",
]

log = logging.getLogger("longrun.engine")

Emit = Callable[[list[ServerEvent]], Awaitable[None]]
STORE_UNAVAILABLE: Final = ProtocolError(
    "The response store is unavailable. Please retry.", code="store_unavailable", status=503
)


@dataclass(frozen=True, slots=True)
class CacheEntry:
    """A connection cache entry (wire-protocol 6.2): the previous response, its
    effective input and output items, tools, and their rendered tokens."""

    response: Response
    context: Context  # input + output items of `response`, rendered
    n_items: int  # length of `context` that belongs to this entry (Context is append-only)
    preamble: Preamble
    store: bool

    @property
    def response_id(self) -> str:
        return self.response.id


@dataclass(frozen=True, slots=True)
class Outcome:
    response: Response
    entry: CacheEntry | None  # None unless the response completed (or ended incomplete)
    error: ProtocolError | None = None  # set when the request failed before streaming started

    @property
    def ok(self) -> bool:
        return self.entry is not None


@dataclass(frozen=True, slots=True)
class _Resolved:
    context: Context
    preamble: Preamble
    cached_tokens: int


@dataclass(frozen=True, slots=True)
class Resumed:
    items: tuple[Item, ...]  # appended tool outputs and messages, committed in this order


@dataclass(frozen=True, slots=True)
class Aborted:
    reason: str  # `incomplete_details.reason`: append_timeout, connection_limit


class PauseChannel(Protocol):
    """How a paused append-mode response learns what happens next (the adapter implements it)."""

    async def wait_resume(self, required: tuple[RequiredInput, ...]) -> Resumed | Aborted: ...


@dataclass(frozen=True, slots=True)
class EngineStatistics:
    """Counters of the API service's work (what append and the caches save, made countable)."""

    responses: int  # response objects created = queue entries
    model_calls: int  # sampled model turns
    items_rendered: int  # pre-inference: items validated, rendered and tokenized
    tokens_rendered: int
    pauses: int  # append-mode pauses
    kv_idle_token_s: float  # Σ resident KV tokens × seconds paused
    store_writes: int  # post-inference store writes


@dataclass(slots=True)
class _Counts:
    responses: int = 0
    model_calls: int = 0
    items_rendered: int = 0
    tokens_rendered: int = 0
    pauses: int = 0
    kv_idle_token_s: float = 0.0
    store_writes: int = 0


class _Turn:
    """The model-visible prompt of a response as it grows segment by segment (append mode),
    with how much of it the model already holds."""

    def __init__(self, engine: Engine, request: CreateRequest, resolved: _Resolved, conversation_id: str) -> None:
        self.engine = engine
        self.request = request
        self.resolved = resolved
        self.conversation_id = conversation_id
        self.cached_tokens = resolved.cached_tokens
        self.header = generation_header(engine.tokenizer)
        self.prompt_tokens = self._count()
        self.outputs_in_context = 0

    def _count(self) -> int:
        return len(self.resolved.preamble.tokens) + self.resolved.context.n_tokens + len(self.header)

    @property
    def resident_tokens(self) -> int:
        return self._count() - len(self.header)

    def add_outputs(self, output: Sequence[OutputItem]) -> None:
        """Interleave the response's output items not yet in the context (a pause's segment)."""
        items = [item_from_output(o) for o in output[self.outputs_in_context :]]
        self.outputs_in_context = len(output)
        self.resolved.context.extend(items, self.engine._render(items))

    def add_input(self, items: Sequence[Item]) -> None:
        # Everything before the appended items is resident KV: only they need prefill.
        self.cached_tokens = self.resident_tokens
        self.resolved.context.extend(items, self.engine._render(items))
        self.prompt_tokens = self._count()

    def model_request(self) -> ModelRequest:
        request, context = self.request, self.resolved.context
        return ModelRequest(
            prompt=(self.resolved.preamble.tokens, *context.chunks, self.header),
            prompt_tokens=self.prompt_tokens,
            cached_tokens=self.cached_tokens,
            turn_index=context.turn_index,
            conversation_key=context.conversation_key,
            tools=request.tools,
            tool_choice=request.tool_choice,
            parallel_tool_calls=request.params.parallel_tool_calls is not False,
            max_output_tokens=request.params.max_output_tokens,
            model=request.model,
            conversation_id=self.conversation_id,
        )


class Engine:
    def __init__(
        self,
        *,
        model: TokenModel,
        store: ResponseStore,
        clock: Clock,
        tokenizer: Tokenizer,
        ids: IdFactory,
    ) -> None:
        self.model = model
        self.store = store
        self.clock = clock
        self.tokenizer = tokenizer
        self.ids = ids
        self._counts = _Counts()

    def new_response(self, request: CreateRequest, response_id: str | None = None) -> Response:
        """The in-progress snapshot: echoes the request's settings (instructions are not inherited)."""
        p = request.params
        kwargs: dict[str, object] = {}
        if not is_null(p.reasoning):
            kwargs["reasoning"] = p.reasoning
        if not is_null(p.text):
            kwargs["text"] = p.text
        if not is_null(p.tool_choice):
            kwargs["tool_choice"] = p.tool_choice
        return Response(
            id=response_id or self.ids.new("resp"),
            created_at=int(self.clock.time()),
            status="in_progress",
            instructions=p.instructions,
            max_output_tokens=p.max_output_tokens,
            max_tool_calls=p.max_tool_calls,
            model=request.model,
            parallel_tool_calls=p.parallel_tool_calls is not False,
            previous_response_id=p.previous_response_id,
            prompt_cache_key=p.prompt_cache_key,
            store=request.store,
            temperature=1.0 if p.temperature is None else p.temperature,
            tools=list(request.tools_raw),
            top_p=1.0 if p.top_p is None else p.top_p,
            truncation=p.truncation or "disabled",
            user=p.user,
            metadata=p.metadata or {},
            **kwargs,  # type: ignore[arg-type]
        )

    async def resolve(self, request: CreateRequest, cached: CacheEntry | None) -> _Resolved:
        """Load the previous turn's state and append the new input, rendered.

        Lookup order (wire-protocol 6.2): connection cache, then the store (only
        `store:true` responses are there), else `previous_response_not_found`.
        """
        prev = request.previous_response_id
        if prev is not None and cached is not None and cached.response_id == prev:
            context = cached.context.prefix(cached.n_items)
            if cached.preamble.key == request.preamble_key:
                preamble = cached.preamble
                reused = len(preamble.tokens) + context.n_tokens
            else:
                # New instructions or tools: the rendered items are still reused, but the prompt's
                # prefix changed, so no token of it counts as cached.
                preamble = render_preamble(request, self.tokenizer)
                reused = 0
        else:
            context = Context()
            if prev is not None:
                items = await self._load(prev)
                context.extend(items, self._render(items))
            preamble = render_preamble(request, self.tokenizer)
            reused = 0
        context.extend(request.items, self._render(request.items))
        return _Resolved(context, preamble, reused)

    async def _load(self, response_id: str) -> list[Item]:
        try:
            data = await self.store.get(response_id)
        except StoreUnavailable:
            log.exception("store unavailable while loading %s", response_id)
            raise STORE_UNAVAILABLE from None
        if data is None:
            raise ProtocolError(
                f"Previous response with id '{response_id}' not found.",
                code="previous_response_not_found",
                param="previous_response_id",
            )
        record = decode_stored(data)
        items = list(parse_items(record.context))
        items.extend(item_from_output(o) for o in record.response.output[record.output_in_context :])
        return items

    async def run(
        self,
        request: CreateRequest,
        cached: CacheEntry | None,
        emit: Emit,
        *,
        response_id: str | None = None,
        counter: SequenceCounter | None = None,
        pauses: PauseChannel | None = None,
    ) -> Outcome:
        """Serve one create. Request errors before the first event come back in
        `Outcome.error` (nothing was emitted); failures after it end the stream
        with `response.failed`. Cancellation propagates after cleanup.

        With `pauses` (append mode) a turn that ends in function calls pauses the
        response instead of finishing it: `response.done`, then the channel says
        whether to resume with appended items or to end `incomplete`."""
        template = self.new_response(request, response_id)
        self._counts.responses += 1
        try:
            resolved = await self.resolve(request, cached)
        except ProtocolError as err:
            return Outcome(template, None, err)
        stream = ResponseStream(template, self.ids, counter)
        turn = _Turn(self, request, resolved, template.id)
        if not request.generate:
            # Warm-up (wire-protocol 3.3): pre-inference work only, `output: []`, zero usage.
            await emit(stream.receive(Start(input_tokens=0, cached_tokens=0, warm_up=True)))
            return await self._finish(request, stream, resolved, stream.receive(SamplingFinished("stop")), emit)
        await emit(stream.receive(Start(input_tokens=turn.prompt_tokens, cached_tokens=turn.cached_tokens)))
        try:
            while True:
                done = await self._sample(turn.model_request(), stream, emit)
                required = stream.pending_calls()
                if pauses is None or not required or done.reason != "stop":
                    events = stream.receive(done)
                    return await self._finish(request, stream, resolved, events, emit, turn.outputs_in_context)
                await emit(stream.receive(Pause()))
                turn.add_outputs(stream.output)
                self._counts.pauses += 1
                paused_at = self.clock.now()
                decision = await pauses.wait_resume(tuple(required))
                # The response's KV stays resident while the client runs its tools.
                self._counts.kv_idle_token_s += turn.resident_tokens * (self.clock.now() - paused_at)
                if isinstance(decision, Aborted):
                    events = stream.end_incomplete(decision.reason)
                    return await self._finish(request, stream, resolved, events, emit, turn.outputs_in_context)
                turn.add_input(decision.items)
                await emit(stream.receive(Resume(input_tokens=turn.prompt_tokens, cached_tokens=turn.cached_tokens)))
        except ConnectionResetError:
            raise  # the peer is gone: nothing to tell it
        except Exception:
            # The model, the stream core or the store failed after the first event: end the
            # stream with `response.failed`, details only in the log.
            log.exception("response %s failed", template.id)
            return await self._failed(stream, emit)

    async def _sample(self, request: ModelRequest, stream: ResponseStream, emit: Emit) -> SamplingFinished:
        self._counts.model_calls += 1
        async for event in self.model.sample(request):
            if isinstance(event, SamplingFinished):
                return event
            await emit(stream.receive(event))
        raise StreamError("model ended without SamplingFinished")

    async def _finish(
        self,
        request: CreateRequest,
        stream: ResponseStream,
        resolved: _Resolved,
        events: list[ServerEvent],
        emit: Emit,
        in_context: int = 0,  # append mode: output items already interleaved in the context
    ) -> Outcome:
        # Post-inference, once per response: persist the final Response, then send the terminal event.
        response = stream.response
        context = resolved.context
        if request.store:
            record = StoredResponse(response=response, context=context.raw_items(), output_in_context=in_context)
            self._counts.store_writes += 1
            await self.store.put(response.id, encode(record))
        outputs = [item_from_output(o) for o in response.output[in_context:]]
        context.extend(outputs, self._render(outputs))
        entry = CacheEntry(response, context, len(context.items), resolved.preamble, request.store)
        await emit(events)
        return Outcome(response, entry)

    def _render(self, items: Sequence[Item]) -> list[TokenArray]:
        self._counts.items_rendered += len(items)
        chunks = render_items(items, self.tokenizer)
        self._counts.tokens_rendered += sum(len(c) for c in chunks)
        return chunks

    def statistics(self) -> EngineStatistics:
        c = self._counts
        return EngineStatistics(
            c.responses, c.model_calls, c.items_rendered, c.tokens_rendered, c.pauses, c.kv_idle_token_s, c.store_writes
        )

    async def _failed(self, stream: ResponseStream, emit: Emit) -> Outcome:
        await emit(stream.abort("server_error", INTERNAL_ERROR.message))
        return Outcome(stream.response, None)

    async def get_stored(self, response_id: str) -> Response:
        try:
            data = await self.store.get(response_id)
        except StoreUnavailable:
            log.exception("store unavailable")
            raise STORE_UNAVAILABLE from None
        if data is None:
            raise ProtocolError(f"Response with id '{response_id}' not found.", code="response_not_found", status=404)
        return decode_stored(data).response

    async def delete_stored(self, response_id: str) -> None:
        try:
            deleted = await self.store.delete(response_id)
        except StoreUnavailable:
            log.exception("store unavailable")
            raise STORE_UNAVAILABLE from None
        if not deleted:
            raise ProtocolError(f"Response with id '{response_id}' not found.", code="response_not_found", status=404)
