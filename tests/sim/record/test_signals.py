"""Long-session signals per conversation (sim/record/signals.py): the chain's growth, reconnects
and what each lost, the longest silence on a socket between a response and the next request."""

from __future__ import annotations

from msgspec import Raw

from sim.record.capture import Line
from sim.record.signals import session_signals


def _line(turn: int, sent: float, done: float, *, connection: int | None, store: bool | None = None) -> Line:
    usage = b'{"input_tokens":%d,"input_tokens_details":{"cached_tokens":%d},"output_tokens":5}' % (
        100 * (turn + 1),
        90 * turn,
    )
    return Line(
        conversation="conv-0",
        mode="ws" if connection else "http",
        turn=turn,
        sent_at=sent,
        done_at=done,
        request_bytes=200 * (turn + 1),
        usage=Raw(usage),
        connection=connection,
        store=store,
    )


def test_a_websocket_conversation_shows_its_growth_reconnects_and_longest_silence() -> None:
    lines = [
        _line(0, 0.0, 1.0, connection=1),
        _line(1, 4.0, 5.0, connection=1),  # 3 s silent on connection 1
        _line(2, 50.0, 51.0, connection=2),  # a reconnect: 45 s, not a silence on one socket
        _line(3, 52.0, 53.0, connection=3, store=False),
        _line(4, 60.0, 61.0, connection=4),
    ]
    [(name, s)] = session_signals(lines).items()
    assert name == "conv-0" and s["turns"] == 5 and s["failed"] == 0 and s["modes"] == ["ws"]
    assert s["input_tokens"] == {"first": 100, "last": 500, "total": 1500}
    assert s["prefilled_tokens"] == {"first": 100, "last": 140, "total": 100 + 110 + 120 + 130 + 140}
    assert s["request_bytes"] == {"first": 200, "last": 1000, "total": 3000}
    assert s["reconnects"] == [
        {"turn": 2, "lost": "connection cache cold"},
        {"turn": 3, "lost": "connection cache cold"},
        {"turn": 4, "lost": "store: false chain ended"},  # turn 3 asked store: false
    ]
    assert s["longest_socket_silence_s"] == 3.0


def test_an_http_conversation_has_no_socket_signals() -> None:
    s = session_signals([_line(0, 0.0, 1.0, connection=None), _line(1, 2.0, 3.0, connection=None)])["conv-0"]
    assert "reconnects" not in s and "longest_socket_silence_s" not in s
    assert s["request_bytes"] == {"first": 200, "last": 400, "total": 600}
