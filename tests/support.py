"""Shared helpers for adapter tests: a live server on loopback, in process."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import jsonschema  # type: ignore[import-untyped]
from aiohttp import web

from prototype.app import make_app
from prototype.config import ServerConfig
from prototype.store import MemoryStore, ResponseStore
from prototype.wallclock import AsyncioClock
from sim.model.accelerator import SimulatedModel
from sim.model.policy import DefaultPolicy, Policy

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
async def live_server(
    *,
    tool_calls: int = 10,
    policy: Policy | None = None,
    store: ResponseStore | None = None,
    config: ServerConfig | None = None,
    seed: int = 0,
    decode_tok_per_s: float = math.inf,
) -> AsyncIterator[Live]:
    """The real app on 127.0.0.1, an ephemeral port, an unpaced simulator by default."""
    clock = AsyncioClock()
    model = SimulatedModel(
        clock=clock,
        policy=policy or DefaultPolicy(tool_calls=tool_calls),
        seed=seed,
        decode_tok_per_s=decode_tok_per_s,
    )
    app = make_app(model=model, store=store or MemoryStore(), clock=clock, config=config, seed=seed)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield Live(app, runner.addresses[0][1], model)
    finally:
        await runner.cleanup()


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
