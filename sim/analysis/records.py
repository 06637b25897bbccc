"""Per-turn records: one JSON line per model turn, the input of calibration (docs/calibration.md).

Every run folder has them (`records.jsonl`, written by sim/harness/trace.py); the same schema can
be written from a capture of any client against any server (docs/calibration.md says how), so a
profile can be fitted to a deployment longrun does not run. Only `mode`, `rollout`, `turn`,
`e2e_s` and `bytes_in` are required; a field a capture cannot know is null, and the fit leaves
out the terms that need it. Pure.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import msgspec

from prototype.pipeline import DESIGNS, Stage
from prototype.wire.schemas import TimingMetrics, WebsocketTiming
from sim.analysis.metrics import per_turn_work
from sim.rollout.result import RolloutResult

__all__ = ["Exchange", "TurnRecord", "Usage", "read_records", "records_from_rollouts"]


class TurnRecord(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One model turn as the client saw it, and, where the server reports them, its stages.

    Times in seconds; `ttft_s` is from the request's first byte sent to the first
    token-carrying delta, `e2e_s` to the turn's terminal (or pause) event. `rollout` names the
    rollout: every mode's copy of one seeded rollout shares it, so a held-out split keeps whole
    rollouts out of the fit. Token counts are the model's: `uncached_tokens` were prefilled,
    the rest of `prompt_tokens` came from a prefix cache or KV held across a pause."""

    source: str = "capture"  # longrun-virtual | longrun-live | capture
    mode: str  # the API path (http, http_prev, ws, append, ...) or a capture's own label
    rollout: str
    turn: int
    e2e_s: float
    bytes_in: int  # request bytes the client sent for the turn
    ttft_s: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    uncached_tokens: int | None = None
    output_tokens: int | None = None
    tokens_rendered: int | None = None  # tokens the API rendered (tokenized) for the turn
    tokens_classified: int | None = None  # tokens the API's safety classifier read for the turn
    tool_s: float | None = None  # the client's time after the turn until its next request
    stages_s: dict[str, float] = {}  # server stage seconds (prototype.pipeline.Stage), where reported


def _count(work: dict[str, float], key: str) -> int | None:
    return int(round(work[key])) if key in work else None


def records_from_rollouts(rollouts: Sequence[RolloutResult], *, source: str) -> list[TurnRecord]:
    """The records of a comparison's rollouts: per turn the client's times and bytes, and the
    server's per-turn work (append-family reports are cumulative per response: differenced)."""
    out: list[TurnRecord] = []
    for r in rollouts:
        for k, (t, work) in enumerate(zip(r.turns, per_turn_work(r), strict=True)):
            prompt = r.prompt_tokens[k] if k < len(r.prompt_tokens) else None
            uncached = _count(work, "tokens_prefilled")
            next_sent = r.turns[k + 1].sent_at if k + 1 < len(r.turns) else None
            out.append(
                TurnRecord(
                    source=source,
                    mode=r.mode,
                    rollout=str(r.index),
                    turn=k,
                    e2e_s=t.e2e_s,
                    bytes_in=t.bytes_sent,
                    ttft_s=t.ttft_s,
                    prompt_tokens=prompt,
                    cached_tokens=None if prompt is None or uncached is None else prompt - uncached,
                    uncached_tokens=uncached,
                    output_tokens=_count(work, "tokens_decoded"),
                    tokens_rendered=_count(work, "tokens_rendered"),
                    tokens_classified=_count(work, "tokens_classified"),
                    tool_s=None if next_sent is None else next_sent - t.done_at,
                    stages_s={key[6:]: v for key, v in work.items() if key.startswith("stage:")},
                )
            )
    return out


class CachedDetails(msgspec.Struct):
    cached_tokens: int = 0


class Usage(msgspec.Struct):
    """A response's `usage`, as the Responses API returns it."""

    input_tokens: int
    output_tokens: int
    input_tokens_details: CachedDetails | None = None


class Exchange(msgspec.Struct, kw_only=True):
    """One line of a proxy log (docs/calibration.md, "Input formats"): a request and its
    response, timed at the client or a proxy. Times are seconds on any one clock; other fields
    a log carries are ignored."""

    conversation: str  # the rollout: every request of one agent conversation
    mode: str  # the API path: http (the whole history), http_prev (previous_response_id), ws
    sent_at: float  # the request's first byte sent
    first_token_at: float | None = None  # the first token-carrying delta (a stream's)
    done_at: float  # the terminal event (or the whole body)
    request_bytes: int
    usage: Usage | None = None  # required but on a failed line
    turn: int | None = None  # the request's index in its conversation; by default the order of the lines
    response_id: str | None = None
    previous_response_id: str | None = None  # where given, it must name an earlier response of the log
    timing_metrics: TimingMetrics | None = None  # a Codex `responsesapi.websocket_timing` frame's
    timing: WebsocketTiming | None = None  # or the whole frame
    failed: str | None = None  # a recorder's request without a usable turn (an error, a fault): skipped
    warmup: bool = False  # the recorder's `generate: false` request: no turn, skipped; later lines may continue it


_decoder = msgspec.json.Decoder(TurnRecord)
_exchange = msgspec.json.Decoder(Exchange)


def _timing_stages(m: TimingMetrics) -> dict[str, float]:
    """A timing frame's split (prototype/ws/timing.py): the engine's TTFT is its queue and prefill,
    the API's view of it adds the inference hop; decode is the engine's total less its TTFT."""
    hop = (m.engine_iapi_ttft_total_ms - m.engine_service_ttft_total_ms) / 1000
    decode = (m.engine_service_total_ms - m.engine_service_ttft_total_ms) / 1000
    if min(hop, decode, m.engine_service_ttft_total_ms) < 0:
        raise ValueError("timing frame: negative hop, engine TTFT or decode time")
    return {
        Stage.INFERENCE_HOP.value: hop,
        Stage.PREFILL.value: m.engine_service_ttft_total_ms / 1000,
        Stage.DECODE.value: decode,
    }


def _from_exchange(e: Exchange, turn: int) -> TurnRecord:
    if e.mode not in DESIGNS:
        raise ValueError(f"mode {e.mode!r}: one of {', '.join(DESIGNS)}")
    first = e.first_token_at if e.first_token_at is not None else None
    if e.done_at < e.sent_at or (first is not None and not e.sent_at <= first <= e.done_at):
        raise ValueError("negative time: want sent_at <= first_token_at <= done_at")
    if e.usage is None:
        raise ValueError("missing usage")
    if e.request_bytes < 0 or e.usage.input_tokens < 0 or e.usage.output_tokens < 0:
        raise ValueError("negative size or token count")
    if e.usage is None:
        raise ValueError("missing usage")
    cached = e.usage.input_tokens_details.cached_tokens if e.usage.input_tokens_details else 0
    metrics = e.timing_metrics or (e.timing.timing_metrics if e.timing else None)
    return TurnRecord(
        source="capture",
        mode=e.mode,
        rollout=e.conversation,
        turn=turn,
        e2e_s=e.done_at - e.sent_at,
        bytes_in=e.request_bytes,
        ttft_s=None if first is None else first - e.sent_at,
        prompt_tokens=e.usage.input_tokens,
        cached_tokens=cached,
        uncached_tokens=e.usage.input_tokens - cached,
        output_tokens=e.usage.output_tokens,
        stages_s=_timing_stages(metrics) if metrics is not None else {},
    )


def _check(r: TurnRecord) -> None:
    if r.turn < 0 or r.e2e_s < 0 or (r.ttft_s is not None and not 0 <= r.ttft_s <= r.e2e_s):
        raise ValueError("negative time or turn: want turn >= 0 and 0 <= ttft_s <= e2e_s")
    if any(v < 0 for v in r.stages_s.values()) or r.bytes_in < 0:
        raise ValueError("negative stage time or size")


def _relabel(
    records: list[TurnRecord],
    lines: dict[tuple[str, str, int], int],
    order: dict[tuple[str, str], int],
    conversation: str,
) -> None:
    """An `http` conversation continued by `previous_response_id` is an `http_prev` one from its
    first turn (which had no response to name): its earlier records take the mode."""
    for r in records:
        if r.source == "capture" and r.mode == "http" and r.rollout == conversation:
            lines[("http_prev", conversation, r.turn)] = lines.pop(("http", conversation, r.turn))
            r.mode = "http_prev"
    if ("http", conversation) in order:
        order[("http_prev", conversation)] = order.pop(("http", conversation))


def read_records(paths: Iterable[str | Path]) -> list[TurnRecord]:
    """Records from JSONL files (longrun's records, or a proxy log with or without timing
    frames: docs/calibration.md), or from run folders (their `records.jsonl`). A bad line is an
    error naming its file and line: a missing field, a negative time, a turn whose conversation
    lacks the turns before it, a `previous_response_id` the log does not have. A line marked
    `failed` (the recorder's: a request that ended without a turn) or `warmup` (its `generate:
    false` request) is skipped; an `http`
    conversation a later line continues by `previous_response_id` is read as `http_prev`."""
    out: list[TurnRecord] = []
    for given in paths:
        path = Path(given)
        if path.is_dir():
            path = path / "records.jsonl"
        lines: dict[tuple[str, str, int], int] = {}  # (mode, rollout, turn) -> line
        order: dict[tuple[str, str], int] = {}
        responses: dict[str, TurnRecord] = {}
        warmed: set[str] = set()  # the response ids of warm-ups: continued, but no turn
        for number, line in enumerate(path.read_bytes().splitlines(), 1):
            if not line.strip():
                continue
            try:
                if b'"sent_at"' in line:
                    e = _exchange.decode(line)
                    if e.failed is not None:
                        continue
                    if e.warmup:
                        warmed.add(e.response_id or "")
                        continue
                    if e.previous_response_id is not None and not (
                        e.previous_response_id in responses or e.previous_response_id in warmed
                    ):
                        raise ValueError(f"previous_response_id {e.previous_response_id!r} is not an earlier response")
                    before = responses.get(e.previous_response_id or "")
                    if before is not None and before.mode == "http" and e.mode == "http_prev":
                        _relabel(out, lines, order, before.rollout)
                    key = (e.mode, e.conversation)
                    turn = e.turn if e.turn is not None else order.get(key, 0)
                    order[key] = turn + 1
                    record = _from_exchange(e, turn)
                    if e.response_id is not None:
                        responses[e.response_id] = record
                else:
                    record = _decoder.decode(line)
                _check(record)
                if record.turn > 0 and (record.mode, record.rollout, record.turn - 1) not in lines:
                    raise ValueError(
                        f"turn {record.turn} of {record.mode} conversation {record.rollout!r} without its "
                        f"turn {record.turn - 1} before it"
                    )
            except (msgspec.DecodeError, ValueError) as exc:  # ValidationError is a DecodeError
                raise ValueError(f"{path}:{number}: {exc}") from None
            lines[(record.mode, record.rollout, record.turn)] = number
            out.append(record)
    return out
