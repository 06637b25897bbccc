"""One long tool loop, turn by turn, with or without server-side compaction (docs/compaction.md).

`run_long_rollout(config)` runs a single rollout of `config.turns` tool calls against the
in-process server on a virtual clock and returns what each turn cost the server: its
`server_s` (the stage report's measured time), its prompt (`usage.input_tokens`), the
prompt tokens the model's prefix cache or held KV covered, and whether the turn compacted.
With `compact_threshold` the creates carry `context_management` and the server compacts
whenever a prompt grows past it; without, the prompt grows with every turn. The seeded
tool outputs are the same in both, and so are the model's outputs (the compaction item
carries the model's turn count), so the two rollouts differ only in the context.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

import numpy as np

from prototype.app import ServerConfig, make_engine
from prototype.client import Mode, tool_outputs
from prototype.clock import Clock
from prototype.model import ModelEvent, ModelRequest, Prefilled
from prototype.pipeline import CostProfile, StageReport, load_profile
from prototype.store import MemoryStore

from .accelerator import SimulatedModel
from .inprocess import InProcessServer
from .live import EXEC_TOOL, instructions, tool_output_text
from .policy import DefaultPolicy
from .virtual import VirtualClock, run_virtual

__all__ = ["LongRolloutConfig", "TurnCost", "long_rollout", "run_long_rollout"]


@dataclass(frozen=True, slots=True)
class LongRolloutConfig:
    mode: Mode = "ws"
    turns: int = 200  # tool calls, each answered by a seeded tool output
    compact_threshold: int | None = None  # None: no `context_management`
    seed: int = 0
    profile: str | CostProfile = "hosted"  # a profile's name or file, or the profile
    tps: float = 1000.0
    prefill_tok_per_s: float = 20_000.0
    model_latency_s: float = 0.05
    system_prompt_tokens: int = 2_000
    tool_output_median_tokens: int = 200
    tool_output_sigma: float = 0.8


@dataclass(frozen=True, slots=True)
class TurnCost:
    turn: int
    server_s: float
    prompt_tokens: int
    cached_tokens: int
    compacted: bool
    compaction_s: float  # the `compaction` stage of this turn
    connection_cache: str  # hit | miss | none (the stage report's)
    outputs: tuple[str, ...]  # the model's items (arguments or text), compaction items left out


class _Recorder:
    """The model as the server sees it, recording each sampled turn's prompt and cache hit
    (an append-mode pause reports neither on the wire)."""

    def __init__(self, model: SimulatedModel) -> None:
        self.model = model
        self.turns: list[tuple[int, int]] = []  # (prompt tokens, cached tokens) per sampled turn

    async def sample(self, request: ModelRequest) -> AsyncGenerator[ModelEvent, None]:
        async with contextlib.aclosing(self.model.sample(request)) as events:
            async for event in events:
                if isinstance(event, Prefilled):
                    self.turns.append((request.prompt_tokens, event.cached_tokens))
                yield event

    def release(self, conversation_id: str) -> None:
        self.model.release(conversation_id)


async def long_rollout(config: LongRolloutConfig, clock: Clock) -> list[TurnCost]:
    model = _Recorder(
        SimulatedModel(
            clock=clock,
            policy=DefaultPolicy(tool_calls=config.turns),
            seed=config.seed,
            decode_tok_per_s=config.tps if config.tps > 0 else math.inf,
            model_latency_s=config.model_latency_s,
            prefill_tok_per_s=config.prefill_tok_per_s if config.prefill_tok_per_s > 0 else math.inf,
        )
    )
    profile = config.profile if isinstance(config.profile, CostProfile) else load_profile(config.profile)
    server_config = ServerConfig(profile=profile)
    engine = make_engine(model=model, store=MemoryStore(), clock=clock, config=server_config, seed=config.seed)
    client = InProcessServer(engine, server_config).client(config.mode, clock)
    rng = np.random.default_rng(np.random.SeedSequence([config.seed, 18]))
    sizes = np.minimum(
        rng.lognormal(np.log(config.tool_output_median_tokens), config.tool_output_sigma, size=config.turns), 10_000
    ).astype(int)
    settings: dict[str, Any] = {
        "model": "sim",
        "instructions": instructions(config.system_prompt_tokens),
        "tools": [EXEC_TOOL],
        "store": config.mode == "http_prev",
    }
    if config.compact_threshold is not None:
        settings["context_management"] = [{"type": "compaction", "compact_threshold": config.compact_threshold}]
    items: list[dict[str, Any]] = [{"type": "message", "role": "user", "content": "Task 0: fix the failing test."}]
    costs = []
    # Append mode's stage report is cumulative over the response's segments: a turn is the difference.
    before = StageReport()
    try:
        for turn in range(config.turns + 1):
            result = await client.turn(items, **settings)
            report = result.response.longrun
            assert isinstance(report, StageReport) and len(model.turns) == turn + 1
            prompt, cached = model.turns[turn]
            compaction_s = report.stages_s.get("compaction", 0.0)
            costs.append(
                TurnCost(
                    turn,
                    report.server_s - before.server_s,
                    prompt,
                    cached,
                    any(item.get("type") == "compaction" for item in result.output_items),
                    compaction_s - before.stages_s.get("compaction", 0.0),
                    report.connection_cache,
                    tuple(_content(item) for item in result.output_items if item.get("type") != "compaction"),
                )
            )
            if config.mode == "append":
                before = report
            if turn == config.turns or not result.call_ids:
                break
            items = tool_outputs(result, tool_output_text(rng, int(sizes[turn])))
    finally:
        await client.close()
    return costs


def _content(item: dict[str, Any]) -> str:
    if item.get("type") == "function_call":
        return f"{item['name']}({item['arguments']})"
    return "".join(part.get("text", "") for part in item.get("content", []))


def run_long_rollout(config: LongRolloutConfig, *, charge_cpu: bool = False) -> list[TurnCost]:
    """`long_rollout` on a virtual clock (CPU free by default: exactly reproducible)."""
    return run_virtual(lambda: long_rollout(config, VirtualClock()), charge_cpu=charge_cpu)
