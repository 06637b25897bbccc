"""The hold policies: what becomes of a turn's context at its last token (sim/fleet/engine.py's
theory of operation: hold policies). A paused append response's KV is held (`hold`), held
until a time-to-live (`ttl`), copied to host memory (`offload`) or handed to the prefix cache
(`release`); `minwaste` picks one of those at each pause; a session's last turn, and any turn
of the create modes, goes to the cache. The part changes the ledgers and pushes its own events
(the copy's end, the time-to-live); it never calls back into the fleet."""

from __future__ import annotations

import math
from typing import Final

from sim.fleet.compute import StepCost
from sim.fleet.config import FleetConfig, FleetRun
from sim.fleet.ledger import KVLedger
from sim.fleet.loop import Event, EventLoop
from sim.fleet.offload import CHOICE_OF, POLICY_OF, HostLedger, min_waste
from sim.fleet.state import Replica, SessionState
from sim.model.accelerator import prefill_time_s

__all__ = ["CALL_TEMPLATE_TOKENS", "Holds"]

CALL_TEMPLATE_TOKENS: Final = 14  # a generated call's closing template: the paused context is prompt + output + this


class Holds:
    """The hold policy at each turn's end, and the quantities it is decided on."""

    def __init__(
        self,
        config: FleetConfig,
        loop: EventLoop,
        ledger: KVLedger,
        host: HostLedger,
        run: FleetRun,
        cost: StepCost,
        *,
        append: bool,
        pause_s: float,
    ) -> None:
        self.config = config
        self.loop = loop
        self.ledger = ledger
        self.host = host
        self.run = run
        self.cost = cost
        self.append = append  # paused responses hold their context (append, the Agents API's turns)
        self.pause_s = pause_s

    def after_turn(self, r: Replica, st: SessionState, s: int, k: int) -> None:
        """Turn `k` of session `s` has freed its slot and running KV on `r`: its context is held,
        offloaded or cached."""
        config = self.config
        last = k == st.spec.turns - 1
        context = st.prompts[k] + st.spec.output_tokens[k] + CALL_TEMPLATE_TOKENS
        cacheable = context if config.model.cache_generated else st.prompts[k]
        policy = config.hold_policy
        moved = r.index != st.replica  # the next turn was sent elsewhere before this one's last token
        paused = self.append and not last and not moved  # a paused response, its context on this replica
        unique = context - r.shared
        if paused and policy == "minwaste":
            policy = self.choose(r, unique, context)
        copied = self.host.offload(r, s, unique) if paused and policy == "offload" else None
        if copied is not None:  # its KV stays on the GPU until its copy out ends
            self.ledger.add_active(r, unique)
            self.loop.push(copied, Event.COPIED, r.index, unique)
        elif paused and policy == "offload":
            policy = "release"  # the host memory cannot take it
        if paused and config.hold_policy == "minwaste":
            self.run.pause_choices[CHOICE_OF[policy]] += 1
        if paused and policy != "release":
            st.resident = context
            st.held = unique
            st.epoch += 1
            if policy != "offload":
                r.holders[s] = unique
                self.ledger.add_held(r, unique)
                if config.held_slot:  # the slot stays with the paused response
                    st.slot_held = True
                    r.free_slots -= 1
                if policy == "ttl":
                    self.loop.push(self.loop.now + self.hold_ttl(unique, context), Event.TTL, s, st.epoch)
        else:
            self.ledger.to_cache(r, s, cacheable)

    def hold_ttl(self, unique: int, context: int) -> float:
        """How long a paused context is held under `ttl`: `hold_ttl_s`, or (`ttl_rule="reload"`)
        until the KV it holds, as a share of the budget, has cost as much replica time as
        prefilling it again would: ski rental's break-even, the rule Continuum's TTL refines with
        the tool's duration distribution. Unlimited KV holds to the resume."""
        if self.config.ttl_rule == "fixed":
            return self.config.hold_ttl_s
        if not self.config.kv_budget_tokens:
            return math.inf
        return self.reprefill_s(unique, context) * self.ledger.budget / max(1, unique)

    def reprefill_s(self, unique: int, context: int) -> float:
        """Replica time to prefill a paused context's `unique` tokens again, alone (the shared
        prefix before them stays cached)."""
        if self.config.compute == "priced":
            return self.cost.prefill_alone_s(context - unique, unique)
        m = self.config.model
        return prefill_time_s(
            m.model_latency_s, m.prefill_tok_per_s, m.prefill_s_per_token_ctx, context - unique, unique
        )

    def choose(self, r: Replica, unique: int, context: int) -> str:
        """`minwaste`: the hold policy that carries out the least-waste choice at this pause."""
        recompute_s = self.reprefill_s(unique, context)
        copy_s = unique * self.host.copy_s_per_token
        return POLICY_OF[min_waste(unique, r.active, self.pause_s, recompute_s, copy_s)]
