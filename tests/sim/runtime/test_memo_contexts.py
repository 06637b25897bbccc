"""`sim.runtime.memo.MemoContexts`: a request that resends its history starts from the context its
previous request built. The context, the errors and the counts are those of the plain path (a
fresh context checked and extended item by item), whatever the caller does to a context after."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any, cast

import numpy as np
import pytest
from msgspec import Raw

from prototype.context.conversation import Context, Item, check_continuation, parse_items
from prototype.context.tokenizer import get_tokenizer
from prototype.ids import IdFactory
from prototype.model import TokenModel
from prototype.response.engine import Engine
from prototype.response.prepare import _fresh
from prototype.store.memory import MemoryStore
from prototype.wire.errors import ProtocolError
from prototype.wire.schemas import StageReport
from sim.runtime.clock import ManualClock
from sim.runtime.memo import MemoContexts


def _engine() -> Engine:
    # Only `render` is used: no model is asked anything.
    model = cast(TokenModel, None)
    return Engine(model=model, store=MemoryStore(), clock=ManualClock(), tokenizer=get_tokenizer(), ids=IdFactory(1))


def _items(*bodies: dict[str, Any]) -> list[Item]:
    return list(parse_items([Raw(json.dumps(b)) for b in bodies]))


def _user(text: object, **more: Any) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": text, **more}


def _call(call_id: str, **more: Any) -> dict[str, Any]:
    return {"type": "function_call", "call_id": call_id, "name": "run", "arguments": "{}", **more}


def _output(call_id: str, **more: Any) -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": call_id, "output": f"out {call_id}", **more}


def _assistant(text: str, **more: Any) -> dict[str, Any]:
    return {"type": "message", "role": "assistant", "content": text, **more}


# A conversation as an `http` client resends it: each request is the last one and more.
HISTORY = _items(
    _user("Fix the failing test.", id="msg_1"),
    _call("c1", id="fc_1"),
    _output("c1"),
    _call("c2", id="fc_2"),
    _call("c3", id="fc_3"),
    _output("c3"),
    _output("c2"),
    _assistant("Done: the test passes.", id="msg_2"),
    _user(
        [{"type": "input_text", "text": "Now the docs.", "prompt_cache_breakpoint": {"mode": "explicit"}}], id="msg_3"
    ),
    _call("c4", id="fc_4"),
    _output("c4"),
)
REQUESTS = (3, 7, 8, 11)  # where each request's input ends


def _state(context: Context) -> tuple[object, ...]:
    return (
        [id(item) for item in context.items],
        [chunk.tolist() for chunk in context.chunks],
        context.n_tokens,
        context.held_bytes,
        context.turn_index,
        context.conversation_key,
        context.last_was_model,
        set(context.item_ids),
        set(context.call_ids),
        list(context.pending),
        list(context.marked),
    )


async def _plain(engine: Engine, items: Sequence[Item], report: StageReport) -> Context:
    """What `resolve` does with an input and no history when the engine has no known contexts."""
    context = Context()
    check_continuation(context, items)
    context.extend(items, await engine.render(items, report))
    return context


def _error(call: Any) -> tuple[object, ...]:
    with pytest.raises(ProtocolError) as caught:
        asyncio.run(call)
    return caught.value.status, caught.value.body()


def test_a_resent_history_builds_the_plain_context_and_counts() -> None:
    plain, memo, known = _engine(), _engine(), MemoContexts()
    for end in (*REQUESTS, *REQUESTS):  # twice: the second pass finds each request's own context
        items = HISTORY[:end]
        a, b = StageReport(), StageReport()
        expected = asyncio.run(_plain(plain, items, a))
        got = asyncio.run(_fresh(memo, known, items, b))
        assert _state(got) == _state(expected)
        assert b.tokens_rendered == a.tokens_rendered  # the known prefix is counted as rendered
    assert memo.statistics().items_rendered == plain.statistics().items_rendered
    assert memo.statistics().tokens_rendered == plain.statistics().tokens_rendered


def test_a_known_prefix_is_the_callers_to_change_and_stays_as_kept() -> None:
    memo, known = _engine(), MemoContexts()
    first = asyncio.run(_fresh(memo, known, HISTORY[:3], StageReport()))
    more = HISTORY[3:7]
    first.extend(more, [np.zeros(2, np.uint32)] * len(more))  # what finish does: the same object, in place
    first.end_turn()
    again = asyncio.run(_fresh(memo, known, HISTORY[:8], StageReport()))
    assert again is not first and _state(again) == _state(asyncio.run(_plain(_engine(), HISTORY[:8], StageReport())))
    again.item_ids.add("msg_9")  # a caller's change to its copy is not the kept context's
    assert _state(asyncio.run(_fresh(memo, known, HISTORY[:8], StageReport()))) == _state(
        asyncio.run(_plain(_engine(), HISTORY[:8], StageReport()))
    )


@pytest.mark.parametrize(
    "tail",
    [
        _items(_user("again", id="msg_1")),  # an id the known prefix already has
        _items(_output("c9")),  # an output that answers no call
        _items(_call("c9")),  # a call left without an output
        _items(_call("c9"), _output("c9"), _call("c1", id="fc_1")),  # a duplicate after valid items
    ],
    ids=["duplicate", "no-call", "no-output", "late-duplicate"],
)
def test_invalid_input_after_a_known_prefix_fails_as_plain(tail: list[Item]) -> None:
    memo, known = _engine(), MemoContexts()
    asyncio.run(_fresh(memo, known, HISTORY[:8], StageReport()))
    items = [*HISTORY[:8], *tail]
    assert _error(_fresh(memo, known, items, StageReport())) == _error(_plain(_engine(), items, StageReport()))
    # The failed request kept nothing: the known prefix is still the last valid one.
    assert _state(asyncio.run(_fresh(memo, known, HISTORY[:11], StageReport()))) == _state(
        asyncio.run(_plain(_engine(), HISTORY[:11], StageReport()))
    )


def test_an_input_with_a_reference_is_not_kept() -> None:
    """A reference lets an output answer a call the check cannot see anywhere in the input, so a
    prefix holding one is never the start of another input's check."""
    memo, known = _engine(), MemoContexts()
    asyncio.run(_fresh(memo, known, HISTORY[:3], StageReport()))  # known: the reference comes after it
    referenced = [*HISTORY[:3], *_items({"type": "item_reference", "id": "fc_0"})]
    asyncio.run(_fresh(memo, known, referenced, StageReport()))
    found = known.known(referenced)
    assert found is not None and len(found.items) == 3  # the prefix before it, as it was kept
    items = [*referenced, *_items(_output("c0"))]  # answers the referenced call: valid
    assert _state(asyncio.run(_fresh(memo, known, items, StageReport()))) == _state(
        asyncio.run(_plain(_engine(), items, StageReport()))
    )


def test_only_the_same_items_are_known() -> None:
    memo, known = _engine(), MemoContexts()
    asyncio.run(_fresh(memo, known, HISTORY[:7], StageReport()))
    assert known.known(HISTORY[:6]) is None  # shorter than what is kept
    equal = [*_items(_user("Fix the failing test.", id="msg_1")), *HISTORY[1:8]]  # equal, not the same object
    assert known.known(equal) is None
    changed = [*HISTORY[:5], *_items(_output("c3", status="completed")), *HISTORY[6:8]]
    assert known.known(changed) is None
    found = known.known(HISTORY[:8])
    assert found is not None and len(found.items) == 7


def test_what_known_returns_is_a_copy() -> None:
    memo, known = _engine(), MemoContexts()
    asyncio.run(_fresh(memo, known, HISTORY[:7], StageReport()))
    found = known.known(HISTORY[:8])
    assert found is not None
    before = _state(found)
    found.extend(HISTORY[7:8], [np.zeros(1, np.uint32)])
    found.item_ids.add("msg_9")
    found.end_turn()
    again = known.known(HISTORY[:8])
    assert again is not None and again is not found and _state(again) == before
