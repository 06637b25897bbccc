"""Pre-inference for one response: the prompt its model segments read.

`resolve` builds it once, before the first segment (load the previous turn's state, render what
is not rendered yet, compact past the threshold, check the input limit, classify what is not
classified yet); `Turn` holds it as it grows (the pauses of append mode, the decode-on of beta
async tools) and `add_resumed` adds a resume's items to it with the same checks.

These are plain functions and a value the run (`run.ResponseRun`) calls and holds: the run
owns the response's state (its stream, its stage timer, its inbox) and the events; nothing here
emits an event or keeps state of its own. The engine lends its shared services (renderer,
classifier, store, clock) and counters, typed as `services.Services`, so this module does not
import the engine that imports it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from msgspec import UNSET, UnsetType

from ..context.breakpoints import TTL_S, conversation_breakpoints, has_breakpoints, refuse_explicit
from ..context.cache import CacheEntry
from ..context.compaction import COMPACTION_TYPE, Compaction, is_kept, prune
from ..context.conversation import (
    REFERENCE_TYPE,
    Context,
    CreateRequest,
    Item,
    Preamble,
    check_continuation,
    generation_header,
    item_from_output,
    item_type,
    render_preamble,
)
from ..context.safety import ClassifierState
from ..model import ModelRequest
from ..pipeline import STAGE_SWITCH, Count, Optimization, Stage
from ..wire.contract import applied_prompt_cache_options, check_context_window, comparison_response_id
from ..wire.errors import ProtocolError
from ..wire.schemas import (
    CacheHit,
    CacheMiss,
    ComparisonResponseNotFound,
    DiagnosticsUnavailable,
    OutputItem,
    PromptCacheDiagnostics,
    Response,
    StageReport,
)
from .compact import compact_context
from .services import Arrival, KnownContexts, Services, Stages

__all__ = ["Resolved", "Turn", "classify", "compaction_limit", "diagnose_cache", "resolve", "add_resumed"]


@dataclass(slots=True)
class Resolved:
    context: Context
    preamble: Preamble
    safety: ClassifierState
    safety_chunks: int  # chunks of `context` the classifier state covers
    compaction: Compaction | None = None  # the compaction this response's prompt went through


class Turn:
    """The model-visible prompt of a response as it grows segment by segment (append mode),
    with how much of it the model holds for this response (its KV kept across pauses)."""

    def __init__(
        self, engine: Services, request: CreateRequest, resolved: Resolved, conversation_id: str, *, hold_kv: bool
    ) -> None:
        self.engine = engine
        self.request = request
        self.resolved = resolved
        self.conversation_id = conversation_id
        self.hold_kv = hold_kv
        self.held_tokens = 0  # first segment: whatever the model's prefix cache still has
        self.header = generation_header(engine.tokenizer)
        self.prompt_tokens = self.count()
        self.outputs_in_context = 0
        options = applied_prompt_cache_options(request.params)
        self.cache_mode: Literal["implicit", "explicit"] = "implicit"
        self.cache_ttl_s = TTL_S["30m"]
        if not isinstance(options, UnsetType):
            self.cache_mode = "explicit" if options.mode == "explicit" else "implicit"
            self.cache_ttl_s = TTL_S[options.ttl]

    def count(self) -> int:
        return len(self.resolved.preamble.tokens) + self.resolved.context.n_tokens + len(self.header)

    @property
    def resident_tokens(self) -> int:
        return self.count() - len(self.header)

    async def add_outputs(self, output: Sequence[OutputItem], report: StageReport) -> None:
        """Interleave the response's output items not yet in the context (a pause's segment)."""
        items = [item_from_output(o) for o in output[self.outputs_in_context :]]
        self.outputs_in_context = len(output)
        self.resolved.context.extend(items, await self.engine.render(items, report))

    async def add_input(self, items: Sequence[Item], report: StageReport) -> None:
        # Everything before the appended items is held KV: only they need prefill.
        self.held_tokens = self.resident_tokens
        self.resolved.context.extend(items, await self.engine.render(items, report))
        self.prompt_tokens = self.count()

    def _output_budget(self) -> int | None:
        """The request's `max_output_tokens`, within the model's output limit and what is left
        of its context window: the model never reads more than the window."""
        engine, budget = self.engine, self.request.params.max_output_tokens
        caps = []
        if engine.output_token_limit is not None:
            caps.append(engine.output_token_limit)
        if engine.context_window is not None:
            caps.append(max(0, engine.context_window - self.prompt_tokens))
        if caps:
            budget = min(caps) if budget is None else min(budget, *caps)
        return budget

    def model_request(self) -> ModelRequest:
        request, context = self.request, self.resolved.context
        return ModelRequest(
            prompt=(self.resolved.preamble.tokens, *context.chunks, self.header),
            prompt_tokens=self.prompt_tokens,
            resident_tokens=self.held_tokens,
            turn_index=context.turn_index,
            conversation_key=context.conversation_key,
            tools=request.tools,
            tool_choice=request.tool_choice,
            parallel_tool_calls=request.params.parallel_tool_calls is not False,
            max_output_tokens=self._output_budget(),
            model=request.model,
            conversation_id=self.conversation_id,
            hold_kv=self.hold_kv,
            cache_mode=self.cache_mode,
            breakpoints=conversation_breakpoints(
                context, len(self.resolved.preamble.tokens), self.engine.tokenizer, self.cache_ttl_s
            ),
        )


async def resolve(
    engine: Services,
    request: CreateRequest,
    arrival: Arrival,
    stages: Stages,
    cached: CacheEntry | None,
    *,
    fork: bool = False,
) -> Resolved:
    """Load the previous turn's state, render what is not rendered yet, classify what
    is not classified yet.

    Lookup order (docs/protocol.md, docs/lanes.md): connection cache, then the store (only
    `store:true` responses are there), else `previous_response_not_found`.

    `fork`: another response already continues from `cached` (a fork onto another lane), so its
    context is copied rather than extended in place.
    """
    if engine.implicit_cache_only is not None:
        options = applied_prompt_cache_options(request.params)
        explicit = not isinstance(options, UnsetType) and options.mode == "explicit"
        refuse_explicit(explicit, request.items, engine.implicit_cache_only)
    report = stages.report
    prev = request.previous_response_id
    hit = (
        prev is not None
        and cached is not None
        and cached.response_id == prev
        and engine.uses(arrival, STAGE_SWITCH[Stage.LOAD_STATE])
    )
    report.connection_cache = "none" if prev is None else ("hit" if hit else "miss")
    safety: ClassifierState | None = None
    safety_chunks = 0
    if hit:
        assert cached is not None
        if fork:  # the context is shared with another lane's continuation: take a copy of its items
            context = Context()
            context.extend(cached.context.items[: cached.n_items], cached.context.chunks[: cached.n_items])
        else:
            context = cached.context.prefix(cached.n_items)
        stages.lap(Stage.LOAD_STATE)
        if not engine.uses(arrival, Optimization.TOKEN_CACHE):
            items = context.items
            context = Context()
            context.extend(items, await engine.render(items, report))
        same_preamble = cached.preamble.key == request.preamble_key
        preamble = cached.preamble if same_preamble else render_preamble(request, engine.tokenizer)
        if same_preamble and cached.safety is not None and engine.uses(arrival, Optimization.INCREMENTAL_SAFETY):
            safety, safety_chunks = cached.safety, min(cached.safety_chunks, len(context.chunks))
    else:
        context = Context()
        if prev is not None:
            items = await engine.load(prev)
            await stages.wait(Stage.LOAD_STATE, engine.profile.stage_s(Stage.LOAD_STATE))
            context.extend(items, await engine.render(items, report))
        else:
            stages.lap(Stage.LOAD_STATE)
        preamble = render_preamble(request, engine.tokenizer)
    new: Sequence[Item] = request.items
    compacts = COMPACTION_TYPE in map(item_type, new)
    if compacts:
        # A compaction item stands for every item before it but user messages (compaction.py).
        new = prune(new, [item.view for item in new])
        kept = [(item, chunk) for item, chunk in zip(context.items, context.chunks, strict=True) if is_kept(item.view)]
        context = Context()
        context.extend([item for item, _ in kept], [chunk for _, chunk in kept])
        safety, safety_chunks = None, 0
    if prev is None and not compacts and engine.contexts is not None:  # nothing loaded: the input is the context
        context = await _fresh(engine, engine.contexts, new, report)
    else:
        check_continuation(context, new)  # new items only, against the context's sets
        context.extend(new, await engine.render(new, report))
    header = len(generation_header(engine.tokenizer))
    compaction = None
    limit = compaction_limit(engine, request)
    prompt = len(preamble.tokens) + context.n_tokens + header
    if (request.compact_now and request.generate) or (limit is not None and prompt > limit):
        stages.lap(Stage.RENDER)
        compaction, context = await compact_context(engine, context, prompt, report)
        safety, safety_chunks = None, 0  # the context is a new one: classified afresh
        stages.lap(Stage.COMPACTION)
    check_context_window(len(preamble.tokens) + context.n_tokens + header, engine.input_token_limit)
    stages.lap(Stage.RENDER)
    await stages.wait(
        Stage.RENDER, engine.profile.stage_s(Stage.RENDER, {Count.TOKENS_RENDERED: report.tokens_rendered})
    )
    if safety is None:
        safety = engine.classifier.update(engine.classifier.begin(), preamble.tokens)
        report.tokens_classified += len(preamble.tokens)
    resolved = Resolved(context, preamble, safety, safety_chunks, compaction)
    await classify(engine, stages, resolved)
    return resolved


async def _fresh(engine: Services, known: KnownContexts, items: Sequence[Item], report: StageReport) -> Context:
    """A context of `items` alone (a request without history to load: `http`), checked and
    rendered as `resolve` does, starting from the context of its longest prefix built before:
    only the items after that prefix are checked (against the prefix's sets) and rendered, the
    prefix's tokens counted as rendered all the same."""
    context = known.known(items) or Context()
    rest = items[len(context.items) :]
    check_continuation(context, rest)
    chunks = await engine.render(rest, report, held=context)  # counts the prefix as rendered too
    context.extend(rest, chunks)
    if REFERENCE_TYPE not in map(item_type, rest):  # the kept prefix has none
        known.keep(context)
    return context


async def diagnose_cache(
    engine: Services, request: CreateRequest, resolved: Resolved, cached: CacheEntry | None, stages: Stages
) -> PromptCacheDiagnostics | UnsetType:
    """`prompt_cache_diagnostics`, when the request names `prompt_cache_options.comparison_response_id`
    (docs/contract.md#prompt-cache-diagnostics). longrun's prefix of a prompt is its preamble
    (instructions, tools), then the context items; the compared response is found in the connection
    cache, else the store (a store read charged to `load_state`). It says what its own caches know:
    a changed model or preamble diverges at the first token; a prompt that continues the compared
    response (it is `previous_response_id`) reuses it whole unless this request compacted it, or is
    `explicit` with no breakpoint (it uses no prompt caching: `unavailable`, no type says more);
    prompts of unrelated contexts: `unavailable`."""
    comparison = comparison_response_id(request.params)
    if comparison is None:
        return UNSET
    compared: Response | None
    if cached is not None and cached.response.id == comparison:
        compared = cached.response
    else:
        # A store read like a continuation's: its real time and its modeled round trip are load_state's.
        try:
            compared = await engine.get_stored(comparison)
        except ProtocolError as err:
            if err.code != "response_not_found":
                raise
            compared = None
        stages.lap(Stage.LOAD_STATE)
        await stages.wait(Stage.LOAD_STATE, engine.profile.stage_s(Stage.LOAD_STATE))
        if compared is None:
            return ComparisonResponseNotFound()
    prompt = len(resolved.preamble.tokens) + resolved.context.n_tokens
    if compared.model != request.model:
        return CacheMiss(reason="model_changed", cache_missed_tokens=prompt, comparison_reusable_tokens=0)
    if [bytes(t) for t in compared.tools] != [bytes(t) for t in request.tools_echo]:
        return CacheMiss(reason="tools_changed", cache_missed_tokens=prompt, comparison_reusable_tokens=0)
    if compared.instructions != request.params.instructions:
        return CacheMiss(reason="input_changed", cache_missed_tokens=prompt, comparison_reusable_tokens=0)
    if request.previous_response_id != comparison:
        return DiagnosticsUnavailable()
    if resolved.compaction is not None:
        kept = len(resolved.preamble.tokens)  # the compacted context replaces every item after it
        return CacheMiss(reason="context_compacted", cache_missed_tokens=prompt - kept, comparison_reusable_tokens=kept)
    options = applied_prompt_cache_options(request.params)
    if not isinstance(options, UnsetType) and options.mode == "explicit" and not has_breakpoints(resolved.context):
        return DiagnosticsUnavailable()  # no breakpoint: the request does not use prompt caching at all
    return CacheHit()


def compaction_limit(engine: Services, request: CreateRequest) -> int | None:
    """The prompt size past which a response compacts (docs/compaction.md): the request's
    `compact_threshold`, or the model's input limit when it gave none; None: never."""
    threshold = request.compact_threshold
    if threshold is None or not request.generate:
        return None
    return threshold or engine.input_token_limit


async def classify(engine: Services, stages: Stages, resolved: Resolved) -> None:
    """Run the classifier over the context chunks it has not read yet."""
    chunks = resolved.context.chunks
    new = chunks[resolved.safety_chunks :]
    resolved.safety, resolved.safety_chunks = engine.classifier.update_all(resolved.safety, new), len(chunks)
    n = sum(map(len, new))
    stages.report.tokens_classified += n
    engine.counts.tokens_classified += n
    stages.lap(Stage.SAFETY)
    await stages.wait(Stage.SAFETY, engine.profile.stage_s(Stage.SAFETY, {Count.TOKENS_CLASSIFIED: n}))


async def add_resumed(
    engine: Services, request: CreateRequest, stages: Stages, turn: Turn, items: Sequence[Item]
) -> Compaction | None:
    """Items that join a running response's context (a resume's, or those injected while the
    model decoded): rendered, compacted past the threshold, checked against the input limit,
    validated and classified. Returns the compaction to announce (or None); raises the
    `context_length_exceeded` `ProtocolError` when the prompt outgrew the input limit, before
    validating or classifying it (the response then fails without sampling)."""
    before = stages.report.tokens_rendered
    await turn.add_input(items, stages.report)
    stages.lap(Stage.RENDER)
    limit = compaction_limit(engine, request)
    compaction = None
    if limit is not None and turn.prompt_tokens > limit:
        compaction = await _compact_resumed(engine, stages, turn)
    check_context_window(turn.prompt_tokens, engine.input_token_limit)
    rendered = stages.report.tokens_rendered - before
    await stages.wait(Stage.RENDER, engine.profile.stage_s(Stage.RENDER, {Count.TOKENS_RENDERED: rendered}))
    await classify(engine, stages, turn.resolved)
    return compaction


async def _compact_resumed(engine: Services, stages: Stages, turn: Turn) -> Compaction:
    """The resumed prompt is past the threshold. The context becomes the compacted one, so
    the KV held for the dropped history no longer stands for the prompt: it is released, and
    the next segment prefills the compacted prompt."""
    resolved = turn.resolved
    compaction, resolved.context = await compact_context(engine, resolved.context, turn.prompt_tokens, stages.report)
    resolved.safety = engine.classifier.update(engine.classifier.begin(), resolved.preamble.tokens)
    resolved.safety_chunks = 0  # the new context is classified afresh
    stages.report.tokens_classified += len(resolved.preamble.tokens)
    engine.model.release(turn.conversation_id)
    turn.held_tokens = 0
    turn.prompt_tokens = turn.count()
    stages.lap(Stage.COMPACTION)
    return compaction
