"""The router: which replica a turn goes to, and a WebSocket session's reconnection at its
connection's lifetime (sim/fleet/engine.py's theory of operation: router). It reads the replicas'
loads and caches and changes only what a dropped connection loses."""

from __future__ import annotations

import numpy as np

from sim.fleet.config import FleetConfig, FleetRun
from sim.fleet.ledger import KVLedger
from sim.fleet.loop import EventLoop
from sim.fleet.offload import HostLedger
from sim.fleet.state import Replica, SessionState

__all__ = ["Router"]


class Router:
    """`affinity`, `prefix`, `least`, `random` or `hash` over the fleet's replicas."""

    def __init__(
        self,
        config: FleetConfig,
        loop: EventLoop,
        replicas: list[Replica],
        ledger: KVLedger,
        host: HostLedger,
        run: FleetRun,
        rng: np.random.Generator,
        *,
        websocket: bool,
    ) -> None:
        self.config = config
        self.loop = loop
        self.replicas = replicas
        self.ledger = ledger
        self.host = host
        self.run = run
        self.rng = rng
        self.websocket = websocket  # a session is a connection, pinned to the replica it opened on

    def route(self, st: SessionState, s: int) -> int:
        reps = self.replicas
        router = self.config.router
        if router == "random":
            return int(self.rng.integers(len(reps)))
        if router == "hash":  # by the session alone, every connection: the replicas share nothing (sim/fleet/shard.py)
            return s % len(reps)
        if router == "affinity":
            if st.replica >= 0:
                return st.replica
            return s % len(reps) if not self.websocket else min(reps, key=Replica.load).index
        if router == "prefix":
            best = max(reps, key=lambda r: (r.cache[s].tokens if s in r.cache else 0.0, -r.load()))
            mean = sum(r.load() for r in reps) / len(reps)
            if s in best.cache and best.load() <= self.config.prefix_load_cap * max(mean, 1.0):
                return best.index
        return min(reps, key=Replica.load).index

    def reconnect(self, st: SessionState, s: int) -> None:
        """The session's connection has reached its lifetime: a new one, on another replica
        unless the router is `hash`; what the old one held ends with it."""
        self.run.reconnects += 1
        old = self.replicas[st.replica]
        if s in old.holders:
            self.ledger.release_held(old, s, to_cache=False)  # the response ended with its connection
        if st.offloaded:  # an offloaded paused response ended with its connection too
            self.host.drop_offloaded(old, s)
        if self.config.router == "hash":  # the same replica again: its prefix cache outlives the connection
            st.offloaded = False
            st.held = st.resident = 0
            st.connected_at = self.loop.now
            st.fresh = True
            return
        self.ledger.drop_entry(old, s)
        st.offloaded = False
        st.held = st.resident = 0
        others = [r for r in self.replicas if r.index != old.index] or self.replicas
        if self.config.router == "random":
            st.replica = others[int(self.rng.integers(len(others)))].index
        else:
            st.replica = min(others, key=Replica.load).index
        st.connected_at = self.loop.now
        st.fresh = True
