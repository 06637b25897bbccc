"""Metric definitions (docs/experiments.md#metrics), computed from rollout results. Pure.

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
* Interjections (docs/experiments.md#interjections): an interjection's latency runs from the
  user's message (its arrival) to the first token of the model turn that has it in its
  context; per rollout, the mean over its interjections. `tokens_discarded`: decoded tokens
  of items a steer cut off; `successors`: automatic successors started by steers. Summaries
  give the mean over rollouts with its bootstrap interval; pairs the paired difference.
* Time saved vs `http`: rollout i runs in every mode (same seed, same draws), so each
  mode's saving is the mean over rollouts of 1 − tᵢ(mode)/tᵢ(http), paired by rollout
  index; `PairSummary` gives the same for every pair of modes, and the difference in
  seconds.

Intervals (`sim.analysis.stats`, docs/statistics.md): rollout p50/p90 carry the order-statistic
interval, savings and differences the seeded paired bootstrap; `n` is the number of
rollouts (or pairs) an interval rests on. NaN bounds: too few rollouts for that bound.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import msgspec
import numpy as np

from sim.analysis.stats import Estimate, agreement, paired_difference, paired_mean, paired_saving, quantile_interval
from sim.rollout.result import RolloutResult, TurnResult

__all__ = [
    "MODEL_STAGES",
    "CompactionSummary",
    "ModeSummary",
    "PairSummary",
    "headline",
    "interjection_latency",
    "live_agreement",
    "pair_summaries",
    "per_turn_work",
    "summarize",
    "WindowDifference",
    "WindowSummary",
    "compacted",
    "compaction_summary",
    "timeline",
    "turn_intervals",
    "turn_windows",
    "window_differences",
]

MODEL_STAGES = ("queue", "prefill", "decode")


class ModeSummary(msgspec.Struct, frozen=True, kw_only=True):
    mode: str
    rollouts: int
    n: int  # rollouts the intervals rest on (pairs with http for saved_vs_http: saved_vs_http_n)
    turns: int
    completion_p50_s: float
    completion_p50_ci_low: float
    completion_p50_ci_high: float
    completion_p90_s: float
    completion_p90_ci_low: float
    completion_p90_ci_high: float
    ttft_p50_s: float
    tool_to_token_p50_s: float  # tool result ready → next first token
    overhead_share: float
    model_share: float  # Σ(queue + prefill + decode) / rollout time
    bytes_per_turn: float
    tokens_rendered_per_turn: float
    connection_cache_hit_rate: float  # NaN when no turn continued a previous response
    token_hit_rate: float
    kv_idle_token_s: float
    saved_vs_http: float  # mean over rollouts of 1 − tᵢ / tᵢ(http) (NaN without an http run)
    saved_vs_http_ci_low: float
    saved_vs_http_ci_high: float
    saved_vs_http_n: int  # rollouts run in both this mode and http
    # Interjections (NaN, 0 without): per-rollout means, averaged over rollouts, with intervals.
    interjections: int = 0  # delivered, over every rollout of the mode
    interjection_latency_s: float = math.nan
    interjection_latency_ci_low: float = math.nan
    interjection_latency_ci_high: float = math.nan
    tokens_discarded_per_rollout: float = math.nan
    successors_per_rollout: float = math.nan

    def estimate(self, name: str) -> Estimate:
        """A metric with its interval: `completion_p50`, `completion_p90` or `saved_vs_http`."""
        value = getattr(self, name if name == "saved_vs_http" else f"{name}_s")
        n = self.saved_vs_http_n if name == "saved_vs_http" else self.n
        return Estimate(value, getattr(self, f"{name}_ci_low"), getattr(self, f"{name}_ci_high"), n)


class PairSummary(msgspec.Struct, frozen=True, kw_only=True):
    """`other` against `base` over the rollouts both ran (paired by rollout index)."""

    base: str
    other: str
    n: int
    saved: float  # mean of 1 − tᵢ(other)/tᵢ(base)
    saved_ci_low: float
    saved_ci_high: float
    difference_s: float  # mean of tᵢ(other) − tᵢ(base)
    difference_ci_low: float
    difference_ci_high: float
    # Interjections: mean of Lᵢ(other) − Lᵢ(base), Lᵢ a rollout's mean interjection latency (NaN without).
    interjection_latency_difference_s: float = math.nan
    interjection_latency_difference_ci_low: float = math.nan
    interjection_latency_difference_ci_high: float = math.nan


def interjection_latency(result: RolloutResult) -> float | None:
    """The rollout's mean interjection latency (None: it had none delivered)."""
    latencies = [r.latency_s for r in result.interjections if r.latency_s is not None]
    return sum(latencies) / len(latencies) if latencies else None


def _paired_latencies(results: Sequence[RolloutResult], base: str, other: str) -> tuple[list[float], list[float]]:
    a = {r.index: interjection_latency(r) for r in results if r.mode == base}
    b = {r.index: interjection_latency(r) for r in results if r.mode == other}
    shared = sorted(i for i in a.keys() & b.keys() if a[i] is not None and b[i] is not None)
    return [a[i] for i in shared], [b[i] for i in shared]  # type: ignore[misc]


def _paired_times(results: Sequence[RolloutResult], base: str, other: str) -> tuple[list[float], list[float]]:
    a = {r.index: r.completion_s for r in results if r.mode == base}
    b = {r.index: r.completion_s for r in results if r.mode == other}
    shared = sorted(a.keys() & b.keys())
    return [a[i] for i in shared], [b[i] for i in shared]


def pair_summaries(results: Sequence[RolloutResult], *, seed: int = 0) -> list[PairSummary]:
    """Every pair of modes, in run order (`base` first)."""
    modes = list(dict.fromkeys(r.mode for r in results))
    out = []
    for i, base in enumerate(modes):
        for other in modes[i + 1 :]:
            a, b = _paired_times(results, base, other)
            saved = paired_saving(a, b, seed=seed)
            diff = paired_difference(a, b, seed=seed)
            latency = paired_difference(*_paired_latencies(results, base, other), seed=seed)
            out.append(
                PairSummary(
                    base=base,
                    other=other,
                    n=saved.n,
                    saved=saved.value,
                    saved_ci_low=saved.ci_low,
                    saved_ci_high=saved.ci_high,
                    difference_s=diff.value,
                    difference_ci_low=diff.ci_low,
                    difference_ci_high=diff.ci_high,
                    interjection_latency_difference_s=latency.value,
                    interjection_latency_difference_ci_low=latency.ci_low,
                    interjection_latency_difference_ci_high=latency.ci_high,
                )
            )
    return out


def headline(summary: Sequence[ModeSummary]) -> list[tuple[str, Estimate]]:
    """The figures a comparison is about: each mode's time saved vs `http` (not http's own)."""
    return [(s.mode, s.estimate("saved_vs_http")) for s in summary if s.mode != "http" and s.saved_vs_http_n > 0]


def live_agreement(reference: Sequence[RolloutResult], live: Sequence[RolloutResult], *, seed: int = 0) -> Estimate:
    """How much longer (a fraction; negative: shorter) the `live` rollouts took than the same
    (mode, rollout index) in `reference` (a virtual run of the same config), with its interval
    (`sim.analysis.stats.agreement`); n is the number of (mode, rollout) pairs."""
    ref = {(r.mode, r.index): r.completion_s for r in reference}
    pairs = [(ref[(r.mode, r.index)], r.completion_s) for r in live if (r.mode, r.index) in ref]
    return agreement([a for a, _ in pairs], [b for _, b in pairs], seed=seed)


def turn_intervals(results: Sequence[RolloutResult], *, seed: int = 0) -> dict[tuple[str, int], Estimate]:
    """Per (mode, turn index): the mean E2E time of that turn over the rollouts that reached it."""
    samples: dict[tuple[str, int], list[float]] = {}
    for r in results:
        for k, t in enumerate(r.turns):
            samples.setdefault((r.mode, k), []).append(t.e2e_s)
    return {key: paired_mean(v, seed=seed) for key, v in samples.items()}


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
        now["tokens_classified"] = float(report.tokens_classified)
        now["tokens_prefilled"] = float(report.tokens_prefilled)
        now["tokens_decoded"] = float(report.tokens_decoded)
        if t.response.id == previous_id:
            rows.append({k: v - previous.get(k, 0.0) for k, v in now.items()})
        else:
            rows.append(now)
        previous, previous_id = now, t.response.id
    for row, t in zip(rows, turns, strict=True):
        for parent in t.steered:  # `steer` mode: a response a steer ended reports its work once, here
            report = parent.longrun
            if isinstance(report, msgspec.Struct):
                for k, v in report.stages_s.items():
                    row[f"stage:{k}"] = row.get(f"stage:{k}", 0.0) + v
                for key in ("tokens_rendered", "tokens_classified", "tokens_prefilled", "tokens_decoded"):
                    row[key] = row.get(key, 0.0) + getattr(report, key)
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


def summarize(
    results: Sequence[RolloutResult], kv_idle_token_s: dict[str, float] | None = None, *, seed: int = 0
) -> list[ModeSummary]:
    """Per mode, in run order; `seed` seeds the bootstrap (the config's seed: same run, same intervals)."""
    modes = list(dict.fromkeys(r.mode for r in results))
    has_http = any(r.mode == "http" for r in results)
    out = []
    for mode in modes:
        rs = [r for r in results if r.mode == mode]
        completion = np.array([r.completion_s for r in rs])
        p50 = quantile_interval(completion, 0.5)
        p90 = quantile_interval(completion, 0.9)
        saved = paired_saving(*_paired_times(results, "http", mode), seed=seed) if has_http else None
        turns = [t for r in rs for t in r.turns]
        work = [w for r in rs for w in per_turn_work(r)]
        ttft = [v for t in turns if (v := t.ttft_s) is not None]
        later = [v for r in rs for t in r.turns[1:] if (v := t.ttft_s) is not None]
        model_s = sum(w.get(f"stage:{s}", 0.0) for w in work for s in MODEL_STAGES)
        tool_s = sum(r.tool_time_s for r in rs)
        total_s = float(completion.sum())
        caches = [t.response.longrun.connection_cache for t in turns if isinstance(t.response.longrun, msgspec.Struct)]
        continued = [c for c in caches if c != "none"]
        usage = [r.usage for t in turns for r in (*t.steered, t.response) if r.usage is not None]
        input_tokens = sum(u.input_tokens for u in usage)
        interjected = [r for r in rs if r.interjections]
        latency = paired_mean([v for r in interjected if (v := interjection_latency(r)) is not None], seed=seed)
        out.append(
            ModeSummary(
                mode=mode,
                rollouts=len(rs),
                n=len(rs),
                turns=len(turns),
                completion_p50_s=p50.value,
                completion_p50_ci_low=p50.ci_low,
                completion_p50_ci_high=p50.ci_high,
                completion_p90_s=p90.value,
                completion_p90_ci_low=p90.ci_low,
                completion_p90_ci_high=p90.ci_high,
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
                saved_vs_http=saved.value if saved else math.nan,
                saved_vs_http_ci_low=saved.ci_low if saved else math.nan,
                saved_vs_http_ci_high=saved.ci_high if saved else math.nan,
                saved_vs_http_n=saved.n if saved else 0,
                interjections=sum(r.latency_s is not None for x in rs for r in x.interjections),
                interjection_latency_s=latency.value,
                interjection_latency_ci_low=latency.ci_low,
                interjection_latency_ci_high=latency.ci_high,
                tokens_discarded_per_rollout=(
                    float(np.mean([r.tokens_discarded for r in interjected])) if interjected else math.nan
                ),
                successors_per_rollout=float(np.mean([r.successors for r in interjected])) if interjected else math.nan,
            )
        )
    return out


# -- long rollouts: turn windows and compaction (docs/compaction.md) -------------------------------------------------


class WindowSummary(msgspec.Struct, frozen=True, kw_only=True):
    """A mode's turns `first_turn` … `last_turn` (1-based, inclusive). Each rollout gives the mean
    over its turns in the window; the figures are the mean of those over the `n` rollouts that
    reached the window, with the paired-mean interval (`sim.analysis.stats.paired_mean`)."""

    mode: str
    first_turn: int
    last_turn: int
    n: int
    e2e_s: float  # per turn: request sent → the turn's end (what the turn costs the rollout, tools aside)
    e2e_ci_low: float
    e2e_ci_high: float
    prompt_tokens: float  # per turn: the prompt the model read (`RolloutResult.prompt_tokens`)
    prompt_ci_low: float
    prompt_ci_high: float
    compactions: float  # per rollout, in this window
    compactions_ci_low: float
    compactions_ci_high: float


class WindowDifference(msgspec.Struct, frozen=True, kw_only=True):
    """Per-turn E2E of `other` less `base` in one window, paired by rollout (same seeded rollouts)."""

    mode: str
    first_turn: int
    last_turn: int
    n: int
    difference_s: float
    difference_ci_low: float
    difference_ci_high: float


class CompactionSummary(msgspec.Struct, frozen=True, kw_only=True):
    """What compaction did in one mode, per rollout, with intervals over the `n` rollouts."""

    mode: str
    n: int
    compactions: float  # per rollout
    compactions_ci_low: float
    compactions_ci_high: float
    first_turn: float  # the turn (1-based) of a rollout's first compaction (rollouts that compacted)
    first_turn_ci_low: float
    first_turn_ci_high: float
    seconds_per_compaction: float  # the `compaction` stage per compaction (rollouts that compacted)
    seconds_ci_low: float
    seconds_ci_high: float
    prompt_after_tokens: float  # the prompt the model read on a compacting turn (the kept context)
    prompt_after_ci_low: float
    prompt_after_ci_high: float
    kv_idle_token_s_per_rollout: float  # the mode's server counter over its rollouts / rollouts (no interval)


def compacted(turn: TurnResult) -> bool:
    """Whether the turn's output has a compaction item (the server compacted its context)."""
    return any(item.get("type") == "compaction" for item in turn.output_items)


def _windows(turns: int, window_turns: int) -> list[tuple[int, int]]:
    """0-based [start, end) windows of `window_turns` turns over `turns` turns; a remainder
    shorter than a window joins the last one (201 turns by 50: 1–50, …, 151–201)."""
    count = max(1, turns // window_turns)
    bounds = [(w * window_turns, (w + 1) * window_turns) for w in range(count)]
    bounds[-1] = (bounds[-1][0], max(turns, bounds[-1][1]))
    return bounds


def _window_values(
    results: Sequence[RolloutResult], window_turns: int
) -> dict[tuple[str, int, int], dict[int, tuple[float, float, float]]]:
    """Per (mode, start, end) window, per rollout index: (mean E2E, mean prompt, compactions)."""
    longest = max((len(r.turns) for r in results), default=0)
    out: dict[tuple[str, int, int], dict[int, tuple[float, float, float]]] = {}
    for r in results:
        for start, end in _windows(longest, window_turns):
            turns = r.turns[start:end]
            if not turns:
                continue
            prompts = r.prompt_tokens[start:end]
            out.setdefault((r.mode, start, end), {})[r.index] = (
                math.fsum(t.e2e_s for t in turns) / len(turns),
                math.fsum(prompts) / len(prompts) if prompts else math.nan,
                float(sum(compacted(t) for t in turns)),
            )
    return out


def turn_windows(results: Sequence[RolloutResult], window_turns: int, *, seed: int = 0) -> list[WindowSummary]:
    """Each mode's rollouts in windows of `window_turns` turns, in run order, then window order."""
    rows = []
    for (mode, start, end), by_rollout in _window_values(results, window_turns).items():
        values = list(by_rollout.values())
        e2e = paired_mean([v[0] for v in values], seed=seed)
        prompt = paired_mean([v[1] for v in values], seed=seed)
        count = paired_mean([v[2] for v in values], seed=seed)
        rows.append(
            WindowSummary(
                mode=mode,
                first_turn=start + 1,
                last_turn=start + max(len(r.turns[start:end]) for r in results if r.mode == mode),
                n=e2e.n,
                e2e_s=e2e.value,
                e2e_ci_low=e2e.ci_low,
                e2e_ci_high=e2e.ci_high,
                prompt_tokens=prompt.value,
                prompt_ci_low=prompt.ci_low,
                prompt_ci_high=prompt.ci_high,
                compactions=count.value,
                compactions_ci_low=count.ci_low,
                compactions_ci_high=count.ci_high,
            )
        )
    return rows


def window_differences(
    base: Sequence[RolloutResult], other: Sequence[RolloutResult], window_turns: int, *, seed: int = 0
) -> list[WindowDifference]:
    """Per mode and window, the per-turn E2E of `other` less `base` over the rollouts both ran
    (e.g. the same config with and without compaction)."""
    a, b = _window_values(base, window_turns), _window_values(other, window_turns)
    rows = []
    for key, by_rollout in b.items():
        shared = sorted(by_rollout.keys() & a.get(key, {}).keys())
        diff = paired_difference([a[key][i][0] for i in shared], [by_rollout[i][0] for i in shared], seed=seed)
        mode, start, end = key
        last = start + max((len(r.turns[start:end]) for r in other if r.mode == mode), default=0)
        rows.append(
            WindowDifference(
                mode=mode,
                first_turn=start + 1,
                last_turn=last,
                n=diff.n,
                difference_s=diff.value,
                difference_ci_low=diff.ci_low,
                difference_ci_high=diff.ci_high,
            )
        )
    return rows


def compaction_summary(
    results: Sequence[RolloutResult], summary: Sequence[ModeSummary], *, seed: int = 0
) -> list[CompactionSummary]:
    """Per mode (run order): compactions per rollout, the `compaction` stage's seconds per
    compaction (the stage reports: append's and inject's are per response, so per rollout),
    the prompt of a compacting turn, and the mode's held-KV idle token·s per rollout."""
    idle = {s.mode: s.kv_idle_token_s / s.rollouts if s.rollouts else math.nan for s in summary}
    out = []
    for mode in dict.fromkeys(r.mode for r in results):
        rs = [r for r in results if r.mode == mode]
        counts = [float(sum(compacted(t) for t in r.turns)) for r in rs]
        seconds = [
            math.fsum(w.get("stage:compaction", 0.0) for w in per_turn_work(r)) / c
            for r, c in zip(rs, counts, strict=True)
            if c
        ]
        after = [
            float(np.mean([p for t, p in zip(r.turns, r.prompt_tokens, strict=False) if compacted(t)]))
            for r, c in zip(rs, counts, strict=True)
            if c and r.prompt_tokens
        ]
        first = [
            float(next(k for k, t in enumerate(r.turns) if compacted(t)) + 1)
            for r, c in zip(rs, counts, strict=True)
            if c
        ]
        count, per, kept, start = (paired_mean(v, seed=seed) for v in (counts, seconds, after, first))
        out.append(
            CompactionSummary(
                mode=mode,
                n=len(rs),
                compactions=count.value,
                compactions_ci_low=count.ci_low,
                compactions_ci_high=count.ci_high,
                first_turn=start.value,
                first_turn_ci_low=start.ci_low,
                first_turn_ci_high=start.ci_high,
                seconds_per_compaction=per.value,
                seconds_ci_low=per.ci_low,
                seconds_ci_high=per.ci_high,
                prompt_after_tokens=kept.value,
                prompt_after_ci_low=kept.ci_low,
                prompt_after_ci_high=kept.ci_high,
                kv_idle_token_s_per_rollout=idle.get(mode, math.nan),
            )
        )
    return out
