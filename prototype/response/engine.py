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
factory) and the counters, renders items (on an executor when they are long), reads and
writes the store (a store outage is mapped to the wire in one place, `store_errors`) and
starts each response's `run.ResponseRun`, which owns it from its arrival to its terminal
event. `/responses/compact` is `compact.py`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine, Iterator, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Final, Protocol

from ..clock import Clock
from ..config import STEER_BOUNDARIES, ModelLimits, SteerBoundary
from ..context.cache import CacheEntry, store_unavailable
from ..context.conversation import (
    Context,
    CreateRequest,
    Item,
    ItemParser,
    item_from_output,
    parse_items,
    render_texts,
)
from ..context.safety import SafetyClassifier
from ..context.tokenizer import Tokenizer
from ..ids import IdFactory
from ..model import (
    ImplicitCacheOnly,
    TokenArray,
    TokenModel,
)
from ..pipeline import ALL_OPTIMIZATIONS, CONTEXT_CACHE, PROFILES, CostProfile, Optimization, Stage
from ..store.base import ResponseStore, StoreUnavailable
from ..wire.errors import ProtocolError
from ..wire.schemas import (
    Response,
    StageReport,
    decode_stored,
)
from . import metrics
from .finish import Outcome, outputs_in_context
from .metrics import Histogram
from .run import Channel, Emit, ResponseRun, start_response
from .services import Arrival, Counts, KnownContexts

__all__ = ["Engine", "EngineStatistics", "RenderedItems", "store_errors"]


log = logging.getLogger("longrun.engine")

# Texts at least this long are tokenized off the event loop when the engine has a render
# executor: ≈ 0.4 ms of BPE here, against ≈ 90 µs for the hop to a thread and back (uvloop).
OFFLOAD_CHARS: Final = 8_192
UNBOUNDED: Final = ModelLimits(context_window=None, max_output_tokens=None)  # an engine built without limits


class RenderedItems(Protocol):
    """Tokens of items rendered before, by item (`sim.memo.MemoRendered`, where CPU is free)."""

    def get_all(self, items: Sequence[Item]) -> list[TokenArray | None]: ...

    def put(self, item: Item, tokens: TokenArray) -> None: ...


def _encode_all(tokenizer: Tokenizer, texts: Sequence[str]) -> list[TokenArray]:
    return [tokenizer.encode(text) for text in texts]


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
    `store_unavailable()` (503), the details go to the log."""
    try:
        yield
    except StoreUnavailable:
        log.exception("store unavailable while %s", what)
        raise store_unavailable() from None


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
        contexts: KnownContexts | None = None,
        limits: ModelLimits = UNBOUNDED,
        steer_boundary: SteerBoundary = "item",
        multi_agent_holds_calls: bool = True,
    ) -> None:
        self.model = model
        # The model's cache cannot follow explicit breakpoints: its name for the refusal (decided
        # once here, not by a runtime Protocol check on every request).
        self.implicit_cache_only: str | None = model.cache_name if isinstance(model, ImplicitCacheOnly) else None
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
        self.contexts = contexts  # None: a request's input is checked and extended item by item
        # The model's context window and output limit (tokens; None: unbounded): a prompt longer
        # than the window minus the output limit is refused before inference (`wire/contract.py`).
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
        # Beta `multi_agent` responses wait at every function call (docs/beta.md#hosted-multi-agent).
        self.multi_agent_holds_calls = multi_agent_holds_calls
        self.counts = Counts()
        self.histograms: dict[str, Histogram] = {stage: Histogram() for stage in Stage}

    # -- pre-inference -----------------------------------------------------------------------------

    def uses(self, arrival: Arrival, optimization: Optimization) -> bool:
        if optimization not in self.optimizations:
            return False
        return arrival.transport == "ws" or (arrival.session and optimization in CONTEXT_CACHE)

    async def render(
        self, items: Sequence[Item], report: StageReport | None = None, *, held: Context | None = None
    ) -> list[TokenArray]:
        """The items' tokens. Items whose texts add up to `OFFLOAD_CHARS` or more are tokenized
        on `render_executor` if there is one (the BPE releases the GIL): the event loop keeps
        pacing other streams meanwhile. `held`: a context whose tokens the caller already holds
        (a known prefix, `KnownContexts`): not rendered again, counted as rendered all the same
        (the real work renders it again)."""
        rendered = self.rendered
        if rendered is None:
            chunks = await self._tokenize(render_texts(items))
        else:  # items rendered before are looked up; the rest rendered and recorded
            found = rendered.get_all(items)
            missing = [i for i, tokens in enumerate(found) if tokens is None]
            if missing:
                fresh = await self._tokenize(render_texts([items[i] for i in missing]))
                for i, tokens in zip(missing, fresh, strict=True):
                    found[i] = tokens
                    rendered.put(items[i], tokens)
            chunks = found  # type: ignore[assignment]  # no None left
        n, rendered_items = sum(map(len, chunks)), len(items)
        if held is not None:
            n += held.n_tokens
            rendered_items += len(held.items)
        self.counts.items_rendered += rendered_items
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

    def start(
        self,
        request: CreateRequest,
        cached: CacheEntry | None,
        emit: Emit,
        *,
        arrival: Arrival | None = None,
        response_id: str | None = None,
        channel: Channel | None = None,
        fork: bool = False,
    ) -> Coroutine[None, None, ResponseRun | Outcome]:
        """Serve one create, in two steps: pre-inference (`run.start_response`) gives the
        response's `ResponseRun`, which owns its life and whose `run` the caller then awaits
        itself, so no frame stays between them and every event. A request error before the first
        event comes back as the `Outcome` (its `error`; nothing was emitted); a failure after it
        ends the stream with `response.failed` (the run's `Outcome.failure` says which error).
        Cancellation propagates after cleanup.

        `channel`: the response runs on a WebSocket connection core. In its `append` and `beta`
        dialects a turn that ends in function calls pauses the response instead of finishing
        it, and the core decides whether to resume with appended items or to end `incomplete`.

        `fork`: another response already continues from `cached` (a fork onto another lane),
        so its context is copied rather than extended in place."""
        arrival = arrival or Arrival(self.clock.now())
        return start_response(self, request, emit, arrival, response_id, channel, cached, fork)

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
        outage raises `store_unavailable()`."""
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
