"""The service composed once, for every transport: the aiohttp app (`app.make_app`) and the
in-process transport (`sim/runtime/inprocess.py`) both call `compose`.

`compose` takes the server's config whole and the parts only the caller can choose (the model
behind the seam, the store, the clock, the id seed) and returns a `Service`: the `Engine`, its
render threads, the Agents API and the WebSocket connection slots, with one `close`. Whether
render threads are made is the caller's setting (`render_threads`), never read off the event
loop: the live server always asks for them; the in-process server asks when its run charges CPU,
where the loop waits for their work in real time (`sim/runtime/virtual.py`), and not when CPU is
free, where tokenizing on the loop takes no time.
"""

from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Final

from ..clock import Clock
from ..config import ServerConfig
from ..context.conversation import ItemParser, parse_items
from ..context.safety import SafetyClassifier
from ..context.tokenizer import Tokenizer, get_tokenizer
from ..ids import IdFactory
from ..model import TokenModel
from ..response.engine import Engine, RenderedItems
from ..response.services import KnownContexts
from ..store.base import ResponseStore
from .admission import Slots
from .agents_api import AgentsAPI

__all__ = ["RENDER_NICE", "Overrides", "Service", "background_thread", "compose"]

RENDER_NICE: Final = 19  # the render threads' nice value (the event loop's stays as started)


@dataclass(frozen=True, slots=True)
class Overrides:
    """Replacements for the engine's default parts (the simulator's memoizing ones, `sim.runtime.memo`,
    where CPU is free); a part left None keeps its default."""

    tokenizer: Tokenizer | None = None
    classifier: SafetyClassifier | None = None
    item_parser: ItemParser = parse_items
    rendered: RenderedItems | None = None
    contexts: KnownContexts | None = None


class Service:
    """What every transport serves: the engine, the Agents API over it, the WebSocket connection
    slots, and the render threads (None: every text is tokenized on the event loop)."""

    __slots__ = ("agents", "config", "engine", "executor", "slots")

    def __init__(self, config: ServerConfig, engine: Engine, executor: ThreadPoolExecutor | None) -> None:
        self.config = config
        self.engine = engine
        self.executor = executor
        self.agents = AgentsAPI(engine, config, ids=engine.ids.fork("agents"))
        self.slots = Slots(config.websocket.max_connections)  # open WebSocket connections

    async def close(self) -> None:
        """Shutdown, in order: the Agents API's running turns ended and their streams closed, the
        render threads stopped (a render in flight is short: it ends), the store closed.
        Idempotent."""
        await self.agents.close()
        if self.executor is not None:
            self.executor.shutdown(wait=True, cancel_futures=True)
        await self.engine.store.close()


def compose(
    config: ServerConfig,
    *,
    model: TokenModel,
    store: ResponseStore,
    clock: Clock,
    seed: int | None = None,
    render_threads: bool = True,
    overrides: Overrides | None = None,
) -> Service:
    """The service of `config` on these parts. `seed`: the ids' (None: random ids, for a store
    that outlives the process). `render_threads`: whether `config.render_threads` threads
    tokenize long texts off the event loop (the caller's run mode decides)."""
    parts = overrides or Overrides()
    executor = _render_executor(config) if render_threads else None
    engine = Engine(
        model=model,
        store=store,
        clock=clock,
        tokenizer=parts.tokenizer or get_tokenizer(),
        ids=IdFactory(seed),
        profile=config.cost_profile,
        optimizations=config.optimizations,
        classifier=parts.classifier,
        render_executor=executor,
        item_parser=parts.item_parser,
        rendered=parts.rendered,
        contexts=parts.contexts,
        limits=config.model,
        steer_boundary=config.steer_boundary,
        multi_agent_holds_calls=config.multi_agent_holds_calls,
    )
    return Service(config, engine, executor)


def _render_executor(config: ServerConfig) -> ThreadPoolExecutor | None:
    """The render threads of `config` (nice `RENDER_NICE`), or None when it asks for none."""
    if config.render_threads <= 0:
        return None
    return ThreadPoolExecutor(config.render_threads, thread_name_prefix="longrun-render", initializer=background_thread)


def background_thread() -> None:
    """Tokenizer threads yield the CPU to the event loop: nice 19 (Linux: per thread), so
    a burst of long renders on a busy core does not delay the streams' paced tokens."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), RENDER_NICE)
