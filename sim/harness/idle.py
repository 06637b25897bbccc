"""Silent sockets cut by an intermediary's idle timeout, per design, without and with the
server's keepalive (`python -m sim idle`, docs/experiments.md#silent-sockets).

Covers: the same seeded rollouts of a workload with a tool-time tail (`swe-long` by default:
3 % of tool calls from a lognormal of median 30 s, σ 1.5) run in each design in virtual time,
against an in-process server with an intermediary in front (`ServerConfig.idle_timeout_s`,
prototype/serve/wallclock.py's `IdleWatch`), twice: without keepalive, and with the server's
WebSocket pings (`websocket.ping_interval_s`) and SSE comments (`sse_keepalive_s`). A design
that keeps a socket or a stream open and silent while a tool runs (`ws`, `append`, `inject`:
the WebSocket; `agents`: the session's event stream) is cut when a tool call outlasts the
timeout; `http` holds nothing open between requests, and its streams carry deltas.

What the client does when cut is what the real ones do: the measuring client's next send raises
(aiohttp's `ClientConnectionResetError`; openai-python's socket raises websockets'
`ConnectionClosedError`, 1006), an SSE reader gets `ClientPayloadError`, and neither retries:
the rollout ends there, and everything it ran is lost. Per design and setting: the share of
rollouts cut (Wilson 95 % interval), the time lost per rollout (the cut rollouts' time from
their start to the error the client saw, 0 for the others; mean with a percentile-bootstrap interval), the turns a
cut rollout had completed, and the keepalives the server sent per rollout (their cost).

Each (design, setting) runs on a server and model of its own, rollouts one after another (CPU
free, so the figures are exactly reproducible from the seed).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Final, cast

import msgspec
import numpy as np
from msgspec import Meta, structs
from scipy import stats as scipy_stats

from prototype.config import ServerConfig
from prototype.options import add_struct_options, struct_from_args
from prototype.store.memory import MemoryStore
from sim.client.client import ResponsesClient
from sim.client.loop import run_rollout
from sim.harness.console import add_save_options, progress_bar, start_folder
from sim.harness.experiment import ROLLOUT_ERRORS
from sim.model.config import HOSTED_MODEL, ModelConfig, build_model
from sim.model.policy import DefaultPolicy
from sim.rollout.result import ALL_MODES, Mode, TurnResult, error_line
from sim.rollout.spec import RolloutSpec
from sim.rollout.workload import WORKLOADS, draw_rollouts
from sim.runtime.inprocess import InProcessServer
from sim.runtime.virtual import VirtualClock, run_virtual

__all__ = ["IdleConfig", "IdleRollout", "IdleSummary", "idle_main", "idle_options", "idle_table", "run_idle"]

# The designs measured: `http` (a request per turn), the WebSocket designs that run a rollout on one
# socket, and the Agents API's session stream. `http_prev` is `http` for silence, `steer` is `inject`
# without interjections, and `async` reads its socket while tools run (its client overlaps them).
DESIGNS: Final = ("http", "ws", "append", "inject", "agents")
SETTINGS: Final = ("none", "keepalive")
BOOTSTRAP_RESAMPLES: Final = 2000


class IdleConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One run: the same rollouts in every design, without and with the server's keepalive."""

    workload: Annotated[str, Meta(description="a workload profile with a tool-time tail (sim/rollout/workload.py)")] = (
        "swe-long"
    )
    rollouts: Annotated[int, Meta(ge=1, description="rollouts per design and setting")] = 40
    modes: Annotated[tuple[str, ...], Meta(description="comma-separated designs, from " + ",".join(DESIGNS))] = DESIGNS
    idle_timeout_s: Annotated[
        float,
        Meta(gt=0, description="the intermediary closes a connection silent this long (AWS ALB's default: 60 s)"),
    ] = 60.0
    ping_interval_s: Annotated[
        float, Meta(gt=0, description="with keepalive: the server's WebSocket pings (websockets' default: 20 s)")
    ] = 20.0
    sse_keepalive_s: Annotated[
        float, Meta(gt=0, description="with keepalive: SSE comments on a silent stream (the SSE spec suggests 15 s)")
    ] = 15.0
    profile: Annotated[str, Meta(description="API cost profile: local, hosted, or a JSON file")] = "hosted"
    seed: int = 0
    model: ModelConfig = HOSTED_MODEL

    def __post_init__(self) -> None:
        if self.workload not in WORKLOADS:
            raise ValueError(f"workload: one of {', '.join(WORKLOADS)}, got {self.workload!r}")
        for m in self.modes:
            if m not in DESIGNS:
                why = " (see sim/harness/idle.py)" if m in ALL_MODES else ""
                raise ValueError(f"modes: each one of {', '.join(DESIGNS)}, got {m!r}{why}")
        if not self.modes:
            raise ValueError("modes: at least one design")

    def server(self, setting: str) -> ServerConfig:
        """The server under test with the intermediary in front, its keepalives on or off."""
        config = ServerConfig(profile=self.profile, idle_timeout_s=self.idle_timeout_s)
        if setting == "none":
            return config
        ws = structs.replace(config.websocket, ping_interval_s=self.ping_interval_s)
        return structs.replace(config, websocket=ws, sse_keepalive_s=self.sse_keepalive_s)


@dataclass(frozen=True, slots=True)
class IdleRollout:
    """One rollout of one design and setting: its span on the virtual clock, the turns it
    completed, and, if it was cut, the error its client saw."""

    mode: str
    setting: str
    index: int
    start_s: float
    end_s: float
    turns: int
    cut: bool
    error: str  # "" when it finished


@dataclass(frozen=True, slots=True)
class IdleSummary:
    """One design and setting: rollouts cut (share, Wilson 95 % interval), time lost per rollout
    (mean, 95 % bootstrap interval), a cut rollout's completed turns (median), keepalives per rollout,
    and the commonest error a cut client saw."""

    mode: str
    setting: str
    n: int
    failed: int  # rollouts that ended in an error with no cut (not this job's subject)
    cut: int
    cut_share: float
    cut_low: float
    cut_high: float
    lost_s: float
    lost_low: float
    lost_high: float
    turns_before_cut: float
    keepalives_per_rollout: float
    error: str


async def _design(
    config: IdleConfig, mode: Mode, setting: str, specs: Sequence[RolloutSpec], table: dict[int, int], done: Any
) -> tuple[list[IdleRollout], int]:
    """Every rollout of one design and setting on a server of its own; the keepalives it sent."""
    clock = VirtualClock()
    policy = DefaultPolicy(tool_calls=0, per_conversation=dict(table))
    model = build_model(config.model, clock=clock, policy=policy, seed=config.seed)
    server = InProcessServer(config.server(setting), model=model, store=MemoryStore(), clock=clock, seed=config.seed)
    rows: list[IdleRollout] = []
    try:
        for spec in specs:
            client = _Counting(server.client(mode, clock))
            cuts, start, error = len(server.cuts), clock.now(), ""
            try:
                await run_rollout(client, clock, spec, model="sim")
            except ROLLOUT_ERRORS as exc:
                error = error_line(exc)
            finally:
                await client.close()
            # A failure with no cut is reported beside the figures (`failed`), never counted as a cut.
            cut = bool(error) and len(server.cuts) > cuts
            rows.append(IdleRollout(mode, setting, spec.index, start, clock.now(), client.turns, cut, error))
            done()
    finally:
        await server.close()
    return rows, server.keepalives


class _Counting:
    """A client whose completed turns are counted (a cut rollout's `run_rollout` raises, its
    result with it)."""

    def __init__(self, inner: ResponsesClient) -> None:
        self.inner = inner
        self.mode: Mode = inner.mode
        self.turns = 0

    async def turn(self, new_items: list[dict[str, Any]], **settings: Any) -> TurnResult:
        result = await self.inner.turn(new_items, **settings)
        self.turns += 1
        return result

    async def close(self) -> None:
        await self.inner.close()


def run_idle(config: IdleConfig, *, progress: bool = False) -> tuple[list[IdleRollout], list[IdleSummary]]:
    """Every design without and with keepalive, on the same rollouts."""
    specs, table = draw_rollouts(WORKLOADS[config.workload], config.seed, config.rollouts)
    rollouts: list[IdleRollout] = []
    summaries: list[IdleSummary] = []
    with progress_bar(progress, total=len(config.modes) * len(SETTINGS) * len(specs)) as bar:
        for mode in config.modes:
            for setting in SETTINGS:
                rows, keepalives = run_virtual(
                    _design(config, cast(Mode, mode), setting, specs, table, bar.update),
                    charge_cpu=False,
                )
                rollouts += rows
                summaries.append(summarize(rows, keepalives, seed=config.seed))
    return rollouts, summaries


def _mean_interval(x: np.ndarray[Any, np.dtype[np.float64]], seed: int) -> tuple[float, float, float]:
    """The mean and its 95 % percentile-bootstrap interval (most values are 0 and a few large:
    a t interval would reach below 0)."""
    mean = float(x.mean())
    if len(x) < 2:
        return mean, math.nan, math.nan
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, len(x), size=(BOOTSTRAP_RESAMPLES, len(x)))].mean(axis=1)
    low, high = np.quantile(means, [0.025, 0.975])
    return mean, float(low), float(high)


def summarize(rows: Sequence[IdleRollout], keepalives: int, *, seed: int = 0) -> IdleSummary:
    """One design and setting's figures from its rollouts."""
    n = len(rows)
    cut = [r for r in rows if r.cut]
    low, high = scipy_stats.binomtest(len(cut), n).proportion_ci(confidence_level=0.95, method="wilson")
    lost = np.array([r.end_s - r.start_s if r.cut else 0.0 for r in rows])
    mean, lost_low, lost_high = _mean_interval(lost, seed)
    errors = Counter(r.error for r in cut).most_common(1)
    return IdleSummary(
        rows[0].mode,
        rows[0].setting,
        n,
        sum(1 for r in rows if r.error and not r.cut),
        len(cut),
        len(cut) / n,
        float(low),
        float(high),
        mean,
        lost_low,
        lost_high,
        float(np.median([r.turns for r in cut])) if cut else math.nan,
        keepalives / n,
        errors[0][0] if errors else "",
    )


def idle_table(config: IdleConfig, summaries: Sequence[IdleSummary]) -> str:
    """The figures as text, one row per design and setting."""

    def ci(value: float, low: float, high: float, fmt: str) -> str:
        def one(x: float) -> str:
            return "?" if math.isnan(x) else format(x, fmt)

        return f"{one(value)} ({one(low)}–{one(high)})"

    keepalive = f"pings {config.ping_interval_s:g} s, SSE comments {config.sse_keepalive_s:g} s"
    rows = [
        f"idle timeout {config.idle_timeout_s:g} s; workload {config.workload}; n = {config.rollouts} rollouts per "
        f"design and setting; keepalive = {keepalive} (95 % intervals):",
        f"{'design':<8} {'keepalive':<10} {'cut':>7} {'share cut':>22} {'time lost s/rollout':>26} "
        f"{'turns before cut':>17} {'keepalives/rollout':>19}",
    ]
    for s in summaries:
        turns = "-" if math.isnan(s.turns_before_cut) else f"{s.turns_before_cut:g}"
        rows.append(
            f"{s.mode:<8} {s.setting:<10} {f'{s.cut}/{s.n}':>7} "
            f"{ci(100 * s.cut_share, 100 * s.cut_low, 100 * s.cut_high, '.1f') + ' %':>22} "
            f"{ci(s.lost_s, s.lost_low, s.lost_high, '.0f'):>26} {turns:>17} {s.keepalives_per_rollout:>19.1f}"
        )
    failed = [f"{s.mode} ({s.setting}): {s.failed}" for s in summaries if s.failed]
    if failed:
        rows += ["", "rollouts that failed with no cut (in the run folder's rollouts.csv): " + ", ".join(failed)]
    errors = {(s.mode, s.error) for s in summaries if s.error}
    if errors:
        rows += ["", "what a cut client saw (it does not retry: the rollout ends):"]
        rows += [f"{mode:<8} {error}" for mode, error in sorted(errors)]
    return "\n".join(rows)


def idle_options(sub: Any) -> None:
    """`python -m sim idle`'s parser, one option per leaf of `IdleConfig`."""
    p = sub.add_parser(
        "idle",
        help="silent sockets: per design, the share of rollouts an intermediary's idle timeout cuts and the time "
        "lost, without and with the server's keepalive (virtual time, docs/experiments.md#silent-sockets)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_struct_options(p, IdleConfig)
    add_save_options(p, "config.json, summary.csv, rollouts.csv", "idle")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def idle_main(args: argparse.Namespace) -> int:
    # Imported here: the run-folder writer is the one module that writes files.
    from sim.harness.trace import write_json, write_table

    try:
        config = struct_from_args(args, IdleConfig)
    except (msgspec.ValidationError, ValueError) as exc:
        raise SystemExit(f"invalid option: {exc}") from None
    folder = start_folder(args, "idle")
    print(f"longrun idle: {len(config.modes)} designs x {len(SETTINGS)} settings, virtual time (CPU free)", flush=True)
    rollouts, summaries = run_idle(config, progress=not args.quiet)
    print("\n" + idle_table(config, summaries))
    if folder is not None:
        write_json({"config": config}, folder / "config.json")
        write_table([msgspec.to_builtins(s) for s in summaries], folder / "summary.csv")
        write_table([msgspec.to_builtins(r) for r in rollouts], folder / "rollouts.csv")
        print(f"run folder: {folder}", file=sys.stderr)
    return 0
