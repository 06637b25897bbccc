"""Long texts are tokenized on the app's render thread, off the event loop (the BPE releases
the GIL), with the same tokens as on the loop; short ones stay on the loop; the thread runs
at a low priority and is stopped with the app."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from prototype.config import ServerConfig
from prototype.context.tokenizer import TokenArray, Tokenizer
from prototype.response.engine import OFFLOAD_CHARS
from prototype.serve.app import ENGINE
from prototype.serve.compose import RENDER_NICE, background_thread
from prototype.serve.wallclock import AsyncioClock
from sim.client.client import open_client
from sim.model.policy import PlannedItem, ScriptPolicy
from sim.rollout.result import tool_outputs
from tests.support import EXEC_TOOL, live_server

LONG = OFFLOAD_CHARS + 100
# The model's own long outputs are rendered at the end of each turn, for the next turn's cache.
SCRIPT = ScriptPolicy(
    [
        PlannedItem("function_call", "exec_command", '{"cmd":"' + "ls " * (LONG // 3) + '"}'),
        PlannedItem("function_call", "exec_command", '{"cmd":"pwd"}'),
        PlannedItem("message", "", "done " * (LONG // 5)),
    ]
)


class RecordingTokenizer(Tokenizer):
    """Notes the thread and text length of every `encode`."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def encode(self, text: str) -> TokenArray:
        self.calls.append((threading.current_thread().name, len(text)))
        return super().encode(text)


async def _rollout(mode: str, render_threads: int) -> tuple[list[Any], RecordingTokenizer]:
    """Three turns, a long tool output in the first; each turn's tokens rendered and usage
    (append mode pauses without usage: the last turn has the whole response's)."""
    config = ServerConfig(render_threads=render_threads)
    async with live_server(policy=SCRIPT, config=config) as live:
        tokenizer = live.app[ENGINE].tokenizer = RecordingTokenizer()
        client = open_client(mode, live.base_url, AsyncioClock())  # type: ignore[arg-type]
        settings = {"model": "sim", "tools": [EXEC_TOOL], "store": False}
        items: list[dict[str, Any]] = [{"role": "user", "content": "Fix the failing test."}]
        inputs, outputs = [], ["line of tool output\n" * (LONG // 19 + 1), "/work"]
        try:
            for output in [*outputs, None]:
                result = await client.turn(items, **settings)
                assert result.response.longrun is not None
                inputs.append((result.response.longrun.tokens_rendered, result.response.usage))
                if output is None:
                    break
                items = tool_outputs(result, output)
        finally:
            await client.close()
    return inputs, tokenizer


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["http", "ws", "append"])
async def test_long_texts_go_to_the_render_thread_with_the_same_tokens(mode: str) -> None:
    threaded, recorded = await _rollout(mode, render_threads=1)
    inline, on_loop = await _rollout(mode, render_threads=0)
    assert threaded == inline  # the same prompt tokens, turn by turn
    assert threaded[-1][1].input_tokens > LONG // 4  # the long texts are in the prompt (< 4 chars/token)
    main = threading.current_thread().name
    long_calls = [name for name, size in recorded.calls if size >= OFFLOAD_CHARS]
    # The long tool output and the model's long call and answer at least; every one off the loop.
    assert len(long_calls) >= 3 and all(name.startswith("longrun-render") for name in long_calls)
    # Short batches stay on the loop (a batch goes to the thread as a whole once its texts add up).
    assert main in {name for name, size in recorded.calls if size < OFFLOAD_CHARS}
    assert {name for name, _ in on_loop.calls} == {main}  # render_threads=0: all on the loop


def test_the_render_thread_runs_at_low_priority() -> None:
    with ThreadPoolExecutor(1, initializer=background_thread) as pool:
        nice = pool.submit(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())).result()
    assert nice == RENDER_NICE
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) != RENDER_NICE  # the caller is untouched


async def test_the_render_thread_stops_with_the_app() -> None:
    async with live_server(config=ServerConfig(render_threads=1)) as live:
        executor = live.app[ENGINE].render_executor
        assert executor is not None
        assert executor.submit(sum, [1, 2]).result() == 3
    with pytest.raises(RuntimeError, match="shutdown"):
        executor.submit(sum, [1])
