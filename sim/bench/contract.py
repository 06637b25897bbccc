"""Benchmark row: what the request contract's checks cost a WebSocket continuation turn.

The same rollout (a tool call every turn, `previous_response_id` plus one
`function_call_output`, served from the connection cache) runs against two bench
servers at once, in lockstep: this checkout, and a baseline revision exported with
`git archive` (the code before the checks). The gated figure is the
time of a turn from sending its frame to reading its terminal event on loopback (the
server's work plus a constant of the socket and this client), median over every
continuation turn of every round, this checkout's over the baseline's. The server's own
`longrun.server_s` is reported too, as a mean: it is read on the event loop's clock,
whose ticks (uvloop: a millisecond) are as long as a turn, so only a mean over many
turns starting at random phases resolves it.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Final

import aiohttp

from .process import bench_process

__all__ = ["contract_rows", "contract_rows_report"]

ROOT: Final = Path(__file__).resolve().parents[2]
TOOL: Final = {
    "type": "function",
    "name": "exec_command",
    "description": "Run a shell command and return its output.",
    "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]},
    "strict": False,
}
TERMINAL: Final = ("response.completed", "response.incomplete", "response.failed", "error")


@contextlib.contextmanager
def exported(revision: str) -> Iterator[Path]:
    """The tree of `revision` in a temporary directory."""
    with tempfile.TemporaryDirectory(prefix="longrun-baseline-") as tmp:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", revision], check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
        yield Path(tmp)


def server(tree: Path, n_turns: int, core: int) -> contextlib.AbstractContextManager[int]:
    """A bench server running the code in `tree` (its cwd and PYTHONPATH), pinned to `core`."""
    return bench_process(["--tps", "0", "--policy", "agent", "--tool-calls", str(n_turns + 10)], core=core, tree=tree)


async def _checks_unknown_parameters(port: int) -> bool:
    """Whether the server runs the contract (an unknown parameter is refused over HTTP)."""
    body = {"model": "sim", "input": "hi", "not_a_parameter": 1, "store": False, "max_output_tokens": 16}
    async with aiohttp.ClientSession() as s, s.post(f"http://127.0.0.1:{port}/v1/responses", json=body) as r:
        await r.read()
        return r.status == 400


class _Rollout:
    """One WebSocket rollout, a turn at a time: each turn answers the last call."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse, output: str) -> None:
        self.ws, self.output = ws, output
        self.frame: dict[str, Any] = {
            "type": "response.create",
            "model": "sim",
            "input": [{"role": "user", "content": "Task 0: fix the failing test."}],
            "tools": [TOOL],
            "store": False,
        }

    async def turn(self) -> tuple[float, float]:
        """(seconds from send to terminal event, the server's `longrun.server_s`)."""
        data = json.dumps(self.frame)
        sent = time.perf_counter()
        await self.ws.send_str(data)
        while True:
            raw = (await self.ws.receive(timeout=60)).data
            if any(f'"type":"{t}"' in raw[:40] for t in TERMINAL):
                break
        took = time.perf_counter() - sent
        event = json.loads(raw)
        if event["type"] != "response.completed":
            raise RuntimeError(f"a turn ended with {event}")
        response = event["response"]
        call = response["output"][-1]
        self.frame = {
            "type": "response.create",
            "model": "sim",
            "previous_response_id": response["id"],
            "input": [{"type": "function_call_output", "call_id": call["call_id"], "output": self.output}],
            "tools": [TOOL],
            "store": False,
        }
        return took, float(response["longrun"]["server_s"])


async def _lockstep(trees: dict[str, Path], n_turns: int, rounds: int, core: int) -> dict[str, list[list[float]]]:
    """Per tree: [turn seconds, server seconds] of every continuation turn, the two servers
    running at once on `core` and their rollouts advancing a turn each, in alternating order."""
    output = "ok\n" + "src/module.py:12: assert result == expected\n" * 40  # a ~500-token tool output
    samples: dict[str, list[list[float]]] = {which: [[], []] for which in trees}
    with contextlib.ExitStack() as stack:
        ports = {which: stack.enter_context(server(tree, n_turns * rounds, core)) for which, tree in trees.items()}
        async with aiohttp.ClientSession() as session:
            for _ in range(rounds):
                sockets = {w: await session.ws_connect(f"ws://127.0.0.1:{p}/v1/responses") for w, p in ports.items()}
                rollouts = {w: _Rollout(ws, output) for w, ws in sockets.items()}
                order = list(trees)
                for k in range(n_turns + 1):
                    for which in order if k % 2 == 0 else order[::-1]:
                        took, spent = await rollouts[which].turn()
                        if k > 0:  # the first turn is not a continuation
                            samples[which][0].append(took)
                            samples[which][1].append(spent)
                for ws in sockets.values():
                    await ws.close()
    return samples


def _paired(a: list[float], b: list[float]) -> float:
    """The median of the turn-by-turn ratios: turn k of one rollout over turn k of the other,
    run back to back under the same load."""
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


async def contract_rows(
    baseline: str, n_turns: int, rounds: int, core: int, *, check_baseline: bool = True
) -> dict[str, tuple[float, float, float]]:
    """{figure: (this checkout, the baseline, ratio)}: "turn", the median turn time and the
    median paired ratio; "server", the mean `server_s`; "noise" and "server_noise", the same
    figures of the baseline against a second copy of itself (what the machine's load alone does).
    `check_baseline=False` lets the baseline run the checks too (a smoke run: this code against
    its own last commit, every step run, the ratios noise)."""
    with exported(baseline) as old_tree:
        trees = {"new": ROOT, "old": old_tree}
        for which, tree in trees.items():
            with server(tree, 1, core) as port:
                if await _checks_unknown_parameters(port) != (which == "new" or not check_baseline):
                    raise RuntimeError(f"the {which} server does not run the code it should ({tree})")
        main = await _lockstep(trees, n_turns, rounds, core)
        twin = await _lockstep({"old": old_tree, "again": old_tree}, n_turns, rounds, core)
    (new_turn, new_server), (old_turn, old_server) = main["new"], main["old"]
    return {
        "turn": (statistics.median(new_turn), statistics.median(old_turn), _paired(new_turn, old_turn)),
        "server": (
            statistics.fmean(new_server),
            statistics.fmean(old_server),
            statistics.fmean(new_server) / statistics.fmean(old_server),
        ),
        "server_noise": (
            statistics.fmean(twin["old"][1]),
            statistics.fmean(twin["again"][1]),
            statistics.fmean(twin["old"][1]) / statistics.fmean(twin["again"][1]),
        ),
        "noise": (
            statistics.median(twin["old"][0]),
            statistics.median(twin["again"][0]),
            _paired(twin["old"][0], twin["again"][0]),
        ),
    }


def contract_rows_report(
    report: Callable[[str, str, float, float, float, str, bool | None], None],
    rows: dict[str, tuple[float, float, float]],
    baseline: str,
) -> None:
    """`contract_rows`' figures through `sim.bench`'s `report`."""
    new, old, ratio = rows["turn"]
    report(
        "contract",
        f"ws continuation turn ms, paired vs {baseline}",
        new * 1e3,
        old * 1e3,
        ratio,
        "< 1.05",
        ratio < 1.05,
    )
    new, old, ratio = rows["server"]
    report("contract", f"ws continuation server_s ms (mean) vs {baseline}", new * 1e3, old * 1e3, ratio, "report", None)
    new, old, ratio = rows["server_noise"]
    report("contract", f"{baseline} against itself, server_s (noise)", new * 1e3, old * 1e3, ratio, "report", None)
    new, old, ratio = rows["noise"]
    report("contract", f"{baseline} against itself, paired (noise)", new * 1e3, old * 1e3, ratio, "report", None)
