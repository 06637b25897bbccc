"""The append-vs-create comparison as a value: a `CompareConfig` (with its seed) in, results out.

Covers: one server, every selected mode in turn, the same seeded rollouts in
each (same tasks, tool outputs, tool times, model tokens). Scenario: an agent
loop against the Responses API at a given decode speed, with the API's stage
costs from a cost profile. Live runs use real sockets on loopback and the event
loop's clock; virtual runs use the in-process transport on a `VirtualTimeLoop`,
through the same engine and WebSocket adapter.

Each mode starts from a cold prefix cache: the same prompts run in every mode,
and a cache warmed by the previous mode would favour whichever runs later. On a
real engine the modes are interleaved round by round, and the engine's own speed
is checked across modes and over the run (`CompareResult.drift`, sim/harness/drift.py).

With `ci_width` > 0 the run continues in batches of `rollouts` on the same server (each
mode keeps its own prefix cache across batches, so the rollouts are those of one larger
run) until every time-saved interval is narrower than ± `ci_width` points or
`max_rollouts` is reached; `CompareResult.stopped` says which (docs/statistics.md).

`run_compare` composes three parts: `_World` (the tool steps, the simulated model, the server and a
client per mode), `_Scheduler` (a batch of rollouts in every mode, with each mode's prefix cache,
the concurrency gate and shared lanes) and `_stopping_rule` (whether another batch runs).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Annotated, Any, Final

import aiohttp
import msgspec
from aiohttp import web
from msgspec import Meta, structs

from prototype.clock import Clock
from prototype.config import ServerConfig
from prototype.context.conversation import ToolCache, conversation_key
from prototype.model import ModelEvent, ModelRequest
from prototype.options import replace_leaves
from prototype.pipeline import Optimization, load_profile
from prototype.response.engine import Engine
from prototype.serve.app import ENGINE, ApiRunner, make_app
from prototype.serve.compose import Overrides
from prototype.serve.wallclock import AsyncioClock
from prototype.store.memory import MemoryStore
from prototype.wire.contract import COMPACT_THRESHOLD_MIN
from sim.analysis.metrics import ModeSummary, PairSummary, headline, pair_summaries, summarize
from sim.client.client import ResponsesClient, open_client
from sim.client.loop import run_async_rollout, run_rollout
from sim.client.reconnect import SessionConfig, session_client
from sim.client.tools import ToolRunner, tool_runner
from sim.client.websocket import AsyncDriver, WSClient, share_socket
from sim.engine.backend import check_installed, engine_limits, engine_model
from sim.engine.config import EngineConfig
from sim.engine.model import EngineModel, EngineTurn
from sim.harness.console import progress_bar
from sim.harness.drift import Drift, carry, drift_report, rotation, round_size
from sim.harness.specs import first_rollouts, interjected, more_rollouts
from sim.model.accelerator import SimulatedModel
from sim.model.config import HOSTED_MODEL, ModelConfig, build_model
from sim.model.kv import PrefixCache
from sim.model.policy import Policy
from sim.rollout.result import ALL_MODES, MODES, WS_MODES, ClientError, Mode, RolloutFailure, RolloutResult, error_line
from sim.rollout.spec import RolloutSpec
from sim.rollout.workload import WORKLOADS
from sim.runtime import memo
from sim.runtime.inprocess import InProcessServer, Tap
from sim.runtime.virtual import VirtualClock, load_live_costs, run_virtual

__all__ = [
    "DEFAULT_ROLLOUTS",
    "CompareConfig",
    "CompareResult",
    "check",
    "compare",
    "config_of",
    "run_compare",
]

# Rollouts per mode of the default comparison: its time-saved intervals are within ±2 points
# at this n in virtual time (docs/statistics.md has the measured widths).
DEFAULT_ROLLOUTS: Final = 20


class CompareConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    rollouts: Annotated[int, Meta(ge=1, description="rollouts per mode (with ci_width: per batch)")] = DEFAULT_ROLLOUTS
    ci_width: Annotated[
        float,
        Meta(
            ge=0,
            description="add batches of rollouts until every time-saved interval is narrower than ± this many "
            "points (0 = one batch)",
        ),
    ] = 0.0
    max_rollouts: Annotated[int, Meta(ge=1, description="with ci_width: stop adding batches at this many")] = 256
    tool_calls: Annotated[int, Meta(ge=0, description="tool calls per rollout, then a text answer")] = 20
    tool_time_s: Annotated[float, Meta(ge=0, description="median simulated tool time (Codex-interactive: 0.3)")] = 0.3
    tool_time_sigma: Annotated[float, Meta(ge=0, description="lognormal sigma of tool time")] = 0.8
    tool_output_tokens: Annotated[int, Meta(ge=1, description="median tool output size (lognormal, sigma 1.1)")] = 500
    system_prompt_tokens: Annotated[int, Meta(ge=1, description="initial context: system prompt size")] = 6000
    rtt_s: Annotated[float | None, Meta(description="override the profile's round trip")] = None
    workload: Annotated[
        str,
        Meta(
            description="custom (the fields above) or a workload profile (sim/rollout/workload.py)",
            extra={"choices": ("custom", *WORKLOADS)},  # the registry's names, listed by --help
        ),
    ] = "custom"
    trace: Annotated[
        str | None, Meta(description="replay a recorded trace (JSONL, see sim/rollout/replay.py) instead of a workload")
    ] = None
    concurrency: Annotated[int, Meta(ge=1, description="rollouts of a mode in flight at once")] = 1
    stagger_s: Annotated[
        float,
        Meta(
            ge=0,
            description="rollout i of the rollouts a mode starts together starts i × this many seconds after the "
            "first: the arrival order, an input (0 = all at once, in the order the gate lets them)",
        ),
    ] = 0.0
    cold_rounds: Annotated[
        bool,
        Meta(
            description="each round of a mode's rollouts (those it starts together) starts on a cold prefix cache, "
            "as a real engine's comparison erases its slots at each round (an engine run records true); "
            "off: a mode's cache is kept across its rollouts"
        ),
    ] = False
    lanes: Annotated[
        int,
        Meta(
            ge=0,
            description="WebSocket modes: this many rollouts share one connection, one lane (stream_id) each, "
            "all in flight at once (0 = a connection per rollout)",
        ),
    ] = 0
    real_tools: Annotated[
        bool, Meta(description="live only: a real subprocess per tool step (drawn time, drawn output)")
    ] = False
    tool_command: Annotated[
        str | None, Meta(description="live only: run this shell command per tool step and send back its output")
    ] = None
    compact_threshold: Annotated[
        int,
        Meta(
            ge=0,
            description="every mode's creates carry context_management=[{type: compaction, compact_threshold: "
            "this}]: the server compacts a prompt past this many tokens (0 = no context_management; else >= 1000)",
        ),
    ] = 0
    interjections: Annotated[
        int,
        Meta(
            ge=0,
            description="user messages per rollout at seeded tool-call turns, each arriving mid-turn: steer mode "
            "sends response.steer at once, every other mode holds it for the next turn's input (0 = none)",
        ),
    ] = 0
    interjection_window_s: Annotated[
        float,
        Meta(ge=0, description="an interjection arrives a delay uniform in [0, this) s after its turn's first token"),
    ] = 0.1
    live_costs: Annotated[
        str | None,
        Meta(
            description="virtual time with CPU charged: also charge the live transport's per-operation costs in "
            "this JSON file (`python -m sim fidelity --calibrate` writes it; docs/fidelity.md)"
        ),
    ] = None
    seed: int = 0
    # The server and the model stand-in under test, whole: a virtual run reaches every field the live
    # server has. The comparison's defaults: the hosted cost profile; a model that pays 50 ms before
    # its first token and prefills at 20,000 tokens/s, and whose next turn does not need half of the
    # async tool outputs (longrun's assumption: no public figure).
    server: ServerConfig = ServerConfig(profile="hosted")
    model: ModelConfig = HOSTED_MODEL
    modes: Annotated[
        tuple[str, ...],
        Meta(description=f"comma-separated modes, in run order, from {','.join(ALL_MODES)}"),
    ] = MODES
    # A real engine behind the server instead of the simulator (docs/engine.md): live only; the
    # simulator still plans every turn's tokens, the engine prefills and decodes them.
    engine: EngineConfig = EngineConfig()
    session: SessionConfig = SessionConfig()  # the client's store and its moves across the connection limit

    @classmethod
    def of(cls, **fields: Any) -> CompareConfig:
        """The default comparison with fields set by their leaf names, wherever they are nested
        (`CompareConfig.of(rollouts=5, tps=65.0, profile="local")`): the other defaults stay."""
        return replace_leaves(cls(), **fields)

    def updated(self, **fields: Any) -> CompareConfig:
        """This comparison with fields replaced by their leaf names, wherever they are nested."""
        return replace_leaves(self, **fields)


@dataclass(frozen=True, slots=True)
class CompareResult:
    config: CompareConfig
    virtual: bool
    rollouts: list[RolloutResult]
    summary: list[ModeSummary]
    pairs: list[PairSummary] = field(default_factory=list)
    stopped: str = ""  # with ci_width: why no more batches ran (intervals narrow enough, or the cap)
    engine_turns: list[EngineTurn] = field(default_factory=list)  # a real engine's own per-turn counters
    failed: list[RolloutFailure] = field(default_factory=list)  # rollouts that ended in an error, not in the metrics
    drift: Drift | None = None  # a real engine's speed per mode and over the run (sim/harness/drift.py)


def narrow_enough(summary: list[ModeSummary], width_points: float) -> tuple[bool, float]:
    """Whether every headline interval's half-width is below `width_points` (percentage
    points), and the widest one (NaN where a bound is missing, which never counts as narrow)."""
    widths = [100 * e.half_width for _, e in headline(summary)]
    if not widths:
        return True, math.nan
    widest = math.nan if any(math.isnan(w) for w in widths) else max(widths)
    return (not math.isnan(widest) and widest < width_points), widest


# Where a run folder's config.json may hold server and model fields at its top level (the flat
# layout): `config_of` moves them into `server` and `model`, where a 0 meant the default.
_FLAT_SERVER: Final = ("profile", "disable", "steer_boundary")
_FLAT_MODEL: Final = (
    "tps",
    "model_latency_s",
    "prefill_tok_per_s",
    "kv_capacity_tokens",
    "decode_slots",
    "concurrency_slowdown",
    "async_independent",
)


def config_of(data: dict[str, Any]) -> CompareConfig:
    """A `CompareConfig` from its JSON form, nested or flat (a run folder's config.json)."""
    data = dict(data)
    nested: dict[str, dict[str, Any]] = {"server": dict(data.pop("server", {})), "model": dict(data.pop("model", {}))}
    for part, names in (("server", _FLAT_SERVER), ("model", _FLAT_MODEL)):
        for name in names:
            if name in data:
                value = data.pop(name)
                if not (name in ("kv_capacity_tokens", "decode_slots") and value == 0):
                    nested[part][name] = value
    default = CompareConfig()
    server = msgspec.convert({**msgspec.to_builtins(default.server), **nested["server"]}, ServerConfig)
    model = msgspec.convert({**msgspec.to_builtins(default.model), **nested["model"]}, ModelConfig)
    return msgspec.convert(
        {**data, "server": msgspec.to_builtins(server), "model": msgspec.to_builtins(model)}, CompareConfig
    )


def _server_config(config: CompareConfig) -> ServerConfig:
    """The server under test: `config.server`, its cost profile resolved and `rtt_s` applied. A
    calibration's fit is refused when it leaves open a wait the run's modes pay."""
    spec = config.server.profile
    profile = (
        load_profile(spec, config.modes, compaction=config.compact_threshold > 0) if isinstance(spec, str) else spec
    )
    if config.rtt_s is not None:
        profile = structs.replace(profile, rtt_s=config.rtt_s)
    server = structs.replace(config.server, profile=profile)
    if config.interjections and {"inject", "async"} & set(config.modes):
        # The beta's inject takes tool outputs only; its clients hand a held interjection to the
        # paused response with the outputs, so these runs take the what-if (docs/beta.md).
        server = structs.replace(server, websocket=structs.replace(server.websocket, inject_messages=True))
    return server


def compare(
    config: CompareConfig,
    *,
    virtual: bool = True,
    free_cpu: bool = False,
    progress: bool = False,
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None,
) -> CompareResult:
    """Run `config` to completion: in virtual time (CPU work charged unless `free_cpu`), or live
    on loopback on a fresh event loop from `loop_factory`. Callable where an event loop already
    runs in this thread (a notebook's): the run then goes to a worker thread."""

    def go() -> CompareResult:
        if virtual:
            main = run_compare(
                config, VirtualClock(), virtual=True, progress=progress, memoize=free_cpu, charge_cpu=not free_cpu
            )
            return run_virtual(main, charge_cpu=not free_cpu)
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            return runner.run(run_compare(config, AsyncioClock(), virtual=False, progress=progress))

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return go()
    with ThreadPoolExecutor(max_workers=1) as worker:
        return worker.submit(go).result()


def check(config: CompareConfig, *, virtual: bool) -> None:
    """Raise ValueError, with the choices, for a name the config gets wrong (before anything runs)."""
    for m in config.modes:
        if m not in ALL_MODES:
            raise ValueError(f"unknown mode {m!r}; choose from {', '.join(ALL_MODES)}")
    if "steer" in config.modes and config.interjections and config.compact_threshold:
        # The beta refuses to steer a response that compacts automatically (docs/beta.md).
        raise ValueError(
            "steer mode with interjections cannot use compact_threshold: the beta does not steer "
            "responses with automatic compaction"
        )
    if config.workload != "custom" and config.workload not in WORKLOADS:
        raise ValueError(f"unknown workload {config.workload!r}; choose from custom, {', '.join(WORKLOADS)}")
    if 0 < config.compact_threshold < COMPACT_THRESHOLD_MIN:
        raise ValueError(
            f"compact_threshold {config.compact_threshold} is below the API's minimum of {COMPACT_THRESHOLD_MIN} "
            "(0 = no compaction)"
        )
    _server_config(config)  # a profile file that does not load is refused here
    if config.engine.engine_kind != "none":
        if virtual:
            raise ValueError("a real engine runs in real time only: run it live (--live)")
        check_installed(config.engine)
    tool_runner(real_tools=config.real_tools, tool_command=config.tool_command, virtual=virtual)
    if config.live_costs:
        try:
            load_live_costs(config.live_costs)
        except (OSError, msgspec.DecodeError) as exc:
            raise ValueError(f"live_costs {config.live_costs!r}: {exc}") from None


class _PromptLog:
    """The server's model, recording every turn it samples, by (mode, conversation): the prompt
    the turn's model read, and the prompt tokens it found cached and the tokens it decoded, in
    every mode (an append or inject turn that pauses reports no usage on the wire, and its
    response's usage at the end is the total). The model reports the last two itself, to its
    receipt (sim/model/receipt.py), once the turn's stream ends: its events pass as they are."""

    def __init__(self, model: SimulatedModel) -> None:
        self.model: SimulatedModel | EngineModel = model
        self.mode = ""
        self.prompts: dict[tuple[str, int], list[int]] = {}
        self.outputs: dict[tuple[str, int], list[tuple[int, int]]] = {}

    def sample(self, request: ModelRequest) -> AsyncGenerator[ModelEvent, None]:
        key = (self.mode, request.conversation_key)
        self.prompts.setdefault(key, []).append(request.prompt_tokens)
        return self.model.sample(request, self.outputs.setdefault(key, []).append)

    def release(self, conversation_id: str) -> None:
        self.model.release(conversation_id)

    def take(self, mode: str, spec: RolloutSpec) -> tuple[list[int], list[tuple[int, int]]]:
        key = (mode, conversation_key(spec.task))
        return self.prompts.pop(key, []), self.outputs.pop(key, [])

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)  # the rest of the model's interface, as it is


def _prefix_cache(config: CompareConfig, memoize: bool) -> PrefixCache:
    kind = memo.MemoPrefixCache if memoize else PrefixCache
    return kind(block_tokens=config.model.prefix_block_tokens, capacity_tokens=config.model.kv_capacity_tokens)


async def run_compare(
    config: CompareConfig,
    clock: Clock,
    *,
    virtual: bool,
    progress: bool = False,
    pace_by_turn: bool = False,
    memoize: bool = False,
    charge_cpu: bool = False,
    tap: Tap | None = None,
) -> CompareResult:
    """Run every mode of `config` against one server (see the module docstring). `pace_by_turn`:
    the model waits only for each turn's first and last token (`SimulatedModel`), for summaries
    in virtual time without a wake-up per token. `memoize`: planning, tokenizing, classifying,
    hashing KV blocks, validating and rendering input items and drawing rollout specs look up
    work done before in this process (`sim.runtime.memo`); only for virtual time with CPU free, where
    that work's duration is not measured (same results, less wall time). `charge_cpu` (virtual
    only): the in-process server's run mode (`InProcessServer`), the loop's (`run_virtual`) too.
    `tap` (virtual only) sees every body and frame the in-process transports carry."""
    check(config, virtual=virtual)
    if config.engine.engine_kind != "none":  # one cache, its slots erased at each round (`_Scheduler`)
        config = config.updated(cold_rounds=True)
    if memoize and not virtual:
        raise ValueError("memoize=True is for virtual time with free CPU: a live run measures that work")
    if charge_cpu and not virtual:
        raise ValueError("charge_cpu=True is the in-process server's run mode; a live run's CPU is always real")
    if charge_cpu and memoize:
        raise ValueError("memoize=True is for virtual time with free CPU; charge_cpu=True measures that work")
    if tap is not None and not virtual:
        raise ValueError("tap= sees the in-process transport of a virtual run; a live run uses sockets")
    specs, drawn = first_rollouts(config, memoize=memoize)
    specs = interjected(config, specs)
    world = _World.build(config, clock, drawn, virtual=virtual, pace_by_turn=pace_by_turn, memoize=memoize)
    async with world.serve(config, clock, virtual=virtual, memoize=memoize, charge_cpu=charge_cpu, tap=tap):
        scheduler = _Scheduler(config, world, clock, memoize=memoize)
        stopped = ""
        with progress_bar(progress, total=len(config.modes) * len(specs)) as bar:
            for batch in itertools.count():
                n = scheduler.per_mode + len(specs)
                bar.total = bar.n + len(config.modes) * len(specs)  # each batch adds its rollouts to the bar
                bar.set_postfix_str(f"n={n} per mode")
                await scheduler.run_batch(batch, specs, done=bar.update)
                reason = _stopping_rule(config, scheduler, n)
                if reason is not None:
                    stopped = reason
                    break
                specs = more_rollouts(config, drawn, n, min(config.rollouts, config.max_rollouts - n), memoize=memoize)
                specs = interjected(config, specs)
    for outcomes in (scheduler.results, scheduler.failed):  # interleaved rounds: back in mode order (a stable sort)
        outcomes.sort(key=lambda r: config.modes.index(r.mode))
    summary = summarize(scheduler.results, scheduler.kv_idle, seed=config.seed)
    engine_turns = list(world.real_engine.turns) if world.real_engine is not None else []
    pairs = pair_summaries(scheduler.results, seed=config.seed)
    drift = None
    if world.real_engine is not None:
        drift = drift_report(engine_turns, config.modes)
        if round_size(config.concurrency, config.lanes) <= config.engine.engine_slots:  # no contention
            base = config.modes[0]
            drift = carry(
                drift, engine_turns,
                [(p.other, p.saved, p.saved_ci_low, p.saved_ci_high) for p in pairs if p.base == base],
                base=base, base_total_s=sum(r.completion_s for r in scheduler.results if r.mode == base),
            )  # fmt: skip
    return CompareResult(
        config,
        virtual,
        scheduler.results,
        summary,
        pairs,
        stopped,
        engine_turns,
        scheduler.failed,
        drift,
    )


@dataclass(slots=True)
class _World:
    """What the rollouts run against: the tool steps, the server's simulated model (behind the
    prompt log), its store and config, and once `serve` runs, its engine and a client per mode:
    in process (virtual time) or on a loopback socket (live)."""

    tools: ToolRunner
    model: SimulatedModel
    prompts: _PromptLog
    store: MemoryStore
    server_config: ServerConfig
    engine: Engine | None = None
    client_for: Callable[[Mode], ResponsesClient] | None = None
    real_engine: EngineModel | None = None  # the llama.cpp engine behind the server, when the config asks for one

    @classmethod
    def build(
        cls, config: CompareConfig, clock: Clock, policy: Policy, *, virtual: bool, pace_by_turn: bool, memoize: bool
    ) -> _World:
        tools = tool_runner(real_tools=config.real_tools, tool_command=config.tool_command, virtual=virtual)
        model = build_model(
            config.model,
            clock=clock,
            policy=memo.MemoPolicy(policy) if memoize else policy,
            seed=config.seed,
            pace_by_turn=pace_by_turn,
            tokenizer=memo.memo_tokenizer() if memoize else None,
        )
        return cls(tools, model, _PromptLog(model), MemoryStore(), _server_config(config))

    @contextlib.asynccontextmanager
    async def serve(
        self, config: CompareConfig, clock: Clock, *, virtual: bool, memoize: bool, charge_cpu: bool, tap: Tap | None
    ) -> AsyncIterator[None]:
        """The server up for the block: `engine` and `client_for` set; its threads or socket closed after."""
        if virtual:
            async with self._in_process(config, clock, memoize=memoize, charge_cpu=charge_cpu, tap=tap):
                yield
            return
        async with contextlib.AsyncExitStack() as stack:
            server_config = self.server_config
            if config.engine.engine_kind != "none":
                real = await stack.enter_async_context(engine_model(config.engine, planner=self.model, clock=clock))
                self.prompts.model = self.real_engine = real
                server_config = structs.replace(server_config, model=engine_limits(config.engine))
            app = make_app(model=self.prompts, store=self.store, clock=clock, config=server_config, seed=config.seed)
            self.engine = app[ENGINE]
            runner = ApiRunner(app)
            await runner.setup()
            stack.push_async_callback(runner.cleanup)
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            base_url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1"
            self.client_for = lambda mode: open_client(mode, base_url, clock)
            yield

    @contextlib.asynccontextmanager
    async def _in_process(
        self, config: CompareConfig, clock: Clock, *, memoize: bool, charge_cpu: bool, tap: Tap | None
    ) -> AsyncIterator[None]:
        parts = None
        if memoize:
            items, rendered, contexts = memo.MemoItems(), memo.MemoRendered(), memo.MemoContexts()
            parts = Overrides(memo.memo_tokenizer(), memo.memo_classifier(), items, rendered, contexts)
        # Where CPU is free, HTTP requests also skip validating a tool list identical to the last.
        server = InProcessServer(
            self.server_config,
            model=self.prompts,
            store=self.store,
            clock=clock,
            seed=config.seed,
            charge_cpu=charge_cpu,
            overrides=parts,
            tool_cache=ToolCache() if memoize else None,
            tap=tap,
            live_costs=load_live_costs(config.live_costs) if config.live_costs else None,
        )
        self.engine = server.engine
        self.client_for = lambda mode: server.client(mode, clock)
        try:
            yield
        finally:
            await server.close()


# What ends one rollout and not the comparison: the server's error reply or failed response, a
# transport's error, a timeout. Anything else is a bug and stops the run.
ROLLOUT_ERRORS: Final = (ClientError, aiohttp.ClientError, OSError, TimeoutError)


class _Scheduler:
    """Runs a batch of rollouts in every mode in turn against one world, and keeps the results and
    each mode's KV idle time across batches. Each mode has its own prefix cache, cold at its first
    rollout and kept across batches: the same prompts run in every mode, and a shared cache would
    favour whichever mode runs later. Within a mode, `concurrency` (or `lanes`) rollouts are in
    flight at once; with `lanes`, the rollouts of a WebSocket mode share connections. A real engine
    (`config.engine`) has one cache: its slots are erased as each round's rollouts start in each
    mode, and the modes are interleaved round by round; `cold_rounds` runs the simulator so (a
    prediction of an engine run)."""

    def __init__(self, config: CompareConfig, world: _World, clock: Clock, *, memoize: bool) -> None:
        self.config, self.world, self.clock = config, world, clock
        self.results: list[RolloutResult] = []
        self.failed: list[RolloutFailure] = []
        self.kv_idle = dict.fromkeys(config.modes, 0.0)
        self._memoize = memoize
        self._caches = {mode: _prefix_cache(config, memoize) for mode in config.modes}
        self._gate = asyncio.Semaphore(max(config.concurrency, config.lanes))
        self.rounds = 0  # a real engine's rounds run so far (their mode order rotates)
        self._shared: dict[tuple[Mode, int, int], list[WSClient]] = {}
        self._context_management = (
            [{"type": "compaction", "compact_threshold": config.compact_threshold}]
            if config.compact_threshold
            else None
        )

    @property
    def per_mode(self) -> int:
        """Rollouts run so far in each mode (failed ones included)."""
        return (len(self.results) + len(self.failed)) // max(1, len(self.config.modes))

    async def run_batch(self, batch: int, specs: list[RolloutSpec], *, done: Callable[[], object]) -> None:
        """Every mode's rollouts of `specs`; `done()` after each rollout. The simulator: mode after
        mode (each has its own cache). `cold_rounds` (every real engine's run): in rounds of the
        rollouts in flight at once, every mode per round in an order rotating by round, each on a
        cold cache (sim/harness/drift.py)."""
        indexed = list(enumerate(specs))
        if not self.config.cold_rounds:
            for mode in self.config.modes:
                await self._run_mode(mode, batch, indexed, len(specs), done)
            return
        size = round_size(self.config.concurrency, self.config.lanes)
        for start in range(0, len(specs), size):
            for mode in rotation(self.config.modes, self.rounds):
                await self._run_mode(mode, batch, indexed[start : start + size], len(specs), done)
            self.rounds += 1

    async def _run_mode(
        self, mode: str, batch: int, indexed: list[tuple[int, RolloutSpec]], size: int, done: Callable[[], object]
    ) -> None:
        """The rollouts `indexed` (their index in a batch of `size`) in `mode`, gathered."""
        world = self.world
        assert world.engine is not None, "the world serves while batches run"
        if self.config.cold_rounds:  # the round starts cold: a real engine's slots erased, or a new cache
            if world.real_engine is not None:
                await world.real_engine.reset()
            else:
                self._caches[mode] = _prefix_cache(self.config, self._memoize)
        world.model.prefix_cache = self._caches[mode]
        world.prompts.mode = mode
        if world.real_engine is not None:
            world.real_engine.tag = mode
        idle_before = world.engine.statistics().kv_idle_token_s
        # Started in order, each waits its turn at the gate (FIFO): concurrency 1 is sequential.
        # With a stagger, the p-th rollout of the group first waits until p × stagger_s after the
        # group's start (the arrival order is the config's, not the event loop's).
        first = self.clock.now()
        runs = (
            self._one(mode, batch, i, spec, size, done, start_at=first + p * self.config.stagger_s)  # type: ignore[arg-type]
            for p, (i, spec) in enumerate(indexed)
        )
        for outcome in await asyncio.gather(*runs):
            if isinstance(outcome, RolloutFailure):
                self.failed.append(outcome)
            else:
                self.results.append(outcome)
        self.kv_idle[mode] += world.engine.statistics().kv_idle_token_s - idle_before

    def _client(self, mode: Mode, batch: int, index: int, size: int) -> ResponsesClient:
        """With `lanes`, rollout `index` of a batch of `size` rollouts of a WebSocket mode runs on
        lane index % lanes of the connection its group of `lanes` rollouts shares."""
        lanes, client_for = self.config.lanes, self.world.client_for
        assert client_for is not None, "the world serves while batches run"
        if not lanes or mode not in WS_MODES:
            return client_for(mode)
        key = (mode, batch, index // lanes)
        group = self._shared.get(key)
        if group is None:
            start = key[2] * lanes
            group = self._shared[key] = [client_for(mode) for _ in range(min(lanes, size - start))]  # type: ignore[misc]
            share_socket(group)
        return group[index % lanes]

    async def _one(
        self,
        mode: Mode,
        batch: int,
        index: int,
        spec: RolloutSpec,
        size: int,
        done: Callable[[], object],
        *,
        start_at: float,
    ) -> RolloutResult | RolloutFailure:
        """One rollout, started no earlier than `start_at` (the config's stagger); one that ends
        in an error (the server's, the transport's, the engine's behind the server) is a
        `RolloutFailure` with the error's line, and the others run on."""
        config, clock, tools = self.config, self.clock, self.world.tools
        if start_at > clock.now():
            await clock.sleep_until(start_at)
        async with self._gate:
            lifetime_s = self.world.server_config.websocket.lifetime_s
            client = session_client(self._client(mode, batch, index, size), clock, config.session, lifetime_s)
            result: RolloutResult | RolloutFailure
            try:
                # Without the state cache, `ws` continues from the store, so it must store.
                store = mode == "http_prev" or (mode == "ws" and Optimization.STATE_CACHE in config.server.disable)
                store = store if config.session.store_responses is None else config.session.store_responses
                if isinstance(client, AsyncDriver):
                    result = await run_async_rollout(
                        client, clock, spec, model="sim", tools=tools, context_management=self._context_management
                    )
                else:
                    result = await run_rollout(
                        client,
                        clock,
                        spec,
                        model="sim",
                        tools=tools,
                        store=store,
                        context_management=self._context_management,
                    )
                failed = next((t.response for t in result.turns if t.response.status == "failed"), None)
                if failed is not None:  # a response that failed in its stream (a paused one's resume)
                    error = failed.error
                    line = f"{error.code}: {error.message}" if error is not None else "failed"
                    result = RolloutFailure(mode, spec.index, f"response {failed.status} {line}")
            except ROLLOUT_ERRORS as exc:
                result = RolloutFailure(mode, spec.index, error_line(exc))
            finally:
                await client.close()
        prompts, outputs = self.world.prompts.take(mode, spec)
        if isinstance(result, RolloutResult):
            result.prompt_tokens = prompts
            result.model_tokens = outputs
        done()
        return result


def _stopping_rule(config: CompareConfig, scheduler: _Scheduler, n: int) -> str | None:
    """After a batch that brought each mode to `n` rollouts: None to run another batch, else why
    not ("" with `ci_width` 0, one batch): every time-saved interval narrower than ± `ci_width`
    points, a trace with no more rollouts, or the cap of `max_rollouts`."""
    if config.ci_width <= 0:
        return ""
    ok, widest = narrow_enough(summarize(scheduler.results, scheduler.kv_idle, seed=config.seed), config.ci_width)
    if ok:
        return f"every time-saved interval is narrower than ±{config.ci_width:g} points at n={n}"
    if config.trace is not None:
        return f"a trace has {n} rollouts, no more to add (widest ±{widest:.2f} points)"
    if n >= config.max_rollouts:
        return f"cap of {config.max_rollouts} rollouts reached (widest ±{widest:.2f} points)"
    return None
