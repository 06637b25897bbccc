"""Post-inference for one response, once, at its end: billing, the store write, the cache entry,
the stage report the terminal event carries; and what a run ends with (`Outcome`).

The store write happens *before* the terminal event is sent, so a continuation sent the moment
`response.completed` arrives finds it (read-after-write; LiteLLM #28587 lost continuations for
~10 s because its write was asynchronous). A failed write turns the terminal event into
`response.failed` at the same sequence number.

`finish` is a plain function the run (`run.ResponseRun`) calls with what it owns; the run
then numbers what was acknowledged meanwhile and sends the events. It reaches the engine's
services through `services.Services`, so it does not import the engine that imports it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from msgspec import structs

from ..context.cache import CacheEntry
from ..context.conversation import CreateRequest, item_from_output
from ..pipeline import STAGE_SWITCH, Stage
from ..wire.errors import ProtocolError
from ..wire.schemas import (
    OutputItem,
    RequiredInput,
    Response,
    ResponseCompleted,
    ResponseError,
    ResponseFailed,
    ResponseIncomplete,
    ServerEvent,
    StoredResponse,
    encode,
)
from .prepare import Resolved
from .services import Arrival, Services, Stages
from .stream import ResponseStream

__all__ = ["Outcome", "finish", "outputs_in_context"]


@dataclass(frozen=True, slots=True)
class Outcome:
    response: Response
    entry: CacheEntry | None  # None unless the response completed (or ended incomplete)
    error: ProtocolError | None = None  # set when the request failed before streaming started
    failure: ProtocolError | None = None  # set when the response ended `failed`: what to say over HTTP
    owed: tuple[RequiredInput, ...] = ()  # beta: client calls the response ended on, unanswered

    @property
    def ok(self) -> bool:
        return self.entry is not None


def outputs_in_context(outputs: Sequence[OutputItem]) -> list[OutputItem]:
    """The output items the next turn's context holds: not those a steer cut off mid-decode
    (status `incomplete`), so the successor plans that turn afresh (docs/beta.md)."""
    return [o for o in outputs if getattr(o, "status", None) != "incomplete"]


async def finish(
    engine: Services,
    request: CreateRequest,
    arrival: Arrival,
    stages: Stages,
    stream: ResponseStream,
    resolved: Resolved,
    in_context: int,
    events: list[ServerEvent],
) -> Outcome:
    """Billing, persist the final Response, render its output for the next turn's cache; the
    terminal event, `events[-1]`, is replaced in place by the one carrying the stage report
    (the stored copy does not: it was written before the report). `in_context`: output items
    already interleaved in the context (append mode)."""
    billing = engine.profile.stage_s(Stage.POST)
    if engine.uses(arrival, STAGE_SWITCH[Stage.POST]):
        stages.report.overlapped_s += billing  # overlapped with the client's next request
    else:
        await stages.wait(Stage.POST, billing)
    context = resolved.context
    if request.store:
        record = StoredResponse(response=stream.response, context=context.raw_items(), output_in_context=in_context)
        try:
            await engine.put_stored(stream.response.id, encode(record))
        except ProtocolError as err:
            return _unstored(stream, events, err)
    stages.lap(Stage.POST)
    outputs = [item_from_output(o) for o in outputs_in_context(stream.response.output[in_context:])]
    context.extend(outputs, await engine.render(outputs))
    stages.lap(Stage.RENDER)  # the output, rendered for the next turn's cache
    report = stages.end_segment()
    for stage, seconds in report.stages_s.items():
        engine.histograms[stage].observe(seconds)
    response = stream.response = structs.replace(stream.response, longrun=report)
    events[-1] = structs.replace(events[-1], response=response)
    entry = CacheEntry(
        response,
        context,
        len(context.items),
        resolved.preamble,
        request.store,
        resolved.safety,
        resolved.safety_chunks,
    )
    return Outcome(response, entry)


def _unstored(stream: ResponseStream, events: list[ServerEvent], err: ProtocolError) -> Outcome:
    """The store write failed: the terminal event, not sent yet, becomes `response.failed`
    at the same sequence number, so nothing claims a stored response. `Response.error.code`
    is a closed set in the API reference: `server_error`, with the store's message; HTTP
    without streaming answers `err` itself (503 `store_unavailable`)."""
    failed = stream.response = structs.replace(
        stream.response,
        status="failed",
        error=ResponseError(code="server_error", message=err.message),
        incomplete_details=None,
        completed_at=None,
    )
    terminal = events[-1]
    assert isinstance(terminal, ResponseCompleted | ResponseIncomplete)
    events[-1] = ResponseFailed(sequence_number=terminal.sequence_number, response=failed)
    return Outcome(failed, None, failure=err)
