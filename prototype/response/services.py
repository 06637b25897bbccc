"""What a response's life is handed by the engine, typed without the engine.

`Arrival` (how a request came in), `Stages` (the stage clock of one response, charging the
engine's `Counts`) and `Services`, the engine's shared services as a protocol: what the run's
preparation (prepare.py) and finish (finish.py) may call. The engine (engine.py) implements
`Services`; those modules import this one, not the engine, so the engine can import them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from ..clock import Clock
from ..config import SteerBoundary
from ..context.conversation import Context, Item, ItemParser
from ..context.safety import SafetyClassifier
from ..context.tokenizer import TokenArray, Tokenizer
from ..ids import IdFactory
from ..model import TokenModel
from ..pipeline import CostProfile, Optimization, Stage, StageReport
from ..wire.schemas import Response
from .metrics import Histogram

__all__ = ["Arrival", "Counts", "KnownContexts", "Services", "Stages"]


@dataclass(frozen=True, slots=True)
class Arrival:
    """How a request reached the engine: when, how big, and over what."""

    at: float  # clock time the request (or append frame) arrived
    body_bytes: int = 0
    transport: Literal["http", "ws"] = "http"
    routed: bool = False  # auth and routing already done on this connection
    # The server keeps the caller's last context (an Agents API session's runner): a continuation
    # is served from it as from a connection cache (`pipeline.CONTEXT_CACHE`), whatever the transport.
    session: bool = False


@dataclass(slots=True)
class Counts:
    """What the engine counts across responses (`EngineStatistics` is their published form)."""

    responses: int = 0
    responses_websocket: int = 0  # of `responses`, those created over a WebSocket
    model_calls: int = 0
    items_rendered: int = 0
    tokens_rendered: int = 0
    tokens_classified: int = 0
    pauses: int = 0
    kv_idle_token_s: float = 0.0
    store_writes: int = 0
    stage_s: dict[str, float] = field(default_factory=dict)
    compactions: int = 0


class Stages:
    """Times one response's stages on the clock into a `StageReport`."""

    def __init__(self, clock: Clock, counts: Counts, arrival_at: float) -> None:
        self.clock = clock
        self.counts = counts
        self.report = StageReport()
        self.segment_start = arrival_at
        self.mark = arrival_at  # end of the last timed stage

    def add(self, stage: Stage, seconds: float) -> None:
        """Charge `seconds` to `stage`: in the response's report and in the engine's counts."""
        stages = self.report.stages_s
        stages[stage] = stages.get(stage, 0.0) + seconds
        totals = self.counts.stage_s
        totals[stage] = totals.get(stage, 0.0) + seconds

    def lap(self, stage: Stage) -> None:
        """Charge the time since the last mark to `stage` (real work just done)."""
        now = self.clock.now()
        self.add(stage, now - self.mark)
        self.mark = now

    async def wait(self, stage: Stage, seconds: float) -> None:
        """A modeled wait: the named stage awaits the clock, then is charged as measured."""
        if seconds > 0:
            await self.clock.sleep_until(self.clock.now() + seconds)
        self.lap(stage)

    def end_segment(self) -> StageReport:
        now = self.clock.now()
        self.report.server_s += now - self.segment_start
        return self.report

    def new_segment(self, arrival_at: float) -> None:
        self.segment_start = arrival_at
        self.mark = arrival_at


class KnownContexts(Protocol):
    """Contexts built before from the same items (`sim.runtime.memo.MemoContexts`, where CPU is
    free): a request that resends a history (`http`) starts from the context of its longest
    known prefix instead of validating and extending every item again. Only fresh contexts are
    kept: extended from empty with items that passed `check_continuation` against it, none of
    them an item reference (which lets an output answer a call the check cannot see: a prefix
    with one would change how the items after it are checked)."""

    def known(self, items: Sequence[Item]) -> Context | None:
        """A copy of the kept context whose items are the longest prefix of `items` (the same
        objects), the caller's to change; None when none is."""
        ...

    def keep(self, context: Context) -> None:
        """Keep a fresh context as it is now (a copy: the caller goes on changing its own)."""
        ...


class Services(Protocol):
    """The engine's shared services and counters, as a response's life uses them."""

    model: TokenModel
    implicit_cache_only: str | None  # the model's cache name when it cannot follow explicit breakpoints
    clock: Clock
    ids: IdFactory
    item_parser: ItemParser
    contexts: KnownContexts | None
    steer_boundary: SteerBoundary
    multi_agent_holds_calls: bool
    tokenizer: Tokenizer
    classifier: SafetyClassifier
    profile: CostProfile
    counts: Counts
    histograms: dict[str, Histogram]
    context_window: int | None
    input_token_limit: int | None
    output_token_limit: int | None

    def uses(self, arrival: Arrival, optimization: Optimization) -> bool: ...

    async def render(
        self, items: Sequence[Item], report: StageReport | None = None, *, held: Context | None = None
    ) -> list[TokenArray]: ...

    async def load(self, response_id: str) -> list[Item]: ...

    async def put_stored(self, response_id: str, data: bytes) -> None: ...

    async def get_stored(self, response_id: str) -> Response: ...
