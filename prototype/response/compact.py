"""Compaction's real work, once: a server-side compaction of a run's context (`compact_context`) and
the `POST /v1/responses/compact` endpoint (`compact`), timed in the same stages (docs/compaction.md)."""

from __future__ import annotations

from msgspec import Raw

from ..context.compaction import COMPACTION_TYPE, Compaction, encode_payload, is_kept, prune, summary_text
from ..context.conversation import (
    Context,
    Item,
    check_continuation,
    generation_header,
    item_from_output,
    message_text,
    split_trigger,
)
from ..ids import IdFactory
from ..pipeline import Count, Stage
from ..wire.contract import check_compact_params, check_context_window
from ..wire.errors import ProtocolError
from ..wire.schemas import (
    CompactedResponse,
    CompactionItem,
    CompactParams,
    InputTokensDetails,
    OutputTokensDetails,
    StageReport,
    Usage,
    encode,
)
from .services import Arrival, Services, Stages

__all__ = ["compact", "compact_context"]


async def compact_context(
    services: Services, context: Context, prompt_tokens: int, report: StageReport
) -> tuple[Compaction, Context]:
    """Real work of one compaction: the summary of the dropped history, the item that
    carries it, rendered; the new context is the user messages, then the item."""
    kept = [(item, chunk) for item, chunk in zip(context.items, context.chunks, strict=True) if is_kept(item.view)]
    dropped = [chunk for item, chunk in zip(context.items, context.chunks, strict=True) if not is_kept(item.view)]
    text, written = summary_text(dropped, services.profile.compaction_ratio, services.tokenizer)
    content = encode_payload(context.turn_index, context.conversation_key, text)
    item = CompactionItem(id=services.ids.new("cmp"), encrypted_content=content)
    as_input = item_from_output(item)
    fresh = Context()
    fresh.extend([i for i, _ in kept], [c for _, c in kept])
    fresh.extend([as_input], await services.render([as_input], report))
    services.counts.compactions += 1
    return Compaction(item, prompt_tokens, written, sum(len(c) for c in dropped)), fresh


async def compact(services: Services, params: CompactParams, arrival: Arrival) -> CompactedResponse:
    """Compact a history (the request's `input`, after the stored `previous_response_id` if
    given) into its user messages and one compaction item (docs/compaction.md). The same
    work as a server-side compaction, timed in the same stages; nothing is stored."""
    stages = Stages(services.clock, services.counts, arrival.at)
    await stages.wait(Stage.NETWORK, services.profile.upload_s(arrival.body_bytes))
    if not params.model:
        raise ProtocolError("Missing required parameter: 'model'.", code="missing_required_parameter", param="model")
    check_compact_params(params)
    # The create's item rules: a `compaction_trigger` only last (it asks for what this endpoint
    # does anyway, so it is dropped), and below, every tool output answers a call and ids are unique.
    items, _ = split_trigger(tuple(services.item_parser(params.input)) if params.input else ())
    prev = params.previous_response_id
    if not items and prev is None:
        raise ProtocolError("Missing required parameter: 'input'.", code="missing_required_parameter", param="input")
    stages.lap(Stage.PARSE)
    history: list[Item] = []
    if prev is not None:
        if not prev.startswith("resp_"):
            raise ProtocolError(
                f"Invalid 'previous_response_id': '{prev}'. Expected an ID that begins with 'resp_'.",
                code="invalid_value",
                param="previous_response_id",
            )
        history = await services.load(prev)
        await stages.wait(Stage.LOAD_STATE, services.profile.stage_s(Stage.LOAD_STATE))
    # What the model reads, as a create continuing `history` with `items` sees it (prepare.py):
    # a compaction item in the new input keeps only the user messages before it.
    new: list[Item] = list(items)
    if any(item.view.type == COMPACTION_TYPE for item in new):
        new = prune(new, [item.view for item in new])
        history = [item for item in history if is_kept(item.view)]
    else:
        history = prune(history, [item.view for item in history])
    context = Context()
    context.extend(history, await services.render(history, stages.report))
    check_continuation(context, new)
    context.extend(new, await services.render(new, stages.report))
    preamble = services.tokenizer.encode(
        f"<|start|>developer<|message|>{params.instructions}<|end|>" if params.instructions else ""
    )
    stages.lap(Stage.RENDER)
    rendered = stages.report.tokens_rendered
    await stages.wait(Stage.RENDER, services.profile.stage_s(Stage.RENDER, {Count.TOKENS_RENDERED: rendered}))
    prompt = len(preamble) + context.n_tokens + len(generation_header(services.tokenizer))
    check_context_window(prompt, services.input_token_limit)
    compaction, compacted = await compact_context(services, context, prompt, stages.report)
    stages.lap(Stage.COMPACTION)
    await stages.wait(Stage.COMPACTION, services.profile.compaction_s(prompt, compaction.summary_tokens))
    output = [Raw(_user_message(item, services.ids)) for item in compacted.items[:-1]]
    output.append(Raw(encode(compaction.item)))
    report = stages.end_segment()
    for stage, seconds in report.stages_s.items():
        services.histograms[stage].observe(seconds)
    return CompactedResponse(
        id=services.ids.new("resp"),
        created_at=int(services.clock.time()),
        output=output,
        usage=Usage(
            input_tokens=prompt,
            input_tokens_details=InputTokensDetails(cached_tokens=0),
            output_tokens=compaction.summary_tokens,
            output_tokens_details=OutputTokensDetails(reasoning_tokens=0),
            total_tokens=prompt + compaction.summary_tokens,
        ),
    )


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
