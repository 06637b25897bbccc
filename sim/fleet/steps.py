"""The fleet's two compute models, each a part that pushes events and returns what it finished
(sim/fleet/engine.py's theory of operation: priced and free compute).

* `PricedSteps`: a replica runs engine steps (sim/fleet/compute.py). Each step gives every
  decoding turn a token and fills the rest of the token budget with prefill chunks of the
  admitted turns, first come first served; with no prefill, identical decode-only steps run as
  one segment up to the next last token, and new work cuts the segment at once. A step's end
  hands back the turns whose last token or end of prefill it reached; the fleet acts on them,
  then `schedule` starts the next. Under verified decoding (`StepCost.decode_tokens_per_step`
  k > 1) every step is priced on its own: each decoding turn puts its next k tokens (its last
  pass, what is left) into the step, and prefill chunks fill the rest of the budget; with
  `request_round_trip` a pass or prompt answered or taken at a step's end sits out the next step
  when other work is ready (its request is still on its way). A verified turn ends on its last
  pass.
* `FreeCompute`: each turn at its own rates from its admission (first token, slot free, end),
  three events pushed at once."""

from __future__ import annotations

import heapq
import math
from typing import Final

from sim.fleet.compute import StepCost
from sim.fleet.config import FleetConfig
from sim.fleet.loop import Event, EventLoop
from sim.fleet.state import Decoding, Phase, Prefill, Replica, SessionState
from sim.model.accelerator import prefill_time_s

__all__ = ["FreeCompute", "PricedSteps"]

_IDLE: Final = Phase.IDLE
_STEP: Final = Phase.STEP
_SEGMENT: Final = Phase.SEGMENT
_STEP_EVENT: Final = Event.STEP


class PricedSteps:
    """Priced compute: every replica's step loop (vLLM v1's scheduler, in outline)."""

    def __init__(self, loop: EventLoop, states: list[SessionState], cost: StepCost) -> None:
        self.loop = loop
        self.states = states
        self.cost = cost
        self.verify_k = cost.decode_tokens_per_step
        self.round_trip = cost.request_round_trip and self.verify_k > 1

    def start(
        self, r: Replica, st: SessionState, s: int, k: int, ready: float, cached: int, uncached: int, reload_s: float
    ) -> None:
        """An admitted turn: it joins the prefill queue now, or once its offloaded context is back."""
        st.prefill_s_per_token = float(self.cost.prefill_s_per(cached, uncached))
        st.run_id += 1
        st.ready_at = ready
        r.runners[s] = k
        if reload_s > 0:
            st.join_at = self.loop.now + reload_s
            self.loop.push(st.join_at, Event.JOIN, s, k)
        else:
            self.join(r, s, k)

    def join(self, r: Replica, s: int, k: int) -> None:
        """An admitted turn's uncached prompt joins the replica's prefill queue (FCFS)."""
        st = self.states[s]
        r.prefilling.append(Prefill(s, k, float(st.prompts[k] - st.cached_now), st.prefill_s_per_token, st.run_id))
        if self.round_trip and r.in_step:  # taken at a step's end: its request is on its way
            r.in_flight.add(s)
        self.kick(r)

    def kick(self, r: Replica) -> None:
        """New work on `r`: a step in flight takes it at its end; a decode-only segment is cut now."""
        if r.in_step or r.phase is _STEP:
            return
        if r.phase is _SEGMENT:
            self.advance(r)
        self.schedule(r)

    def advance(self, r: Replica) -> None:
        now = self.loop.now
        elapsed = now - r.segment_at
        if elapsed > 0 and r.step_s > 0:
            r.position += elapsed / r.step_s
            r.busy += elapsed
        r.segment_at = now

    def schedule(self, r: Replica) -> None:
        """The replica's next step: every decoding sequence gets a token (verified decoding: its
        next pass), prefill chunks fill the rest of the token budget first come first served;
        with no prefill, identical decode steps run as one segment up to the next last token.
        The step in flight, if any, has ended."""
        r.in_step = False
        r.version += 1
        cost = self.cost
        if self.verify_k > 1:
            self._schedule_verified(r)
            return
        decoding = len(r.decode_heap)
        step_s = cost.step_s + cost.decode_s(decoding) + cost.decode_s_per_ctx_token * r.context_sum
        now = self.loop.now
        if r.prefilling:
            avail = float(cost.token_budget - decoding)
            plan: list[Prefill] = []
            r.plan = plan
            r.phase, r.step_s = _STEP, self._fill(plan, r.prefilling, avail, step_s)
            self.loop.push(now + r.step_s, _STEP_EVENT, r.index, r.version)
        elif decoding:
            r.phase, r.step_s, r.segment_at = _SEGMENT, step_s, now
            self.loop.push(
                now + max(0.0, r.decode_heap[0].last_at - r.position) * step_s, _STEP_EVENT, r.index, r.version
            )
        else:
            r.phase = _IDLE

    @staticmethod
    def _fill(plan: list[Prefill], prefilling: list[Prefill], avail: float, step_s: float) -> float:
        """The prefill chunks of a step with `avail` tokens of its budget left, first come first
        served, into `plan`: the step's time `step_s` with theirs."""
        for entry in prefilling:
            if avail <= 0:
                break
            chunk = min(entry.left, avail)
            entry.chunk = chunk
            plan.append(entry)
            step_s += chunk * entry.s_per_token
            avail -= chunk
        return step_s

    def _schedule_verified(self, r: Replica) -> None:
        """Verified decoding's step: each decoding turn's next pass (k tokens, or its last ones),
        priced as a prefill of its tokens after the context so far, the prefill chunks in the
        rest of the budget. With `request_round_trip`, a request on its way (answered at the
        step that just ended) misses this step when other work is ready."""
        heap, late = r.decode_heap, r.in_flight
        if not (r.prefilling or heap):
            r.phase = _IDLE
            late.clear()
            return
        passes, prefilling = heap, r.prefilling
        if late:
            ready = [e for e in heap if e.session not in late]
            waiting = [p for p in prefilling if p.session not in late]  # the late ones are the queue's tail
            if ready or waiting:
                passes, prefilling = ready, waiting
            late.clear()
        cost, k, states = self.cost, self.verify_k, self.states
        step_s, tokens = cost.step_s, 0
        for e in passes:
            st = states[e.session]
            n = min(k, st.decode_left)
            tokens += n
            step_s += n * cost.prefill_s_per(st.prompts[e.turn] + st.spec.output_tokens[e.turn] - st.decode_left, n)
        r.passes = list(passes)
        plan: list[Prefill] = []
        r.plan = plan
        r.phase, r.step_s = _STEP, self._fill(plan, prefilling, float(cost.token_budget - tokens), step_s)
        self.loop.push(self.loop.now + r.step_s, _STEP_EVENT, r.index, r.version)

    def _end_verified(self, r: Replica) -> tuple[list[Decoding], list[Prefill]]:
        """A verified step's end: its passes move their turns on; the turns whose last pass it
        was, in order, and the prefill entries it finished."""
        r.busy += r.step_s
        r.steps += 1
        r.position += 1.0
        states, k, late = self.states, self.verify_k, r.in_flight
        finished = []
        for e in r.passes:
            st = states[e.session]
            if not st.decoding:  # preempted meanwhile
                continue
            st.decode_left -= min(k, st.decode_left)
            if st.decode_left <= 0:
                finished.append(e)
            elif self.round_trip:
                late.add(e.session)
        prefilled = [entry for entry in r.plan if entry.left - entry.chunk <= 0]
        for entry in r.plan:
            entry.left -= entry.chunk
        if prefilled:
            del r.prefilling[: len(prefilled)]  # FCFS: the finished ones are the queue's head
            if self.round_trip:
                late.update(entry.session for entry in prefilled)
        if finished:
            finished.sort()
            gone = {e.seq for e in finished}
            r.decode_heap = [e for e in r.decode_heap if e.seq not in gone]
            heapq.heapify(r.decode_heap)
            for done in finished:
                r.context_sum -= states[done.session].decode_context
        r.plan, r.passes = [], []
        return finished, prefilled

    def begin_step(self, r: Replica, version: int) -> tuple[list[Decoding], list[Prefill]] | None:
        """A step (or segment) of `r` ends: the turns whose last token it reached, in order, and
        the prefill entries it finished (each stale if its session was preempted meanwhile);
        None for a stale step. Until `schedule`, new work waits for the next step."""
        if version != r.version:
            return None
        r.in_step = True
        if self.verify_k > 1:
            return self._end_verified(r)
        prefilled = []
        if r.phase is _STEP:
            r.busy += r.step_s
            r.steps += 1
            r.position += 1.0
            for entry in r.plan:
                entry.left -= entry.chunk
                if entry.left <= 0:
                    prefilled.append(entry)
            if prefilled:
                del r.prefilling[: len(prefilled)]  # FCFS: the finished ones are the queue's head
            r.plan = []
        else:
            self.advance(r)
            r.position = max(r.position, r.decode_heap[0].last_at)
        finished = []
        heap = r.decode_heap
        while heap and heap[0].last_at <= r.position + 1e-9:
            done = heapq.heappop(heap)
            r.context_sum -= self.states[done.session].decode_context
            finished.append(done)
        return finished, prefilled

    def decode(self, r: Replica, st: SessionState, s: int, k: int) -> bool:
        """The turn's first token is out: it decodes to its last, or (one token) it is done: False."""
        out = st.spec.output_tokens[k]
        st.decoding = True
        if out <= 1:
            return False
        seq = self.loop.next_seq()
        st.decode_context = st.prompts[k] + out / 2
        r.context_sum += st.decode_context
        steps = out - 1
        if self.verify_k > 1:  # its passes: k tokens each, the last what is left
            st.decode_left = out - 1
            steps = -(-(out - 1) // self.verify_k)
        heapq.heappush(r.decode_heap, Decoding(r.position + steps, seq, s, k))
        return True

    def finish(self, r: Replica, st: SessionState, s: int) -> None:
        """The turn's last token."""
        st.decode_context = 0.0
        st.decoding = False
        r.runners.pop(s, None)

    def preempt(self, r: Replica, v: int) -> tuple[int, int]:
        """Running session `v` leaves the step loop: its turn and the prompt tokens it had computed."""
        st = self.states[v]
        k = r.runners.pop(v)
        if st.decoding:
            r.decode_heap = [e for e in r.decode_heap if e.session != v]
            heapq.heapify(r.decode_heap)
            r.context_sum -= st.decode_context
            st.decoding = False
            computed = st.prompts[k]
        else:
            mine = [e for e in r.prefilling if e.session == v and e.run_id == st.run_id]
            left = mine[0].left if mine else 0.0
            r.prefilling = [e for e in r.prefilling if not (e.session == v and e.run_id == st.run_id)]
            computed = st.prompts[k] - int(left)
        st.run_id += 1
        st.decode_context = 0.0
        st.join_at = math.nan
        return k, computed


class FreeCompute:
    """Free compute: a turn's first token after its prefill at the accelerator's rates, its
    tokens at the decode rate slowed by the turns decoding beside it."""

    def __init__(self, loop: EventLoop, config: FleetConfig) -> None:
        self.loop = loop
        self.model = config.model

    def start(self, r: Replica, st: SessionState, s: int, k: int, cached: int, uncached: int, reload_s: float) -> float:
        """An admitted turn's events: first token, slot free, end. Returns its first token's time."""
        m = self.model
        now = self.loop.now
        t0 = (
            now
            + reload_s
            + prefill_time_s(m.model_latency_s, m.prefill_tok_per_s, m.prefill_s_per_token_ctx, cached, uncached)
        )
        out = st.spec.output_tokens[k]
        rate = m.tps
        if m.concurrency_slowdown > 0:
            others = sum(1 for first, free in r.decoding.values() if first <= t0 < free)
            rate /= 1.0 + m.concurrency_slowdown * others
        r.decoding[s] = (t0, t0 + out / rate)
        st.record.model_s += t0 + out / rate - now
        self.loop.push(t0, Event.FIRST, s, k)
        self.loop.push(t0 + out / rate, Event.FREE, s, k)
        self.loop.push(t0 + (out - 1) / rate + st.post_s, Event.END, s, k)
        return t0
