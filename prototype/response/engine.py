"""The API service's work for one response, shared by HTTP, SSE and WebSocket.

Stages of a turn (`pipeline.Stage`), each timed on the injected clock:

    network → parse_validate → load_state → render → [compaction] → safety → routing →
    inference_hop → queue → prefill → decode → post_inference → terminal event

(`compaction` only when the prompt is past the create's `compact_threshold`, or the input
ends with a `compaction_trigger`: docs/compaction.md.)

What a stage touches depends on the path (pipeline.py has the costs):

* HTTP, full history: every item is new, so rendering and classification cover
  the whole history every turn; auth, routing and billing every turn.
* HTTP + `previous_response_id`: the history comes from the store (one store
  round trip), then is re-rendered and re-classified in full.
* WebSocket + connection cache: the previous turn's items, rendered tokens and
  classifier state come from the cache, so only new items are rendered and only
  tokens not yet classified are classified; auth and routing happen once per
  connection; billing is overlapped with the next request. Each of these is an
  `Optimization` switch.
* Append: the pre-inference stages run once over the full context, then on each
  resume only over the appended items, with no routing, hop or queue re-entry;
  post-inference once at the end.

`Engine` holds the shared services (model, store, tokenizer, classifier, clock, id
factory) and the counters; a `ResponseRun` owns one response from its arrival to its
terminal event. A store outage is mapped to the wire in one place (`store_errors`).

The run keeps the segment loop (sample, decode on, pause, the boundary rules of steers and
calls) and calls two plain units for the rest: `prepare.py` builds and grows the prompt
(pre-inference), `finish.py` does post-inference (billing, the store write before the
terminal event, the stage report). Neither keeps state or emits: one owner per response.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Final, Protocol

from msgspec import Raw, structs

from ..clock import Clock
from ..config import STEER_BOUNDARIES, ModelLimits, SteerBoundary
from ..context.cache import STORE_UNAVAILABLE, CacheEntry
from ..context.compaction import Compaction, encode_payload, is_kept, prune, summary_text
from ..context.conversation import (
    Context,
    CreateRequest,
    Item,
    ItemParser,
    generation_header,
    item_from_output,
    message_text,
    parse_items,
    render_texts,
)
from ..context.safety import SafetyClassifier
from ..context.tokenizer import Tokenizer
from ..ids import IdFactory
from ..model import (
    ContextWindowExceeded,
    DecidesAsync,
    ItemFinished,
    ModelRequest,
    Prefilled,
    SamplingFinished,
    TokenArray,
    TokenModel,
    TokensSampled,
)
from ..pipeline import ALL_OPTIMIZATIONS, PROFILES, STAGE_SWITCH, CostProfile, Count, Optimization, Stage
from ..store.base import ResponseStore, StoreUnavailable
from ..wire.contract import CONTEXT_LENGTH_MESSAGE, check_compact_params, check_context_window
from ..wire.errors import INTERNAL_ERROR, ProtocolError
from ..wire.schemas import (
    CompactedResponse,
    CompactionItem,
    CompactParams,
    FunctionCall,
    InputTokensDetails,
    OutputTokensDetails,
    RequiredInput,
    Response,
    ServerEvent,
    StageReport,
    SteerRef,
    Usage,
    decode_stored,
    encode,
    is_null,
)
from . import metrics
from .finish import Outcome, finish, outputs_in_context
from .metrics import Histogram
from .prepare import Turn, add_resumed, resolve
from .services import Arrival, Counts, Stages
from .stream import (
    DIALECTS,
    CompactionDone,
    CompactionStarted,
    Continue,
    InjectAccepted,
    InjectRefused,
    Interrupt,
    Pause,
    ResponseStream,
    Resume,
    Start,
    SteerAccepted,
    SteerPending,
    StreamError,
)

__all__ = [
    "Aborted",
    "Arrival",
    "CacheEntry",
    "Channel",
    "Emit",
    "Engine",
    "EngineStatistics",
    "Inbox",
    "Outcome",
    "ResponseRun",
    "Resumed",
    "STORE_UNAVAILABLE",
    "Stages",
    "store_errors",
]

log = logging.getLogger("longrun.engine")

Emit = Callable[[list[ServerEvent]], Awaitable[None]]
# Texts at least this long are tokenized off the event loop when the engine has a render
# executor: ≈ 0.4 ms of BPE here, against ≈ 90 µs for the hop to a thread and back (uvloop).
OFFLOAD_CHARS: Final = 8_192
UNBOUNDED: Final = ModelLimits(context_window=None, max_output_tokens=None)  # an engine built without limits


class RenderedItems(Protocol):
    """Tokens of items rendered before, by item (`sim.memo.MemoRendered`, where CPU is free)."""

    def get(self, item: Item) -> TokenArray | None: ...

    def put(self, item: Item, tokens: TokenArray) -> None: ...


def _encode_all(tokenizer: Tokenizer, texts: Sequence[str]) -> list[TokenArray]:
    return [tokenizer.encode(text) for text in texts]


@dataclass(frozen=True, slots=True)
class Resumed:
    items: tuple[Item, ...]  # appended tool outputs and messages, committed in this order
    arrival: Arrival | None = None  # the append frame that completed them


@dataclass(frozen=True, slots=True)
class Aborted:
    reason: str  # `incomplete_details.reason`: append_timeout, connection_limit


Ack = InjectAccepted | InjectRefused | SteerAccepted


class Inbox:
    """What the connection core sends one running response over a WebSocket: acknowledgements
    to number in its stream, the input handed over at a turn's end, the decision that ends a
    pause. The session puts; only the response's own task takes, so every event of the stream
    is numbered by one writer. `steers` is what this response was told of the steers queued for
    it (the submissions themselves are the core's)."""

    __slots__ = ("acks", "steers", "_decision", "_handed", "_wake")

    def __init__(self) -> None:
        self.acks: list[Ack] = []  # in arrival order; the run's hot path tests this list
        self.steers: list[SteerRef] = []
        self._decision: Resumed | Aborted | None = None
        self._handed: tuple[Item, ...] | None = None
        self._wake: asyncio.Event | None = None

    def acknowledge(self, ack: Ack) -> None:
        self.acks.append(ack)
        if isinstance(ack, SteerAccepted):
            self.steers.append(ack.steer)
        self._notify()

    def hand(self, items: tuple[Item, ...]) -> None:
        """Beta, at a turn's end: what was injected so far."""
        self._handed = items

    def decide(self, decision: Resumed | Aborted) -> None:
        self._decision = decision
        self._notify()

    def take_handed(self) -> tuple[Item, ...]:
        items, self._handed = self._handed or (), None
        return items

    def take_decision(self) -> Resumed | Aborted | None:
        decision, self._decision = self._decision, None
        return decision

    async def wait(self) -> None:
        """Until something is put (return at once if something is waiting)."""
        if self.acks or self._decision is not None:
            return
        self._wake = asyncio.Event()
        try:
            await self._wake.wait()
        finally:
            self._wake = None

    def _notify(self) -> None:
        if self._wake is not None:
            self._wake.set()


class Channel(Protocol):
    """A WebSocket response's link to its connection core (the session's per-job handle).
    The run tells the core what happened; the core's answers come back as return values
    (`turn_ended`) or through `inbox`, which only the run's task drains. `dialect` is the
    connection's: `create` (no pauses; steering), `append` or `beta` (the pause's wire
    rendering, stream.DIALECTS)."""

    dialect: str
    inbox: Inbox

    async def called(self, call: RequiredInput) -> None:
        """Beta: an async call was emitted; its output may be injected from now on."""
        ...

    async def turn_ended(self) -> tuple[Item, ...]:
        """Beta: the run's turn ended in async calls; returns what was injected so far, before
        the run decides whether its model decodes on."""
        ...

    async def paused(self, required: tuple[RequiredInput, ...]) -> None:
        """The response paused for `required`; the decision arrives in `inbox`."""
        ...


@dataclass(frozen=True, slots=True)
class EngineStatistics:
    """Counters of the API service's work (what append and the caches save, made countable)."""

    responses: int  # response objects created = queue entries
    model_calls: int  # sampled model turns
    items_rendered: int  # pre-inference: items rendered and tokenized
    tokens_rendered: int
    tokens_classified: int
    pauses: int  # append-mode pauses
    kv_idle_token_s: float  # Σ resident KV tokens × seconds paused
    store_writes: int  # post-inference store writes
    stage_s: dict[str, float]  # Σ seconds per stage
    compactions: int = 0  # server-side compactions and `/responses/compact` calls
    responses_websocket: int = 0  # of `responses`, those created over a WebSocket


@contextlib.contextmanager
def store_errors(what: str) -> Iterator[None]:
    """The one mapping of a store outage to the wire: `StoreUnavailable` becomes
    `STORE_UNAVAILABLE` (503), the details go to the log."""
    try:
        yield
    except StoreUnavailable:
        log.exception("store unavailable while %s", what)
        raise STORE_UNAVAILABLE from None


class Engine:
    def __init__(
        self,
        *,
        model: TokenModel,
        store: ResponseStore,
        clock: Clock,
        tokenizer: Tokenizer,
        ids: IdFactory,
        profile: CostProfile | None = None,
        optimizations: frozenset[Optimization] = ALL_OPTIMIZATIONS,
        classifier: SafetyClassifier | None = None,
        render_executor: Executor | None = None,
        item_parser: ItemParser = parse_items,
        rendered: RenderedItems | None = None,
        limits: ModelLimits = UNBOUNDED,
        steer_boundary: SteerBoundary = "item",
    ) -> None:
        self.model = model
        self.store = store
        self.clock = clock
        self.tokenizer = tokenizer
        self.ids = ids
        self.profile = profile or PROFILES["local"]
        self.optimizations = optimizations
        self.classifier = classifier or SafetyClassifier()
        self.render_executor = render_executor  # None: tokenize inline (virtual time charges it to the loop)
        self.item_parser = item_parser  # validates the items of HTTP bodies and of loaded contexts
        self.rendered = rendered  # None: every item is rendered and tokenized when used
        # The model's context window and output limit (tokens; None: unbounded): a prompt longer
        # than the window minus the output limit is refused before inference (contract.py).
        # The model's limits, taken whole (`ServerConfig.model`); None: unbounded.
        self.context_window = context_window = limits.context_window
        self.output_token_limit = output_token_limit = limits.max_output_tokens
        self.input_token_limit = None if context_window is None else context_window - (output_token_limit or 0)
        # Where a steer accepted mid-decode stops the response (docs/beta.md#steering): at the end
        # of the output item in flight (the steering guide's rule), or at the next token (the item
        # in flight is cut off, ending `incomplete`).
        if steer_boundary not in STEER_BOUNDARIES:
            raise ValueError(f"steer_boundary must be one of {STEER_BOUNDARIES}, not {steer_boundary!r}")
        self.steer_boundary = steer_boundary
        self.counts = Counts()
        self.histograms: dict[str, Histogram] = {stage: Histogram() for stage in Stage}

    # -- the Response object -----------------------------------------------------------------------

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
            prompt_cache_retention=p.prompt_cache_retention,
            frequency_penalty=p.frequency_penalty if isinstance(p.frequency_penalty, float | int) else 0.0,
            presence_penalty=p.presence_penalty if isinstance(p.presence_penalty, float | int) else 0.0,
            safety_identifier=p.safety_identifier,
            top_logprobs=p.top_logprobs or 0,
            store=request.store,
            temperature=1.0 if p.temperature is None else p.temperature,
            tools=list(request.tools_echo),
            top_p=1.0 if p.top_p is None else p.top_p,
            truncation=p.truncation or "disabled",
            user=p.user,
            metadata=p.metadata or {},
            **kwargs,  # type: ignore[arg-type]
        )

    # -- pre-inference -----------------------------------------------------------------------------

    def uses(self, arrival: Arrival, optimization: Optimization) -> bool:
        return arrival.transport == "ws" and optimization in self.optimizations

    async def render(self, items: Sequence[Item], report: StageReport | None = None) -> list[TokenArray]:
        """The items' tokens. Items whose texts add up to `OFFLOAD_CHARS` or more are tokenized
        on `render_executor` if there is one (the BPE releases the GIL): the event loop keeps
        pacing other streams meanwhile."""
        rendered = self.rendered
        if rendered is None:
            chunks = await self._tokenize(render_texts(items))
        else:  # items rendered before are looked up; the rest rendered and recorded
            found = [rendered.get(item) for item in items]
            missing = [i for i, tokens in enumerate(found) if tokens is None]
            if missing:
                fresh = await self._tokenize(render_texts([items[i] for i in missing]))
                for i, tokens in zip(missing, fresh, strict=True):
                    found[i] = tokens
                    rendered.put(items[i], tokens)
            chunks = found  # type: ignore[assignment]  # no None left
        n = sum(len(c) for c in chunks)
        self.counts.items_rendered += len(items)
        self.counts.tokens_rendered += n
        if report is not None:
            report.tokens_rendered += n
        return chunks

    async def _tokenize(self, texts: list[str]) -> list[TokenArray]:
        if self.render_executor is not None and sum(map(len, texts)) >= OFFLOAD_CHARS:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self.render_executor, _encode_all, self.tokenizer, texts)
        return _encode_all(self.tokenizer, texts)

    async def load(self, response_id: str) -> list[Item]:
        with store_errors(f"loading {response_id}"):
            data = await self.store.get(response_id)
        if data is None:
            raise ProtocolError(
                f"Previous response with id '{response_id}' not found.",
                code="previous_response_not_found",
                param="previous_response_id",
            )
        record = decode_stored(data)
        items = list(self.item_parser(record.context))
        outputs = outputs_in_context(record.response.output[record.output_in_context :])
        items.extend(item_from_output(o) for o in outputs)
        return items

    # -- one response ------------------------------------------------------------------------------

    def run(
        self,
        request: CreateRequest,
        cached: CacheEntry | None,
        emit: Emit,
        *,
        arrival: Arrival | None = None,
        response_id: str | None = None,
        channel: Channel | None = None,
        fork: bool = False,
    ) -> Coroutine[None, None, Outcome]:
        """Serve one create: the coroutine of a new `ResponseRun`, which owns its life (returned
        as is, so awaiting it adds no frame to every resumption of the response). Request errors before the first event
        come back in `Outcome.error` (nothing was emitted); failures after it end the stream
        with `response.failed` (`Outcome.failure` says which error). Cancellation propagates
        after cleanup.

        `channel`: the response runs on a WebSocket connection core. In its `append` and `beta`
        dialects a turn that ends in function calls pauses the response instead of finishing
        it, and the core decides whether to resume with appended items or to end `incomplete`.

        `fork`: another response already continues from `cached` (a fork onto another lane),
        so its context is copied rather than extended in place."""
        run = ResponseRun(self, request, emit, arrival or Arrival(self.clock.now()), response_id, channel)
        return run.run(cached, fork=fork)

    async def compact_context(
        self, context: Context, prompt_tokens: int, report: StageReport
    ) -> tuple[Compaction, Context]:
        """Real work of one compaction: the summary of the dropped history, the item that
        carries it, rendered; the new context is the user messages, then the item."""
        kept = [(item, chunk) for item, chunk in zip(context.items, context.chunks, strict=True) if is_kept(item.view)]
        dropped = [chunk for item, chunk in zip(context.items, context.chunks, strict=True) if not is_kept(item.view)]
        text, written = summary_text(dropped, self.profile.compaction_ratio, self.tokenizer)
        content = encode_payload(context.turn_index, context.conversation_key, text)
        item = CompactionItem(id=self.ids.new("cmp"), encrypted_content=content)
        as_input = item_from_output(item)
        fresh = Context()
        fresh.extend([i for i, _ in kept], [c for _, c in kept])
        fresh.extend([as_input], await self.render([as_input], report))
        self.counts.compactions += 1
        return Compaction(item, prompt_tokens, written, sum(len(c) for c in dropped)), fresh

    # -- POST /v1/responses/compact -----------------------------------------------------------------

    async def compact(self, params: CompactParams, arrival: Arrival) -> CompactedResponse:
        """Compact a history (the request's `input`, after the stored `previous_response_id` if
        given) into its user messages and one compaction item (docs/compaction.md). The same
        work as a server-side compaction, timed in the same stages; nothing is stored."""
        stages = Stages(self.clock, self.counts, arrival.at)
        await stages.wait(Stage.NETWORK, self.profile.upload_s(arrival.body_bytes))
        if not params.model:
            raise ProtocolError(
                "Missing required parameter: 'model'.", code="missing_required_parameter", param="model"
            )
        check_compact_params(params)
        items = list(self.item_parser(params.input)) if params.input else []
        prev = params.previous_response_id
        if not items and prev is None:
            raise ProtocolError(
                "Missing required parameter: 'input'.", code="missing_required_parameter", param="input"
            )
        stages.lap(Stage.PARSE)
        history: list[Item] = []
        if prev is not None:
            if not prev.startswith("resp_"):
                raise ProtocolError(
                    f"Invalid 'previous_response_id': '{prev}'. Expected an ID that begins with 'resp_'.",
                    code="invalid_value",
                    param="previous_response_id",
                )
            history = await self.load(prev)
            await stages.wait(Stage.LOAD_STATE, self.profile.stage_s(Stage.LOAD_STATE))
        combined = prune([*history, *items], [item.view for item in (*history, *items)])
        context = Context()
        context.extend(combined, await self.render(combined, stages.report))
        preamble = self.tokenizer.encode(
            f"<|start|>developer<|message|>{params.instructions}<|end|>" if params.instructions else ""
        )
        stages.lap(Stage.RENDER)
        rendered = stages.report.tokens_rendered
        await stages.wait(Stage.RENDER, self.profile.stage_s(Stage.RENDER, {Count.TOKENS_RENDERED: rendered}))
        prompt = len(preamble) + context.n_tokens + len(generation_header(self.tokenizer))
        check_context_window(prompt, self.input_token_limit)
        compaction, compacted = await self.compact_context(context, prompt, stages.report)
        stages.lap(Stage.COMPACTION)
        await stages.wait(Stage.COMPACTION, self.profile.compaction_s(prompt, compaction.summary_tokens))
        output = [Raw(_user_message(item, self.ids)) for item in compacted.items[:-1]]
        output.append(Raw(encode(compaction.item)))
        report = stages.end_segment()
        for stage, seconds in report.stages_s.items():
            self.histograms[stage].observe(seconds)
        return CompactedResponse(
            id=self.ids.new("resp"),
            created_at=int(self.clock.time()),
            output=output,
            usage=Usage(
                input_tokens=prompt,
                input_tokens_details=InputTokensDetails(cached_tokens=0),
                output_tokens=compaction.summary_tokens,
                output_tokens_details=OutputTokensDetails(reasoning_tokens=0),
                total_tokens=prompt + compaction.summary_tokens,
            ),
        )

    # -- stored responses --------------------------------------------------------------------------

    def prometheus(self) -> str:
        s = self.statistics()
        counters = {
            "responses_total": s.responses,
            "responses_websocket_total": s.responses_websocket,
            "model_calls_total": s.model_calls,
            "tokens_rendered_total": s.tokens_rendered,
            "tokens_classified_total": s.tokens_classified,
            "pauses_total": s.pauses,
            "kv_idle_token_seconds_total": s.kv_idle_token_s,
            "store_writes_total": s.store_writes,
            "compactions_total": s.compactions,
        }
        return metrics.render(self.histograms, counters)

    def statistics(self) -> EngineStatistics:
        c = self.counts
        return EngineStatistics(
            c.responses,
            c.model_calls,
            c.items_rendered,
            c.tokens_rendered,
            c.tokens_classified,
            c.pauses,
            c.kv_idle_token_s,
            c.store_writes,
            dict(c.stage_s),
            c.compactions,
            c.responses_websocket,
        )

    async def put_stored(self, response_id: str, data: bytes) -> None:
        """Persist a finished response's record (`finish.py`, before its terminal event); an
        outage raises `STORE_UNAVAILABLE`."""
        self.counts.store_writes += 1
        with store_errors(f"storing {response_id}"):
            await self.store.put(response_id, data)

    async def get_stored(self, response_id: str) -> Response:
        with store_errors(f"reading {response_id}"):
            data = await self.store.get(response_id)
        if data is None:
            raise ProtocolError(f"Response with id '{response_id}' not found.", code="response_not_found", status=404)
        return decode_stored(data).response

    async def delete_stored(self, response_id: str) -> None:
        with store_errors(f"deleting {response_id}"):
            deleted = await self.store.delete(response_id)
        if not deleted:
            raise ProtocolError(f"Response with id '{response_id}' not found.", code="response_not_found", status=404)


def _user_message(item: Item, ids: IdFactory) -> bytes:
    """A kept user message as an output item of `/responses/compact`: the `Message` item the
    spec's `ItemField` types (an id, a status, `input_text` parts)."""
    text = message_text(item.view)
    return encode(
        {
            "type": "message",
            "id": item.view.id or ids.new("msg"),
            "status": "completed",
            "role": "user",
            "content": [{"type": "input_text", "text": text}],
        }
    )


class ResponseRun:
    """One response's whole life: pre-inference (`prepare.resolve`), the model segments, the
    pauses of append mode and the decode-on of beta async tools, post-inference
    (`finish.finish`) and the terminal event. The engine lends it the shared services (model,
    store, tokenizer, classifier, clock) and the counters; everything about this response lives
    here, and only this run's task numbers its events."""

    def __init__(
        self,
        engine: Engine,
        request: CreateRequest,
        emit: Emit,
        arrival: Arrival,
        response_id: str | None,
        channel: Channel | None,
    ) -> None:
        self.engine = engine
        self.request = request
        self.emit = emit
        self.arrival = arrival
        # Append and beta pause; a `create` connection's responses end where HTTP's do.
        self.pauses = channel if channel is not None and channel.dialect in DIALECTS else None
        # Acknowledgements that arrive from the core wait here until this run's task numbers
        # them, at its next event boundary or at once while it waits, so sequence numbers go out
        # in order. Over HTTP nothing arrives.
        self.inbox = channel.inbox if channel is not None else Inbox()
        self.stages = Stages(engine.clock, engine.counts, arrival.at)
        self.template = engine.new_response(request, response_id)
        if self.pauses is not None:
            async_tools = frozenset(tool.name for tool in request.tools if tool.is_async)
            self.stream = ResponseStream(
                self.template, engine.ids, dialect=self.pauses.dialect, async_tools=async_tools
            )
        else:
            self.stream = ResponseStream(self.template, engine.ids)
        self.in_context = 0  # append mode: output items already interleaved in the context
        self.beta = self.pauses is not None and self.pauses.dialect == "beta"
        # Beta async tools: the unanswered async calls (call_id -> the turn_index of the turn that made them).
        self._open_calls: dict[str, int] = {}

    async def run(self, cached: CacheEntry | None, *, fork: bool = False) -> Outcome:
        """The response's life, then what the core acknowledged while its last events went out
        (numbered after them: see stream.py). Nothing awaits between the last look at the inbox
        and the return, so the core learns of the end before it can acknowledge anything else."""
        outcome = await self._life(cached, fork)
        if outcome.error is None:
            while self.inbox.acks:
                await self.emit(self._drain())
        return outcome

    async def _life(self, cached: CacheEntry | None, fork: bool) -> Outcome:
        engine, stages, request = self.engine, self.stages, self.request
        profile = engine.profile
        engine.counts.responses += 1
        engine.counts.responses_websocket += self.arrival.transport == "ws"
        try:
            await stages.wait(Stage.NETWORK, profile.upload_s(self.arrival.body_bytes))
            stages.lap(Stage.PARSE)
            self.resolved = await resolve(engine, request, self.arrival, stages, cached, fork=fork)
        except ProtocolError as err:
            return Outcome(self.template, None, err)
        self.turn = Turn(engine, request, self.resolved, self.template.id, hold_kv=self.pauses is not None)
        if not request.generate:
            # Warm-up (`generate: false`, the WebSocket-mode guide): pre-inference work and a prefill
            # of the prompt (so the model's prefix cache holds it), no decode: `output: []`, zero usage.
            await self.emit(self._started(self.stream.receive(Start(input_tokens=0, warm_up=True))))
            warm_up = dataclasses.replace(self.turn.model_request(), max_output_tokens=0)
            async with contextlib.aclosing(engine.model.sample(warm_up)) as prefill:
                async for _ in prefill:
                    pass
            stages.lap(Stage.PREFILL)
            return await self._finish(self.stream.receive(SamplingFinished("stop")))
        if not (self.arrival.routed and engine.uses(self.arrival, STAGE_SWITCH[Stage.ROUTING])):
            await stages.wait(Stage.ROUTING, profile.stage_s(Stage.ROUTING))
        await self.emit(self._started(self.stream.receive(Start(input_tokens=self.turn.prompt_tokens))))
        if self.resolved.compaction is not None:
            await self._announce_compaction(self.resolved.compaction)
            if request.compact_now:  # a `compaction_trigger` asks for the compaction alone
                return await self._finish(self.stream.receive(SamplingFinished("stop")))
        if engine.classifier.verdict(self.resolved.safety).flagged:
            return await self._finish(self.stream.end_incomplete("content_filter"))  # refused before inference
        try:
            return await self._segments()
        finally:
            if self.pauses is not None:
                engine.model.release(self.template.id)  # the held KV becomes ordinary, evictable prefix cache

    # -- compaction --------------------------------------------------------------------------------

    async def _announce_compaction(self, compaction: Compaction) -> None:
        """The compaction's events and its modeled summarisation call, charged to `compaction`."""
        stream, stages = self.stream, self.stages
        await self.emit(stream.receive(CompactionStarted(compaction.item.id)))
        stages.lap(Stage.COMPACTION)
        cost = self.engine.profile.compaction_s(compaction.tokens_read, compaction.summary_tokens)
        await stages.wait(Stage.COMPACTION, cost)
        await self.emit(stream.receive(CompactionDone(compaction.item)))
        # The item already stands in the context: what follows it in the output is new to it.
        self.in_context = self.turn.outputs_in_context = len(stream.output)

    # -- model segments and pauses -----------------------------------------------------------------

    async def _segments(self) -> Outcome:
        stream, turn, stages = self.stream, self.turn, self.stages
        try:
            await stages.wait(Stage.INFERENCE_HOP, self.engine.profile.stage_s(Stage.INFERENCE_HOP))
            while True:
                if self.inbox.steers and self._steerable():
                    # A steer queued before this segment's first token; nothing decoded yet.
                    return await self._finish(stream.receive(Interrupt()))
                done = await self._sample(turn.model_request())
                if isinstance(done, Interrupt):
                    events = stream.receive(done)
                    stages.report.tokens_discarded = stream.discarded_tokens
                    return await self._finish(events)
                carried: tuple[Item, ...] = ()
                if self.beta:
                    # Only async calls make the response wait; any other call ends it (docs/beta.md).
                    required, owed = stream.split_calls()
                    if owed or not required or done.reason != "stop":
                        return await self._finish(stream.receive(done), owed=tuple(owed))
                    if self._may_decode_on():
                        carried = await self._boundary()
                        if self._decodes_on():
                            ended = await self._decode_on(carried)
                            if ended is not None:
                                return ended
                            continue
                else:
                    required = stream.pending_calls()
                if self.pauses is None:
                    # WebSocket mode (and HTTP): every call is the client's; steers wait for its outputs.
                    return await self._finish(
                        stream.receive(done), owed=tuple(required) if done.reason == "stop" else ()
                    )
                if not required or done.reason != "stop":
                    return await self._finish(stream.receive(done))
                ended = await self._pause(self.pauses, tuple(required), carried)
                if ended is not None:
                    return ended
        except ConnectionResetError:
            raise  # the peer is gone: nothing to tell it
        except ContextWindowExceeded:  # a real engine's own context limit, before its first token
            failed = stream.abort("context_length_exceeded", CONTEXT_LENGTH_MESSAGE)
            self.inbox.acks.clear()
            await self.emit(failed)
            too_long = ProtocolError(CONTEXT_LENGTH_MESSAGE, code="context_length_exceeded", param="input")
            return Outcome(stream.response, None, failure=too_long)
        except Exception:
            # The model, the stream core or the store failed after the first event: end the
            # stream with `response.failed`, details only in the log.
            log.exception("response %s failed", stream.response.id)
            failed = stream.abort("server_error", INTERNAL_ERROR.message)
            self.inbox.acks.clear()  # the response failed: what was acknowledged comes back from the core
            await self.emit(failed)
            return Outcome(stream.response, None, failure=INTERNAL_ERROR)

    # -- beta async tools: decoding on past a call (docs/beta.md#async-tools-that-overlap-decoding) --

    def _may_decode_on(self) -> bool:
        """Whether the model is asked at all: it must decide (`DecidesAsync`), and a queued steer
        takes the next safe boundary, which is a resume."""
        return isinstance(self.engine.model, DecidesAsync) and not self.inbox.steers

    async def _boundary(self) -> tuple[Item, ...]:
        """The end of a turn that made async calls: the calls join the context, and the core
        hands over what was injected meanwhile (in the context only if the model decodes on;
        otherwise carried to the resume, ahead of what comes later)."""
        assert self.pauses is not None
        turn = self.turn
        await turn.add_outputs(self.stream.output, self.stages.report)
        self.in_context = turn.outputs_in_context
        turn.prompt_tokens = turn.count()
        self.stages.lap(Stage.RENDER)
        taken = await self.pauses.turn_ended()
        for item in taken:
            if item.view.type == "function_call_output":
                self._open_calls.pop(str(item.view.call_id), None)
        return taken

    def _decodes_on(self) -> bool:
        """The model's decision (`DecidesAsync.decodes_on`) for the next turn, given the turns
        whose outputs are still outstanding. Nothing outstanding: the pause resumes at once, as
        when every output came during the turn. The request is the next turn's as the context
        stands (its calls in; what was handed over joins it if the model decodes on)."""
        model = self.engine.model
        outstanding = tuple(sorted(set(self._open_calls.values())))
        if not outstanding or not isinstance(model, DecidesAsync):
            return False
        return model.decodes_on(self.turn.model_request(), outstanding)

    async def _decode_on(self, carried: tuple[Item, ...]) -> Outcome | None:
        """The model samples its next turn now: what was injected joins the context (its upload
        overlapped the decode), is validated and classified, and a new segment starts with no
        pause and no event; past the compaction threshold or the input limit, as at a resume.
        The KV stays in use, so none of this is idle KV time."""
        engine, stream, turn = self.engine, self.stream, self.turn
        self.resolved.context.end_turn()  # the next turn's calls are not this turn's parallel calls
        taken = await self._add_resumed(carried)
        if isinstance(taken, Outcome):
            return taken
        compaction = taken
        events = stream.receive(Continue(input_tokens=turn.prompt_tokens))
        if self.inbox.acks:
            events += self._drain()
        if events:
            await self.emit(events)
        if compaction is not None:
            await self._announce_compaction(compaction)
        if engine.classifier.verdict(self.resolved.safety).flagged:
            return await self._finish(stream.end_incomplete("content_filter"))
        return None

    async def _pause(
        self, pauses: Channel, required: tuple[RequiredInput, ...], carried: tuple[Item, ...] = ()
    ) -> Outcome | None:
        """Pause for tool outputs; resume with what was appended (None), or end incomplete.
        `carried`: beta, input the core handed over at the turn's end, committed first."""
        engine, stream, turn, stages = self.engine, self.stream, self.turn, self.stages
        await turn.add_outputs(stream.output, stages.report)
        self.in_context = turn.outputs_in_context
        stages.lap(Stage.RENDER)
        stream.response = structs.replace(stream.response, longrun=stages.end_segment())
        pause = stream.receive(Pause())
        await self.emit(self._drain() + pause if self.inbox.acks else pause)
        engine.counts.pauses += 1
        paused_at = engine.clock.now()
        await pauses.paused(required)
        decision = await self._decision()
        # The response's KV stays resident while the client runs its tools.
        engine.counts.kv_idle_token_s += turn.resident_tokens * (engine.clock.now() - paused_at)
        if isinstance(decision, Aborted):
            stages.new_segment(engine.clock.now())
            return await self._finish(stream.end_incomplete(decision.reason))
        self._open_calls.clear()  # the core resumes once every pending call has its output
        resumed = decision.arrival or Arrival(engine.clock.now(), transport="ws")
        stages.new_segment(resumed.at)
        await stages.wait(Stage.NETWORK, engine.profile.upload_s(resumed.body_bytes))
        stages.lap(Stage.PARSE)
        taken = await self._add_resumed((*carried, *decision.items))
        if isinstance(taken, Outcome):
            return taken
        compaction = taken
        if self.inbox.steers:
            # Beta: the resume point is a safe output boundary (no output in flight, no call
            # owed): a queued steer ends the response here; its successor commits the steer.
            return await self._finish(stream.end_incomplete("steered"))
        await self.emit(stream.receive(Resume(input_tokens=turn.prompt_tokens)))
        if compaction is not None:
            await self._announce_compaction(compaction)
        if engine.classifier.verdict(self.resolved.safety).flagged:
            return await self._finish(stream.end_incomplete("content_filter"))
        return None

    async def _add_resumed(self, items: Sequence[Item]) -> Compaction | Outcome | None:
        """Items that join the running response's context (`prepare.add_resumed`): the compaction
        to announce (or None); an `Outcome` when the prompt outgrew the input limit and the
        response failed without sampling."""
        try:
            return await add_resumed(self.engine, self.request, self.stages, self.turn, items)
        except ProtocolError:  # the one it raises, context_length_exceeded: never sampled
            stream = self.stream
            await self.emit(stream.abort("context_length_exceeded", CONTEXT_LENGTH_MESSAGE) + self._drain())
            return Outcome(stream.response, None)

    async def _decision(self) -> Resumed | Aborted:
        """The core's decision for the paused response (go on with the appended items, or end
        `incomplete`); what it acknowledges meanwhile goes out as it comes."""
        inbox = self.inbox
        while True:
            if self.inbox.acks:
                await self.emit(self._drain())
            decision = inbox.take_decision()
            if decision is not None:
                return decision
            await inbox.wait()

    def _drain(self) -> list[ServerEvent]:
        """The queued acknowledgements, numbered now."""
        out: list[ServerEvent] = []
        for ack in self.inbox.acks:
            out.extend(self.stream.receive(ack))
        self.inbox.acks.clear()
        return out

    def _started(self, events: list[ServerEvent]) -> list[ServerEvent]:
        """The stream's first events, then the acknowledgements that came before them."""
        return events + self._drain() if self.inbox.acks else events

    def _steerable(self) -> bool:
        """Whether the response may stop here for a queued steer (docs/beta.md#steering): no call
        finished in this segment, so ending it leaves nothing owed. An item in flight (only with
        `steer_boundary="token"`) ends `incomplete` and stays out of the context."""
        return not any(isinstance(item, FunctionCall) for item in self.stream.segment_output())

    async def _sample(self, request: ModelRequest) -> SamplingFinished | Interrupt:
        """One model segment. A steer accepted meanwhile stops it, if `_steerable`, at the end
        of the output item in flight (or, with `steer_boundary="token"`, at the event boundary
        it is acknowledged at): the model's generator is closed there, so no later token is
        decoded."""
        stream, stages, emit = self.stream, self.stages, self.emit
        self.engine.counts.model_calls += 1
        # Closed on every exit: a failed emit (the peer went away) stops the model's loop now,
        # not whenever the suspended generator is garbage-collected.
        async with contextlib.aclosing(self.engine.model.sample(request)) as events:
            receive, queued, steers = stream.receive, self.inbox.acks, self.inbox.steers
            cut = self.engine.steer_boundary == "token"
            async for event in events:
                if type(event) is not TokensSampled:  # the per-token hot path skips these tests
                    if isinstance(event, Prefilled):
                        stages.report.tokens_prefilled += request.prompt_tokens - event.cached_tokens
                        stages.add(Stage.QUEUE, event.queued_s)
                        stages.lap(Stage.PREFILL)
                        stages.add(Stage.PREFILL, -event.queued_s)  # the simulator's split of the wait
                    elif isinstance(event, SamplingFinished):
                        stages.lap(Stage.DECODE)
                        stages.report.tokens_decoded = stream.output_tokens
                        return event
                    elif isinstance(event, ItemFinished):
                        await emit(receive(event))
                        call = stream.output[-1]
                        if self.beta and isinstance(call, FunctionCall) and call.is_async is True:
                            assert self.pauses is not None
                            # Its output may be injected from now on, while the model decodes on.
                            self._open_calls[call.call_id] = request.turn_index
                            await self.pauses.called(RequiredInput(call_id=call.call_id, name=call.name))
                        if queued:
                            await emit(self._drain())
                        if steers and self._steerable():  # the item is whole: a safe output boundary
                            stages.lap(Stage.DECODE)
                            stages.report.tokens_decoded = stream.output_tokens
                            return Interrupt()
                        continue
                await emit(receive(event))
                if queued:  # an acknowledgement arrived while the model decoded
                    await emit(self._drain())
                    if cut and steers and self._steerable():
                        stages.lap(Stage.DECODE)
                        stages.report.tokens_decoded = stream.output_tokens
                        return Interrupt()
        raise StreamError("model ended without SamplingFinished")

    # -- post-inference ----------------------------------------------------------------------------

    async def _finish(self, events: list[ServerEvent], owed: tuple[RequiredInput, ...] = ()) -> Outcome:
        """Post-inference, once per response (`finish.finish`: billing, the store write), then the
        terminal event, what was acknowledged meanwhile (numbered after it: see stream.py), and
        (beta) `response.steer.pending` for each queued steer if it completed owing calls."""
        outcome = await finish(
            self.engine, self.request, self.arrival, self.stages, self.stream, self.resolved, self.in_context, events
        )
        events.extend(self._drain())
        if owed and outcome.ok and outcome.response.status == "completed":
            for steer in self.inbox.steers:
                events.extend(self.stream.receive(SteerPending(steer, owed)))
            outcome = dataclasses.replace(outcome, owed=owed)
        await self.emit(events)
        return outcome
