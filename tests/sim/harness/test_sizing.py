"""The engine's slots sized to the workload's planned largest context, or refused in one line
before the engine starts (sim/harness/sizing.py; docs/engine.md). No engine needed."""

from __future__ import annotations

import pytest

import sim.harness.experiment
from sim.__main__ import main
from sim.engine.backend import ENGINE_MAX_OUTPUT_TOKENS, MODEL_CONTEXT, prompt_limit, slot_kv_bytes
from sim.engine.config import DEFAULT_CTX_PER_SLOT
from sim.engine.process import LlamaServer
from sim.harness.experiment import CompareConfig, compare
from sim.harness.sizing import EngineTooSmall, fit_engine, largest_context, planned_prompts

ENGINE = {"engine_kind": "llamacpp"}
GiB = 2**30


def test_the_plan_is_the_prompts_every_mode_reads() -> None:
    config = CompareConfig.of(rollouts=3, tool_calls=3, system_prompt_tokens=500, tool_output_tokens=300)
    plan = planned_prompts(config)
    assert plan is not None
    result = compare(config.updated(modes=("http", "ws", "append")), virtual=True, free_cpu=True)
    for r in result.rollouts:
        assert r.prompt_tokens == plan[r.index], (r.mode, r.index)
    short = CompareConfig.of(workload="short", rollouts=3)
    ran = compare(short.updated(modes=("http",)), virtual=True, free_cpu=True)
    assert {r.index: r.prompt_tokens for r in ran.rollouts} == planned_prompts(short)
    assert planned_prompts(config.updated(compact_threshold=1000)) is None  # compaction: not planned


def test_the_default_workload_on_default_slots_is_sized_to_fit_in_memory() -> None:
    """The issue's run: the default workload (6,000-token system prompt, 500-token tool outputs)
    does not fit 8,192-token slots; with no size given, the slots grow to take it."""
    config = CompareConfig.of(rollouts=1, tool_calls=2, **ENGINE)
    plan = planned_prompts(config)
    assert plan is not None
    need = largest_context(plan).tokens
    assert need > prompt_limit(DEFAULT_CTX_PER_SLOT)
    sized = fit_engine(config, memory_bytes=8 * GiB).engine
    ctx = sized.engine_ctx_per_slot
    assert ctx is not None and ctx % 256 == 0
    assert prompt_limit(ctx) >= need > prompt_limit(ctx - 256)
    assert ctx - 1 - need >= ENGINE_MAX_OUTPUT_TOKENS  # the API's output room is kept
    # A small workload keeps the default slots.
    small = CompareConfig.of(rollouts=2, tool_calls=2, system_prompt_tokens=600, tool_output_tokens=120, **ENGINE)
    assert fit_engine(small, memory_bytes=8 * GiB).engine.engine_ctx_per_slot == DEFAULT_CTX_PER_SLOT
    # Not llama.cpp: nothing to size.
    assert fit_engine(config.updated(engine_kind="none")) == config.updated(engine_kind="none")


def test_a_given_size_that_does_not_fit_is_refused_in_one_line_with_the_flags_that_fit() -> None:
    config = CompareConfig.of(rollouts=2, tool_calls=3, engine_ctx_per_slot=8192, **ENGINE)
    with pytest.raises(EngineTooSmall) as refused:
        fit_engine(config, memory_bytes=8 * GiB)
    line = str(refused.value)
    assert "\n" not in line
    assert "the workload's largest context is 8,295 tokens (rollout 0, turn 3)" in line
    assert "slots of 8,192 tokens take prompts up to 6,144" in line
    larger = int(line.split("--engine-ctx-per-slot ")[1].split()[0])
    assert f"({slot_kv_bytes(larger) / 2**20:,.0f} MiB of KV a slot)" in line
    fewer = int(line.split("--tool-calls ")[1].split(",")[0])
    assert "smaller --system-prompt-tokens/--tool-output-tokens" in line
    # Each suggestion fits.
    assert fit_engine(config.updated(engine_ctx_per_slot=larger)).engine.engine_ctx_per_slot == larger
    assert fit_engine(config.updated(tool_calls=fewer)).engine.engine_ctx_per_slot == 8192
    with pytest.raises(EngineTooSmall):
        fit_engine(config.updated(tool_calls=fewer + 1))


def test_past_the_models_context_or_the_memory_is_refused() -> None:
    default = CompareConfig.of(rollouts=20, **ENGINE)  # 20 tool calls: a context past Gemma 3 270M's 32,768
    with pytest.raises(EngineTooSmall, match=f"reads at most {MODEL_CONTEXT:,} tokens a slot.*--tool-calls \\d+"):
        fit_engine(default, memory_bytes=64 * GiB)
    config = CompareConfig.of(rollouts=1, tool_calls=2, **ENGINE)
    with pytest.raises(EngineTooSmall, match="more than half the 256 MiB available: run with fewer --engine-slots"):
        fit_engine(config, memory_bytes=256 * 2**20)
    with pytest.raises(EngineTooSmall, match="a smaller workload than swe-long"):
        fit_engine(CompareConfig.of(workload="swe-long", rollouts=4, **ENGINE))


def test_the_cli_refuses_before_the_engine_starts(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`compare --engine llamacpp` on a workload its slots cannot take: one line, and no engine started."""
    monkeypatch.setattr(sim.harness.experiment, "check_installed", lambda config: None)

    def no_start(self: LlamaServer) -> LlamaServer:
        raise AssertionError("the engine was started")

    monkeypatch.setattr(LlamaServer, "start", no_start)
    assert (
        main(
            ["compare", "--engine", "llamacpp", "--rollouts", "1", "--tool-calls", "2", "--engine-ctx-per-slot", "8192"]
        )
        == 2
    )
    message = capsys.readouterr().err
    assert message.startswith("python -m sim compare: the workload's largest context is ") and message.count("\n") == 1
    assert "--engine-ctx-per-slot " in message and "--tool-calls 0" in message
    assert main(["compare", "--engine", "llamacpp"]) == 2  # the default workload: 20 rollouts of 20 tool calls
    assert "Gemma 3 270M reads at most 32,768 tokens a slot" in capsys.readouterr().err
    assert "longrun compare" not in capsys.readouterr().out  # refused before the run's first line
