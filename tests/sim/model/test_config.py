"""The model's configuration (sim/model/config.py): the prefix cache's granularity is a setting."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from sim.harness.experiment import CompareConfig
from sim.model.config import HOSTED_MODEL, ModelConfig, build_model
from sim.model.kv import DEFAULT_BLOCK_TOKENS
from sim.model.policy import DefaultPolicy
from sim.runtime.virtual import VirtualClock


def _cached(block_tokens: int, cached: int, prompt: int) -> int:
    """Tokens a model of `block_tokens` finds cached for a prompt of `prompt` tokens whose first
    `cached` tokens an earlier turn inserted."""
    config = ModelConfig(prefix_block_tokens=block_tokens)
    model = build_model(config, clock=VirtualClock(), policy=DefaultPolicy(tool_calls=1))
    assert model.prefix_cache is not None and model.prefix_cache.block_tokens == block_tokens
    tokens = np.arange(prompt, dtype=np.uint32)
    model.prefix_cache.insert([tokens[:cached]], now=0.0)
    return model.prefix_cache.match([tokens])


def test_the_prefix_caches_granularity_is_the_models_setting() -> None:
    """37 tokens cached, a 50-token prompt that starts with them: 16-token blocks find 32 (two
    whole blocks), token-exact reuse (llama.cpp's slots) all 37; the last prompt token is always
    computed, whatever the blocks."""
    assert _cached(DEFAULT_BLOCK_TOKENS, 37, 50) == 32
    assert _cached(1, 37, 50) == 37
    assert _cached(8, 37, 50) == 32
    assert _cached(1, 50, 50) == 49 and _cached(16, 50, 50) == 48


def test_the_default_granularity_is_unchanged_and_a_capacity_below_a_block_is_refused() -> None:
    assert ModelConfig().prefix_block_tokens == HOSTED_MODEL.prefix_block_tokens == 16
    assert CompareConfig().model.prefix_block_tokens == 16
    with pytest.raises(msgspec.ValidationError, match="prefix_block_tokens"):
        msgspec.convert({"prefix_block_tokens": 0}, ModelConfig)
    with pytest.raises(ValueError, match="holds no block"):
        ModelConfig(kv_capacity_tokens=8, prefix_block_tokens=16)
