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

from sim.analysis.metrics import per_turn_work
from sim.harness.live import RolloutResult

__all__ = ["TurnRecord", "read_records", "records_from_rollouts"]


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


_decoder = msgspec.json.Decoder(TurnRecord)


def read_records(paths: Iterable[str | Path]) -> list[TurnRecord]:
    """Records from JSONL files, or from run folders (their `records.jsonl`). A bad line is an
    error naming its file and line."""
    out: list[TurnRecord] = []
    for given in paths:
        path = Path(given)
        if path.is_dir():
            path = path / "records.jsonl"
        for number, line in enumerate(path.read_bytes().splitlines(), 1):
            if not line.strip():
                continue
            try:
                out.append(_decoder.decode(line))
            except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
                raise ValueError(f"{path}:{number}: {exc}") from None
    return out
