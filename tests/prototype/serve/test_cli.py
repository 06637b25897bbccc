"""The entry point as a subprocess: `python -m prototype.server`, driven by the sync openai SDK.

Readiness is the server's own stdout line, read event-driven (selector + raw
reads, as for redis-server in processes.py); no sleeps, no port polling. Every
test is bounded: HTTP calls by the client timeout, everything else (a blocked
WebSocket `recv()`) by a watchdog that kills the server at a deadline, which
turns a hang into a closed socket and a failed test.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import openai
import pytest
import websockets.exceptions

from prototype.config import ServerConfig
from prototype.options import flag_of, leaves
from prototype.server import main
from sim.model.config import ModelConfig
from tests.processes import REPO, START_TIMEOUT_S, ServerProcess, start_server
from tests.support import EXEC_TOOL

REQUEST_TIMEOUT_S: Final = 10.0
API_KEY: Final = "sk-x"
TERMINAL: Final = frozenset({"response.completed", "response.failed", "response.incomplete", "error"})
TOOLS: Final[Any] = [EXEC_TOOL]  # Any: the SDK's TypedDict params do not accept a plain dict
FIRST_INPUT: Final[Any] = [
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "List the repo and run the tests."}]}
]


@pytest.fixture
def server() -> Iterator[ServerProcess]:
    with start_server("--port", "0", "--tps", "0", "--seed", "3", "--api-key", API_KEY, "--tool-calls", "2") as s:
        yield s


def sdk(server: ServerProcess, api_key: str = API_KEY) -> openai.OpenAI:
    return openai.OpenAI(api_key=api_key, base_url=server.base_url, max_retries=0, timeout=REQUEST_TIMEOUT_S)


def tool_output(call: Any) -> Any:
    cmd = json.loads(call.arguments)["cmd"]
    return {"type": "function_call_output", "call_id": call.call_id, "output": f"$ {cmd}\nok\n"}


def check_conversation(responses: list[Any]) -> list[tuple[str, str]]:
    """Turns 1-2 call exec_command, turn 3 answers in text; returns (kind, payload) per turn."""
    seen = []
    for k, resp in enumerate(responses, start=1):
        assert resp.status == "completed", (k, resp)
        assert len(resp.output) == 1, (k, resp.output)
        item = resp.output[0]
        assert resp.usage.output_tokens > 0
        assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens
        if k < len(responses):
            assert item.type == "function_call" and item.name == "exec_command", (k, item)
            assert isinstance(json.loads(item.arguments)["cmd"], str)
            seen.append(("function_call", item.arguments))
        else:
            assert item.type == "message", (k, item)
            text = "".join(p.text for p in item.content if p.type == "output_text")
            assert text.strip()
            seen.append(("message", text))
    inputs = [r.usage.input_tokens for r in responses]
    assert inputs == sorted(set(inputs)), inputs
    return seen


def ws_conversation(client: openai.OpenAI, turns: int = 3) -> list[Any]:
    responses: list[Any] = []
    with client.responses.connect() as conn:
        new_items: Any = FIRST_INPUT
        for _ in range(turns):
            extra = {"previous_response_id": responses[-1].id} if responses else {}
            conn.response.create(model="sim", input=new_items, tools=TOOLS, store=False, **extra)
            while (ev := conn.recv()).type not in TERMINAL:
                assert ev.type.startswith("response."), ev
            assert ev.type == "response.completed", ev
            responses.append(ev.response)
            if ev.response.output[-1].type == "function_call":
                new_items = [tool_output(ev.response.output[-1])]
    return responses


def http_sse_conversation(client: openai.OpenAI, turns: int = 3) -> list[Any]:
    responses: list[Any] = []
    new_items: Any = FIRST_INPUT
    for _ in range(turns):
        extra = {"previous_response_id": responses[-1].id} if responses else {}
        stream: Any = client.responses.create(model="sim", input=new_items, tools=TOOLS, stream=True, **extra)
        with stream:
            events = list(stream)
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert events[-1].type == "response.completed", events[-1]
        responses.append(events[-1].response)
        if events[-1].response.output[-1].type == "function_call":
            new_items = [tool_output(events[-1].response.output[-1])]
    return responses


# -- tests --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_help_lists_every_option() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "prototype.server", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=START_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    for option in (
        "--host",
        "--port",
        "--tps",
        "--tool-calls",
        "--script",
        "--seed",
        "--store",
        *(flag_of(field) for cls in (ServerConfig, ModelConfig) for _, field in leaves(cls)),
    ):
        assert re.search(rf"(^|\s){re.escape(option)}\b", done.stdout), (option, done.stdout)


@pytest.mark.slow
def test_conversations_over_websocket_and_http_then_sigterm(server: ServerProcess) -> None:
    assert server.base_url == f"http://127.0.0.1:{server.port}/v1" and server.port > 0
    with sdk(server) as client:
        over_ws = check_conversation(ws_conversation(client))
        over_http = check_conversation(http_sse_conversation(client))
        # Same seed and prompt: the same calls and text whichever transport carried them.
        assert over_ws == over_http
        assert [kind for kind, _ in over_ws] == ["function_call", "function_call", "message"]

        # SIGTERM while a WebSocket is open (and idle): the process still exits 0, and the
        # server says goodbye with close code 1001 (going away) instead of dropping the TCP connection.
        with client.responses.connect() as conn:
            conn.response.create(model="sim", input="hi", tools=TOOLS, store=False)
            while (ev := conn.recv()).type not in TERMINAL:
                pass
            assert ev.type == "response.completed"
            assert server.terminate() == 0, server.log
            with pytest.raises(websockets.exceptions.ConnectionClosed) as excinfo:
                conn.recv()
            assert excinfo.value.rcvd is not None and excinfo.value.rcvd.code == 1001, excinfo.value


# websockets 17, installed apart by `make install` (the dev extra has 16: openai-agents needs <17).
WEBSOCKETS_NEXT: Final = REPO / "build" / "websockets-next"
_ON_WEBSOCKETS_NEXT: Final = """
import json, sys
import openai, websockets
from websockets.sync import client as sync_client
assert hasattr(sync_client, "reconnect"), websockets.__file__  # openai's sync connect goes through it
base_url, api_key, first, tools = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
client = openai.OpenAI(api_key=api_key, base_url=base_url, max_retries=0, timeout=10.0)
said, items, previous = [], first, {}
with client.responses.connect() as conn:
    for _ in range(3):
        conn.response.create(model="sim", input=items, tools=tools, store=False, **previous)
        while (ev := conn.recv()).type not in ("response.completed", "response.failed", "error"):
            pass
        assert ev.type == "response.completed", ev
        item = ev.response.output[-1]
        if item.type == "function_call":
            said.append(["function_call", item.arguments])
            cmd = json.loads(item.arguments)["cmd"]
            items = [{"type": "function_call_output", "call_id": item.call_id, "output": f"$ {cmd}\\nok\\n"}]
        else:
            said.append(["message", "".join(p.text for p in item.content if p.type == "output_text")])
        previous = {"previous_response_id": ev.response.id}
print(json.dumps({"websockets": websockets.__version__, "said": said}))
"""


@pytest.mark.slow
def test_the_sync_connect_on_websockets_17_takes_reconnect_and_says_the_same(server: ServerProcess) -> None:
    """openai 3.63's `client.responses.connect()` opens its socket with websockets 17's
    `sync.client.reconnect` (redirects not followed) where it exists: the same conversation as on
    16's `connect`, run in a subprocess that finds websockets 17 first on its path."""
    if not (WEBSOCKETS_NEXT / "websockets").is_dir():
        pytest.skip(f"websockets 17 is not at {WEBSOCKETS_NEXT} (make install puts it there)")
    env = {**os.environ, "PYTHONPATH": str(WEBSOCKETS_NEXT)}
    done = subprocess.run(
        [sys.executable, "-c", _ON_WEBSOCKETS_NEXT, server.base_url, API_KEY, *map(json.dumps, (FIRST_INPUT, TOOLS))],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen["websockets"].startswith("17."), seen
    with sdk(server) as client:
        assert [tuple(turn) for turn in seen["said"]] == check_conversation(ws_conversation(client))


@pytest.mark.slow
def test_wrong_api_key_is_refused_over_http_and_websocket(server: ServerProcess) -> None:
    with sdk(server, api_key="sk-wrong") as bad:
        with pytest.raises(openai.AuthenticationError) as excinfo:
            bad.responses.create(model="sim", input="hi", tools=TOOLS)
        assert excinfo.value.status_code == 401
        assert excinfo.value.code == "invalid_api_key"
        # The upgrade is refused before any frame: openai-python lets websockets' InvalidStatus through.
        with pytest.raises(websockets.exceptions.InvalidStatus) as ws_excinfo:
            with bad.responses.connect():
                pass
        assert ws_excinfo.value.response.status_code == 401
    # The right key still works on the same server afterwards.
    with sdk(server) as good:
        assert good.responses.create(model="sim", input="hi", tools=TOOLS).status == "completed"
    assert server.terminate() == 0, server.log


@pytest.mark.slow
def test_script_replays_exact_call_then_text(tmp_path: Path) -> None:
    arguments = {"cmd": "pytest -q tests/prototype/store/test_store.py", "workdir": "/repo"}
    text = "Done — the store tests pass now (12 passed)."
    script = tmp_path / "turns.jsonl"
    script.write_text(
        "# a tool call, then the answer\n"
        + json.dumps({"tool_call": {"name": "exec_command", "arguments": arguments}})
        + "\n\n"
        + json.dumps({"text": text}, ensure_ascii=False)
        + "\n",
        encoding="utf-8",
    )
    with start_server("--port", "0", "--tps", "0", "--script", str(script)) as server:
        with sdk(server, api_key="anything") as client:  # no --api-key: any key is accepted
            first = client.responses.create(model="sim", input=FIRST_INPUT, tools=TOOLS)
            assert first.status == "completed"
            call: Any
            [call] = first.output
            assert call.type == "function_call"
            assert call.name == "exec_command"
            assert call.arguments == json.dumps(arguments, separators=(",", ":"))  # compact, key order kept
            second = client.responses.create(
                model="sim", input=[tool_output(call)], tools=TOOLS, previous_response_id=first.id
            )
            assert second.status == "completed"
            [message] = second.output
            assert message.type == "message"
            assert second.output_text == text
            third = client.responses.create(
                model="sim", input="anything else?", tools=TOOLS, previous_response_id=second.id
            )
            assert third.output_text == "(script exhausted)"
        assert server.terminate() == 0, server.log


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--engine", "openai"], "engine_url"),
        (["--tps", "-1"], "--tps: Expected `float` >= 0.0"),
        (["--port", "99999"], "--port: 99999 is not a TCP port"),  # not 99999 mod 65536
        (["--port", "-1"], "--port: -1 is not a TCP port"),
    ],
)
def test_an_invalid_option_is_one_line_and_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m prototype.server: invalid option:") and message in err
    assert "Traceback" not in err and err.count("\n") == 1


def test_a_busy_port_is_one_line_and_exit_2() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "prototype.server", "--port", str(port)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=START_TIMEOUT_S,
        )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith(
        f"python -m prototype.server: invalid option: --port: cannot listen on 127.0.0.1:{port}"
    )
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr


def test_a_value_argparse_refuses_is_one_line_too(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as refused:
        main(["--port", "eighty"])
    assert refused.value.code == 2
    assert capsys.readouterr().err == "python -m prototype.server: argument --port: invalid int value: 'eighty'\n"
