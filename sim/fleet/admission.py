"""Admission: a replica's queue of turns waiting for a slot and KV, the turn's reservation
(making room as the config allows, a turn over the whole budget alone and counted), the
prefix-cache lookup, and with `running_kv="grow"` the output's KV at the first token, preempting
the newest running turn when short (sim/fleet/engine.py's theory of operation: the KV budget).
An admitted turn starts on its replica's compute (sim/fleet/steps.py), which pushes its events."""

from __future__ import annotations

import heapq
import math
from typing import Final

from sim.fleet.config import FleetConfig, FleetRun
from sim.fleet.holds import CALL_TEMPLATE_TOKENS
from sim.fleet.ledger import KVLedger, floor_blocks
from sim.fleet.loop import EventLoop
from sim.fleet.offload import HostLedger
from sim.fleet.state import Queued, Replica, SessionState
from sim.fleet.steps import FreeCompute, PricedSteps

__all__ = ["SHARED_PREFIX_EXTRA", "Admission"]

SHARED_PREFIX_EXTRA: Final = 81  # template tokens rendered with the instructions, before the task (costs.py)


class Admission:
    """Every replica's admission queue and the KV a turn takes."""

    def __init__(
        self,
        config: FleetConfig,
        loop: EventLoop,
        states: list[SessionState],
        ledger: KVLedger,
        host: HostLedger,
        steps: PricedSteps,
        free: FreeCompute,
        run: FleetRun,
    ) -> None:
        self.config = config
        self.loop = loop
        self.states = states
        self.ledger = ledger
        self.host = host
        self.steps = steps
        self.free = free
        self.run = run
        self.priced = config.compute == "priced"
        self.grow = config.running_kv == "grow"
        self.program = config.queue_order == "program"
        self.queued = 0  # turns queued so far: the queue's tie-break

    def enqueue(self, r: Replica, s: int, k: int, ready: float) -> None:
        self.queued += 1
        priority = self.states[s].record.arrived_at if self.program else ready
        heapq.heappush(r.queue, Queued(priority, self.queued, s, k, ready))

    def try_admit(self, r: Replica) -> None:
        while r.queue:
            head = r.queue[0]
            if not self.admit(r, head.session, head.turn, head.ready):
                break
            heapq.heappop(r.queue)
        if self.config.held_slot and r.queue:
            # A paused response resumes in the slot it kept, whatever waits ahead of it for a free one
            # (a request for its pinned slot, as llama.cpp serves it).
            for entry in sorted(r.queue):
                s = entry.session
                if self.states[s].slot_held and s in r.holders and self.admit(r, s, entry.turn, entry.ready):
                    r.queue.remove(entry)
                    heapq.heapify(r.queue)

    def lookup(self, r: Replica, st: SessionState, s: int, k: int) -> int:
        """Prompt tokens of turn `k` whose KV is on `r` now: held, or block-granular cache hits
        (the accelerator matches when the turn arrives; the last prompt token is always computed)."""
        prompt = st.prompts[k]
        if s in r.holders or st.offloaded:
            return min(st.resident, prompt - 1)
        entry = r.cache.get(s)
        shared = r.shared if r.shared_at <= self.loop.now else 0
        own = entry.tokens + r.shared if entry is not None else 0
        return floor_blocks(min(max(own, shared), prompt - 1), self.ledger.block)

    def admit(self, r: Replica, s: int, k: int, ready: float) -> bool:
        """Turn `k` of session `s` takes a slot and its KV on `r` if they are there (making room
        as the config allows), and starts on the replica's compute; False: it waits."""
        st = self.states[s]
        if r.free_slots <= 0 and not (st.slot_held and s in r.holders):
            return False
        prompt = st.prompts[k]
        out = st.spec.output_tokens[k]
        shared = r.shared or floor_blocks(st.spec.instruction_tokens + SHARED_PREFIX_EXTRA, self.ledger.block)
        need = prompt + out + CALL_TEMPLATE_TOKENS - shared  # the context after the turn, template included
        if self.grow:  # the prompt now, the output at the first token
            st.pending_kv = out + CALL_TEMPLATE_TOKENS
            need -= st.pending_kv
        own_held = st.held if (s in r.holders) else 0
        entry = r.cache.get(s)
        own_cached = entry.tokens if entry is not None else 0
        ledger = self.ledger
        extra = need - own_held - own_cached + (0 if r.shared else shared)
        if extra > ledger.budget - r.used() and not self.make_room(r, s, extra, need + shared):
            return False
        if self.config.slot_cache:
            ledger.keep_sequences(r, s)
            entry = r.cache.get(s)  # its context may be back from the host cache
        found = self.lookup(r, st, s, k)  # the KV here for the turn (making room never takes the turn's own)
        # Admitted: what the session held or had cached here becomes its running KV.
        reload_s = 0.0
        if own_held:
            r.holders.pop(s)
            ledger.add_held(r, -own_held)
            if st.slot_held:  # it resumes in the slot it kept
                st.slot_held = False
                r.free_slots += 1
        elif st.offloaded:
            reload_s = self.host.reload_s(r, s)
            st.offloaded = False
        if entry is not None:
            ledger.drop_entry(r, s)
        st.held = st.resident = 0
        # What the turn finds: llama.cpp's slots (`slot_cache`) match a prompt when a slot takes it;
        # otherwise as the simulator does, when the turn reached the replica (its plan is made then).
        cached = found if self.config.slot_cache else min(st.hint, found)
        st.cached_now = cached
        first = not r.shared
        st.active = need
        ledger.add_active(r, need)
        r.free_slots -= 1
        r.running += 1
        self.count_admission(r, st, prompt, cached, out, ready)
        st.running_on = r.index
        st.admitted_at = self.loop.now
        if self.priced:
            if first:  # cached once its prefill is done (first_token)
                r.shared, r.shared_at = shared, math.inf
                ledger.add_shared(r, shared)
            self.steps.start(r, st, s, k, ready, cached, prompt - cached, reload_s)
            return True
        t0 = self.free.start(r, st, s, k, cached, prompt - cached, reload_s)
        if first:  # the shared blocks: in r.shared (not an entry of r.cache), cached in the fleet's totals
            r.shared, r.shared_at = shared, t0
            ledger.add_shared(r, shared)
        return True

    def make_room(self, r: Replica, s: int, extra: int, total: int) -> bool:
        """Room for `extra` more tokens on `r` for session `s`, whose turn's context is `total`:
        held KV is preempted by choice (`preempt_held`), or when nothing runs here and so nothing
        else could ever free room (without it the paused sessions would wait on each other). A
        turn over the whole budget runs alone, its excess counted. False: it waits."""
        ledger = self.ledger
        preempt = self.config.preempt_held or r.running == 0
        if ledger.make_room(r, extra, s, preempt=preempt):
            return True
        if r.running == 0 and total > ledger.budget:
            ledger.make_room(r, extra, s, preempt=preempt, force=True)
            self.run.overflow_tokens += total - ledger.budget
            return True
        return False

    def count_admission(self, r: Replica, st: SessionState, prompt: int, cached: int, out: int, ready: float) -> None:
        """The run's and the session's counts of an admitted turn (a preempted turn's return
        continues its own wait)."""
        run = self.run
        uncached = prompt - cached
        now = self.loop.now
        if st.requeued:  # the same turn again after a preemption: its wait adds to the turn's
            st.requeued = False
            st.record.admission_wait_s[-1] += now - ready
        else:
            run.turns += 1
            run.prompt_tokens += prompt
            st.first_done = False
            st.record.admission_wait_s.append(now - ready)
        run.hit_tokens += cached
        run.prefilled_tokens += uncached
        again = max(0, min(st.seen, prompt) - cached)
        run.reprefill_tokens += again
        st.record.reprefill_tokens += again
        st.seen = prompt + out + CALL_TEMPLATE_TOKENS
        r.prefilled += uncached

    # -- running_kv="grow": output KV at the first token, preemption of the newest running turn --

    def grow_room(self, r: Replica, s: int) -> bool:
        """Session `s`'s output KV, taken at its first token: cache and (with `preempt_held`) held
        KV first, then the newest running turn, recomputed later, as vLLM preempts when a running
        request needs blocks that are not there. False when `s` itself was the newest."""
        st = self.states[s]
        need = st.pending_kv
        ledger = self.ledger
        while ledger.budget - r.used() < need and not ledger.make_room(r, need, s, preempt=self.config.preempt_held):
            victim = next(reversed(r.runners))
            if victim == s and len(r.runners) == 1:  # alone and over the budget: counted, not hidden
                ledger.make_room(r, need, s, preempt=True, force=True)
                self.run.overflow_tokens += max(0, need - (ledger.budget - r.used()))
                break
            self.preempt_running(r, victim)
            if victim == s:
                return False
        st.pending_kv = 0
        st.active += need
        ledger.add_active(r, need)
        return True

    def preempt_running(self, r: Replica, v: int) -> None:
        """Running session `v` gives its KV back; its turn queues again and is recomputed."""
        st = self.states[v]
        k, computed = self.steps.preempt(r, v)
        self.run.running_preemptions += 1
        self.ledger.add_active(r, -st.active)
        st.active = 0
        r.free_slots += 1
        r.running -= 1
        st.record.model_s += self.loop.now - st.admitted_at
        if self.config.evict_tail and computed > 0:  # its blocks stay in the prefix cache until evicted
            self.ledger.to_cache(r, v, computed)
        st.requeued = True
        st.hint = st.prompts[k]
        self.enqueue(r, v, k, st.ready_at)
