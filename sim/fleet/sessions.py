"""A session as the fleet sees it: per turn the tokens, bytes and tool time every mode sees.

A session is one rollout of the comparison (`sim/rollout/spec.py` `make_spec`) or of a workload
(`sim/rollout/workload.py` `draw_rollouts`), built by the same functions from the same seeded
streams, so a capacity run and `python -m sim compare` see the same tool times and tool outputs
for a seed. The model's output per turn is the server's own: `DefaultPolicy.plan` on the turn's
rng (`turn_rng(seed, conversation, turn)`) and the real o200k_base tokenizer, so every mode's
turn k has the same output tokens as on the full path. Only counts are kept (the texts are
dropped once measured).

Rendering is the server's chat template (prototype/render.py): the first prompt is the
instructions, the tool definition and the task with their template tokens; each tool step adds
the call and its output with `STEP_TEMPLATE_TOKENS` of template. A tool output's words are
single o200k tokens and each of its newlines one more (`tool_output_text`), so its tokens are
counted from the text without encoding it. A test checks every count against the full path.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import msgspec
import numpy as np

from prototype.context.conversation import conversation_key
from prototype.context.tokenizer import get_tokenizer
from prototype.model import FunctionTool, ModelRequest
from sim.model.accelerator import turn_rng
from sim.model.policy import DefaultPolicy
from sim.rollout.spec import _WORDS, EXEC_TOOL, RolloutSpec, make_spec
from sim.rollout.workload import Workload, draw_rollouts

__all__ = [
    "STEP_TEMPLATE_TOKENS",
    "SessionTokens",
    "array_sessions",
    "custom_sessions",
    "from_spec",
    "workload_sessions",
]

STEP_TEMPLATE_TOKENS: Final = 36  # template around one function call and its output (checked against the full path)
FIRST_TEMPLATE_TOKENS: Final = 96  # template and tool definition around the instructions and the task

_TOOL: Final = FunctionTool(
    name=EXEC_TOOL["name"],
    description=EXEC_TOOL["description"],
    parameters_json=msgspec.json.encode(EXEC_TOOL["parameters"]),
    strict=EXEC_TOOL["strict"],
)


@dataclass(frozen=True, slots=True)
class SessionTokens:
    """One session: the first prompt, then per model turn k its output, and per tool step k
    (between turn k and k + 1) the tool's time and its output's tokens and JSON bytes."""

    index: int
    instruction_tokens: int  # the shared system prompt: the same in every session of a run
    first_prompt_tokens: int
    instruction_bytes: int  # the instructions' JSON string
    first_request_bytes: int  # the first request's texts: instructions and task
    output_tokens: tuple[int, ...]  # per model turn (tool steps + 1)
    output_bytes: tuple[int, ...]  # per model turn: its item's JSON bytes (a call's arguments, or the answer)
    tool_times_s: tuple[float, ...]  # per tool step
    tool_tokens: tuple[int, ...]  # per tool step
    tool_bytes: tuple[int, ...]  # per tool step: the output's JSON string bytes

    @property
    def turns(self) -> int:
        return len(self.output_tokens)

    def prompt_tokens(self) -> list[int]:
        """Prompt tokens of each model turn: the context grows by the call and its output."""
        p = self.first_prompt_tokens
        out = [p]
        for k in range(self.turns - 1):
            p += self.output_tokens[k] + self.tool_tokens[k] + STEP_TEMPLATE_TOKENS
            out.append(p)
        return out


@functools.lru_cache(maxsize=8)
def _instruction_tokens(text: str) -> int:
    return len(get_tokenizer().encode_list(text))


def _json_bytes(text: str) -> int:
    return len(msgspec.json.encode(text))


def from_spec(spec: RolloutSpec, tool_calls: int) -> SessionTokens:
    """The token profile of `spec` with `tool_calls` calls, then a text answer."""
    tokenizer = get_tokenizer()
    key = conversation_key(spec.task)
    policy = DefaultPolicy(tool_calls=tool_calls)
    outputs, output_bytes = [], []
    for k in range(tool_calls + 1):
        request = ModelRequest(
            prompt=(), prompt_tokens=0, resident_tokens=0, turn_index=k, conversation_key=key, tools=(_TOOL,)
        )
        items = policy.plan(request, turn_rng(spec.seed, key, k))
        outputs.append(sum(len(tokenizer.encode_list(item.text)) for item in items))
        output_bytes.append(sum(_json_bytes(item.text) for item in items))
    texts = spec.tool_outputs[:tool_calls]
    tool_tokens = tuple(t.count(" ") + 2 * t.count("\n") + 1 for t in texts)
    instruction = _instruction_tokens(spec.instructions)
    task = len(tokenizer.encode_list(spec.task))
    return SessionTokens(
        index=spec.index,
        instruction_tokens=instruction,
        first_prompt_tokens=instruction + task + FIRST_TEMPLATE_TOKENS,
        instruction_bytes=_json_bytes(spec.instructions),
        first_request_bytes=_json_bytes(spec.instructions) + _json_bytes(spec.task),
        output_tokens=tuple(outputs),
        output_bytes=tuple(output_bytes),
        tool_times_s=tuple(spec.tool_times_s[:tool_calls]),
        tool_tokens=tool_tokens,
        tool_bytes=tuple(_json_bytes(t) for t in texts),
    )


def custom_sessions(
    seed: int,
    indices: Sequence[int],
    *,
    tool_calls: int,
    tool_time_median_s: float,
    tool_time_sigma: float,
    tool_output_median_tokens: int,
    system_prompt_tokens: int,
) -> list[SessionTokens]:
    """The comparison's own rollouts (`CompareConfig`'s custom workload) as sessions."""
    return [
        from_spec(
            make_spec(
                seed,
                i,
                max_turns=tool_calls,
                tool_time_median_s=tool_time_median_s,
                tool_time_sigma=tool_time_sigma,
                tool_output_median_tokens=tool_output_median_tokens,
                system_prompt_tokens=system_prompt_tokens,
            ),
            tool_calls,
        )
        for i in indices
    ]


def workload_sessions(w: Workload, seed: int, count: int, *, start: int = 0) -> list[SessionTokens]:
    """`draw_rollouts`'s rollouts `start` … `start + count − 1` as sessions."""
    specs, _ = draw_rollouts(w, seed, count, start=start)
    return [from_spec(s, len(s.tool_outputs)) for s in specs]


_ARRAY_STREAM: Final = 0xA77A  # SeedSequence word of the array-built sessions' draws
_POOL_SESSIONS: Final = 64  # sessions whose policy outputs form the resampled pool


def array_sessions(w: Workload, seed: int, count: int) -> list[SessionTokens]:
    """`count` sessions of workload `w` built as arrays, for points too large to plan and tokenize
    every turn (100,000 sessions): the same distributions as `workload_sessions`, other draws.

    * Turns, tool times (the workload's mixture and cap) and tool-output sizes are drawn for the
      whole point at once from one stream, not per rollout and turn; a tool output's tokens are
      counted from its size (its words are one token each, each of its ⌈n/12⌉ − 1 newlines
      one more: `tool_output_text`'s layout) and its JSON bytes from the vocabulary's mean word
      length, so no text is made.
    * Each turn's output (tokens and JSON bytes) is resampled from the server policy's own
      outputs for the first `_POOL_SESSIONS` rollouts of `workload_sessions` (a call turn from
      the calls, the last turn from the answers), so the output sizes keep their distribution.

    The sessions are the same in every mode and variant of a point; they are not the full path's
    rollouts turn for turn (`workload_sessions` is, and a test checks it)."""
    pool = workload_sessions(w, seed, min(_POOL_SESSIONS, count))
    calls = np.array([(t, b) for s in pool for t, b in zip(s.output_tokens[:-1], s.output_bytes[:-1], strict=True)])
    answers = np.array([(s.output_tokens[-1], s.output_bytes[-1]) for s in pool])
    first = pool[0]
    rng = np.random.default_rng(np.random.SeedSequence([seed, _ARRAY_STREAM]))
    turns = np.clip(np.rint(w.turns_median * np.exp(w.turns_sigma * rng.standard_normal(count))), 1, w.turns_cap)
    steps = (turns - 1).astype(np.int64)
    total = int(steps.sum())
    weights = np.array([c.weight for c in w.tool_time], dtype=float)
    component = rng.choice(len(w.tool_time), size=total, p=weights / weights.sum())
    medians = np.array([c.median_s for c in w.tool_time])[component]
    sigmas = np.array([c.sigma for c in w.tool_time])[component]
    times = np.minimum(medians * np.exp(sigmas * rng.standard_normal(total)), w.tool_time_cap_s)
    size = np.minimum(w.tool_output_median_tokens * np.exp(w.tool_output_sigma * rng.standard_normal(total)), 10_000)
    words = np.maximum(1, size.astype(np.int64))
    lines = -(-words // 12)
    tokens = words + lines - 1
    mean_word = float(np.mean([len(x) for x in _WORDS]))
    nbytes = np.rint(words * mean_word + (words - lines) + 2 * (lines - 1) + 2).astype(np.int64)
    pick_calls = calls[rng.integers(0, len(calls), size=total)]
    pick_answers = answers[rng.integers(0, len(answers), size=count)]
    ends = np.cumsum(steps)
    out = []
    for i in range(count):
        a, b = int(ends[i] - steps[i]), int(ends[i])
        c_tok, c_bytes = pick_calls[a:b, 0].tolist(), pick_calls[a:b, 1].tolist()
        out.append(
            SessionTokens(
                index=i,
                instruction_tokens=first.instruction_tokens,
                first_prompt_tokens=first.first_prompt_tokens,
                instruction_bytes=first.instruction_bytes,
                first_request_bytes=first.first_request_bytes,
                output_tokens=(*c_tok, int(pick_answers[i, 0])),
                output_bytes=(*c_bytes, int(pick_answers[i, 1])),
                tool_times_s=tuple(times[a:b].tolist()),
                tool_tokens=tuple(tokens[a:b].tolist()),
                tool_bytes=tuple(nbytes[a:b].tolist()),
            )
        )
    return out
