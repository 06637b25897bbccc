"""The fleet: sessions sharing replicas with a KV budget, a prefix cache over time, hold policies, a router.

Theory of operation
-------------------
A discrete-event simulation: an event loop alone (sim/fleet/loop.py: a clock, a heap of (time,
sequence, event), a handler table by event kind) and small parts that push events or return what
they finished, never calling back into the loop: the compute models (sim/fleet/steps.py), the
hold policies (holds.py), the router (routing.py), the KV ledger (ledger.py) and the host
ledger (offload.py), the admission queue (admission.py). `_Fleet` holds them and owns the
handlers: a turn's path from its send to its end. Every wait is one of the named quantities
below; the model is the full path's accelerator (sim/model/accelerator.py) and API stages
(sim/fleet/costs.py) run for many sessions at once, with what one process cannot show added
as switches.

* **A turn** pays its mode's API work (`turn_cost.pre_s`), then waits for admission on its
  replica (a slot of `decode_slots`, vLLM's `max_num_seqs`, and its KV), then runs on the
  replica's compute. The client then runs the tool and sends the next turn.
* **Priced compute** (`compute="priced"`, the default): a replica runs engine steps
  (sim/fleet/compute.py): each step gives every decoding turn a token and fills the rest of
  the token budget with prefill chunks of the admitted turns, first come first served (vLLM
  v1's chunked prefill; llama.cpp's `n_batch`); its time is the engine's step cost. A turn's
  first token comes with the step that ends its prefill, its last `output − 1` steps later.
  Steps with prefill are simulated one by one; identical decode-only steps run as one segment
  up to the next last token (a turn admitted inside it cuts it, joining at once rather than at
  the next step boundary: an error under one step). The replicas' prefill rate, time running
  steps and each turn's model-side time are reported.
* **Free compute** (`compute="free"`, the model before compute was priced, kept for
  comparison): the turn takes its decode slot through prefill and decode as the accelerator
  does: first token at ``admitted + prefill_time_s(...)`` (the accelerator's prefill: latency,
  uncached tokens at the prefill rate, their attention over the context), token i at
  ``t0 + i / rate`` with ``rate = tps / (1 + concurrency_slowdown × others)`` (others: turns
  of the replica decoding at t0), the slot free at ``t0 + output / rate``; blocking billing
  (`post_s`) comes after the last token. Every prefill runs in parallel with every other at
  its own rate. The cache is looked up when the turn reaches its replica, as the accelerator does.
* **KV budget** (`kv_budget_tokens` per replica, 0 = unlimited). A replica's KV holds the
  shared instructions' blocks once (every prompt starts with them), running turns (*active*:
  prompt, output and the call's template, reserved at admission, so a running turn never grows
  past its reservation and is never preempted), paused append responses (*held*) and the
  prefix cache (*cached*). A turn that does not fit evicts cache entries least recently used
  first, then the held KV of other paused sessions, oldest pause first, each a counted
  **preemption** whose session re-prefills at its resume (with `preempt_held` off, only when
  nothing runs on the replica: then nothing else could free room, and paused sessions would
  wait on each other for ever). With `admission="plan"` (the default) the victims are planned
  first and nothing is evicted unless they make the room, as vLLM's scheduler allocates a
  request's blocks only when they fit; `"greedy"` evicts, then checks. With `evict_tail`
  (default) a victim loses its tail blocks only, as many as the turn needs, and a preempted
  paused context goes to the prefix cache first, so its prefix still hits: as every entry is
  the blocks of one free, this is vLLM's free-block queue order, block for block. If it still
  does not fit it waits in the replica's **admission queue**: first come first served by turn
  (`queue_order="turn"`), or by session arrival (`"program"`, Continuum's program-level first
  come first served, so a resume passes newer sessions' turns). With `running_kv="grow"`
  (priced compute) a turn takes its prompt's KV at admission and its output's at its first
  token; short of it, it evicts the cache (and held KV with `preempt_held`), then preempts the
  newest running turn, which is queued again and recomputed, its blocks left in the prefix
  cache (vLLM's preemption by recomputation, with the output allocated at once rather than
  block by block). A turn larger than the whole budget runs alone, over budget, and the excess
  is counted (`overflow_tokens`): the one way KV exceeds the budget.
* **Prefix cache.** After a turn, its session's blocks go to the replica's cache: the prompt,
  and with `cache_generated` the generated call too (vLLM's v1 KV-cache manager caches full
  blocks of generated tokens). Hits are block-granular with the last prompt token recomputed.
  An entry idle longer than `cache_ttl_s` (0 = kept until evicted) is dropped: idle tool or
  think time then costs a re-prefill.
* **Hold policies** (append: a paused response's KV while the client runs its tool). `hold`
  keeps it until the resume; `ttl` keeps it `hold_ttl_s` (`ttl_rule="fixed"`) or, with
  `ttl_rule="reload"`, until its share of the KV budget has cost as much replica time as
  prefilling it again (`hold_ttl`), then releases it to the prefix cache (Continuum's
  time-to-live); `release` hands it to the cache at once (what create relies on); `offload`
  copies it to the replica's host memory (`offload_host_gb`, dropping the least recently
  offloaded contexts when full) over the replica's one link, and the resume reloads it over
  the same link before its prefill; `minwaste` takes, at each pause, whichever of hold,
  release and offload InferCept's estimate says wastes the least KV over time
  (sim/fleet/offload.py).
* **Router.** `affinity` pins a session to one replica (a WebSocket connection's replica; an
  HTTP session by its index); at `websocket.lifetime_s` a WebSocket session reconnects to another
  replica, loses the connection cache (its next request is a first request again) and the old
  replica's cache; an append response dies with its connection. `prefix` sends a turn to the
  replica with the longest cached prefix of its session unless that replica's load exceeds
  `prefix_load_cap` × the mean (then the least loaded), `least` to the fewest running + queued
  turns, `random` uniformly. A paused append response's resume goes where its KV is.
  `hash` sends every request and connection of session i to replica i mod R, a reconnection
  too (a load balancer keyed by session): the replicas share nothing, so a point splits into
  one run per replica (sim/fleet/shard.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from prototype.pipeline import CostProfile
from sim.fleet.admission import SHARED_PREFIX_EXTRA, Admission
from sim.fleet.config import FleetConfig, FleetRun, SessionRecord
from sim.fleet.costs import FLEET_MODES, HELD_MODES, turn_cost
from sim.fleet.holds import Holds
from sim.fleet.ledger import KVLedger
from sim.fleet.loop import Event, EventLoop, Handler
from sim.fleet.offload import HostLedger, expected_pause_s
from sim.fleet.routing import Router
from sim.fleet.sessions import SessionTokens
from sim.fleet.state import Replica, SessionState
from sim.fleet.steps import FreeCompute, PricedSteps

__all__ = ["SHARED_PREFIX_EXTRA", "simulate"]


def simulate(
    mode: str,
    profile: CostProfile,
    config: FleetConfig,
    sessions: Sequence[SessionTokens],
    *,
    arrivals: Sequence[float] | None = None,
    users: int = 0,
    think_s: Sequence[float] = (),
    seed: int = 0,
    max_time_s: float = math.inf,
    series_every_s: float = 0.0,
) -> FleetRun:
    """Serve `sessions` in `mode`: open loop, session i arriving at `arrivals[i]`, or closed loop
    (`arrivals` None): `users` users, each starting the next unstarted session `think_s[i]` after
    its previous one ends (session i's think time, 0 when `think_s` is short). Runs until every
    session has ended, or to `max_time_s` (the rest are in flight)."""
    return _Fleet(mode, profile, config, sessions, seed, series_every_s).run(arrivals, users, think_s, max_time_s)


class _Fleet:
    """The fleet's handlers over its parts. `ledger` builds the KV ledger (a subclass may watch it)."""

    def __init__(
        self,
        mode: str,
        profile: CostProfile,
        config: FleetConfig,
        sessions: Sequence[SessionTokens],
        seed: int,
        series_every_s: float,
        ledger: type[KVLedger] = KVLedger,
    ) -> None:
        if mode not in FLEET_MODES:
            raise ValueError(f"mode: one of {', '.join(FLEET_MODES)}, got {mode!r}")
        self.config = config
        self.mode = mode
        self.profile = profile
        self.append = mode in HELD_MODES  # append, and the Agents API's session turns
        self.whole_calls = mode == "agents"
        self.websocket = mode in ("ws", "append")
        self.priced = config.compute == "priced"
        self.grow = config.running_kv == "grow"
        self.program = config.queue_order == "program"
        self.specs = list(sessions)
        self.run_record = FleetRun(mode, [], kv_budget_tokens=config.kv_budget_tokens)
        self.loop = EventLoop()
        self.replicas = [Replica(i, config.model.decode_slots or (1 << 30)) for i in range(config.replicas)]
        self.states: list[SessionState] = []
        run, loop = self.run_record, self.loop
        self.ledger = ledger(config, run, loop, self.replicas, self.states, series_every_s)
        self.host = HostLedger(config, run, loop, self.states)
        cost = config.step_cost()
        self.holds = Holds(
            config,
            loop,
            self.ledger,
            self.host,
            run,
            cost,
            append=self.append,
            pause_s=expected_pause_s(config, sessions),
        )
        rng = np.random.default_rng(np.random.SeedSequence([seed, 0xF1EE7]))
        self.router = Router(config, loop, self.replicas, self.ledger, self.host, run, rng, websocket=self.websocket)
        self.steps = PricedSteps(loop, self.states, cost)
        self.admission = Admission(
            config, loop, self.states, self.ledger, self.host, self.steps, FreeCompute(loop, config), run
        )
        self.arrivals_open = True
        self.started = 0
        self.think_s: Sequence[float] = ()
        handlers: dict[Event, Handler] = {
            Event.ARRIVE: self.on_arrive,
            Event.READY: self.on_ready,
            Event.FIRST: self.on_first,
            Event.FREE: self.on_free,
            Event.END: self.on_end,
            Event.SEND: self.send,
            Event.TTL: self.on_ttl,
            Event.STEP: self.on_step,
            Event.JOIN: self.on_join,
            Event.COPIED: self.on_copied,
        }
        self.handlers = [handlers[kind] for kind in Event]

    def run(
        self, arrivals: Sequence[float] | None, users: int, think_s: Sequence[float], max_time_s: float
    ) -> FleetRun:
        for spec in self.specs:
            self.states.append(SessionState(spec, spec.prompt_tokens(), SessionRecord(spec.index)))
        loop = self.loop
        if arrivals is not None:
            if len(arrivals) != len(self.specs):
                raise ValueError("one arrival time per session")
            for i, t in enumerate(arrivals):
                loop.push(t, Event.ARRIVE, i)
        else:
            self.arrivals_open = False
            self.think_s = think_s
            for u in range(min(users, len(self.specs))):
                loop.push(0.0, Event.ARRIVE, u)
            self.started = min(users, len(self.specs))
        loop.run(self.handlers, self.ledger.account, max_time_s)
        if not loop.heap and any(r.queue or r.running for r in self.replicas):
            # Nothing left to happen but turns still waiting: a bookkeeping fault, never a result.
            raise RuntimeError(f"fleet stalled at {loop.now:.3f} s with turns queued and no event to free room")
        self.ledger.account(loop.now)
        run = self.run_record
        run.end_s = loop.now
        run.replica_prefill_tokens = [r.prefilled for r in self.replicas]
        if self.priced:
            run.replica_busy_s = [r.busy for r in self.replicas]
            run.replica_steps = [r.steps for r in self.replicas]
        self.host.report_links()
        return run

    # -- the handlers, one per event kind ------------------------------------------------------

    def on_step(self, t: float, replica: int, version: int) -> None:
        r = self.replicas[replica]
        ended = self.steps.begin_step(r, version)
        if ended is None:
            return
        finished, prefilled = ended
        for done in finished:
            self.last_token(r, done.session, done.turn)
        states = self.states
        for entry in prefilled:
            if entry.run_id == states[entry.session].run_id:  # not preempted meanwhile
                self.first_token(r, entry.session, entry.turn)
        self.steps.schedule(r)

    def on_copied(self, t: float, replica: int, tokens: int) -> None:
        """An offloaded context's copy out has ended: its GPU KV is free."""
        r = self.replicas[replica]
        self.ledger.add_active(r, -tokens)
        self.admission.try_admit(r)

    def on_arrive(self, t: float, s: int, _: int) -> None:
        st = self.states[s]
        st.record.arrived_at = t
        self.run_record.sessions.append(st.record)
        self.send(t, s, 0)

    def on_ready(self, t: float, s: int, k: int) -> None:
        st = self.states[s]
        r = self.replicas[st.replica]
        st.hint = self.admission.lookup(r, st, s, k)
        if self.program:  # the oldest session first: a resume may pass the turns waiting
            self.admission.enqueue(r, s, k, t)
            self.admission.try_admit(r)
        elif r.queue or not self.admission.admit(r, s, k, t):
            self.admission.enqueue(r, s, k, t)
            if st.slot_held:  # it need not wait its turn for the slot it kept
                self.admission.try_admit(r)

    def on_first(self, t: float, s: int, _: int) -> None:
        st = self.states[s]
        st.record.ttft_s.append(t - st.sent_at)

    def on_free(self, t: float, s: int, k: int) -> None:
        self.turn_done(s, k)

    def on_end(self, t: float, s: int, k: int) -> None:
        st = self.states[s]
        st.record.e2e_s.append(t - st.sent_at)
        if self.whole_calls and k < st.spec.turns - 1 and st.record.ttft_s:
            # The Agents API shows a function call only once it is whole (its turn.item.added):
            # the client's first token of a tool turn is the turn's end (docs/agents-api.md).
            st.record.ttft_s[-1] = t - st.sent_at
        if k == st.spec.turns - 1:
            st.record.finished_at = t
            started = self.started
            if not self.arrivals_open and started < len(self.specs):  # the freed user starts the next one
                think = self.think_s[started] if started < len(self.think_s) else 0.0
                self.loop.push(t + think, Event.ARRIVE, started)
                self.started += 1
        else:
            self.loop.push(t + st.spec.tool_times_s[k], Event.SEND, s, k + 1)

    def on_join(self, t: float, s: int, k: int) -> None:
        st = self.states[s]
        if t == st.join_at:  # not preempted (and admitted again) while it reloaded
            self.steps.join(self.replicas[st.running_on], s, k)

    def on_ttl(self, t: float, s: int, epoch: int) -> None:
        st = self.states[s]
        r = self.replicas[st.replica]
        if st.epoch == epoch and s in r.holders:
            self.run_record.ttl_releases += 1
            self.ledger.release_held(r, s, to_cache=True)
            self.admission.try_admit(r)

    # -- the turn ----------------------------------------------------------------------------

    def send(self, now: float, s: int, k: int) -> None:
        """Turn `k` of session `s` leaves the client at `now` (the SEND handler)."""
        st = self.states[s]
        if st.replica < 0:
            st.replica = self.router.route(st, s)
            st.connected_at = now
        elif self.websocket and now - st.connected_at >= self.config.websocket.lifetime_s:
            self.router.reconnect(st, s)
        elif not self.append:  # an append response lives on its replica until its connection ends
            st.replica = self.router.route(st, s)
        cost = turn_cost(self.profile, self.mode, st.spec, k, st.prompts, fresh=st.fresh)
        st.fresh = False
        st.sent_at = now
        st.post_s = cost.post_s
        self.loop.push(now + cost.pre_s, Event.READY, s, k)

    def turn_done(self, s: int, k: int) -> None:
        """The turn's last token: its slot and running KV free; its context is held or cached."""
        st = self.states[s]
        r = self.replicas[st.running_on]
        r.free_slots += 1
        r.running -= 1
        r.decoding.pop(s, None)
        r.shared_used = self.loop.now
        self.ledger.add_active(r, -st.active)
        st.active = 0
        self.holds.after_turn(r, st, s, k)
        self.admission.try_admit(r)

    # -- priced compute: what the fleet does at a turn's first and last token -------------------

    def first_token(self, r: Replica, s: int, k: int) -> None:
        st = self.states[s]
        if math.isinf(r.shared_at):
            r.shared_at = self.loop.now
        if self.grow and not self.admission.grow_room(r, s):
            return  # preempted itself: the newest running turn
        if not st.first_done:
            st.first_done = True
            st.record.ttft_s.append(self.loop.now - st.sent_at)
        if not self.steps.decode(r, st, s, k):
            self.last_token(r, s, k)

    def last_token(self, r: Replica, s: int, k: int) -> None:
        st = self.states[s]
        self.steps.finish(r, st, s)
        now = self.loop.now
        st.record.model_s += now - st.admitted_at
        self.loop.push(now + st.post_s, Event.END, s, k)
        self.turn_done(s, k)
