"""One response's whole life (`ResponseRun`), from its arrival to its terminal event, and what it
exchanges with a WebSocket connection core while it runs (`Channel`, `Inbox`, `Resumed`, `Aborted`).

The run keeps the segment loop (sample, decode on, pause, the boundary rules of steers and calls)
and calls plain units for the rest: `prepare.py` builds and grows the prompt (pre-inference),
`finish.py` does post-inference (billing, the store write before the terminal event, the stage
report), `compact.py` a server-side compaction. None of them keeps state or emits: one owner per
response. What waiting for the client means (whether a turn's calls pause the response, whether the
model holds its KV or decodes on past async calls) the run asks the response's dialect object
(`dialect.py`), built from the one its channel names. The engine lends the run its shared services
(`services.Services`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Final, Protocol

from msgspec import UNSET, structs

from ..clock import Clock
from ..context.cache import CacheEntry
from ..context.compaction import Compaction
from ..context.conversation import (
    CreateRequest,
    Item,
)
from ..ids import IdFactory
from ..model import (
    ContextWindowExceeded,
    ItemFinished,
    ModelRequest,
    Prefilled,
    SamplingFinished,
    TokensSampled,
)
from ..pipeline import STAGE_SWITCH, Stage
from ..wire.contract import CONTEXT_LENGTH_MESSAGE, applied_prompt_cache_options
from ..wire.errors import INTERNAL_ERROR, ProtocolError
from ..wire.requests import is_null
from ..wire.schemas import FunctionCall, RequiredInput, Response, ServerEvent, SteerRef
from .dialect import Pauses, ResponseDialect
from .finish import Outcome, finish
from .prepare import Resolved, Turn, add_resumed, diagnose_cache, resolve
from .services import Arrival, Services, Stages
from .stream import (
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
    "Channel",
    "Emit",
    "Inbox",
    "ResponseRun",
    "Resumed",
    "new_response",
    "start_response",
]

log = logging.getLogger("longrun.engine")

Emit = Callable[[list[ServerEvent]], Awaitable[None]]


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
    is numbered by one writer."""

    __slots__ = ("acks", "_decision", "_handed", "_wake")

    def __init__(self) -> None:
        self.acks: list[Ack] = []  # in arrival order; the run's hot path tests this list
        self._decision: Resumed | Aborted | None = None
        self._handed: tuple[Item, ...] | None = None
        self._wake: asyncio.Event | None = None

    def acknowledge(self, ack: Ack) -> None:
        self.acks.append(ack)
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

    def drain(self, stream: ResponseStream) -> list[ServerEvent]:
        """The queued acknowledgements, numbered now in the response's stream."""
        out: list[ServerEvent] = []
        for ack in self.acks:
            out.extend(stream.receive(ack))
        self.acks.clear()
        return out

    async def decision(self, stream: ResponseStream, emit: Emit) -> Resumed | Aborted:
        """The core's decision for the paused response (go on with the appended items, or end
        `incomplete`); what it acknowledges meanwhile goes out as it comes."""
        while True:
            if self.acks:
                await emit(self.drain(stream))
            decision = self.take_decision()
            if decision is not None:
                return decision
            await self.wait()

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


class Channel(Pauses, Protocol):
    """A WebSocket response's link to its connection core (the session's per-job handle).
    The run tells the core what happened, without waiting (nothing is written to the socket
    from here: the connection has one writer); the core's answers come back as return values
    (`turn_ended`, `steers`) or through `inbox`, which only the run's task drains. `dialect`:
    the pause dialect the connection's responses run in (its core's `PauseDialect.responses`),
    of which the run builds one object."""

    dialect: type[ResponseDialect]
    inbox: Inbox

    def steers(self) -> tuple[SteerRef, ...]:
        """The steers queued for this response, oldest first (the core holds them: one place)."""
        ...


# The steers a response without a channel has (over HTTP): none, from a call into C.
_no_steers: Final[Callable[[], tuple[SteerRef, ...]]] = tuple


def _steerable(stream: ResponseStream) -> bool:
    """Whether the response may stop here for a queued steer (docs/beta.md#steering): no call
    finished in this segment, so ending it leaves nothing owed. An item in flight (only with
    `steer_boundary="token"`) ends `incomplete` and stays out of the context."""
    return not any(isinstance(item, FunctionCall) for item in stream.segment_output())


_NUMBER: Final = (float, int)  # a constant: `float | int` would build its union at every call


def new_response(request: CreateRequest, ids: IdFactory, clock: Clock, response_id: str | None = None) -> Response:
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
        id=response_id or ids.new("resp"),
        created_at=int(clock.time()),
        status="in_progress",
        instructions=p.instructions,
        max_output_tokens=p.max_output_tokens,
        max_tool_calls=p.max_tool_calls,
        model=request.model,
        parallel_tool_calls=p.parallel_tool_calls is not False,
        previous_response_id=p.previous_response_id,
        prompt_cache_key=p.prompt_cache_key,
        prompt_cache_options=applied_prompt_cache_options(p),
        prompt_cache_retention=p.prompt_cache_retention,
        frequency_penalty=p.frequency_penalty if isinstance(p.frequency_penalty, _NUMBER) else 0.0,
        presence_penalty=p.presence_penalty if isinstance(p.presence_penalty, _NUMBER) else 0.0,
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


async def start_response(
    engine: Services,
    request: CreateRequest,
    emit: Emit,
    arrival: Arrival,
    response_id: str | None,
    channel: Channel | None,
    cached: CacheEntry | None,
    fork: bool,
) -> ResponseRun | Outcome:
    """Pre-inference up to the resolved prompt (`prepare.resolve`), then the response's
    `ResponseRun`, built whole from it, for the caller to await its `run`: no frame of
    pre-inference stays under every resumption of the response. A request error found before
    the first event comes back as the `Outcome` (its `error`), nothing emitted."""
    engine.counts.responses += 1
    engine.counts.responses_websocket += arrival.transport == "ws"
    stages = Stages(engine.clock, engine.counts, arrival.at)
    template = new_response(request, engine.ids, engine.clock, response_id)
    try:
        await stages.wait(Stage.NETWORK, engine.profile.upload_s(arrival.body_bytes))
        stages.lap(Stage.PARSE)
        resolved = await resolve(engine, request, arrival, stages, cached, fork=fork)
        diagnostics = await diagnose_cache(engine, request, resolved, cached, stages)
    except ProtocolError as err:
        return Outcome(template, None, err)
    if diagnostics is not UNSET:
        template = structs.replace(template, prompt_cache_diagnostics=diagnostics)
    return ResponseRun(engine, request, emit, arrival, channel, stages, template, resolved)


class ResponseRun:
    """One response's whole life: pre-inference (`prepare.resolve`), the model segments, the
    pauses of append mode and the decode-on of beta async tools, post-inference
    (`finish.finish`) and the terminal event. The engine lends it the shared services (model,
    store, tokenizer, classifier, clock) and the counters; everything about this response lives
    here, and only this run's task numbers its events."""

    def __init__(
        self,
        engine: Services,
        request: CreateRequest,
        emit: Emit,
        arrival: Arrival,
        channel: Channel | None,
        stages: Stages,
        template: Response,
        resolved: Resolved,
    ) -> None:
        """Built whole from what pre-inference resolved (`start_response`)."""
        self.engine = engine
        self.request = request
        self.emit = emit
        self.arrival = arrival
        # What waiting for the client means for this response (a `create` connection's
        # responses end where HTTP's do).
        self.dialect = channel.dialect(channel) if channel is not None else ResponseDialect()
        # Acknowledgements that arrive from the core wait here until this run's task numbers
        # them, at its next event boundary or at once while it waits, so sequence numbers go out
        # in order. Over HTTP nothing arrives.
        self.inbox = channel.inbox if channel is not None else Inbox()
        self.steers = channel.steers if channel is not None else _no_steers  # queued for this response
        self.stages = stages
        self.template = template
        self.stream = self.dialect.stream(template, engine.ids, request, engine.multi_agent_holds_calls)
        self.resolved = resolved
        self.turn = Turn(engine, request, resolved, template.id, hold_kv=self.dialect.holds_kv)

    async def run(self) -> Outcome:
        """The response's life, then what the core acknowledged while its last events went out
        (numbered after them: see stream.py). Nothing awaits between the last look at the inbox
        and the return, so the core learns of the end before it can acknowledge anything else."""
        outcome = await self._start()
        if outcome is None:  # the model segments run in this frame: no layer between them and `run`
            try:
                outcome = await self._segments()
            finally:
                if self.dialect.holds_kv:
                    self.engine.model.release(self.template.id)  # the held KV becomes ordinary, evictable prefix cache
        if outcome.error is None:
            while self.inbox.acks:
                await self.emit(self._drain())
        return outcome

    async def _start(self) -> Outcome | None:
        """Up to the first model segment; the outcome if the response ends before it (None: sample)."""
        engine, stages, request = self.engine, self.stages, self.request
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
            await stages.wait(Stage.ROUTING, engine.profile.stage_s(Stage.ROUTING))
        await self.emit(self._started(self.stream.receive(Start(input_tokens=self.turn.prompt_tokens))))
        if self.resolved.compaction is not None:
            await self._announce_compaction(self.resolved.compaction)
            if request.compact_now:  # a `compaction_trigger` asks for the compaction alone
                return await self._finish(self.stream.receive(SamplingFinished("stop")))
        if engine.classifier.verdict(self.resolved.safety).flagged:
            return await self._finish(self.stream.end_incomplete("content_filter"))  # refused before inference
        return None

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
        self.turn.outputs_in_context = len(stream.output)

    # -- model segments and pauses -----------------------------------------------------------------

    async def _segments(self) -> Outcome:
        stream, turn, stages = self.stream, self.turn, self.stages
        try:
            await stages.wait(Stage.INFERENCE_HOP, self.engine.profile.stage_s(Stage.INFERENCE_HOP))
            while True:
                if self.steers() and _steerable(stream):
                    # A steer queued before this segment's first token; nothing decoded yet.
                    return await self._finish(stream.receive(Interrupt()))
                done = await self._sample(turn.model_request())
                if isinstance(done, Interrupt):
                    events = stream.receive(done)
                    stages.report.tokens_discarded = stream.discarded_tokens
                    return await self._finish(events)
                end = self.dialect.turn_end(stream, done)
                if not end.waits_for:
                    return await self._finish(stream.receive(done), owed=end.owed)
                carried: tuple[Item, ...] = ()
                # A queued steer takes the next safe boundary, which is a resume: the model is not asked.
                if self.dialect.may_decode_on(self.engine.model) and not self.steers():
                    carried = await self._boundary()
                    if self.dialect.decodes_on(self.engine.model, self.turn.model_request):
                        ended = await self._decode_on(carried)
                        if ended is not None:
                            return ended
                        continue
                ended = await self._pause(end.waits_for, carried)
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

    async def _boundary(self) -> tuple[Item, ...]:
        """The end of a turn that made async calls: the calls join the context, and the core
        hands over what was injected meanwhile (in the context only if the model decodes on;
        otherwise carried to the resume, ahead of what comes later)."""
        turn = self.turn
        await turn.add_outputs(self.stream.output, self.stages.report)
        turn.prompt_tokens = turn.count()
        self.stages.lap(Stage.RENDER)
        return self.dialect.turn_ended()

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

    async def _pause(self, required: tuple[RequiredInput, ...], carried: tuple[Item, ...] = ()) -> Outcome | None:
        """Pause for tool outputs; resume with what was appended (None), or end incomplete.
        `carried`: beta, input the core handed over at the turn's end, committed first."""
        engine, stream, turn, stages = self.engine, self.stream, self.turn, self.stages
        await turn.add_outputs(stream.output, stages.report)
        stages.lap(Stage.RENDER)
        stream.response = structs.replace(stream.response, longrun=stages.end_segment())
        pause = stream.receive(Pause())
        await self.emit(self._drain() + pause if self.inbox.acks else pause)
        engine.counts.pauses += 1
        paused_at = engine.clock.now()
        self.dialect.paused(required)
        decision = await self.inbox.decision(self.stream, self.emit)
        # The response's KV stays resident while the client runs its tools.
        engine.counts.kv_idle_token_s += turn.resident_tokens * (engine.clock.now() - paused_at)
        if isinstance(decision, Aborted):
            stages.new_segment(engine.clock.now())
            return await self._finish(stream.end_incomplete(decision.reason))
        self.dialect.resumed()
        resumed = decision.arrival or Arrival(engine.clock.now(), transport="ws")
        stages.new_segment(resumed.at)
        await stages.wait(Stage.NETWORK, engine.profile.upload_s(resumed.body_bytes))
        stages.lap(Stage.PARSE)
        taken = await self._add_resumed((*carried, *decision.items))
        if isinstance(taken, Outcome):
            return taken
        compaction = taken
        if self.steers():
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

    def _drain(self) -> list[ServerEvent]:
        return self.inbox.drain(self.stream)

    def _started(self, events: list[ServerEvent]) -> list[ServerEvent]:
        """The stream's first events, then the acknowledgements that came before them."""
        return events + self._drain() if self.inbox.acks else events

    async def _sample(self, request: ModelRequest) -> SamplingFinished | Interrupt:
        """One model segment. A steer accepted meanwhile stops it, if `_steerable`, at the end
        of the output item in flight (or, with `steer_boundary="token"`, at the event boundary
        it is acknowledged at): the model's generator is closed there, so no later token is
        decoded."""
        stream, stages, emit = self.stream, self.stages, self.emit
        receive, queued, steers = stream.receive, self.inbox.acks, self.steers
        cut = self.engine.steer_boundary == "token"
        item_done = self.dialect.item_done
        self.engine.counts.model_calls += 1
        events = self.engine.model.sample(request)
        # Closed on every exit: a failed emit (the peer went away) stops the model's loop now,
        # not whenever the suspended generator is garbage-collected.
        try:
            async for event in events:
                if type(event) is not TokensSampled:  # the per-token hot path skips these tests
                    if type(event) is Prefilled:  # the model's event types are final: no isinstance call
                        stages.report.tokens_prefilled += request.prompt_tokens - event.cached_tokens
                        stages.add(Stage.QUEUE, event.queued_s)
                        stages.lap(Stage.PREFILL)
                        stages.add(Stage.PREFILL, -event.queued_s)  # the simulator's split of the wait
                    elif type(event) is SamplingFinished:
                        stages.lap(Stage.DECODE)
                        stages.report.tokens_decoded = stream.output_tokens
                        return event
                    elif type(event) is ItemFinished:
                        await emit(receive(event))
                        item_done(stream, request.turn_index)
                        if queued:
                            await emit(self._drain())
                        if steers() and _steerable(stream):  # the item is whole: a safe output boundary
                            stages.lap(Stage.DECODE)
                            stages.report.tokens_decoded = stream.output_tokens
                            return Interrupt()
                        continue
                await emit(receive(event))
                if queued:  # an acknowledgement arrived while the model decoded
                    await emit(self._drain())
                    if cut and steers() and _steerable(stream):
                        stages.lap(Stage.DECODE)
                        stages.report.tokens_decoded = stream.output_tokens
                        return Interrupt()
        finally:
            await events.aclose()
        raise StreamError("model ended without SamplingFinished")

    # -- post-inference ----------------------------------------------------------------------------

    async def _finish(self, events: list[ServerEvent], owed: tuple[RequiredInput, ...] = ()) -> Outcome:
        """Post-inference, once per response (`finish.finish`: billing, the store write), then the
        terminal event, what was acknowledged meanwhile (numbered after it: see stream.py), and
        (beta) `response.steer.pending` for each queued steer if it completed owing calls."""
        outcome = await finish(
            self.engine,
            self.request,
            self.arrival,
            self.stages,
            self.stream,
            self.resolved,
            self.turn.outputs_in_context,
            events,
        )
        events.extend(self._drain())
        if owed and outcome.ok and outcome.response.status == "completed":
            for steer in self.steers():
                events.extend(self.stream.receive(SteerPending(steer, owed)))
            outcome = Outcome(outcome.response, outcome.entry, outcome.error, outcome.failure, owed=owed)
        await self.emit(events)
        return outcome
