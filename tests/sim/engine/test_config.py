"""What a run says about the real engine (sim/engine/config.py): the prefix cache's granularity
the prediction of the engine uses comes from the engine's dialect unless the run states it."""

from __future__ import annotations

import msgspec
import pytest

from sim.engine.config import EngineConfig


def test_the_engines_prefix_granularity_is_its_dialects_unless_stated() -> None:
    assert EngineConfig().prefix_block_tokens == 16  # the simulator's own blocks
    assert EngineConfig(engine_kind="llamacpp").prefix_block_tokens == 1  # a slot reuses its KV to the token
    openai = EngineConfig(engine_kind="openai", engine_url="http://127.0.0.1:8000")
    assert openai.prefix_block_tokens == 16  # vLLM's default --block-size
    assert msgspec.structs.replace(openai, engine_block_tokens=32).prefix_block_tokens == 32
    with pytest.raises(msgspec.ValidationError, match="engine_block_tokens"):
        msgspec.convert({"engine_block_tokens": 0}, EngineConfig)
