"""The fleet: sessions sharing replicas with a KV budget, a prefix cache over time, hold policies, a router.

Theory of operation
-------------------
A discrete-event simulation on a heap of (time, sequence, event). Every wait is one of the named
quantities below; the model is the full path's accelerator (sim/model/accelerator.py) and API
stages (sim/fleet/costs.py) run for many sessions at once, with what one process cannot show
added as switches.

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

import heapq
import math
from collections.abc import Sequence
from typing import Final

import numpy as np

from prototype.pipeline import CostProfile
from sim.fleet.config import FleetConfig, FleetRun, SessionRecord
from sim.fleet.costs import FLEET_MODES, HELD_MODES, turn_cost
from sim.fleet.ledger import floor_blocks
from sim.fleet.offload import CHOICE_OF, HostLedger, expected_pause_s
from sim.fleet.sessions import SessionTokens
from sim.fleet.state import Replica, SessionState
from sim.model.accelerator import prefill_time_s

__all__ = ["SHARED_PREFIX_EXTRA", "simulate"]

CALL_TEMPLATE_TOKENS: Final = 14  # a generated call's closing template: the paused context is prompt + output + this
SHARED_PREFIX_EXTRA: Final = 81  # template tokens rendered with the instructions, before the task (costs.py)

_ARRIVE, _READY, _FIRST, _FREE, _END, _SEND, _TTL, _STEP, _JOIN, _COPIED = range(10)


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


class _Fleet(HostLedger):
    def __init__(
        self,
        mode: str,
        profile: CostProfile,
        config: FleetConfig,
        sessions: Sequence[SessionTokens],
        seed: int,
        series_every_s: float,
    ) -> None:
        if mode not in FLEET_MODES:
            raise ValueError(f"mode: one of {', '.join(FLEET_MODES)}, got {mode!r}")
        run = FleetRun(mode, [], kv_budget_tokens=config.kv_budget_tokens)
        super().__init__(config, run, expected_pause_s(config, sessions))
        self.mode = mode
        self.append = mode in HELD_MODES  # append, and the Agents API's session turns
        self.whole_calls = mode == "agents"
        self.websocket = mode in ("ws", "append")
        self.profile = profile
        self.priced = config.compute == "priced"
        self.grow = config.running_kv == "grow"
        self.program = config.queue_order == "program"
        self.qseq = 0
        self.replicas = [Replica(i, config.model.decode_slots or (1 << 30)) for i in range(config.replicas)]
        self.rng = np.random.default_rng(np.random.SeedSequence([seed, 0xF1EE7]))
        self.specs = list(sessions)
        self.heap: list[tuple[float, int, int, int, int]] = []
        self.seq = 0
        self.last_t = 0.0
        self.series_every_s = series_every_s
        self.next_sample = 0.0

    # -- events ------------------------------------------------------------------------------

    def push(self, t: float, kind: int, s: int, k: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, s, k))

    def run(
        self, arrivals: Sequence[float] | None, users: int, think_s: Sequence[float], max_time_s: float
    ) -> FleetRun:
        for spec in self.specs:
            self.states.append(SessionState(spec, spec.prompt_tokens(), SessionRecord(spec.index)))
        started = 0
        if arrivals is not None:
            if len(arrivals) != len(self.specs):
                raise ValueError("one arrival time per session")
            for i, t in enumerate(arrivals):
                self.push(t, _ARRIVE, i)
        else:
            for u in range(min(users, len(self.specs))):
                self.push(0.0, _ARRIVE, u)
            started = min(users, len(self.specs))
        heap = self.heap
        while heap:
            t, _, kind, s, k = heap[0]
            if t > max_time_s:
                break
            heapq.heappop(heap)
            self.account(t)
            self.now = t
            if kind == _STEP:
                self.on_step(self.replicas[s], k)
                continue
            if kind == _COPIED:  # an offloaded context's copy out has ended: its GPU KV is free
                self.add(self.replicas[s], 0, -k)
                self.try_admit(self.replicas[s])
                continue
            st = self.states[s]
            if kind == _ARRIVE:
                st.record.arrived_at = t
                self.run_.sessions.append(st.record)
                self.send(s, 0)
            elif kind == _READY:
                r = self.replicas[st.replica]
                st.hint = self.lookup(r, st, s, k)
                if self.program:  # the oldest session first: a resume may pass the turns waiting
                    self.enqueue(r, s, k, t)
                    self.try_admit(r)
                elif r.queue or not self.admit(r, s, k, t):
                    self.enqueue(r, s, k, t)
                    if st.slot_held:  # it need not wait its turn for the slot it kept
                        self.try_admit(r)
            elif kind == _FIRST:
                st.record.ttft_s.append(t - st.sent_at)
            elif kind == _FREE:
                self.turn_done(s, k)
            elif kind == _END:
                st.record.e2e_s.append(t - st.sent_at)
                if self.whole_calls and k < st.spec.turns - 1 and st.record.ttft_s:
                    # The Agents API shows a function call only once it is whole (its turn.item.added):
                    # the client's first token of a tool turn is the turn's end (docs/agents-api.md).
                    st.record.ttft_s[-1] = t - st.sent_at
                if k == st.spec.turns - 1:
                    st.record.finished_at = t
                    if arrivals is None and started < len(self.specs):  # the freed user starts the next one
                        self.push(t + (think_s[started] if started < len(think_s) else 0.0), _ARRIVE, started)
                        started += 1
                else:
                    self.push(t + st.spec.tool_times_s[k], _SEND, s, k + 1)
            elif kind == _SEND:
                self.send(s, k)
            elif kind == _JOIN:
                if t == st.join_at:  # not preempted (and admitted again) while it reloaded
                    self.join(self.replicas[st.running_on], s, k)
            elif kind == _TTL:
                r = self.replicas[st.replica]
                if st.epoch == k and s in r.holders:
                    self.run_.ttl_releases += 1
                    self.release_held(r, s, to_cache=True)
                    self.try_admit(r)
        if not heap and any(r.queue or r.running for r in self.replicas):
            # Nothing left to happen but turns still waiting: a bookkeeping fault, never a result.
            raise RuntimeError(f"fleet stalled at {self.now:.3f} s with turns queued and no event to free room")
        self.account(self.now)
        self.run_.end_s = self.now
        self.run_.replica_prefill_tokens = [r.prefilled for r in self.replicas]
        if self.priced:
            self.run_.replica_busy_s = [r.busy for r in self.replicas]
            self.run_.replica_steps = [r.steps for r in self.replicas]
        self.report_links()
        return self.run_

    def account(self, t: float) -> None:
        """The KV totals integrated up to `t`; with a cache time-to-live each entry leaves them
        (and the cache) at its timeout, replicas' entries in time order (a replica's cache is in
        idle order)."""
        ttl = self.c.cache_ttl_s
        while ttl > 0:
            heads = [(next(iter(r.cache.values()))[1], r.index) for r in self.replicas if r.cache]
            if not heads:
                break
            last, j = min(heads)
            if not t - last > ttl:
                break
            self.integrate(last + ttl)
            r = self.replicas[j]
            self.drop_entry(r, next(iter(r.cache)))
        self.integrate(t)

    def integrate(self, t: float) -> None:
        dt = t - self.last_t
        if dt > 0:
            kv = self.run_.kv_token_s
            kv["active"] += self.totals[0] * dt
            kv["held"] += self.totals[1] * dt
            kv["cached"] += self.totals[2] * dt
            self.last_t = t
        if self.series_every_s > 0 and t >= self.next_sample:
            self.run_.kv_series.append((t, *self.totals))  # type: ignore[arg-type]
            self.next_sample = t + self.series_every_s

    # -- the turn ----------------------------------------------------------------------------

    def route(self, st: SessionState, s: int) -> int:
        reps = self.replicas
        router = self.c.router
        if router == "random":
            return int(self.rng.integers(len(reps)))
        if router == "hash":  # by the session alone, every connection: the replicas share nothing (sim/fleet/shard.py)
            return s % len(reps)
        if router == "affinity":
            if st.replica >= 0:
                return st.replica
            return s % len(reps) if not self.websocket else min(reps, key=Replica.load).index
        if router == "prefix":
            best = max(reps, key=lambda r: (r.cache[s][0] if s in r.cache else 0.0, -r.load()))
            mean = sum(r.load() for r in reps) / len(reps)
            if s in best.cache and best.load() <= self.c.prefix_load_cap * max(mean, 1.0):
                return best.index
        return min(reps, key=Replica.load).index

    def send(self, s: int, k: int) -> None:
        st = self.states[s]
        now = self.now
        if st.replica < 0:
            st.replica = self.route(st, s)
            st.connected_at = now
        elif self.websocket and now - st.connected_at >= self.c.websocket.lifetime_s:
            self.reconnect(st, s)
        elif not self.append:  # an append response lives on its replica until its connection ends
            st.replica = self.route(st, s)
        cost = turn_cost(self.profile, self.mode, st.spec, k, st.prompts, fresh=st.fresh)
        st.fresh = False
        st.sent_at = now
        st.post_s = cost.post_s
        self.push(now + cost.pre_s, _READY, s, k)

    def reconnect(self, st: SessionState, s: int) -> None:
        self.run_.reconnects += 1
        old = self.replicas[st.replica]
        if s in old.holders:
            self.release_held(old, s, to_cache=False)  # the response ended with its connection
        if st.offloaded:  # an offloaded paused response ended with its connection too
            self.drop_offloaded(old, s)
        if self.c.router == "hash":  # the same replica again: its prefix cache outlives the connection
            st.offloaded = False
            st.held = st.resident = 0
            st.connected_at = self.now
            st.fresh = True
            return
        self.drop_entry(old, s)
        st.offloaded = False
        st.held = st.resident = 0
        others = [r for r in self.replicas if r.index != old.index] or self.replicas
        if self.c.router == "random":
            st.replica = others[int(self.rng.integers(len(others)))].index
        else:
            st.replica = min(others, key=Replica.load).index
        st.connected_at = self.now
        st.fresh = True

    def enqueue(self, r: Replica, s: int, k: int, ready: float) -> None:
        self.qseq += 1
        priority = self.states[s].record.arrived_at if self.program else ready
        heapq.heappush(r.queue, (priority, self.qseq, s, k, ready))

    def try_admit(self, r: Replica) -> None:
        while r.queue:
            _, _, s, k, ready = r.queue[0]
            if not self.admit(r, s, k, ready):
                break
            heapq.heappop(r.queue)
        if self.c.held_slot and r.queue:
            # A paused response resumes in the slot it kept, whatever waits ahead of it for a free one
            # (a request for its pinned slot, as llama.cpp serves it).
            for entry in sorted(r.queue):
                _, _, s, k, ready = entry
                st = self.states[s]
                if st.slot_held and s in r.holders and self.admit(r, s, k, ready):
                    r.queue.remove(entry)
                    heapq.heapify(r.queue)

    def lookup(self, r: Replica, st: SessionState, s: int, k: int) -> int:
        """Prompt tokens of turn `k` whose KV is on `r` now: held, or block-granular cache hits
        (the accelerator matches when the turn arrives; the last prompt token is always computed)."""
        prompt = st.prompts[k]
        if s in r.holders or st.offloaded:
            return min(st.resident, prompt - 1)
        entry = r.cache.get(s)
        shared = r.shared if r.shared_at <= self.now else 0
        own = int(entry[0]) + r.shared if entry is not None else 0
        return floor_blocks(min(max(own, shared), prompt - 1))

    def admit(self, r: Replica, s: int, k: int, ready: float) -> bool:
        st = self.states[s]
        if r.free_slots <= 0 and not (st.slot_held and s in r.holders):
            return False
        prompt = st.prompts[k]
        out = st.spec.output_tokens[k]
        shared = r.shared or floor_blocks(st.spec.instruction_tokens + SHARED_PREFIX_EXTRA)
        need = prompt + out + CALL_TEMPLATE_TOKENS - shared  # the context after the turn, template included
        grow = self.grow
        if grow:  # the prompt now, the output at the first token
            st.pending_kv = out + CALL_TEMPLATE_TOKENS
            need -= st.pending_kv
        own_held = st.held if (s in r.holders) else 0
        entry = r.cache.get(s)
        own_cached = int(entry[0]) if entry is not None else 0
        extra = need - own_held - own_cached + (0 if r.shared else shared)
        # Held KV is preempted by choice (`preempt_held`), or when nothing runs here and so nothing
        # else could ever free room: without it the paused sessions would wait on each other.
        preempt = self.c.preempt_held or r.running == 0
        if extra > self.budget - r.used() and not self.make_room(r, extra, s, preempt=preempt):
            if r.running == 0 and need + shared > self.budget:
                self.make_room(r, extra, s, preempt=preempt, force=True)
                self.run_.overflow_tokens += need + shared - self.budget
            else:
                return False
        if self.c.slot_cache:
            self.keep_sequences(r, s)
        found = self.lookup(r, st, s, k)  # the KV here for the turn (making room never takes the turn's own)
        # Admitted: what the session held or had cached here becomes its running KV.
        reload_s = 0.0
        if own_held:
            r.holders.pop(s)
            self.add(r, 1, -own_held)
            if st.slot_held:  # it resumes in the slot it kept
                st.slot_held = False
                r.free_slots += 1
        elif st.offloaded:
            reload_s = self.reload_s(r, s)
            st.offloaded = False
        if entry is not None:
            self.drop_entry(r, s)
        st.held = st.resident = 0
        cached = min(st.hint, found)
        st.cached_now = cached
        first = not r.shared
        st.active = need
        self.add(r, 0, need)
        r.free_slots -= 1
        r.running += 1
        run = self.run_
        uncached = prompt - cached
        if st.requeued:  # the same turn again after a preemption: its wait adds to the turn's
            st.requeued = False
            st.record.admission_wait_s[-1] += self.now - ready
        else:
            run.turns += 1
            run.prompt_tokens += prompt
            st.first_done = False
            st.record.admission_wait_s.append(self.now - ready)
        run.hit_tokens += cached
        run.prefilled_tokens += uncached
        again = max(0, min(st.seen, prompt) - cached)
        run.reprefill_tokens += again
        st.record.reprefill_tokens += again
        st.seen = prompt + out + CALL_TEMPLATE_TOKENS
        r.prefilled += uncached
        st.running_on = r.index
        st.admitted_at = self.now
        if self.priced:
            if first:  # cached once its prefill is done (first_token)
                r.shared, r.shared_at = shared, math.inf
                self.totals[2] += shared
                self.run_.kv_peak_tokens = max(self.run_.kv_peak_tokens, r.used())
            st.dctx = float(self.cost.prefill_s_per(cached, uncached))  # until it decodes: the per-token cost
            st.run_id += 1
            st.ready_at = ready
            r.runners[s] = k
            if reload_s > 0:
                st.join_at = self.now + reload_s
                self.push(st.join_at, _JOIN, s, k)
            else:
                self.join(r, s, k)
            return True
        c = self.c
        m = c.model
        t0 = (
            self.now
            + reload_s
            + prefill_time_s(m.model_latency_s, m.prefill_tok_per_s, m.prefill_s_per_token_ctx, cached, uncached)
        )
        if first:  # the shared blocks: in r.shared (not an entry of r.cached), cached in the fleet's totals
            r.shared, r.shared_at = shared, t0
            self.totals[2] += shared
            self.run_.kv_peak_tokens = max(self.run_.kv_peak_tokens, r.used())
        rate = c.model.tps
        if c.model.concurrency_slowdown > 0:
            others = sum(1 for a, b in r.decoding.values() if a <= t0 < b)
            rate /= 1.0 + c.model.concurrency_slowdown * others
        r.decoding[s] = (t0, t0 + out / rate)
        st.record.model_s += t0 + out / rate - self.now
        self.push(t0, _FIRST, s, k)
        self.push(t0 + out / rate, _FREE, s, k)
        self.push(t0 + (out - 1) / rate + st.post_s, _END, s, k)
        return True

    def turn_done(self, s: int, k: int) -> None:
        """The turn's last token: its slot and running KV free; its context is held or cached."""
        st = self.states[s]
        r = self.replicas[st.running_on]
        r.free_slots += 1
        r.running -= 1
        r.decoding.pop(s, None)
        self.add(r, 0, -st.active)
        st.active = 0
        last = k == st.spec.turns - 1
        context = st.prompts[k] + st.spec.output_tokens[k] + CALL_TEMPLATE_TOKENS
        cacheable = context if self.c.model.cache_generated else st.prompts[k]
        policy = self.c.hold_policy
        moved = r.index != st.replica  # the next turn was sent elsewhere before this one's last token
        paused = self.append and not last and not moved  # a paused response, its context on this replica
        unique = context - r.shared
        if paused and policy == "minwaste":
            policy = self.choose(r, unique, context)
        copied = self.offload(r, s, unique) if paused and policy == "offload" else None
        if copied is not None:  # its KV stays on the GPU until its copy out ends
            self.add(r, 0, unique)
            self.push(copied, _COPIED, r.index, unique)
        elif paused and policy == "offload":
            policy = "release"  # the host memory cannot take it
        if paused and self.c.hold_policy == "minwaste":
            self.run_.pause_choices[CHOICE_OF[policy]] += 1
        if paused and policy != "release":
            st.resident = context
            st.held = unique
            st.epoch += 1
            if policy != "offload":
                r.holders[s] = unique
                self.add(r, 1, unique)
                if self.c.held_slot:  # the slot stays with the paused response
                    st.slot_held = True
                    r.free_slots -= 1
                if policy == "ttl":
                    self.push(self.now + self.hold_ttl(unique, context), _TTL, s, st.epoch)
        else:
            self.to_cache(r, s, cacheable)
        self.try_admit(r)

    def hold_ttl(self, unique: int, context: int) -> float:
        """How long a paused context is held under `ttl`: `hold_ttl_s`, or (`ttl_rule="reload"`)
        until the KV it holds, as a share of the budget, has cost as much replica time as
        prefilling it again would: ski rental's break-even, the rule Continuum's TTL refines with
        the tool's duration distribution. Unlimited KV holds to the resume."""
        if self.c.ttl_rule == "fixed":
            return self.c.hold_ttl_s
        if not self.c.kv_budget_tokens:
            return math.inf
        return self.reprefill_s(unique, context) * self.budget / max(1, unique)

    # -- priced compute: the step loop ---------------------------------------------------------

    def join(self, r: Replica, s: int, k: int) -> None:
        """An admitted turn's uncached prompt joins the replica's prefill queue (FCFS)."""
        st = self.states[s]
        r.prefilling.append([s, k, float(st.prompts[k] - st.cached_now), st.dctx, st.run_id])
        self.kick(r)

    def kick(self, r: Replica) -> None:
        """New work on `r`: a step in flight takes it at its end; a decode-only segment is cut now."""
        if r.in_step or r.phase == 1:
            return
        if r.phase == 2:
            self.advance(r)
        self.schedule(r)

    def advance(self, r: Replica) -> None:
        elapsed = self.now - r.seg_t
        if elapsed > 0 and r.tau > 0:
            r.pos += elapsed / r.tau
            r.busy += elapsed
        r.seg_t = self.now

    def schedule(self, r: Replica) -> None:
        """The replica's next step (vLLM v1's scheduler, in outline): every decoding sequence
        gets a token, prefill chunks fill the rest of the token budget first come first served;
        with no prefill, identical decode steps run as one segment up to the next last token."""
        r.version += 1
        cost = self.cost
        decoding = len(r.dheap)
        tau = cost.step_s + cost.decode_s(decoding) + cost.decode_s_per_ctx_token * r.ctx_sum
        if r.prefilling:
            avail = float(cost.token_budget - decoding)
            plan = []
            for entry in r.prefilling:
                if avail <= 0:
                    break
                chunk = min(entry[2], avail)
                plan.append((entry, chunk))
                tau += chunk * entry[3]
                avail -= chunk
            r.plan = plan
            r.phase, r.tau = 1, tau
            self.push(self.now + tau, _STEP, r.index, r.version)
        elif decoding:
            r.phase, r.tau, r.seg_t = 2, tau, self.now
            self.push(self.now + max(0.0, r.dheap[0][0] - r.pos) * tau, _STEP, r.index, r.version)
        else:
            r.phase = 0

    def on_step(self, r: Replica, version: int) -> None:
        if version != r.version:
            return
        r.in_step = True
        if r.phase == 1:
            r.busy += r.tau
            r.steps += 1
            r.pos += 1.0
            done = []
            for entry, chunk in r.plan:
                entry[2] -= chunk
                if entry[2] <= 0:
                    done.append(entry)
            if done:
                del r.prefilling[: len(done)]  # FCFS: the finished ones are the queue's head
            r.plan = []
        else:
            self.advance(r)
            r.pos = max(r.pos, r.dheap[0][0])
            done = []
        while r.dheap and r.dheap[0][0] <= r.pos + 1e-9:
            _, _, s, k = heapq.heappop(r.dheap)
            st = self.states[s]
            r.ctx_sum -= st.dctx
            self.last_token(r, s, k)
        for entry in done:
            if entry[4] == self.states[int(entry[0])].run_id:  # not preempted meanwhile
                self.first_token(r, int(entry[0]), int(entry[1]))
        r.in_step = False
        self.schedule(r)

    def first_token(self, r: Replica, s: int, k: int) -> None:
        st = self.states[s]
        if math.isinf(r.shared_at):
            r.shared_at = self.now
        if self.grow and not self.grow_room(r, s):
            return  # preempted itself: the newest running turn
        if not st.first_done:
            st.first_done = True
            st.record.ttft_s.append(self.now - st.sent_at)
        out = st.spec.output_tokens[k]
        st.decoding = True
        if out <= 1:
            self.last_token(r, s, k)
            return
        self.seq += 1
        st.dctx = st.prompts[k] + out / 2
        r.ctx_sum += st.dctx
        heapq.heappush(r.dheap, (r.pos + out - 1, self.seq, s, k))

    def last_token(self, r: Replica, s: int, k: int) -> None:
        st = self.states[s]
        st.dctx = 0.0
        st.decoding = False
        r.runners.pop(s, None)
        st.record.model_s += self.now - st.admitted_at
        self.push(self.now + st.post_s, _END, s, k)
        self.turn_done(s, k)

    # -- running_kv="grow": output KV at the first token, preemption of the newest running turn --

    def grow_room(self, r: Replica, s: int) -> bool:
        """Session `s`'s output KV, taken at its first token: cache and (with `preempt_held`) held
        KV first, then the newest running turn, recomputed later, as vLLM preempts when a running
        request needs blocks that are not there. False when `s` itself was the newest."""
        st = self.states[s]
        need = st.pending_kv
        while self.budget - r.used() < need and not self.make_room(r, need, s, preempt=self.c.preempt_held):
            victim = next(reversed(r.runners))
            if victim == s and len(r.runners) == 1:  # alone and over the budget: counted, not hidden
                self.make_room(r, need, s, preempt=True, force=True)
                self.run_.overflow_tokens += max(0, need - (self.budget - r.used()))
                break
            self.preempt_running(r, victim)
            if victim == s:
                return False
        st.pending_kv = 0
        st.active += need
        self.add(r, 0, need)
        return True

    def preempt_running(self, r: Replica, v: int) -> None:
        st = self.states[v]
        k = r.runners.pop(v)
        self.run_.running_preemptions += 1
        if st.decoding:
            r.dheap = [e for e in r.dheap if e[2] != v]
            heapq.heapify(r.dheap)
            r.ctx_sum -= st.dctx
            st.decoding = False
            computed = st.prompts[k]
        else:
            left = next((e[2] for e in r.prefilling if e[0] == v and e[4] == st.run_id), 0.0)
            r.prefilling = [e for e in r.prefilling if not (e[0] == v and e[4] == st.run_id)]
            computed = st.prompts[k] - int(left)
        st.run_id += 1
        st.dctx = 0.0
        st.join_at = math.nan
        self.add(r, 0, -st.active)
        st.active = 0
        r.free_slots += 1
        r.running -= 1
        st.record.model_s += self.now - st.admitted_at
        if self.c.evict_tail and computed > 0:  # its blocks stay in the prefix cache until evicted
            self.to_cache(r, v, computed)
        st.requeued = True
        st.hint = st.prompts[k]
        self.enqueue(r, v, k, st.ready_at)
