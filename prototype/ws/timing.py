"""Timing frames: the per-response split Codex CLI asks the WebSocket API for.

Codex CLI sends `x-responsesapi-include-timing-metrics: true` on its WebSocket upgrade and reads
`responsesapi.websocket_timing` frames whose `timing_metrics` hold six millisecond fields
(openai/codex: `codex-rs/otel`, `record_responses_websocket_timing_metrics`); it records each as a
duration and drops missing, negative or non-finite values. longrun fills them from the response's
own stage report (`StageReport`, prototype/pipeline.py's stages), the engine being the model:

* engine service total: queue + prefill + decode;
* engine TTFT, as the engine service sees it: queue + prefill; as the API sees it across the
  inference hop (`iapi`): that plus the hop;
* time between tokens: decode over the tokens after the first (no per-token hop is modeled, so
  the engine's and the API's are equal);
* the API's own duration, excluding the engine and the client's tool time: the server's time for
  the response (arrival to terminal, summed over segments, so pauses for tools are left out) less
  the engine's.

A response that pauses (append mode, the beta) gets a frame at each pause and at its end, each
with its part since the last, so a response's frames add up to its whole. Pure.
"""

from __future__ import annotations

from typing import Final

from ..pipeline import Stage
from ..wire.schemas import (
    ResponseCompleted,
    ResponseDone,
    ResponseFailed,
    ResponseIncomplete,
    ServerEvent,
    StageReport,
    TimingMetrics,
    WebsocketTiming,
)

__all__ = ["TIMING_HEADER", "TimingFrames", "wants_timing"]

TIMING_HEADER: Final = "x-responsesapi-include-timing-metrics"
_ENDS: Final = (ResponseCompleted, ResponseFailed, ResponseIncomplete)
_PAUSES: Final = (ResponseDone,)


def wants_timing(value: str | None) -> bool:
    """Whether an upgrade's header value asks for timing frames."""
    return value is not None and value.strip().lower() in ("true", "1")


def _totals(report: StageReport) -> tuple[float, float, float, float, float, float]:
    s = report.stages_s
    queue, prefill, decode = s.get(Stage.QUEUE, 0.0), s.get(Stage.PREFILL, 0.0), s.get(Stage.DECODE, 0.0)
    return (
        report.server_s,
        queue + prefill + decode,
        queue + prefill,
        s.get(Stage.INFERENCE_HOP, 0.0),
        decode,
        float(report.tokens_decoded),
    )


class TimingFrames:
    """One connection's timing frames: put one before each terminal or pause event."""

    def __init__(self) -> None:
        self._seen: dict[str, tuple[float, ...]] = {}  # response id -> totals at its last frame

    def frame(self, event: ServerEvent) -> WebsocketTiming | None:
        if not isinstance(event, (*_ENDS, *_PAUSES)) or not isinstance(event.response.longrun, StageReport):
            return None
        now = _totals(event.response.longrun)
        rid = event.response.id
        before = self._seen.pop(rid, (0.0,) * len(now))
        if isinstance(event, _PAUSES):
            self._seen[rid] = now
        server, engine, ttft, hop, decode, tokens = (max(0.0, a - b) for a, b in zip(now, before, strict=True))
        tbt_ms = 1000.0 * decode / max(1.0, tokens - 1.0)
        return WebsocketTiming(
            timing_metrics=TimingMetrics(
                responses_duration_excl_engine_and_client_tool_time_ms=1000.0 * max(0.0, server - engine),
                engine_service_total_ms=1000.0 * engine,
                engine_iapi_ttft_total_ms=1000.0 * (ttft + hop),
                engine_service_ttft_total_ms=1000.0 * ttft,
                engine_iapi_tbt_across_engine_calls_ms=tbt_ms,
                engine_service_tbt_across_engine_calls_ms=tbt_ms,
            )
        )

    def around(self, events: list[ServerEvent]) -> list[ServerEvent]:
        """`events` with a timing frame before each terminal or pause event."""
        out: list[ServerEvent] = []
        for ev in events:
            timing = self.frame(ev)
            if timing is not None:
                out.append(timing)
            out.append(ev)
        return out
