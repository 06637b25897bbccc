"""Shared helpers of the recorder's and calibration's tests: openai-python's agent loops in the
three modes a user can record, the recorder on an ephemeral port, captures drawn from random
cost profiles (the http and ws turns of a virtual run, as a proxy would see them), and the server
running a cost profile no preset holds that the chains to a prediction start from."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, Final

import msgspec
import numpy as np
import pytest
from aiohttp import web
from openai import AsyncOpenAI

from prototype.config import ServerConfig
from prototype.pipeline import PROFILES, CostProfile
from prototype.serve.app import make_app
from prototype.serve.wallclock import AsyncioClock
from prototype.store.memory import MemoryStore
from sim.analysis.records import TurnRecord, records_from_rollouts
from sim.harness.experiment import CompareConfig, compare
from sim.model.accelerator import SimulatedModel
from sim.model.policy import DefaultPolicy
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

Flow = Callable[[AsyncOpenAI, str], Awaitable[list[dict[str, Any]]]]

_TIMED: Final = re.compile(r"(_at|_s|_ms)$")  # wall-clock stamps and measured durations
# resp_…, msg_…, fc_…, call_…, and UUIDs (Codex's thread ids)
_ID: Final = re.compile(r"\b[a-z]+_[0-9a-f]{16,}\b|\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b")


def seen_of(event: Any) -> dict[str, Any]:
    """An event as openai-python delivered it (the fields the server sent)."""
    dumped: dict[str, Any] = event.model_dump(mode="json", exclude_unset=True)
    return dumped


def _untimed(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: "<time>" if _TIMED.search(k) else _untimed(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_untimed(v) for v in value]
    return value


def normalised(events: list[dict[str, Any]]) -> list[str]:
    """What a client's stream is compared on across runs: every event whole, in order, with what
    legitimately differs run to run replaced (timestamps and measured durations by `<time>`,
    each id by its order of first appearance); lanes compared one after another (`stream_id`
    order), since lanes on one socket interleave as the machine schedules them."""
    lanes: dict[str, list[dict[str, Any]]] = {}
    for event in events:
        lanes.setdefault(str(event.get("stream_id")), []).append(event)
    ids: dict[str, str] = {}
    out = []
    for lane in sorted(lanes):
        for event in lanes[lane]:
            text = json.dumps(_untimed(event), sort_keys=True)
            out.append(_ID.sub(lambda m: ids.setdefault(m.group(0), f"<id{len(ids)}>"), text))
    return out


def outputs_of(response: Any) -> list[Any]:
    return [
        {"type": "function_call_output", "call_id": item.call_id, "output": "ok"}
        for item in response.output
        if item.type == "function_call"
    ]


async def http_flow(c: AsyncOpenAI, prompt: str) -> list[dict[str, Any]]:
    """The whole history each request, streamed, until the model answers in text."""
    seen: list[dict[str, Any]] = []
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


async def http_prev_flow(c: AsyncOpenAI, prompt: str) -> list[dict[str, Any]]:
    """`previous_response_id` over HTTP; the first turn not streamed (a whole JSON body)."""
    response = await c.responses.create(model="sim", input=prompt, tools=TOOLS)
    seen = [{"type": "body", "response": seen_of(response)}]
    while calls := outputs_of(response):
        stream = await c.responses.create(
            model="sim", input=calls, tools=TOOLS, previous_response_id=response.id, stream=True
        )
        async for event in stream:
            seen.append(seen_of(event))
            if event.type == "response.completed":
                response = event.response
    return seen


async def ws_flow(c: AsyncOpenAI, prompt: str) -> list[dict[str, Any]]:
    """WebSocket mode (`client.responses.connect()`): one connection, `previous_response_id` after the first."""
    seen: list[dict[str, Any]] = []
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


LANES: Final = ("a", "b")


async def lanes_flow(c: AsyncOpenAI, prompt: str) -> list[dict[str, Any]]:
    """Two lanes (`stream_id`) on one WebSocket connection, their tool loops at the same time: each
    lane's next `response.create` goes out when that lane's response completes."""
    seen: list[dict[str, Any]] = []
    async with c.responses.connect() as connection:
        for lane in LANES:
            await connection.response.create(model="sim", input=f"{prompt} (lane {lane})", tools=TOOLS, stream_id=lane)
        open_lanes = set(LANES)
        async for event in connection:
            seen.append(seen_of(event))
            if event.type in ("error", "response.failed"):
                raise AssertionError(event)
            if event.type != "response.completed":
                continue
            lane = getattr(event, "stream_id", None)
            assert lane in open_lanes, event
            calls = outputs_of(event.response)
            if not calls:
                open_lanes.discard(lane)
                if not open_lanes:
                    return seen
                continue
            await connection.response.create(
                model="sim",
                input=calls,
                tools=TOOLS,
                previous_response_id=event.response.id,
                stream_id=lane,
            )
    raise AssertionError(f"the connection closed with lanes {open_lanes} open")


def recorded_lines(out: Path, name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / name).read_text().splitlines()]


def check_recording(out: Path, modes: list[list[str]], *, warmups: int = 0) -> list[list[dict[str, Any]]]:
    """The recorder's files after a run of whole agent loops that each ended in text: one
    conversation per entry of `modes` (in order of their first request), each a capture line per
    turn in that mode (its usage, first-token time, unique response id, chained by
    `previous_response_id` where the client sent one), and a `workload.jsonl` line per turn with
    the capture's token counts and the client's time between turns; `warmups` lines marked
    `warmup` (`generate: false`) besides, each continued by a turn. The capture's lines (the
    turns'), per conversation."""
    lines = recorded_lines(out, "capture.jsonl")
    warm = {line["response_id"]: line for line in lines if line.get("warmup")}
    assert len(warm) == warmups, lines
    lines = [line for line in lines if not line.get("warmup")]
    by_conversation: dict[str, list[dict[str, Any]]] = {}
    for line in lines:
        by_conversation.setdefault(line["conversation"], []).append(line)
    assert [[line["mode"] for line in conv] for conv in by_conversation.values()] == modes, lines
    workload = {(w["rollout"], w["turn"]): w for w in recorded_lines(out, "workload.jsonl")}
    assert len(workload) == len(lines), workload
    ids = [line["response_id"] for line in lines]
    assert all(isinstance(i, str) and i.startswith("resp_") for i in ids) and len(set(ids)) == len(ids), ids
    for conversation, conv in by_conversation.items():
        assert [line["turn"] for line in conv] == list(range(len(conv)))
        for k, line in enumerate(conv):
            assert "failed" not in line, line
            assert line["request_bytes"] > 0 and line["proxy_request_ms"] >= 0, line
            assert line["sent_at"] <= line.get("first_token_at", line["sent_at"]) <= line["done_at"], line
            assert ("connection" in line) == (line["mode"] == "ws"), line
            chained = line.get("previous_response_id")
            if line["mode"] in ("ws", "http_prev") and k > 0:
                assert chained == conv[k - 1]["response_id"], (k, line)
            elif k == 0 and chained in warm:
                assert warm.pop(chained)["conversation"] == conversation, line
            else:
                assert chained is None, (k, line)
            usage = line["usage"]
            w = workload[(conversation, k)]
            assert (w["mode"], w["input_tokens"], w["output_tokens"]) == (
                line["mode"],
                usage["input_tokens"],
                usage["output_tokens"],
            ), (w, line)
            assert w["cached_tokens"] == usage.get("input_tokens_details", {}).get("cached_tokens", 0), (w, line)
            assert w["tool_call"] == (k < len(conv) - 1), w
            assert usage["input_tokens"] > 0 and usage["output_tokens"] > 0, line
            if k < len(conv) - 1:  # the client's time from this response's end to its next request
                assert w["tool_time_s"] == pytest.approx(conv[k + 1]["sent_at"] - line["done_at"], abs=1e-5), (w, line)
            # Streamed turns carry their first token's time; these flows' `http_prev` loops send
            # their first turn unstreamed (a whole JSON body).
            unstreamed = k == 0 and len(conv) > 1 and conv[1]["mode"] == "http_prev"
            assert ("first_token_at" in line) != unstreamed, line
    assert not warm, warm  # every warm-up continued by its conversation's first turn
    return list(by_conversation.values())


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


# A profile no preset holds, for the chains from a live server to a prediction
# (tests/sim/measure/test_driver.py, tests/sim/harness/test_predict.py): hosted's shape at other
# sizes (waits of 45 to 270 ms), large enough beside the loopback's own CPU time (server, recorder
# and client share one process) on a shared machine for the fit to follow the profile.
OWN_PROFILE: Final = CostProfile(
    name="own",
    rtt_s=0.090,
    uplink_bytes_per_s=5e6,
    auth_s=0.075,
    routing_s=0.150,
    validate_s_per_token=1e-5,
    state_load_s=0.060,
    safety_call_s=0.180,
    safety_s_per_token=1e-5,
    inference_hop_s=0.045,
    billing_s=0.270,
)
OWN_MODEL: Final = {"tps": 800.0, "prefill_tok_per_s": 8000.0, "model_latency_s": 0.15}
_PREDICTED: Final = re.compile(r"^(\w+)\s+(-?[\d.]+) %\s+(-?[\d.]+) %–(-?[\d.]+) %", re.M)


def own_profile_app() -> web.Application:
    """longrun's server on the wall clock running `OWN_PROFILE` over a model of `OWN_MODEL`'s rates
    (three tool calls a rollout)."""
    clock = AsyncioClock()
    model = SimulatedModel(
        clock=clock,
        policy=DefaultPolicy(tool_calls=3),
        seed=3,
        decode_tok_per_s=OWN_MODEL["tps"],
        prefill_tok_per_s=OWN_MODEL["prefill_tok_per_s"],
        model_latency_s=OWN_MODEL["model_latency_s"],
    )
    return make_app(model=model, store=MemoryStore(), clock=clock, config=ServerConfig(profile=OWN_PROFILE), seed=3)


def predicted_saved(out: str) -> dict[str, tuple[float, float, float]]:
    """`sim calibrate --predict`'s table: each mode's time saved and its interval, as fractions."""
    return {m: (float(s) / 100, float(lo) / 100, float(hi) / 100) for m, s, lo, hi in _PREDICTED.findall(out)}
