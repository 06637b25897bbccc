"""Codex CLI (npm `@openai/codex`, pinned in tests/node/package.json) against the server, unchanged.

`codex exec` runs one task with a custom model provider whose `base_url` is the server: over
HTTP + SSE (`supports_websockets = false`) and over WebSocket mode. The model's turns are a
script (sim/model/policy.py `ScriptPolicy`): first a call of Codex's own shell tool, which Codex
runs itself in the task's folder (it writes a marker file), then a text answer. The test checks
what each side saw: the file Codex's tool wrote, the tool's output sent back as the next turn's
`function_call_output`, Codex's final message, and the transport it used. Codex sends fields the
SDK's types lack (`client_metadata`), so a server that refuses them fails here.

Through the recorder (`python -m sim record`, sim/record/proxy.py) in front of the server, Codex's
run is the one it makes directly (its `--json` thread events, ids aside), and the capture and the
workload have a line per model turn with the usage Codex reported.

The binary is installed by `make node-clients` (tests/node); missing, the test fails under
LONGRUN_REQUIRE_ALL=1 (CI) and skips elsewhere.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import numpy as np
import pytest

from prototype.context.tokenizer import get_tokenizer
from prototype.model import ModelRequest
from prototype.serve.app import ENGINE
from sim.analysis.records import read_records
from sim.model.policy import PlannedItem, ScriptPolicy, parse_script
from tests.recording import check_recording, normalised, recording
from tests.support import NODE_DIR, live_server, run_client

CODEX: Final = NODE_DIR / "node_modules" / ".bin" / "codex"
MARKER: Final = "longrun-tool-ok"
ANSWER: Final = "Done: the marker is written."
TASK: Final = "write the marker file"
CODEX_TIMEOUT_S: Final = 120.0
"""Upper bound on one `codex exec`, so a client that waits for an event that never comes fails."""
SCRIPT: Final = "\n".join(
    json.dumps(turn)
    for turn in (
        {"tool_call": {"name": "exec_command", "arguments": {"cmd": f"echo {MARKER} > marker.txt; cat marker.txt"}}},
        {"text": ANSWER},
    )
)


def _config(port: int, websockets: bool) -> str:
    return f"""model = "gpt-5.1-codex"
model_provider = "longrun"

[model_providers.longrun]
name = "longrun"
base_url = "http://127.0.0.1:{port}/v1"
wire_api = "responses"
env_key = "LONGRUN_API_KEY"
supports_websockets = {str(websockets).lower()}
"""


async def _exec(home: Path, work: Path, *flags: str) -> tuple[int, str, str]:
    env = {
        "PATH": os.environ.get("PATH", ""),
        "HOME": str(home),
        "CODEX_HOME": str(home),
        "LONGRUN_API_KEY": "sk-longrun",
        "NO_COLOR": "1",
    }
    code, out, err = await run_client(
        str(CODEX),
        "exec",
        "--skip-git-repo-check",
        "--dangerously-bypass-approvals-and-sandbox",  # the tool runs in the task's tmp folder
        *flags,
        TASK,
        cwd=work,
        env=env,
        timeout_s=CODEX_TIMEOUT_S,
    )
    return code, out.decode(errors="replace"), err.decode(errors="replace")


@dataclass
class Recording:
    """The script, and what the model saw at each turn: its prompt's text and the tools declared."""

    script: ScriptPolicy
    prompts: list[str] = field(default_factory=list)
    tools: list[tuple[str, ...]] = field(default_factory=list)

    def plan(self, request: ModelRequest, rng: np.random.Generator) -> list[PlannedItem]:
        self.prompts.append(get_tokenizer().decode(np.concatenate(request.prompt)))
        self.tools.append(tuple(t.name for t in request.tools))
        return self.script.plan(request, rng)


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["http", "websocket"])
async def test_codex_exec_runs_a_tool_loop(tmp_path: Path, transport: str) -> None:
    if not CODEX.exists():
        pytest.skip(f"Codex CLI is not installed at {CODEX} (`make node-clients` installs it)")
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    model = Recording(parse_script(SCRIPT))
    async with live_server(policy=model) as live:
        (home / "config.toml").write_text(_config(live.port, transport == "websocket"))
        code, out, err = await _exec(home, work)
        stats = live.app[ENGINE].statistics()
    assert code == 0, f"codex exec failed ({code}):\n{err[-4000:]}"
    # Codex declared its shell tool, ran the call itself in the task's folder, sent the output
    # back as the next turn's input, and printed the model's final answer.
    assert "exec_command" in model.tools[0], model.tools[0]
    assert (work / "marker.txt").read_text().strip() == MARKER
    # Over WebSocket Codex first warms the connection up (`generate: false`: a prefill of its
    # instructions, no user turn); the task's turns are the ones that carry it.
    turns = [p for p in model.prompts if TASK in p]
    assert len(turns) == 2 and MARKER not in turns[0] and MARKER in turns[1], [p[-200:] for p in turns]
    assert ANSWER in out, out
    websocket = stats.responses_websocket
    assert websocket == (stats.responses if transport == "websocket" else 0), (transport, stats)


async def _exec_json(tmp: Path, transport: str, record: Path | None) -> list[dict[str, object]]:
    """One `codex exec --json` on a fresh server (through the recorder into `record`, if given):
    the thread's events Codex printed, after checking it ran the task's tool loop."""
    home, work = tmp / "home", tmp / "work"
    for folder in (home, work):  # the same paths each run: Codex puts its folder in the prompt
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()
    async with live_server(policy=parse_script(SCRIPT)) as live:
        port = live.port
        async with contextlib.AsyncExitStack() as stack:
            if record is not None:
                base, _ = await stack.enter_async_context(recording(f"http://127.0.0.1:{live.port}", record))
                port = int(base.rsplit(":", 1)[1].split("/")[0])
            (home / "config.toml").write_text(_config(port, transport == "websocket"))
            code, out, err = await _exec(home, work, "--json")
        stats = live.app[ENGINE].statistics()
    assert code == 0, f"codex exec failed ({code}):\n{err[-4000:]}"
    assert (work / "marker.txt").read_text().strip() == MARKER
    assert stats.responses_websocket == (stats.responses if transport == "websocket" else 0), (transport, stats)
    events = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert any(ANSWER in json.dumps(e) for e in events), out
    return events


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["http", "websocket"])
async def test_codex_exec_runs_unchanged_through_the_recorder(tmp_path: Path, transport: str) -> None:
    """`python -m sim record` in front of the server: Codex's run through it is the run it makes
    directly (its thread's events, ids and times aside), and the recorder wrote a line per request."""
    if not CODEX.exists():
        pytest.skip(f"Codex CLI is not installed at {CODEX} (`make node-clients` installs it)")
    direct = await _exec_json(tmp_path, transport, None)
    proxied = await _exec_json(tmp_path, transport, tmp_path / "record")
    # Its thread's events are the direct run's, ids aside; the token counts only up to its own
    # tool's output, which carries the command's wall time.
    untimed = [normalised([{**e, "usage": "<usage>"} if "usage" in e else e for e in run]) for run in (direct, proxied)]
    assert untimed[0] == untimed[1]
    # The recorder wrote a line per model turn, each with the usage Codex then reported (summed
    # over its turns), the WebSocket's warm-up (`generate: false`) marked as no turn.
    mode = "ws" if transport == "websocket" else "http"
    [turns] = check_recording(tmp_path / "record", [[mode, mode]], warmups=int(transport == "websocket"))
    [usage] = [e["usage"] for e in proxied if e["type"] == "turn.completed"]
    assert isinstance(usage, dict)
    for key in ("input_tokens", "output_tokens"):
        assert usage[key] == sum(line["usage"][key] for line in turns), (usage, turns)
    cached = sum(line["usage"]["input_tokens_details"]["cached_tokens"] for line in turns)
    assert usage["cached_input_tokens"] == cached, (usage, turns)
    records = read_records([tmp_path / "record" / "capture.jsonl"])
    assert [(r.mode, r.turn) for r in records] == [(mode, 0), (mode, 1)]
