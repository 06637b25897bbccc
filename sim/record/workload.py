"""What the recorder writes besides the capture: the user's own rollouts, `workload.jsonl`, in
the trace-replay format's sized flavour (sim/rollout/replay.py), so `python -m sim compare
--trace` and `calibrate --predict --trace` run *their* agent.

Sans-IO: the capture (sim/record/capture.py) hands this module each completed turn (its
conversation, turn, usage, whether the response called a tool, when it ended) and each request
as it begins. One line per turn:

    {"rollout": "conv-0", "turn": 0, "mode": "http", "input_tokens": 812, "cached_tokens": 0,
     "output_tokens": 95, "tool_call": true, "tool_time_s": 1.234}

`tool_time_s` is the client's time between the response's end and the conversation's next
request (its tool and its own work); a turn's line is written when that next request begins,
so lines come out as conversations advance. A conversation's last turn has no next request: it
is written at shutdown as the rollout's answer (`"tool_call": false`). A turn that named tool
calls but is the last the recorder saw is written the same way: the replay ends a rollout on a
text turn. Every line is one `write` of whole bytes; a killed recorder leaves the lines of the
turns that had a next request, each whole. Content (the task, each turn's output, each tool's
output) is written only when asked (`keep_content`), and then only the texts, never a key.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
from msgspec import Raw

__all__ = ["Turn", "Workload", "WorkloadLine", "assistant_of", "task_of", "tool_output_of", "usage_counts"]


class _Details(msgspec.Struct):
    cached_tokens: int = 0


class _Usage(msgspec.Struct):
    input_tokens: int = 0
    output_tokens: int = 0
    input_tokens_details: _Details | None = None


_usage = msgspec.json.Decoder(_Usage)
_encoder = msgspec.json.Encoder()


def usage_counts(usage: Raw) -> tuple[int, int, int] | None:
    """(input, cached, output) tokens of a `usage` object; None if it is not one."""
    try:
        u = _usage.decode(usage)
    except msgspec.DecodeError:
        return None
    cached = u.input_tokens_details.cached_tokens if u.input_tokens_details is not None else 0
    return u.input_tokens, cached, u.output_tokens


class _Part(msgspec.Struct):
    text: str | None = None


class _Item(msgspec.Struct):
    """The fields of an input or output item the content is read from."""

    type: str | None = None
    role: str | None = None
    content: str | list[_Part] | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[_Part] | None = None


_item = msgspec.json.Decoder(_Item)
_output = msgspec.json.Decoder(list[_Item])


def _text(content: str | list[_Part] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(p.text or "" for p in content)


def task_of(input_items: list[bytes]) -> str | None:
    """A conversation's first user message (the task), from its first request's input items (a
    string input is one item, its JSON string)."""
    for raw in input_items:
        try:
            item = _item.decode(raw)
        except msgspec.ValidationError:  # a string input
            return str(msgspec.json.decode(raw))
        except msgspec.DecodeError:
            continue
        if item.role == "user":
            return _text(item.content)
    return None


def tool_output_of(new_items: list[bytes]) -> str | None:
    """The tools' output a request sends: its new `function_call_output` items', joined by lines."""
    outputs = []
    for raw in new_items:
        try:
            item = _item.decode(raw)
        except msgspec.DecodeError:
            continue
        if item.type == "function_call_output":
            outputs.append(_text(item.output))
    return "\n".join(outputs) if outputs else None


def assistant_of(output: Raw) -> Raw | None:
    """A response's `output` as a trace's `assistant` turn (a `--script` line): its function calls,
    else its messages' text."""
    try:
        items = _output.decode(output)
    except msgspec.DecodeError:
        return None
    calls = [{"name": i.name, "arguments": i.arguments or "{}"} for i in items if i.type == "function_call"]
    if len(calls) == 1:
        return Raw(_encoder.encode({"tool_call": calls[0]}))
    if calls:
        return Raw(_encoder.encode({"tool_calls": calls}))
    return Raw(_encoder.encode({"text": "".join(_text(i.content) for i in items if i.type == "message")}))


class WorkloadLine(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One turn of the user's rollouts (the trace format's sized flavour, sim/rollout/replay.py)."""

    rollout: str
    turn: int
    mode: str
    input_tokens: int
    cached_tokens: int
    output_tokens: int
    tool_call: bool
    tool_time_s: float | None = None
    # With --keep-content only: the first user message, the model's turn, the tools' output.
    task: str | None = None
    instructions: str | None = None
    assistant: Raw | None = None
    tool_output: str | None = None


@dataclass(slots=True)
class Turn:
    """A completed turn waiting for its conversation's next request."""

    conversation: str
    turn: int
    mode: str
    usage: tuple[int, int, int]
    done_at: float
    task: str | None = None
    instructions: str | None = None
    assistant: Raw | None = None


class Workload:
    """The turns that wait for their conversation's next request, and the lines already due."""

    def __init__(self) -> None:
        self._waiting: dict[str, Turn] = {}  # conversation -> its last completed turn
        self.written = 0

    def completed(self, turn: Turn) -> None:
        """A turn's response ended and its line waits for the conversation's next request."""
        self._waiting[turn.conversation] = turn

    def began(self, conversation: str, sent_at: float, tool_output: str | None = None) -> bytes | None:
        """A request of `conversation` began at `sent_at`: the previous turn's line, now that its
        tool time is known (None for a conversation's first request)."""
        turn = self._waiting.pop(conversation, None)
        if turn is None:
            return None
        return self._line(turn, tool_time_s=max(0.0, sent_at - turn.done_at), tool_output=tool_output)

    def close(self) -> bytes:
        """The lines of every conversation's last turn: the rollouts' answers."""
        out = b"".join(self._line(t, tool_time_s=None, tool_output=None) for t in self._waiting.values())
        self._waiting.clear()
        return out

    def _line(self, t: Turn, *, tool_time_s: float | None, tool_output: str | None) -> bytes:
        input_tokens, cached, output = t.usage
        line = WorkloadLine(
            rollout=t.conversation,
            turn=t.turn,
            mode=t.mode,
            input_tokens=input_tokens,
            cached_tokens=cached,
            output_tokens=output,
            tool_call=tool_time_s is not None,
            tool_time_s=None if tool_time_s is None else round(tool_time_s, 6),
            task=t.task,
            instructions=t.instructions,
            assistant=t.assistant,
            tool_output=tool_output if tool_time_s is not None else None,
        )
        self.written += 1
        return _encoder.encode(line) + b"\n"
