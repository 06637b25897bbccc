"""A stand-in for llama.cpp's own API (sim/engine/llamacpp.py's dialect), served from a thread of its
own so a live comparison (which runs its own event loop) can attach to it with `--engine-url`.

``POST /completion`` streams back the ids its token-id grammar forces, one piece each, with
llama.cpp's timings: ``cache_n`` the prompt's common prefix with what its slot holds (token-exact,
as a slot reuses), ``prompt_ms`` and ``predicted_ms`` from the rates `rates(request_number)` gives
(the engine's speed, which a test can make drift); ``POST /slots/N?action=erase`` empties a slot.
A request whose number is in `fail` gets a 500 in llama.cpp's error shape. No model: the tests
that use it check the harness around an engine, not an engine."""

from __future__ import annotations

import asyncio
import contextlib
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import msgspec
from aiohttp import web

_GRAMMAR_ID = re.compile(r"<\[(\d+)\]>")


@dataclass
class FakeLlamaCpp:
    rates: Callable[[int], tuple[float, float]] = lambda _: (250.0, 25.0)  # request -> (prefill, decode) tokens/s
    fail: frozenset[int] = frozenset()  # request numbers (from 0) answered with a 500
    requests: int = 0
    erased: list[int] = field(default_factory=list)  # slot ids, in the order erased
    slots: dict[int, list[int]] = field(default_factory=dict)
    url: str = ""

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/completion", self._completion)
        app.router.add_post("/slots/{slot}", self._slot)
        return app

    async def _slot(self, request: web.Request) -> web.Response:
        slot = int(request.match_info["slot"])
        if request.query.get("action") == "erase":
            self.slots.pop(slot, None)
            self.erased.append(slot)
        return web.json_response({})

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        number, self.requests = self.requests, self.requests + 1
        if number in self.fail:
            error = {"error": {"code": 500, "message": "fake engine fault", "type": "server_error"}}
            return web.json_response(error, status=500)
        body = await request.json()
        prompt: list[int] = body["prompt"]
        forced = [int(i) for i in _GRAMMAR_ID.findall(body.get("grammar", ""))] or [0] * body["n_predict"]
        slot = int(body.get("id_slot", 0))
        held = self.slots.get(slot, [])
        cached = 0
        while cached < min(len(held), len(prompt) - 1) and held[cached] == prompt[cached]:
            cached += 1
        prefill, decode = self.rates(number)
        timings = {
            "cache_n": cached,
            "prompt_n": len(prompt) - cached,
            "prompt_ms": 1e3 * (len(prompt) - cached) / prefill,
            "predicted_n": len(forced),
            "predicted_ms": 1e3 * len(forced) / decode,
        }
        self.slots[slot] = prompt + forced[:-1]
        reply = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await reply.prepare(request)
        for i, token in enumerate(forced):
            last = i == len(forced) - 1
            piece = {"content": "", "tokens": [token], "stop": last, "timings": timings}
            await reply.write(b"data: " + msgspec.json.encode(piece) + b"\n\n")
        await reply.write_eof()
        return reply


@contextlib.contextmanager
def fake_engine(**fields: object) -> Iterator[FakeLlamaCpp]:
    """A `FakeLlamaCpp` listening on loopback (its `url` set) for the block, in a thread."""
    fake = FakeLlamaCpp(**fields)  # type: ignore[arg-type]
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(fake.app())
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    fake.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield fake
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.run_until_complete(runner.cleanup())
        loop.close()
