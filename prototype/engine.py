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
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Final

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
from .model import ModelRequest, SamplingFinished, TokenModel
from .schemas import Response, ServerEvent, StoredResponse, decode_stored, encode, is_null
from .store import ResponseStore, StoreUnavailable
from .stream import ResponseStream, Start, StreamError
from .tokenizer import Tokenizer

__all__ = ["CacheEntry", "Emit", "Engine", "Outcome"]

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

    def new_response(self, request: CreateRequest) -> Response:
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
            id=self.ids.new("resp"),
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
                context.extend(items, render_items(items, self.tokenizer))
            preamble = render_preamble(request, self.tokenizer)
            reused = 0
        context.extend(request.items, render_items(request.items, self.tokenizer))
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
        items.extend(item_from_output(o) for o in record.response.output)
        return items

    async def run(self, request: CreateRequest, cached: CacheEntry | None, emit: Emit) -> Outcome:
        """Serve one create. Request errors before the first event come back in
        `Outcome.error` (nothing was emitted); failures after it end the stream
        with `response.failed`. Cancellation propagates after cleanup."""
        template = self.new_response(request)
        try:
            resolved = await self.resolve(request, cached)
        except ProtocolError as err:
            return Outcome(template, None, err)
        stream = ResponseStream(template, self.ids)
        context = resolved.context
        prompt = (resolved.preamble.tokens, *context.chunks, generation_header(self.tokenizer))
        n_prompt = sum(len(c) for c in prompt)
        if not request.generate:
            # Warm-up (wire-protocol 3.3): pre-inference work only, `output: []`, zero usage.
            await emit(stream.receive(Start(input_tokens=0, cached_tokens=0, warm_up=True)))
            return await self._finish(request, stream, resolved, SamplingFinished("stop"), emit)
        await emit(stream.receive(Start(input_tokens=n_prompt, cached_tokens=resolved.cached_tokens)))
        model_request = ModelRequest(
            prompt=prompt,
            prompt_tokens=n_prompt,
            cached_tokens=resolved.cached_tokens,
            turn_index=context.turn_index,
            conversation_key=context.conversation_key,
            tools=request.tools,
            tool_choice=request.tool_choice,
            parallel_tool_calls=request.params.parallel_tool_calls is not False,
            max_output_tokens=request.params.max_output_tokens,
            model=request.model,
            conversation_id=template.id,
        )
        try:
            async for event in self.model.sample(model_request):
                if isinstance(event, SamplingFinished):
                    return await self._finish(request, stream, resolved, event, emit)
                await emit(stream.receive(event))
            raise StreamError("model ended without SamplingFinished")
        except ConnectionResetError:
            raise  # the peer is gone: nothing to tell it
        except Exception:
            # The model, the stream core or the store failed after the first event: end the
            # stream with `response.failed`, details only in the log.
            log.exception("response %s failed", template.id)
            return await self._failed(stream, emit)

    async def _finish(
        self, request: CreateRequest, stream: ResponseStream, resolved: _Resolved, done: SamplingFinished, emit: Emit
    ) -> Outcome:
        # Post-inference: materialise the final Response, persist it, then send the terminal event.
        events = stream.receive(done)
        response = stream.response
        context = resolved.context
        if request.store:
            record = StoredResponse(response=response, context=context.raw_items())
            await self.store.put(response.id, encode(record))
        outputs = [item_from_output(o) for o in response.output]
        context.extend(outputs, render_items(outputs, self.tokenizer))
        entry = CacheEntry(response, context, len(context.items), resolved.preamble, request.store)
        await emit(events)
        return Outcome(response, entry)

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
