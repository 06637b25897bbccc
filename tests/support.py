"""Shared helpers of the tests: a live server on loopback, in process; WebSocket turns; the
simulated model's requests; the node clients. A test module imports these, never another test
module (servers in subprocesses: tests/processes.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import shutil
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, NoReturn

import aiohttp
import jsonschema  # type: ignore[import-untyped]
import msgspec
import numpy as np
import pytest
from aiohttp import web
from openai.types.beta.agent_session_event import AgentSessionEvent
from openai.types.beta.agent_session_item import AgentSessionItem

from prototype.config import ServerConfig
from prototype.model import FunctionTool, ModelRequest
from prototype.serve.app import ApiRunner, make_app
from prototype.serve.wallclock import AsyncioClock
from prototype.store.base import ResponseStore
from prototype.store.memory import MemoryStore
from sim.fleet.compute import StepCost
from sim.fleet.sessions import SessionTokens
from sim.harness.experiment import CompareConfig
from sim.model.accelerator import SimulatedModel
from sim.model.policy import DefaultPolicy, Policy
from sim.rollout.result import RolloutResult

from .strict import _members

# Codex's `exec_command` tool parameters, trimmed to the fields that matter.
EXEC_COMMAND_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "cmd": {"type": "string"},
        "workdir": {"type": "string"},
        "timeout_ms": {"type": "integer", "minimum": 1},
    },
    "required": ["cmd"],
}
# What openai-agents' @function_tool generates for `def get_weather(city: str)` (strict mode).
GET_WEATHER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"title": "City", "type": "string"}},
    "required": ["city"],
    "title": "get_weather_args",
    "additionalProperties": False,
}


def schema_errors(schema: object, value: object) -> list[str]:
    """What the `jsonschema` library finds wrong with `value` against `schema` ([] = valid): an
    independent check of the simulator's sampler (`sim.model.schema_values`). The draft is the
    one the schema's `$schema` names, else 2020-12; the schema itself must be valid in it."""
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    validator.check_schema(schema)
    errors = validator(schema).iter_errors(value)
    return [f"${''.join(f'[{p!r}]' for p in e.absolute_path)}: {e.message}" for e in errors]


EXEC_TOOL: dict[str, Any] = {
    "type": "function",
    "name": "exec_command",
    "description": "Run a shell command and return its output.",
    "parameters": {
        "type": "object",
        "properties": {"cmd": {"type": "string"}, "workdir": {"type": "string"}},
        "required": ["cmd"],
    },
    "strict": False,
}


@dataclass
class Live:
    app: web.Application
    port: int
    model: SimulatedModel

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/responses"


@contextlib.asynccontextmanager
async def served(app: web.Application) -> AsyncIterator[int]:
    """`app` served on 127.0.0.1 at an ephemeral port (yielded) for the block."""
    runner = ApiRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def live_server(
    *,
    tool_calls: int = 10,
    policy: Policy | None = None,
    store: ResponseStore | None = None,
    config: ServerConfig | None = None,
    seed: int = 0,
    decode_tok_per_s: float = math.inf,
    random_ids: bool = False,
) -> AsyncIterator[Live]:
    """The real app on 127.0.0.1, an ephemeral port, an unpaced simulator by default; `random_ids`:
    ids as a server on a persistent store draws them (not from the seed)."""
    clock = AsyncioClock()
    model = SimulatedModel(
        clock=clock,
        policy=policy or DefaultPolicy(tool_calls=tool_calls),
        seed=seed,
        decode_tok_per_s=decode_tok_per_s,
    )
    app = make_app(
        model=model, store=store or MemoryStore(), clock=clock, config=config, seed=None if random_ids else seed
    )
    async with served(app) as port:
        yield Live(app, port, model)


RECEIVE_TIMEOUT_S = 30.0
"""Upper bound on one WebSocket read in a test. Frames the test waits for come in
milliseconds; this only turns a missing frame into a failure instead of a hung run.
conftest.py applies it to every client read that names no timeout of its own."""

REQUIRE_ALL_ENV = "LONGRUN_REQUIRE_ALL"
"""Set to 1 (CI and `make test` do) and a test that would skip for want of a service or
client fails instead, naming what is missing."""


def require_all() -> bool:
    return os.environ.get(REQUIRE_ALL_ENV, "") not in ("", "0")


async def receive_event(ws: aiohttp.ClientWebSocketResponse, timeout: float = RECEIVE_TIMEOUT_S) -> dict[str, Any]:
    """The next server event (a JSON text frame) within `timeout` seconds."""
    msg = await ws.receive(timeout=timeout)
    assert msg.type is aiohttp.WSMsgType.TEXT, f"expected a text frame, got {msg.type.name}: {msg.data!r}"
    event: dict[str, Any] = json.loads(msg.data)
    return event


async def run_client(
    *args: str, cwd: Path, timeout_s: float, env: Mapping[str, str] | None = None
) -> tuple[int, bytes, bytes]:
    """Run a real client's process to its end: (exit status, stdout, stderr). Killed past
    `timeout_s`, so a client waiting for an event that never comes fails its test."""
    proc = await asyncio.create_subprocess_exec(
        *args,
        cwd=cwd,
        env=dict(env) if env is not None else None,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    assert proc.returncode is not None
    return proc.returncode, out, err


# -- WebSocket turns over aiohttp (tests/prototype/ws/test_ws.py, tests/prototype/serve/test_limits.py) ---

TERMINAL = {"response.completed", "response.failed", "response.incomplete", "error"}


async def turn(ws: aiohttp.ClientWebSocketResponse, **body: Any) -> list[dict[str, Any]]:
    """Send one response.create and read events up to its terminal event."""
    await ws.send_str(json.dumps({"type": "response.create", "model": "sim", **body}))
    return await read_response(ws)


async def read_response(ws: aiohttp.ClientWebSocketResponse) -> list[dict[str, Any]]:
    events = []
    while True:
        msg = await asyncio.wait_for(ws.receive(), 30)
        assert msg.type is aiohttp.WSMsgType.TEXT, msg
        ev = json.loads(msg.data)
        events.append(ev)
        if ev["type"] in TERMINAL:
            return events


def last(events: list[dict[str, Any]]) -> dict[str, Any]:
    return events[-1]


async def connect(live: Live, **kw: Any) -> tuple[aiohttp.ClientSession, aiohttp.ClientWebSocketResponse]:
    session = aiohttp.ClientSession()
    ws = await session.ws_connect(live.ws_url, **kw)
    return session, ws


# -- the simulated model's requests (tests/sim/model/test_sim_policy.py, tests/sim/runtime/test_memo.py) ---

EXEC_COMMAND = FunctionTool("exec_command", "Run a shell command.", msgspec.json.encode(EXEC_COMMAND_SCHEMA))
GET_WEATHER = FunctionTool("get_weather", None, msgspec.json.encode(GET_WEATHER_SCHEMA), strict=True)


def make_request(
    *,
    turn_index: int = 0,
    conversation_key: int = 1234,
    tools: tuple[FunctionTool, ...] = (EXEC_COMMAND, GET_WEATHER),
    tool_choice: str = "auto",
) -> ModelRequest:
    prompt = (np.arange(8, dtype=np.uint32),)
    return ModelRequest(
        prompt=prompt,
        prompt_tokens=8,
        resident_tokens=0,
        turn_index=turn_index,
        conversation_key=conversation_key,
        tools=tools,
        tool_choice=tool_choice,
    )


# -- what a client saw of a turn (tests/clients/test_openai_sdk.py, tests/clients/test_real_clients_lanes.py) ---


@dataclass(frozen=True)
class Seen:
    """What the model produced on one turn, as far as it is transport-independent."""

    kind: str
    name: str | None
    arguments: str | None
    text: str | None
    input_tokens: int
    output_tokens: int


# -- a WebSocket read up to an event type (tests/prototype/ws/test_beta.py, tests/prototype/ws/test_steering.py) ---


async def until(ws: aiohttp.ClientWebSocketResponse, *types: str) -> list[dict[str, Any]]:
    """Events up to and including the first of `types`."""
    out = []
    while True:
        event = await receive_event(ws)
        out.append(event)
        if event["type"] in types:
            return out


# -- the comparison with steers (tests/sim/harness/test_steer_mode.py, tests/prototype/ws/test_steering.py) ---

STEER_COMPARE_BASE = CompareConfig.of(
    rollouts=4,
    tool_calls=5,
    tps=300,
    tool_time_s=0.2,
    seed=11,
    profile="local",
    system_prompt_tokens=300,
    modes=("http", "ws", "append", "inject", "steer"),
    steer_boundary="token",
)


def completed_items(r: RolloutResult) -> list[Any]:
    items = [i for t in r.turns for i in t.output_items if i.get("status") != "incomplete"]
    return [(i["name"], i["arguments"]) if i["type"] == "function_call" else i["content"][0]["text"] for i in items]


def output_tokens(r: RolloutResult) -> int:
    ended = {resp.id: resp for t in r.turns for resp in (*t.steered, t.response) if resp.usage is not None}
    return sum(resp.usage.output_tokens for resp in ended.values() if resp.usage is not None)


# -- openai-node scripts of tests/node (test_real_clients_lanes.py, test_beta.py, test_node_sdks.py) ---

CLIENT_TIMEOUT_S: Final = 30.0
"""Upper bound on one client run, so a client waiting for an event that never comes fails the test."""
TESTS: Final = Path(__file__).resolve().parent  # the suite's folder (its data, its Node clients)
REPO: Final = TESTS.parent
NODE_DIR: Final = TESTS / "node"
NODE_LANES_SCRIPT: Final = NODE_DIR / "lanes.mjs"


def missing(what: str) -> NoReturn:
    """A client that is not installed fails in CI (which must install it) and skips elsewhere."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"{what}; .ci/run installs it", pytrace=False)
    pytest.skip(what)


def node_executable() -> str:
    node = shutil.which("node")
    if node is None:
        missing("node is not on PATH")
    package = NODE_DIR / "node_modules" / "openai" / "package.json"
    if not package.is_file():
        missing("openai-node is not installed: run `npm ci --prefix tests/node`")
    pinned = json.loads((NODE_DIR / "package.json").read_text())["dependencies"]["openai"]
    installed = json.loads(package.read_text())["version"]
    assert installed == pinned, f"tests/node has openai {installed}, package.json pins {pinned}: run npm ci"
    return node


async def run_node(
    plan: dict[str, Any], script: Path = NODE_LANES_SCRIPT, timeout_s: float = CLIENT_TIMEOUT_S
) -> dict[str, Any]:
    """Run an openai-node script of tests/node with `plan` as its argument; its JSON report."""
    node = node_executable()
    proc = await asyncio.create_subprocess_exec(
        node,
        str(script),
        json.dumps(plan),
        cwd=NODE_DIR,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s + 10)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        pytest.fail("the node client did not exit", pytrace=False)
    assert proc.returncode == 0, f"node exited {proc.returncode}: {err.decode(errors='replace')[-4000:]}"
    report: dict[str, Any] = json.loads(out)
    return report


# The beta's WebSocket (test_beta.py, test_beta_edges.py).
BETA_HEADERS: Final = {"OpenAI-Beta": "responses_multi_agent=v1"}
ASYNC_TOOL: Final = {**EXEC_TOOL, "async": True}


async def beta_socket(session: aiohttp.ClientSession, live: Live) -> aiohttp.ClientWebSocketResponse:
    return await session.ws_connect(live.ws_url, headers=BETA_HEADERS)


def beta_create(**fields: Any) -> str:
    """A beta `response.create` frame for the simulator's model with the async exec tool."""
    return json.dumps({"type": "response.create", "model": "sim", "tools": [ASYNC_TOOL], **fields})


# The Agents API's SDK models with validation on (its own parsing skips it): every event, session,
# turn and item the routes send is checked against them (test_agents_api.py, test_agents_sdk.py).
AGENT_EVENT_MODELS: Final = _members(AgentSessionEvent)
AGENT_ITEM_MODELS: Final = _members(AgentSessionItem)


def fleet_session(index: int, prompt: int, outputs: tuple[int, ...], tools: tuple[float, ...] = ()) -> SessionTokens:
    """A fleet session of the given sizes: 16 instruction tokens, 4 bytes a token, 10-token tool outputs."""
    return SessionTokens(
        index=index,
        instruction_tokens=16,
        first_prompt_tokens=prompt,
        instruction_bytes=64,
        first_request_bytes=4 * prompt,
        output_tokens=outputs,
        output_bytes=tuple(4 * o for o in outputs),
        tool_times_s=tools,
        tool_tokens=(10,) * len(tools),
        tool_bytes=(40,) * len(tools),
    )


def flat_step_cost(name: str, *, decode_tokens_per_step: int = 1) -> StepCost:
    """A step cost of round numbers: 1 ms a prefill token and 10 ms a decoded one, nothing fixed,
    no attention term, llama.cpp's 2,048-token budget."""
    return StepCost(
        name=name,
        step_s=0.0,
        prefill_s_per_token=1e-3,
        prefill_s_per_token_ctx=0.0,
        decode_batch=(1,),
        decode_s_per_token=(0.01,),
        decode_s_per_ctx_token=0.0,
        token_budget=2048,
        decode_tokens_per_step=decode_tokens_per_step,
    )


def approx_numbers(expected: Any, *, rel: float | None = None, abs: float | None = None) -> Any:
    """`expected` with each number (int or float, not bool) wrapped in `pytest.approx` and everything
    else left to compare exactly, through dicts, lists and tuples: `row == approx_numbers(other)`.
    `pytest.approx` over a container holding a string raises TypeError from pytest 9.2 on (older
    releases compared the string exactly), so a row of mixed columns goes through this instead."""
    if isinstance(expected, bool) or not isinstance(expected, int | float | Mapping | list | tuple):
        return expected
    if isinstance(expected, int | float):
        return pytest.approx(expected, rel=rel, abs=abs)
    if isinstance(expected, Mapping):
        return {k: approx_numbers(v, rel=rel, abs=abs) for k, v in expected.items()}
    return type(expected)(approx_numbers(v, rel=rel, abs=abs) for v in expected)
