"""Prefix-cache eviction at block granularity (sim/fleet/ledger.py `make_room`, `evict_entry`):
the fleet's order is vLLM v1's free-block queue, checked block by block beside whole runs; a case
computed by hand where whole-entry eviction drops two entries and tail-block eviction keeps
both heads; the shared instructions' blocks are never taken from a turn that reads them."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import msgspec
import pytest

from prototype.pipeline import load_profile
from sim.fleet.config import FleetConfig, FleetRun
from sim.fleet.engine import _Fleet, simulate
from sim.fleet.ledger import BLOCK, KVLedger, floor_blocks
from sim.fleet.sessions import custom_sessions
from sim.fleet.state import Replica
from sim.harness.capacity import arrivals
from sim.model.config import HOSTED_MODEL
from tests.support import fleet_session

LOCAL = load_profile("local")
HOSTED = load_profile("hosted")
SHARED = floor_blocks(16 + 81)  # `fleet_session`'s instructions and their template: the blocks every prompt starts with


class _FreeQueue:
    """vLLM v1's free-block queue for one replica, block by block (docs.vllm.ai, design, Automatic
    Prefix Caching): a request's blocks join the queue's tail when it frees them, its last block
    first, and an allocation takes cached blocks from the head; blocks a request is about to
    reuse are taken out of the queue first. A block is (session, its index after the shared
    instructions); the shared blocks are left out, as every eviction is for a turn that reads
    them."""

    def __init__(self) -> None:
        self.queue: OrderedDict[tuple[int, int], None] = OrderedDict()
        self.blocks: dict[int, int] = {}  # session → its blocks in the queue
        self.evicted = 0

    def free(self, s: int, n: int) -> None:
        for i in reversed(range(n)):
            self.queue[(s, i)] = None
        if n:
            self.blocks[s] = n

    def remove(self, s: int) -> None:
        for i in range(self.blocks.pop(s, 0)):
            del self.queue[(s, i)]

    def evict(self, n: int, victim: int, reading: int) -> None:
        """Take `n` blocks from the head, passing over `reading`'s (the admitted turn reuses
        them): they must be `victim`'s last `n`, tail first."""
        head = [b for b in self.queue if b[0] != reading][:n]
        top = self.blocks[victim]
        assert head == [(victim, top - 1 - j) for j in range(n)], (head, victim, top)
        for b in head:
            del self.queue[b]
        self.blocks[victim] = top - n
        if not self.blocks[victim]:
            del self.blocks[victim]
        self.evicted += n


class _Checked(KVLedger):
    """The KV ledger with vLLM's free-block queue kept beside each replica's cache: every block
    the fleet evicts must be the one at the queue's head."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.free_queues = [_FreeQueue() for _ in self.replicas]
        self.reading = -1  # the session whose turn is making room (its cached blocks are in use)
        self.evicting = False

    def to_cache(self, r: Replica, s: int, tokens: int) -> None:
        # A context is freed whole: none of its blocks is still in the queue from an older free.
        assert s not in self.free_queues[r.index].blocks, f"session {s} freed while blocks of it were free"
        super().to_cache(r, s, tokens)
        if s in r.cache:
            self.free_queues[r.index].free(s, r.cache[s].tokens // BLOCK)

    def drop_entry(self, r: Replica, s: int) -> int:
        if not self.evicting:  # reused by its own turn, expired, or left behind by a reconnection
            self.free_queues[r.index].remove(s)
        return super().drop_entry(r, s)

    def evict_entry(self, r: Replica, s: int, deficit: int) -> None:
        before = r.cache[s].tokens
        self.evicting = True
        try:
            super().evict_entry(r, s, deficit)
        finally:
            self.evicting = False
        after = r.cache[s].tokens if s in r.cache else 0
        self.free_queues[r.index].evict((before - after) // BLOCK, s, self.reading)

    def make_room(self, r: Replica, extra: int, me: int, *, preempt: bool, force: bool = False) -> bool:
        self.reading = me
        try:
            return super().make_room(r, extra, me, preempt=preempt, force=force)
        finally:
            self.reading = -1


def _pressed_sessions() -> tuple[list[Any], list[float]]:
    sessions = custom_sessions(
        0,
        range(40),
        tool_calls=6,
        system_prompt_tokens=6000,
        tool_time_median_s=2.0,
        tool_time_sigma=0.8,
        tool_output_median_tokens=800,
    )
    return sessions, arrivals(0, 40, 2.0)


@pytest.mark.parametrize(
    ("mode", "switches"),
    [
        # The fast loop keeps ws and append as they are; the other variants are slow (docs/testing.md).
        ("ws", {}),
        pytest.param("http", {"router": "least"}, marks=pytest.mark.slow),
        ("append", {}),
        pytest.param("append", {"hold_policy": "ttl", "preempt_held": False}, marks=pytest.mark.slow),
        pytest.param("append", {"hold_policy": "offload", "offload_host_gb": 2.0}, marks=pytest.mark.slow),
        pytest.param("append", {"admission": "greedy"}, marks=pytest.mark.slow),
        pytest.param("ws", {"running_kv": "grow"}, marks=pytest.mark.slow),
        pytest.param("append", {"running_kv": "grow", "queue_order": "program"}, marks=pytest.mark.slow),
        pytest.param("ws", {"compute": "free", "cache_ttl_s": 5.0}, marks=pytest.mark.slow),
        pytest.param("append", {"compute": "free", "router": "prefix"}, marks=pytest.mark.slow),
    ],
)
def test_every_eviction_takes_the_head_of_vllms_free_block_queue(mode: str, switches: dict[str, Any]) -> None:
    """Under KV pressure (2 replicas of 60,000 tokens, 40 sessions at 2/s), in every mode and
    scheduling switch, each block the fleet evicts is the one vLLM's free-block queue would hand
    out: the least recently freed context's last block, passing over the admitted turn's own. A
    context is freed whole (its turn's blocks at the turn's end, a paused or preempted one's when
    released), so the order by free time and tail first is the fleet's order by entry, tail first."""
    sessions, times = _pressed_sessions()
    model = msgspec.structs.replace(HOSTED_MODEL, decode_slots=16)
    config = FleetConfig(model=model, kv_budget_tokens=60_000, replicas=2, **switches)
    fleet = _Fleet(mode, HOSTED, config, sessions, 1, 0.0, _Checked)
    run = fleet.run(times, 0, (), float("inf"))
    assert run.completed == len(sessions)
    assert run.evicted_tokens > 0
    assert isinstance(fleet.ledger, _Checked)
    assert sum(q.evicted for q in fleet.ledger.free_queues) * BLOCK == run.evicted_tokens


def _two_heads(c_prompt: int = 2072, **changes: object) -> FleetRun:
    """ws, one replica of 5,000 tokens, prompt blocks cached (not the generated call). A (2,000
    prompt tokens) at 0 s and B (1,600) at 5 s each run a turn and wait on a tool; C (`c_prompt`) at
    20 s takes room from A's entry; A resumes at about 101 s and takes room from B's; B resumes
    at about 155 s."""
    model = msgspec.structs.replace(HOSTED_MODEL, tps=10.0, cache_generated=False)
    config = FleetConfig(compute="free", kv_budget_tokens=5000, model=model, **changes)  # type: ignore[arg-type]
    sessions = [
        fleet_session(0, 2000, (10, 10), (100.0,)),
        fleet_session(1, 1600, (10, 10), (150.0,)),
        fleet_session(2, c_prompt, (10,)),
    ]
    return simulate("ws", LOCAL, config, sessions, arrivals=[0.0, 5.0, 20.0])


def test_tail_blocks_keep_the_heads_of_two_entries_whole_entries_drop_both() -> None:
    """Computed by hand (entries hold a prompt's full blocks after the 96 shared ones: A 1,904,
    B 1,504 tokens; a turn reserves prompt + 10 output + 14 template - 96).
    C needs 2,000 with 1,496 free: 504 short, 32 blocks (512 tokens). Tail blocks: A keeps
    1,392. Whole entries: A's 1,904 go.
    C's entry (1,968) joins. A's second turn (prompt 2,056) needs 1,984: with tail blocks it
    reuses its 1,392 and 40 are free, 552 short: B, now least recently freed, loses 35 blocks
    (560) and keeps 944; A hits 1,392 + 96. With whole entries 1,432 are free, 552 short: B's
    1,504 go; A hits the shared 96.
    B's second turn (prompt 1,656) needs 1,584: tail blocks, it hits 944 + 96 (C loses 38
    blocks); whole entries, 96 (C goes).
    Hits: first turns 0 (cold), 96, 96; then 1,488 and 1,040 against 96 and 96."""
    tail, whole = _two_heads(), _two_heads(evict_tail=False)
    for run in (tail, whole):
        assert run.completed == 3 and run.overflow_tokens == 0 and run.preemptions == 0
    assert tail.hit_tokens == 96 + 96 + (1392 + SHARED) + (944 + SHARED)
    assert whole.hit_tokens == 4 * SHARED
    assert tail.evicted_tokens == 512 + 560 + 608
    assert whole.evicted_tokens == 1904 + 1504 + 1968
    # A and B prefill again what their next turn had and did not find: the context (prompt, 10
    # output, 14 template) less the hit.
    a_context, b_context = 2000 + 10 + 14, 1600 + 10 + 14
    assert [s.reprefill_tokens for s in tail.sessions] == [a_context - 1488, b_context - 1040, 0]
    assert [s.reprefill_tokens for s in whole.sessions] == [a_context - SHARED, b_context - SHARED, 0]


@pytest.mark.parametrize("evict_tail", [True, False])
def test_the_shared_blocks_stay_while_a_turn_reads_them(evict_tail: bool) -> None:
    """C needs the whole budget but the shared blocks (4,976 + 10 + 14 - 96 = 4,904 of 5,000):
    A's and B's entries go whole (3,408 short, their 1,904 + 1,504 tokens), and C still finds
    the 96 shared tokens it starts with, as vLLM's queue never hands out a block a request
    reuses; so do A's and B's next turns. Hits: 0 (the first turn), then 96 for each of four."""
    run = _two_heads(4976, evict_tail=evict_tail)
    assert run.completed == 3 and run.overflow_tokens == 0
    assert run.kv_peak_tokens == 5000
    assert run.hit_tokens == 4 * SHARED
    assert run.evicted_tokens >= 1904 + 1504
