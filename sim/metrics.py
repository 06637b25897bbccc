"""Metric definitions (workloads.md section 6), computed from rollout results. Pure.

Times are the client's, from `TurnResult` (taken on the run's clock):

* TTFT: request sent → first token-carrying delta.
* Tool-result → next first token: a turn after the first starts the moment the
  previous turn's tool result is ready (the harness sends at once; client build
  time is zero here), so it is that turn's TTFT.
* E2E per turn: request sent → terminal event (append: the segment's pause).
* Rollout completion: first request sent → final terminal event, tools included.
* Overhead share: (rollout − model time − tool time) / rollout, where model time
  is Σ(queue + prefill + decode) as the server's stage report measured it; model
  share: model time / rollout.
* Tokens re-rendered per turn: the server's `tokens_rendered` for the turn.
* Connection-cache hit rate: continuations served from the connection cache /
  all continuations (a store hydration is a miss); token hit rate:
  cached_tokens / input_tokens.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import msgspec
import numpy as np

from prototype.client import TurnResult

from .live import RolloutResult

__all__ = ["MODEL_STAGES", "ModeSummary", "per_turn_work", "summarize", "timeline"]

MODEL_STAGES = ("queue", "prefill", "decode")


class ModeSummary(msgspec.Struct, frozen=True, kw_only=True):
    mode: str
    rollouts: int
    turns: int
    completion_p50_s: float
    completion_p90_s: float
    ttft_p50_s: float
    tool_to_token_p50_s: float  # tool result ready → next first token
    overhead_share: float
    model_share: float  # Σ(queue + prefill + decode) / rollout time
    bytes_per_turn: float
    tokens_rendered_per_turn: float
    connection_cache_hit_rate: float  # NaN when no turn continued a previous response
    token_hit_rate: float
    kv_idle_token_s: float
    saved_vs_http: float  # 1 − p50 / http's p50 (NaN without an http run)


def _reports_per_turn(turns: Sequence[TurnResult]) -> list[dict[str, float]]:
    """Per-turn stage seconds and work; append-mode reports are cumulative per response, so differences."""
    rows: list[dict[str, float]] = []
    previous: dict[str, float] = {}
    previous_id = ""
    for t in turns:
        report = t.response.longrun
        if not isinstance(report, msgspec.Struct):
            rows.append({})
            continue
        now = {f"stage:{k}": v for k, v in report.stages_s.items()}
        now["tokens_rendered"] = float(report.tokens_rendered)
        if t.response.id == previous_id:
            rows.append({k: v - previous.get(k, 0.0) for k, v in now.items()})
        else:
            rows.append(now)
        previous, previous_id = now, t.response.id
    return rows


def per_turn_work(result: RolloutResult) -> list[dict[str, float]]:
    return _reports_per_turn(result.turns)


def timeline(result: RolloutResult) -> list[dict[str, float | str | int]]:
    """One rollout as consecutive segments: per turn the server's stages in pipeline order
    (network first), then `client` (the rest of the turn's client-side time: the stream's
    transfer and parsing, E2E − Σ stages), then `tool` until the next request is sent.
    Times in seconds from the rollout's start. Server stages of a turn are laid end to end,
    so overlap between decode and the stream's transfer shows as a shorter `client`."""
    rows: list[dict[str, float | str | int]] = []
    for k, (turn, work) in enumerate(zip(result.turns, per_turn_work(result), strict=True)):
        at = turn.sent_at - result.started_at
        stages = [(key[6:], value) for key, value in work.items() if key.startswith("stage:") and value > 0]
        stages.append(("client", max(0.0, turn.e2e_s - sum(v for _, v in stages))))
        end_of_turn = turn.done_at - result.started_at
        next_sent = result.turns[k + 1].sent_at - result.started_at if k + 1 < len(result.turns) else end_of_turn
        stages.append(("tool", max(0.0, next_sent - end_of_turn)))
        for name, seconds in stages:
            rows.append(
                {
                    "mode": result.mode,
                    "rollout": result.index,
                    "turn": k,
                    "segment": name,
                    "start_s": at,
                    "end_s": at + seconds,
                }
            )
            at += seconds
    return rows


def summarize(results: Sequence[RolloutResult], kv_idle_token_s: dict[str, float] | None = None) -> list[ModeSummary]:
    modes = list(dict.fromkeys(r.mode for r in results))
    http = [r.completion_s for r in results if r.mode == "http"]
    base = float(np.median(http)) if http else math.nan
    out = []
    for mode in modes:
        rs = [r for r in results if r.mode == mode]
        completion = np.array([r.completion_s for r in rs])
        turns = [t for r in rs for t in r.turns]
        work = [w for r in rs for w in per_turn_work(r)]
        ttft = [t.ttft_s for t in turns if t.ttft_s is not None]
        later = [t.ttft_s for r in rs for t in r.turns[1:] if t.ttft_s is not None]
        model_s = sum(w.get(f"stage:{s}", 0.0) for w in work for s in MODEL_STAGES)
        tool_s = sum(r.tool_time_s for r in rs)
        total_s = float(completion.sum())
        caches = [t.response.longrun.connection_cache for t in turns if isinstance(t.response.longrun, msgspec.Struct)]
        continued = [c for c in caches if c != "none"]
        usage = [t.response.usage for t in turns if t.response.usage is not None]
        input_tokens = sum(u.input_tokens for u in usage)
        out.append(
            ModeSummary(
                mode=mode,
                rollouts=len(rs),
                turns=len(turns),
                completion_p50_s=float(np.median(completion)),
                completion_p90_s=float(np.percentile(completion, 90)),
                ttft_p50_s=float(np.median(ttft)) if ttft else math.nan,
                tool_to_token_p50_s=float(np.median(later)) if later else math.nan,
                overhead_share=(total_s - model_s - tool_s) / total_s if total_s > 0 else math.nan,
                model_share=model_s / total_s if total_s > 0 else math.nan,
                bytes_per_turn=float(np.mean([t.bytes_sent for t in turns])),
                tokens_rendered_per_turn=float(np.mean([w.get("tokens_rendered", 0.0) for w in work])),
                connection_cache_hit_rate=(
                    sum(c == "hit" for c in continued) / len(continued) if continued else math.nan
                ),
                token_hit_rate=(
                    sum(u.input_tokens_details.cached_tokens for u in usage) / input_tokens
                    if input_tokens
                    else math.nan
                ),
                kv_idle_token_s=(kv_idle_token_s or {}).get(mode, math.nan),
                saved_vs_http=1 - float(np.median(completion)) / base if http else math.nan,
            )
        )
    return out
