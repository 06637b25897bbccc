"""The long-session signals a capture shows, per conversation, for the recorder's summary.

Sans-IO, from the capture's lines (sim/record/capture.py):

* the chain's growth: the input tokens each turn sends the model (`usage.input_tokens`, which a
  `previous_response_id` chain re-reads as much as a resent history does), those it had to
  prefill again (less `cached_tokens`), and the request bytes the client re-sent, first and last
  turn and in all;
* reconnects: a WebSocket conversation whose turn runs on another connection than its previous
  turn, and what each lost: a `store: false` chain lives only in the old connection's cache, so
  it ends there (the new connection cannot find the response); otherwise the new connection's
  cache is cold and the response is loaded from the store;
* the longest silence on a socket during a tool call: on one WebSocket connection, the longest
  time from a response's end to the conversation's next request (nothing crosses it meanwhile,
  which is what an intermediary's idle timeout cuts).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from msgspec import Raw

from sim.record.workload import usage_counts

__all__ = ["session_signals"]


class Line(Protocol):
    """The fields of a capture line (sim/record/capture.py's `Line`) the signals read."""

    @property
    def conversation(self) -> str: ...
    @property
    def mode(self) -> str: ...
    @property
    def turn(self) -> int: ...
    @property
    def sent_at(self) -> float: ...
    @property
    def done_at(self) -> float: ...
    @property
    def request_bytes(self) -> int: ...
    @property
    def usage(self) -> Raw | None: ...
    @property
    def failed(self) -> str | None: ...
    @property
    def connection(self) -> int | None: ...
    @property
    def store(self) -> bool | None: ...
    @property
    def warmup(self) -> bool: ...


def session_signals(lines: Sequence[Line]) -> dict[str, dict[str, object]]:
    """Per conversation (module doc), in the order conversations began."""
    by: dict[str, list[Line]] = {}
    for line in lines:
        by.setdefault(line.conversation, []).append(line)
    return {name: _conversation(sorted(turns, key=lambda x: x.sent_at)) for name, turns in by.items()}


def _conversation(lines: list[Line]) -> dict[str, object]:
    done = [x for x in lines if x.failed is None and not x.warmup]
    counts = [usage_counts(x.usage) if x.usage is not None else None for x in done]
    sent = [c[0] for c in counts if c is not None]
    prefilled = [c[0] - c[1] for c in counts if c is not None]
    reconnects: list[dict[str, object]] = []
    silence = 0.0
    for before, after in zip(lines, lines[1:], strict=False):
        if before.connection is None or after.connection is None:
            continue
        if after.connection != before.connection:
            lost = "store: false chain ended" if before.store is False else "connection cache cold"
            reconnects.append({"turn": after.turn, "lost": lost})
        elif before.failed is None and not before.warmup:  # a warm-up is followed by no tool call
            silence = max(silence, after.sent_at - before.done_at)
    out: dict[str, object] = {
        "modes": sorted({x.mode for x in lines}),
        "turns": len(done),
        "failed": sum(1 for x in lines if x.failed is not None),
        "request_bytes": {
            "first": lines[0].request_bytes,
            "last": lines[-1].request_bytes,
            "total": sum(x.request_bytes for x in lines),
        },
    }
    if sent:
        out["input_tokens"] = {"first": sent[0], "last": sent[-1], "total": sum(sent)}
        out["prefilled_tokens"] = {"first": prefilled[0], "last": prefilled[-1], "total": sum(prefilled)}
    if any(x.connection is not None for x in lines):
        out["reconnects"] = reconnects
        out["longest_socket_silence_s"] = round(silence, 6)
    return out
