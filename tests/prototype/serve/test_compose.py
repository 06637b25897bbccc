"""`prototype.serve.compose`: the service every transport serves, composed from the config whole;
render threads only when the caller asks; one `close` for the whole of it."""

from __future__ import annotations

import threading

import pytest

from prototype.config import ModelLimits, ServerConfig
from prototype.context.tokenizer import Tokenizer
from prototype.pipeline import PROFILES, Optimization
from prototype.serve.compose import Overrides, compose
from prototype.serve.wallclock import AsyncioClock
from prototype.store.memory import MemoryStore
from sim.model.config import ModelConfig, build_model
from sim.model.policy import DefaultPolicy


def _parts() -> dict[str, object]:
    clock = AsyncioClock()
    return {
        "model": build_model(ModelConfig(tps=0), clock=clock, policy=DefaultPolicy(tool_calls=1)),
        "store": MemoryStore(),
        "clock": clock,
    }


async def test_the_engine_takes_the_config_whole() -> None:
    config = ServerConfig(
        profile="hosted",
        disable=frozenset({Optimization.TOKEN_CACHE}),
        model=ModelLimits(context_window=8_000, max_output_tokens=1_000),
        steer_boundary="token",
        multi_agent_holds_calls=False,
    )
    engine = compose(config, **_parts()).engine  # type: ignore[arg-type]
    assert engine.profile == config.cost_profile == PROFILES["hosted"]
    assert engine.optimizations == config.optimizations and Optimization.TOKEN_CACHE not in engine.optimizations
    assert (engine.context_window, engine.output_token_limit, engine.input_token_limit) == (8_000, 1_000, 7_000)
    assert engine.steer_boundary == "token" and engine.multi_agent_holds_calls is False


async def test_render_threads_only_when_the_caller_asks_and_the_config_has_some() -> None:
    two = ServerConfig(render_threads=2)
    asked = compose(two, render_threads=True, **_parts())  # type: ignore[arg-type]
    try:
        assert asked.engine.render_executor is asked.executor is not None
        names = {asked.executor.submit(lambda: threading.current_thread().name).result() for _ in range(4)}
        assert names and all(name.startswith("longrun-render") for name in names)
    finally:
        await asked.close()
    for config, threads in ((two, False), (ServerConfig(render_threads=0), True)):
        service = compose(config, render_threads=threads, **_parts())  # type: ignore[arg-type]
        assert service.executor is None and service.engine.render_executor is None


async def test_overrides_replace_the_default_parts() -> None:
    tokenizer = Tokenizer()
    engine = compose(ServerConfig(), overrides=Overrides(tokenizer=tokenizer), **_parts()).engine  # type: ignore[arg-type]
    assert engine.tokenizer is tokenizer
    assert compose(ServerConfig(), **_parts()).engine.tokenizer is not tokenizer  # type: ignore[arg-type]


async def test_close_stops_the_threads_and_closes_the_store_once_or_twice() -> None:
    service = compose(ServerConfig(render_threads=1), **_parts())  # type: ignore[arg-type]
    executor = service.executor
    assert executor is not None
    await service.engine.store.put("resp_1", b"{}")
    await service.close()
    await service.close()
    with pytest.raises(RuntimeError, match="shutdown"):
        executor.submit(sum, [1])
    with pytest.raises(RuntimeError, match="closed"):
        await service.engine.store.get("resp_1")
