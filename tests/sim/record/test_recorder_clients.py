"""`python -m sim record` in front of the real app, with openai-node (tests/node/flows.mjs) unchanged,
and what the recorder keeps out of its files and logs.

Each openai-node loop (HTTP with the whole history, `previous_response_id` over HTTP, WebSocket
mode, two `stream_id` lanes on one socket) runs on a fresh server of one seed directly and through
the recorder: the events the client received are the same, whole (ids and times normalised), and
the capture and workload have a line per turn. openai-python's loops are in test_recorder.py,
Codex CLI's in tests/clients/test_codex_cli.py."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
from pathlib import Path
from typing import Any, Final

import pytest
from openai import AsyncOpenAI

from tests.processes import free_port
from tests.recording import TOOLS, check_recording, http_flow, normalised, recorded_lines, recording, ws_flow
from tests.support import NODE_DIR, REPO, live_server, run_node

FLOWS_SCRIPT: Final = NODE_DIR / "flows.mjs"
TIMEOUT_S: Final = 60.0
CLI_TIMEOUT_S: Final = 120.0
"""Upper bound on `python -m sim record`'s start (a fresh interpreter's imports) and on its
shutdown, so a hung recorder fails the test; generous, for a loaded shared machine."""
PROMPT: Final = "List the files."
MODES: Final = {
    "http": [["http"] * 3],
    "http_prev": [["http", "http_prev", "http_prev"]],
    "ws": [["ws"] * 3],
    "lanes": [["ws"] * 3] * 2,
}


async def _node(flow: str, out: Path | None) -> list[dict[str, Any]]:
    """The events openai-node received on a fresh server of one seed, direct or through the recorder."""
    async with live_server(tool_calls=2, seed=7) as live:
        plan = {"flow": flow, "prompt": PROMPT, "tools": TOOLS, "timeoutMs": int(TIMEOUT_S * 1000)}
        if out is None:
            report = await run_node({**plan, "baseURL": live.base_url}, FLOWS_SCRIPT, TIMEOUT_S)
        else:
            async with recording(f"http://127.0.0.1:{live.port}", out) as (base, _):
                report = await run_node({**plan, "baseURL": base}, FLOWS_SCRIPT, TIMEOUT_S)
    events: list[dict[str, Any]] = report["events"]
    return events


@pytest.mark.slow
@pytest.mark.parametrize("flow", list(MODES))
async def test_openai_node_runs_unchanged_through_the_recorder(tmp_path: Path, flow: str) -> None:
    direct = await _node(flow, None)
    proxied = await _node(flow, tmp_path)
    assert normalised(proxied) == normalised(direct)
    assert sum(e["type"].endswith(".delta") for e in direct) > 10  # the streams carried tokens
    if flow == "lanes":
        assert {e.get("stream_id") for e in direct} == {"a", "b"}
    conversations = check_recording(tmp_path, MODES[flow])
    # The usage each response's terminal event carried is the one its capture line holds.
    usages = [e["response"]["usage"] for e in proxied if e["type"] in ("response.completed", "body")]
    recorded = [json.dumps(line["usage"], sort_keys=True) for conv in conversations for line in conv]
    assert sorted(recorded) == sorted(json.dumps(u, sort_keys=True) for u in usages)


KEY: Final = "sk-canary-key-5f1e2d3c4b5a69788796a5b4"
AZURE_KEY: Final = "azure-canary-key-0a1b2c3d4e5f"  # an `api-key` header, as Azure's clients send
TASK: Final = "Canary task 9d8c7b: list the files."
FORBIDDEN: Final = (KEY, AZURE_KEY, "Bearer", "authorization", "api-key", "run a shell command")
"""What no file or log of the recorder may hold: the keys, the headers that carry them, and any
part of a request body (the tool's description); the task's text only with `--keep-content`."""


async def _agent_loops(base: str) -> None:
    """openai-python over HTTP and over WebSocket mode, with the keys on every request."""
    async with AsyncOpenAI(
        api_key=KEY, base_url=base, max_retries=0, timeout=10, default_headers={"api-key": AZURE_KEY}
    ) as c:
        await http_flow(c, TASK)
        await ws_flow(c, TASK)


def _found(blob: bytes) -> set[str]:
    text = blob.decode(errors="replace").lower()
    return {word for word in (*FORBIDDEN, TASK) if word.lower() in text}


@pytest.mark.slow
@pytest.mark.parametrize("keep_content", [False, True])
async def test_the_cli_writes_no_key_header_or_body_anywhere(tmp_path: Path, keep_content: bool) -> None:
    """`python -m sim record` as a user runs it, stopped by SIGINT: its folder and its output hold
    no key, no header carrying one and no request body; with `--keep-content` the task's text (a
    negative control of the search: it is found where it is written) and still no key."""
    out, port = tmp_path / "run", free_port()
    async with live_server(tool_calls=2, seed=3) as live:
        proc = await asyncio.create_subprocess_exec(
            *(sys.executable, "-m", "sim", "record", "--upstream", f"http://127.0.0.1:{live.port}"),
            *("--listen", f"127.0.0.1:{port}", "--out", str(out)),
            *(["--keep-content"] if keep_content else []),
            cwd=REPO,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        assert proc.stdout is not None
        try:
            assert b"recording" in await asyncio.wait_for(proc.stdout.readline(), CLI_TIMEOUT_S)
            await _agent_loops(f"http://127.0.0.1:{port}/v1")
        finally:
            proc.send_signal(signal.SIGINT)
            stdout, stderr = await asyncio.wait_for(proc.communicate(), CLI_TIMEOUT_S)
    assert proc.returncode == 0, stderr.decode(errors="replace")[-2000:]
    files = sorted(p for p in out.rglob("*") if p.is_file())
    assert [p.name for p in files] == ["capture.jsonl", "summary.json", "workload.jsonl"]
    assert len(recorded_lines(out, "capture.jsonl")) == 6  # both loops were recorded
    for path in files:
        found = _found(path.read_bytes())
        assert found == ({TASK} if keep_content and path.name == "workload.jsonl" else set()), (path.name, found)
    assert _found(stdout + stderr) == set(), (stdout + stderr)[-2000:]


@pytest.mark.slow
async def test_the_recorder_logs_no_key_header_or_body(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Every log record of the recorder and of aiohttp under it, at DEBUG, holds no key, header or body."""
    caplog.set_level(logging.DEBUG)
    async with (
        live_server(tool_calls=2, seed=3) as live,
        recording(f"http://127.0.0.1:{live.port}", tmp_path) as (base, _),
    ):
        await _agent_loops(base)
    recorder_logs = [r for r in caplog.records if r.name.startswith(("aiohttp", "sim"))]
    assert any(r.name == "aiohttp.access" for r in recorder_logs)  # the access log was on, and searched
    assert _found("\n".join(r.getMessage() for r in recorder_logs).encode()) == set()
    assert all(_found(p.read_bytes()) == set() for p in tmp_path.iterdir())
