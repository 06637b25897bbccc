"""Shared helpers of the recorder's and calibration's tests: openai-python's agent loops in the
three modes a user can record, the recorder on an ephemeral port, and captures drawn from random
cost profiles (the http and ws turns of a virtual run, as a proxy would see them)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, Final

import msgspec
import numpy as np
from aiohttp import web
from openai import AsyncOpenAI

from prototype.pipeline import PROFILES, CostProfile
from sim.analysis.records import TurnRecord, records_from_rollouts
from sim.harness.experiment import CompareConfig, compare
from sim.record.proxy import Recorder, make_recorder_app

NOISE: Final = 0.05

TOOLS: Final[list[Any]] = [
    {
        "type": "function",
        "name": "run",
        "description": "run a shell command",
        "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]},
    }
]

Flow = Callable[[AsyncOpenAI, str], Awaitable[list[tuple[str, str]]]]


def seen_of(event: Any) -> tuple[str, str]:
    """What a client's stream is compared on: each event's type and its text (ids aside)."""
    return (event.type, getattr(event, "delta", None) or getattr(event, "text", None) or "")


def outputs_of(response: Any) -> list[Any]:
    return [
        {"type": "function_call_output", "call_id": item.call_id, "output": "ok"}
        for item in response.output
        if item.type == "function_call"
    ]


async def http_flow(c: AsyncOpenAI, prompt: str) -> list[tuple[str, str]]:
    """The whole history each request, streamed, until the model answers in text."""
    seen: list[tuple[str, str]] = []
    items: list[Any] = [{"role": "user", "content": prompt}]
    while True:
        stream = await c.responses.create(model="sim", input=items, tools=TOOLS, stream=True)
        done = None
        async for event in stream:
            seen.append(seen_of(event))
            if event.type == "response.completed":
                done = event.response
        assert done is not None
        calls = outputs_of(done)
        if not calls:
            return seen
        items += [item.model_dump(mode="json", exclude_none=True) for item in done.output] + calls


async def http_prev_flow(c: AsyncOpenAI, prompt: str) -> list[tuple[str, str]]:
    """`previous_response_id` over HTTP; the first turn not streamed (a whole JSON body)."""
    response = await c.responses.create(model="sim", input=prompt, tools=TOOLS)
    seen = [("body", response.output_text)]
    while calls := outputs_of(response):
        stream = await c.responses.create(
            model="sim", input=calls, tools=TOOLS, previous_response_id=response.id, stream=True
        )
        async for event in stream:
            seen.append(seen_of(event))
            if event.type == "response.completed":
                response = event.response
    return seen


async def ws_flow(c: AsyncOpenAI, prompt: str) -> list[tuple[str, str]]:
    """WebSocket mode (`client.responses.connect()`): one connection, `previous_response_id` after the first."""
    seen: list[tuple[str, str]] = []
    async with c.responses.connect() as connection:
        await connection.response.create(model="sim", input=prompt, tools=TOOLS)
        while True:
            done = None
            async for event in connection:
                seen.append(seen_of(event))
                if event.type in ("error", "response.failed"):
                    raise AssertionError(event)
                if event.type == "response.completed":
                    done = event.response
                    break
            assert done is not None
            calls = outputs_of(done)
            if not calls:
                return seen
            await connection.response.create(model="sim", input=calls, tools=TOOLS, previous_response_id=done.id)


@contextlib.asynccontextmanager
async def recording(upstream: str, out: Path) -> AsyncIterator[tuple[str, Recorder]]:
    """The recorder on an ephemeral port in front of `upstream`; yields its base URL."""
    recorder = Recorder(upstream, out)
    runner = web.AppRunner(make_recorder_app(recorder), handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}/v1", recorder
    finally:
        await runner.cleanup()


def draw_profile(seed: int) -> tuple[CostProfile, dict[str, float]]:
    """A profile whose every wait is hosted's times a factor from 1/5 to 5, and model rates drawn
    over a decade each."""
    rng = np.random.default_rng(seed)
    hosted = PROFILES["hosted"]
    waits = {
        f: getattr(hosted, f) * float(np.exp(rng.uniform(np.log(0.2), np.log(5.0))))
        for f in (
            "rtt_s",
            "auth_s",
            "routing_s",
            "validate_s_per_token",
            "state_load_s",
            "safety_call_s",
            "safety_s_per_token",
            "inference_hop_s",
            "billing_s",
        )
    }
    waits["uplink_bytes_per_s"] = hosted.uplink_bytes_per_s * float(np.exp(rng.uniform(np.log(0.2), np.log(5.0))))
    profile = CostProfile(name=f"drawn-{seed}", **waits)
    model = {
        "tps": float(np.exp(rng.uniform(np.log(300), np.log(3000)))),
        "prefill_tok_per_s": float(np.exp(rng.uniform(np.log(5000), np.log(50000)))),
        "model_latency_s": float(rng.uniform(0.01, 0.2)),
    }
    return profile, model


def drawn_capture(profile: CostProfile, model: dict[str, float], seed: int) -> list[TurnRecord]:
    """The http and ws turns of a virtual run as a proxy sees them, each time off by ~5 %."""
    config = CompareConfig.of(rollouts=6, tool_calls=4, modes=("http", "ws"), profile=profile, seed=seed, **model)
    records = records_from_rollouts(compare(config, virtual=True, free_cpu=True).rollouts, source="capture")
    rng = np.random.default_rng(seed)
    out = []
    for r in records:
        assert r.ttft_s is not None
        ttft = r.ttft_s * float(rng.lognormal(0, NOISE))
        tail = (r.e2e_s - r.ttft_s) * float(rng.lognormal(0, NOISE))
        out.append(
            msgspec.structs.replace(
                r, stages_s={}, tokens_rendered=None, tokens_classified=None, ttft_s=ttft, e2e_s=ttft + tail
            )
        )
    return out
