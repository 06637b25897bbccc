"""The benchmark (`python -m sim.bench`): the command lines its targets send their servers, and
that its targets run to the end (at small sizes; the full sizes are `python -m sim.bench`'s job)."""

from __future__ import annotations

import pytest
import uvloop

from prototype.config import ServerConfig
from prototype.options import struct_from_args
from sim.bench import __main__ as bench
from sim.bench import server as bench_server
from sim.harness.client import ClientError


def _server_config(argv: list[str]) -> ServerConfig:
    """The config a bench server started with `argv` serves with."""
    config: ServerConfig = struct_from_args(bench_server.parser().parse_args(argv), ServerConfig)
    return config


def test_the_memory_targets_uncapped_server_keeps_the_default_cache_cap() -> None:
    # The regression: the uncapped run passed `--max-cache-bytes 0`, which the generated option
    # reads as a cap of 0 bytes (nothing cached, the warm-up's second turn not found).
    uncapped = _server_config(bench.memory_server_args(10, None))
    assert uncapped.websocket.max_cache_bytes == ServerConfig().websocket.max_cache_bytes
    assert uncapped.websocket.max_cache_bytes is None or uncapped.websocket.max_cache_bytes > 0


def test_the_memory_targets_capped_server_gets_the_cap() -> None:
    assert _server_config(bench.memory_server_args(10, 12_345)).websocket.max_cache_bytes == 12_345
    assert _server_config(bench.memory_server_args(10, 0)).websocket.max_cache_bytes == 0


def test_only_a_missing_previous_response_is_a_chain_ended_by_the_cap() -> None:
    not_found = {"type": "invalid_request_error", "code": "previous_response_not_found", "message": "x"}
    assert bench.chain_ended_by_cap(ClientError(400, not_found))
    assert not bench.chain_ended_by_cap(ClientError(400, {**not_found, "code": "invalid_value"}))
    assert not bench.chain_ended_by_cap(ClientError(500, "Internal Server Error"))


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("cap", [None, 20_000], ids=["default-cap", "small-cap"])
def test_the_memory_target_runs_to_the_end(cap: int | None, capsys: pytest.CaptureFixture[str]) -> None:
    """A bench server in its own process, a warm-up chain, then one held connection: the row is
    printed. Under a small cap the chain ends early (the row says where) instead of crashing."""
    rows = len(bench.ROWS)
    uvloop.run(bench.memory(1, 8, 500, cap))
    (row,) = bench.ROWS[rows:]
    assert row.target == "6" and row.value == row.value  # not NaN
    if cap is None:
        assert "8-turn cache" in row.figure
    else:
        assert f"max_cache_bytes={cap}" in row.figure
        turn = int(row.figure.split("turn ~")[1].rstrip(")"))
        assert 1 <= turn < 8  # the cap ended the chain before its last turn
    assert row.line() in capsys.readouterr().out
