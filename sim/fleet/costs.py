"""Per-turn API work of each mode: the full path's stages (prototype/pipeline.py) as formulas.

The full path times every stage on its clock; with CPU free (the fleet's setting) what is left
are the cost profile's modeled waits, each a function of a count this module reproduces: the
request's bytes (upload), the tokens rendered and classified (per-token service work), and which
fixed stages a mode pays (docs/pipeline.md, "What each mode touches"):

* `http` uploads the whole history, renders and classifies everything but the instructions (the
  server keeps their rendering), pays auth, routing and the inference hop every turn, and
  bills on the critical path; `http_prev` uploads the instructions and the new output, loads the
  stored state, and otherwise pays what `http` pays.
* `ws` pays auth and routing once per connection, uploads the instructions and the new output,
  renders the output, classifies what is new, hops to inference, and bills off the path.
* `append`'s first turn is `ws`'s; each resume uploads the output alone and skips routing and
  the hop.
* A WebSocket mode's first request on a new connection (a reconnect) is a first turn again:
  the whole history, auth and routing.

Which waits a turn pays is the stage-cost table's (prototype/pipeline.py `STAGE_COSTS`, `pays`):
this module only counts what the rows multiply (bytes, tokens rendered, tokens classified). The
constants are the full path's own request envelopes and template sizes; a test checks the
fleet's per-turn first-token times against the full path's, stage by stage, in every mode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from prototype.pipeline import DESIGNS, CostProfile, Count, turn_s
from sim.fleet.sessions import SessionTokens

__all__ = ["FLEET_MODES", "HELD_MODES", "TurnCost", "turn_cost"]

FLEET_MODES: Final = ("http", "http_prev", "ws", "append", "agents")
HELD_MODES: Final = frozenset({"append", "agents"})  # one response (a session's turn) held across tool waits

# Request JSON around the items: a first request, by mode (its flags differ), and a later one.
FIRST_ENVELOPE_BYTES: Final = {"http": 374, "http_prev": 401, "ws": 413, "append": 413, "agents": 399}
HTTP_STEP_BYTES: Final = 266  # a resent call and output item's JSON around their texts
# + instructions, but a held response's (append's `response.append`, the Agents API's tool result POST)
LATER_ENVELOPE_BYTES: Final = {"http_prev": 484, "ws": 496, "append": 182, "agents": 180}
RENDER_KEPT_TOKENS: Final = 81  # template tokens the server renders once, with the instructions


@dataclass(frozen=True, slots=True)
class TurnCost:
    pre_s: float  # request sent → the model may start the turn
    post_s: float  # last token → the client has the turn's end (blocking billing)
    request_bytes: int


def request_bytes(s: SessionTokens, mode: str, k: int, *, fresh: bool) -> int:
    """Bytes of turn `k`'s request; `fresh`: the first request of a connection (or of the session)."""
    if mode == "http" or k == 0 or (fresh and mode in ("ws", "append")):  # the whole history
        steps = HTTP_STEP_BYTES * k + sum(s.output_bytes[:k]) + sum(s.tool_bytes[:k])
        return s.first_request_bytes + FIRST_ENVELOPE_BYTES[mode] + steps
    instructions = 0 if mode in HELD_MODES else s.instruction_bytes
    return instructions + LATER_ENVELOPE_BYTES[mode] + s.tool_bytes[k - 1]


def turn_cost(
    profile: CostProfile, mode: str, s: SessionTokens, k: int, prompts: list[int], *, fresh: bool
) -> TurnCost:
    """Turn `k`'s API work in `mode` (`prompts`: the session's prompt tokens per turn); `fresh`:
    a WebSocket mode's first request on this connection. The waits are the stage-cost table's
    rows the turn's path pays (prototype/pipeline.py `turn_s`); this module supplies the counts."""
    path = DESIGNS[mode].path(k, fresh=fresh, last=k == s.turns - 1)
    body = request_bytes(s, mode, k, fresh=fresh)
    if path.whole_context:
        rendered = classified = prompts[k] - s.instruction_tokens - RENDER_KEPT_TOKENS
    else:
        rendered, classified = s.tool_tokens[k - 1], prompts[k] - prompts[k - 1]
    counts = {
        Count.BYTES: float(body),
        Count.TOKENS_RENDERED: float(rendered),
        Count.TOKENS_CLASSIFIED: float(classified),
    }
    pre, post = turn_s(profile, path, counts)
    return TurnCost(pre, post, body)
