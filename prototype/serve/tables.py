"""The protocol's state machines as Markdown, rendered from their tables.

`connection.TRANSITIONS` (a WebSocket lane) and `stream.TRANSITIONS` (one response's event
stream) are the one statement of the protocol's legal moves; docs/state-machines.md is this
module's output, and tests/test_docs.py checks that it is current. `make docs-tables` (or
`python3 -m prototype.serve.tables > docs/state-machines.md`) rewrites it.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from ..agents import machine as agents
from ..agents.events import SS
from ..response import stream
from ..ws import connection
from ..ws.lanes import CS

__all__ = ["render", "table"]

E = TypeVar("E", bound=enum.Enum)

HEADER = """# State machines

Generated from the code by `python3 -m prototype.serve.tables` (`make docs-tables`); do not edit by
hand: tests/test_docs.py fails when this page and the tables differ. Each row is one legal move:
in that state, that input runs the action and the machine goes to the next state. Any other
(state, input) pair is a bug in the caller and raises (`ConnectionStateError`, `StreamError`,
`AgentStateError`).
"""


def _doc(action: Callable[..., Any]) -> str:
    """The first sentence of an action's docstring, or nothing."""
    text = " ".join((action.__doc__ or "").split())
    return text.split(". ")[0].rstrip(".") if text else ""


def table(transitions: Mapping[tuple[E, type], tuple[Callable[..., Any], E]], states: type[E]) -> str:
    """One Markdown table, rows in the order of the states, then of the inputs' first use."""
    order = {state: i for i, state in enumerate(states)}
    inputs: dict[type, int] = {}
    for _, kind in transitions:
        inputs.setdefault(kind, len(inputs))
    rows = sorted(transitions.items(), key=lambda row: (order[row[0][0]], inputs[row[0][1]]))
    lines = ["| state | input | action | next state | what the action does |", "|---|---|---|---|---|"]
    for (state, kind), (action, nxt) in rows:
        same = "(same)" if nxt is state else f"`{nxt.name}`"
        lines.append(f"| `{state.name}` | `{kind.__name__}` | `{action.__name__}` | {same} | {_doc(action)} |")
    return "\n".join(lines)


def render() -> str:
    return (
        HEADER
        + "\n## A WebSocket lane (`prototype/ws/connection.py`)\n\n"
        + "The rules are in the module's docstring; the lane records are in `prototype/ws/lanes.py`.\n\n"
        + table(connection.TRANSITIONS, CS)
        + "\n\n## A response's event stream (`prototype/response/stream.py`)\n\n"
        + "Model events in, Responses events out, numbered in one sequence.\n\n"
        + table(stream.TRANSITIONS, stream.RS)
        + "\n\n## An Agents API session (`prototype/agents/machine.py`)\n\n"
        + "Input events and the running turn's milestones in, session events and turn work out"
        + " (docs/agents-api.md). A turn's own states are `TURN_TRANSITIONS` in `prototype/agents/events.py`.\n\n"
        + table(agents.TRANSITIONS, SS)
        + "\n"
    )


if __name__ == "__main__":
    print(render(), end="")
