"""The OpenAI-compatible completions dialect (sim/engine/completions.py) without a real engine:
a small server in vLLM's shapes (ids as `token_id:N`, usage with every chunk, a flat error
object, `POST /reset_prefix_cache`) behind `EngineModel`, and the dialect's refusals. The real
llama.cpp engine spoken to in this dialect is in test_engine.py."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import openai
import pytest
from aiohttp import web
from openai import AsyncOpenAI

from prototype.context.conversation import conversation_key
from prototype.model import ContextWindowExceeded, ImplicitCacheOnly, ModelRequest, Prefilled, TokensSampled
from prototype.serve.app import make_app
from prototype.serve.wallclock import AsyncioClock
from prototype.store.memory import MemoryStore
from sim.engine.backend import engine_model
from sim.engine.completions import CompletionsDialect, completions_error
from sim.engine.config import EngineConfig
from sim.engine.model import EngineError, EngineModel, verify_ends
from sim.harness.experiment import _PromptLog
from sim.model.accelerator import SimulatedModel
from sim.model.policy import DefaultPolicy
from sim.rollout.spec import RolloutSpec
from tests.support import served

pytestmark = pytest.mark.timeout(60)


class FakeVLLM:
    """What vLLM's OpenAI server streams for a token-id prompt, with a one-entry prefix cache:
    the longest common prefix with the last prompt (and its output) counts as cached."""

    def __init__(self, *, ids: bool = True, usage: bool = True, echo_grammar: bool = False) -> None:
        self.ids, self.usage, self.echo_grammar = ids, usage, echo_grammar
        self.last: list[int] = []
        self.bodies: list[dict[str, Any]] = []
        self.resets = 0

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        prompt: list[int] = body["prompt"]
        if len(prompt) > 4096:
            error = {"object": "error", "message": "This model's maximum context length is 4096 tokens.", "code": 400}
            return web.json_response(error, status=400)
        cached = 0  # the last prompt token is always computed (it yields the first output)
        while cached < min(len(prompt) - 1, len(self.last)) and prompt[cached] == self.last[cached]:
            cached += 1
        n = body["max_tokens"]
        if self.echo_grammar and "grammar" in body:  # a server honouring llama.cpp's token-id grammar
            out = [int(t.strip("<[]>")) for t in body["grammar"].removeprefix("root ::= ").split()]
        else:
            out = [5000 + i for i in range(n)]
        self.last = prompt + out
        reply = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await reply.prepare(request)
        usage = {"prompt_tokens": len(prompt), "prompt_tokens_details": {"cached_tokens": cached}}
        for i, token in enumerate(out):
            choice = {"index": 0, "text": "x", "finish_reason": "length" if i == n - 1 else None}
            choice["logprobs"] = {"tokens": [f"token_id:{token}" if self.ids else "x"], "token_logprobs": [-1.0]}
            chunk: dict[str, Any] = {"object": "text_completion", "choices": [choice]}
            if self.usage:
                chunk["usage"] = {**usage, "completion_tokens": i + 1, "total_tokens": len(prompt) + i + 1}
            await reply.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await reply.write(b"data: [DONE]\n\n")
        return reply

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "google/gemma-3-270m", "object": "model"}]})

    async def reset(self, request: web.Request) -> web.Response:
        self.resets += 1
        self.last = []
        return web.Response(text="OK")


@contextlib.asynccontextmanager
async def _vllm(fake: FakeVLLM) -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_post("/v1/completions", fake.completions)
    app.router.add_get("/v1/models", fake.models)
    app.router.add_post("/reset_prefix_cache", fake.reset)
    async with served(app) as port:
        yield f"http://127.0.0.1:{port}"


def _config(url: str, **fields: Any) -> EngineConfig:
    settings: dict[str, Any] = {
        "engine_kind": "openai",
        "engine_url": url,
        "engine_decode": "length",
        "engine_ctx_per_slot": 4096,
        "engine_reset": ("/reset_prefix_cache",),
    }
    return EngineConfig(**{**settings, **fields})


def _request(prompt: np.ndarray[Any, Any], turn: int = 0) -> ModelRequest:
    return ModelRequest(
        prompt=(prompt,), prompt_tokens=len(prompt), resident_tokens=0, turn_index=turn, conversation_key=1
    )


async def _sample(model: EngineModel, request: ModelRequest) -> list[Any]:
    return [event async for event in model.sample(request)]


@contextlib.asynccontextmanager
async def _model(config: EngineConfig) -> AsyncIterator[EngineModel]:
    clock = AsyncioClock()
    planner = SimulatedModel(clock=clock, policy=DefaultPolicy(tool_calls=2), decode_tok_per_s=float("inf"))
    async with engine_model(config, planner=planner, clock=clock) as model:
        yield model


async def test_a_vllm_shaped_server_serves_turns_with_its_cached_counts() -> None:
    fake = FakeVLLM()
    async with _vllm(fake) as url, _model(_config(url)) as model:
        assert isinstance(model.dialect, CompletionsDialect) and model.dialect.model == "google/gemma-3-270m"
        prompt = np.arange(100, 400, dtype=np.uint32)
        first = await _sample(model, _request(prompt))
        # The same prompt again: the server's prefix cache has all of it (the BOS included).
        second = await _sample(model, _request(prompt))
        await model.reset()
    prefilled = [e for e in first if isinstance(e, Prefilled)], [e for e in second if isinstance(e, Prefilled)]
    assert prefilled[0][0].cached_tokens == 0 and prefilled[1][0].cached_tokens == len(prompt) - 1
    # The API streams the plan's tokens, paced by the engine's: the same in both turns.
    tokens = [[e.token_ids for e in events if isinstance(e, TokensSampled)] for events in (first, second)]
    assert tokens[0] == tokens[1] and tokens[0]
    body = fake.bodies[0]
    assert body["prompt"][0] == 2 and body["model"] == "google/gemma-3-270m" and "grammar" not in body
    assert body["stream_options"]["continuous_usage_stats"] and body["return_tokens_as_token_ids"]
    assert [(t.prompt_n, t.cache_n, t.slot, t.resident) for t in model.turns] == [
        (len(prompt) + 1, 0, -1, False),
        (1, len(prompt), -1, False),
    ]
    assert fake.resets == 1


async def test_forced_decoding_checks_every_id_the_server_returns() -> None:
    # A server that honours the token-id grammar decodes the plan; one that ignores it is refused
    # at the first id that differs (a run never goes on with other tokens in the KV).
    prompt = np.arange(100, 300, dtype=np.uint32)
    async with _vllm(FakeVLLM(echo_grammar=True)) as url, _model(_config(url, engine_decode="forced")) as model:
        events = await _sample(model, _request(prompt))
        assert any(isinstance(e, TokensSampled) for e in events)
    async with _vllm(FakeVLLM()) as url, _model(_config(url, engine_decode="forced")) as model:
        with pytest.raises(EngineError, match="forced decoding diverged at token 0"):
            await _sample(model, _request(prompt))


@pytest.mark.parametrize(
    ("fake", "message"),
    [
        (FakeVLLM(ids=False), "without token ids"),
        (FakeVLLM(usage=False), "no cached-token count"),
    ],
)
async def test_a_server_that_cannot_say_what_longrun_needs_is_refused(fake: FakeVLLM, message: str) -> None:
    async with _vllm(fake) as url, _model(_config(url)) as model:
        with pytest.raises(EngineError, match=message):
            await _sample(model, _request(np.arange(100, 200, dtype=np.uint32)))


async def test_errors_come_as_the_seams_exceptions() -> None:
    async with _vllm(FakeVLLM()) as url:
        async with _model(_config(url, engine_ctx_per_slot=8192)) as model:
            with pytest.raises(ContextWindowExceeded, match="maximum context length"):
                await _sample(model, _request(np.arange(5000, dtype=np.uint32)))
        async with _model(_config(url, engine_reset=())) as model:
            with pytest.raises(EngineError, match="--engine-reset"):
                await model.reset()
    assert isinstance(completions_error(500, b'{"error": {"message": "boom"}}'), EngineError)
    assert isinstance(completions_error(400, b"not json"), EngineError)
    with pytest.raises(ValueError, match="engine_url"):
        EngineConfig(engine_kind="openai")


async def test_the_engine_refuses_explicit_prompt_caching() -> None:
    """The engine's prefix cache cannot write or expire breakpoints: behind the real server, the
    openai SDK's `mode: "explicit"` gets the API's 400 and the engine never sees the turn; the
    implicit default is served with the engine's own cached count."""
    fake = FakeVLLM()
    async with _vllm(fake) as url, _model(_config(url)) as model:
        assert isinstance(model, ImplicitCacheOnly)
        app = make_app(model=model, store=MemoryStore(), clock=model.clock, seed=1)
        async with served(app) as port:
            base = f"http://127.0.0.1:{port}/v1"
            async with AsyncOpenAI(api_key="sk-test", base_url=base, max_retries=0, timeout=10.0) as client:
                with pytest.raises(openai.BadRequestError) as raised:
                    await client.responses.create(model="sim", input="hi", prompt_cache_options={"mode": "explicit"})
                body = raised.value.body
                assert isinstance(body, dict)
                assert (body["code"], body["param"]) == ("unsupported_parameter", "prompt_cache_options.mode")
                assert "the OpenAI-compatible engine's prefix cache" in body["message"]
                assert fake.bodies == []
                served_turn = await client.responses.create(model="sim", input="hi")
                assert served_turn.status == "completed" and len(fake.bodies) >= 1


async def test_verified_decoding_sends_the_plan_k_ids_a_pass_and_streams_each_pass_at_its_end() -> None:
    """Each pass is the prompt and the framed ids so far with one token asked (ignored); the API
    gets the plan's tokens, the same as forced decoding's, as each pass returns."""
    prompt = np.arange(100, 300, dtype=np.uint32)
    fake = FakeVLLM(echo_grammar=True)
    async with _vllm(fake) as url:
        async with _model(_config(url, engine_decode="forced")) as model:
            forced = await _sample(model, _request(prompt))
        planned = [int(t.strip("<[]>")) for t in fake.bodies[0]["grammar"].removeprefix("root ::= ").split()]
        fake.bodies.clear()
        seen: list[tuple[Any, int]] = []  # each event, with the passes the server had received when it came
        async with _model(_config(url, engine_decode="verified", engine_verify_k=4)) as model:
            async for event in model.sample(_request(prompt)):
                seen.append((event, len(fake.bodies)))
            turn = model.turns[0]
    ends = verify_ends(len(planned), 4)
    assert len(planned) > 9 and len(ends) == 2 + (len(planned) - 2) // 4
    head = fake.bodies[0]["prompt"]
    assert [b["prompt"] for b in fake.bodies] == [head + planned[:end] for end in ends]
    assert all(b["max_tokens"] == 1 and "grammar" not in b for b in fake.bodies)
    tokens = [e.token_ids for e, _ in seen if isinstance(e, TokensSampled)]
    assert tokens == [e.token_ids for e in forced if isinstance(e, TokensSampled)]
    # Prefilled after the first pass (the prompt alone), the last tokens after the last pass.
    assert isinstance(seen[0][0], Prefilled) and seen[0][1] == 1
    passes_at = [n for e, n in seen if isinstance(e, TokensSampled)]
    assert passes_at == sorted(passes_at) and passes_at[0] == 1 and passes_at[-1] == len(ends)
    assert turn.predicted_n == len(planned) and len(turn.passes) == len(ends) - 1
    assert [p.prompt_n for p in turn.passes] == [b - a for a, b in itertools.pairwise(ends)]


def test_verified_passes_end_where_forced_decoding_leaves_the_slot() -> None:
    assert verify_ends(0, 4) == [0] and verify_ends(1, 4) == [0]
    assert verify_ends(2, 4) == [0, 1]
    assert verify_ends(9, 4) == [0, 4, 8]
    assert verify_ends(10, 4) == [0, 4, 8, 9]


async def test_the_comparison_counts_each_engine_turn_however_its_stream_ends() -> None:
    """The comparison's per-turn counts (`RolloutResult.model_tokens`) from the engine: the cached
    tokens its `Prefilled` said and the tokens streamed, for a turn read whole, one closed early,
    one refused before its first event and one that fails after it."""
    prompt = np.arange(100, 300, dtype=np.uint32)
    task = "count the engine's turns"
    spec = RolloutSpec(0, 0, task, (), ())
    request = dataclasses.replace(_request(prompt), conversation_key=conversation_key(task))
    too_long = dataclasses.replace(request, prompt=(np.arange(5000, dtype=np.uint32),), prompt_tokens=5000)

    async def read(log: _PromptLog, request: ModelRequest, seen: list[Any], stop: int | None = None) -> list[Any]:
        async with contextlib.aclosing(log.sample(request)) as events:
            async for event in events:
                seen.append(event)
                if len(seen) == stop:
                    break
        return seen

    def counts(events: list[Any]) -> tuple[int, int]:
        cached = next((e.cached_tokens for e in events if isinstance(e, Prefilled)), 0)
        return cached, sum(len(e.token_ids) for e in events if isinstance(e, TokensSampled))

    async with _vllm(FakeVLLM()) as url:
        async with _model(_config(url)) as model:
            log = _PromptLog(model.planner)
            log.model = model
            first, second = await read(log, request, []), await read(log, request, [])
            cut = await read(log, request, [], 3)
            with pytest.raises(ContextWindowExceeded):
                await read(log, too_long, [])
            assert log.take("", spec)[1] == [counts(first), counts(second), counts(cut), (0, 0)]
            assert counts(first)[1] > counts(cut)[1] > 0 and counts(second)[0] == len(prompt) - 1
        async with _model(_config(url, engine_decode="forced")) as model:  # the server ignores the grammar
            log = _PromptLog(model.planner)
            log.model = model
            diverged: list[Any] = []
            with pytest.raises(EngineError, match="forced decoding diverged at token 0"):
                await read(log, request, diverged)
            assert [type(e) for e in diverged] == [Prefilled]
            assert log.take("", spec)[1] == [counts(diverged)] == [(len(prompt) - 1, 0)]
