"""The simulated accelerator: a `prototype.model.TokenModel` that paces real tokens on a `Clock`.

Theory of operation. One `sample` call is one model turn:

1. **Plan.** The `Policy` decides the turn's items from the request and an rng
   seeded by ``SeedSequence([seed, conversation_key, turn_index])``: the output
   depends only on (seed, conversation, turn), never on the transport or on
   what else the model is doing (the "same tokens in every mode" invariant).
2. **Tokenize.** Each item's text is encoded with the real o200k_base
   vocabulary, so `usage` counts are real counts. ``max_output_tokens`` caps the
   turn's total (message text and function-call arguments alike): the item
   that crosses the cap is cut at the cap, later items are dropped, and the turn
   ends with ``SamplingFinished("max_output_tokens")``.
3. **Prefill.** The first token is due at::

       t0 = start + model_latency_s + (prompt_tokens - cached_tokens) / prefill_tok_per_s

   i.e. a fixed model-side latency plus linear prefill of the uncached suffix
   (workloads.md section 2: prefill ~20K tok/s uncached, cached tokens skip
   prefill, model-side TTFT ~0.3 s at 1K input). Both default to "free" here;
   the caller picks the operating point.
4. **Decode.** Token i of the turn (0-based, across items) is due at the
   absolute time ``t0 + i / decode_tok_per_s`` (65 tok/s for GPT-5-class,
   1,000 tok/s for the fast tier, workloads.md section 2). At each wake-up the
   model yields every token already due, back to back with no await between
   them, then sleeps until the next one is due. Because deadlines are absolute,
   a late wake-up makes the next batch larger instead of shifting every later
   token: the long-run rate is exact whatever the loop's lateness. Relative
   sleeps (``sleep(1 / rate)`` per token) would lose the lateness on every
   token. ``decode_tok_per_s = math.inf`` means unpaced: after the prefill wait
   all tokens come at once with no further sleep.

Token text: one `TokensSampled` per token, whose ``text`` comes from an
incremental UTF-8 decoder over the token's bytes. A token that ends inside a
multi-byte character carries "" and the completing token carries the
character, so an item's texts concatenate to exactly its text (the last token
of an item flushes the decoder, so a cut inside a character yields U+FFFD
rather than losing bytes).

`statistics()` counts requests and prompt/prefilled tokens when sampling
starts and output tokens as they are yielded (a cancelled turn counts what it
produced).
"""

from __future__ import annotations

import codecs
import math
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Final

import numpy as np

from prototype.clock import Clock
from prototype.model import (
    ItemFinished,
    ItemStarted,
    ModelEvent,
    ModelRequest,
    SamplingFinished,
    TokensSampled,
)
from prototype.tokenizer import Tokenizer, get_tokenizer
from sim.policy import PlannedItem, Policy

__all__ = ["ModelStatistics", "SimulatedModel", "turn_rng"]

_U64_MASK: Final = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class ModelStatistics:
    requests: int = 0  # `sample` calls started
    prompt_tokens: int = 0  # sum of request.prompt_tokens
    prefilled_tokens: int = 0  # sum of uncached prompt tokens (prompt_tokens - cached_tokens)
    output_tokens: int = 0  # tokens yielded


def _entropy(value: int) -> int:
    # SeedSequence takes non-negative ints; map a negative hash to its 64-bit
    # two's complement, which cannot collide with a non-negative 64-bit hash.
    return value if value >= 0 else value & _U64_MASK


def turn_rng(seed: int, conversation_key: int, turn_index: int) -> np.random.Generator:
    """The rng of one model turn; a function of (seed, conversation, turn) only."""
    entropy = [_entropy(seed), _entropy(conversation_key), _entropy(turn_index)]
    return np.random.default_rng(np.random.SeedSequence(entropy))


class SimulatedModel:
    """A `TokenModel` whose words come from a `Policy` and whose timing from a `Clock`.

    Parameters (units in the names): ``decode_tok_per_s`` > 0 (``math.inf`` =
    unpaced), ``model_latency_s`` >= 0 (fixed part of TTFT), ``prefill_tok_per_s``
    > 0 (``math.inf`` = free prefill). ``tokenizer`` defaults to the shared
    o200k_base instance. The model keeps no per-conversation state, so one
    instance may serve any number of concurrent turns.
    """

    def __init__(
        self,
        *,
        clock: Clock,
        policy: Policy,
        tokenizer: Tokenizer | None = None,
        seed: int = 0,
        decode_tok_per_s: float = 1000.0,
        model_latency_s: float = 0.0,
        prefill_tok_per_s: float = math.inf,
    ) -> None:
        if not decode_tok_per_s > 0:
            raise ValueError(f"decode_tok_per_s must be > 0, got {decode_tok_per_s}")
        if not prefill_tok_per_s > 0:
            raise ValueError(f"prefill_tok_per_s must be > 0, got {prefill_tok_per_s}")
        if not (model_latency_s >= 0 and math.isfinite(model_latency_s)):
            raise ValueError(f"model_latency_s must be finite and >= 0, got {model_latency_s}")
        self.clock = clock
        self.policy = policy
        self.tokenizer = tokenizer if tokenizer is not None else get_tokenizer()
        self.seed = seed
        self.decode_tok_per_s = decode_tok_per_s
        self.model_latency_s = model_latency_s
        self.prefill_tok_per_s = prefill_tok_per_s
        self._requests = 0
        self._prompt_tokens = 0
        self._prefilled_tokens = 0
        self._output_tokens = 0

    def statistics(self) -> ModelStatistics:
        return ModelStatistics(
            requests=self._requests,
            prompt_tokens=self._prompt_tokens,
            prefilled_tokens=self._prefilled_tokens,
            output_tokens=self._output_tokens,
        )

    def first_token_delay_s(self, request: ModelRequest) -> float:
        """Seconds from the start of `sample` to the first token (step 3 of the module docstring)."""
        uncached = request.prompt_tokens - request.cached_tokens
        return self.model_latency_s + uncached / self.prefill_tok_per_s

    async def sample(self, request: ModelRequest) -> AsyncGenerator[ModelEvent, None]:
        """Stream one turn: ``(ItemStarted TokensSampled* ItemFinished)* SamplingFinished``.

        Raises `ValueError` (before any event) if ``cached_tokens`` is outside
        ``[0, prompt_tokens]`` or ``max_output_tokens`` is negative.
        """
        if not 0 <= request.cached_tokens <= request.prompt_tokens:
            raise ValueError(
                f"cached_tokens={request.cached_tokens} outside [0, prompt_tokens={request.prompt_tokens}]"
            )
        budget = request.max_output_tokens
        if budget is not None and budget < 0:
            raise ValueError(f"max_output_tokens must be >= 0, got {budget}")
        start = self.clock.now()
        self._requests += 1
        self._prompt_tokens += request.prompt_tokens
        self._prefilled_tokens += request.prompt_tokens - request.cached_tokens

        rng = turn_rng(self.seed, request.conversation_key, request.turn_index)
        planned = self.policy.plan(request, rng)
        encoded = [self.tokenizer.encode_list(item.text) for item in planned]

        # Apply max_output_tokens up front: the plan is fixed, so the cut is too.
        items: list[tuple[PlannedItem, list[int]]] = []
        truncated = False
        left = budget
        for item, ids in zip(planned, encoded, strict=True):
            if left is not None:
                if left == 0 and ids:
                    truncated = True  # nothing of this item fits
                    break
                if len(ids) > left:
                    ids = ids[:left]
                    truncated = True
                left -= len(ids)
            items.append((item, ids))
            if truncated:
                break

        t0 = start + self.first_token_delay_s(request)
        await self.clock.sleep_until(t0)
        paced = math.isfinite(self.decode_tok_per_s)
        index = 0  # token index within the turn
        for item, ids in items:
            yield ItemStarted(item.kind, item.name)
            decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
            last = len(ids) - 1
            for position, token_id in enumerate(ids):
                if paced:
                    due = t0 + index / self.decode_tok_per_s
                    if due > self.clock.now():
                        await self.clock.sleep_until(due)
                text = decoder.decode(self.tokenizer.token_bytes(token_id), final=position == last)
                index += 1
                self._output_tokens += 1
                yield TokensSampled((token_id,), text)
            yield ItemFinished()
        yield SamplingFinished("max_output_tokens" if truncated else "stop")
