"""The per-response state machine: exact event grammar and every (state, input) pair."""

from __future__ import annotations

import itertools

import msgspec
import pytest

from prototype.ids import IdFactory
from prototype.model import ItemFinished, ItemStarted, Prefilled, SamplingFinished, TokensSampled
from prototype.response.stream import (
    INPUT_TYPES,
    RS,
    CompactionDone,
    CompactionStarted,
    Continue,
    EndIncomplete,
    Fail,
    InjectAccepted,
    InjectRefused,
    Interrupt,
    Pause,
    ResponseStream,
    Resume,
    Start,
    SteerAccepted,
    SteerPending,
    StreamError,
    Truncated,
)
from prototype.wire.schemas import (
    CompactionItem,
    FunctionCall,
    OutputMessage,
    RequiredInput,
    Response,
    SteerRef,
    encode,
)


def template() -> Response:
    return Response(id="resp_1", created_at=1767225600, status="in_progress", model="sim")


def run(stream: ResponseStream, inputs: list[object]) -> list[object]:
    out: list[object] = []
    for i in inputs:
        out.extend(stream.receive(i))  # type: ignore[arg-type]
    return out


def types(events: list[object]) -> list[str]:
    return [e.__struct_config__.tag for e in events]  # type: ignore[attr-defined]


TEXT_TURN = [
    Start(input_tokens=10),
    Prefilled(cached_tokens=4),
    ItemStarted("message"),
    TokensSampled((1,), "Hel"),
    TokensSampled((2,), ""),  # mid-character token: no delta
    TokensSampled((3,), "lo"),
    ItemFinished(),
    SamplingFinished(),
]


def test_text_turn_exact_sequence() -> None:
    s = ResponseStream(template(), IdFactory(0))
    events = run(s, TEXT_TURN)
    assert types(events) == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(10))  # type: ignore[attr-defined]
    final = events[-1].response  # type: ignore[attr-defined]
    assert final.status == "completed"
    assert final.usage.input_tokens == 10
    assert final.usage.input_tokens_details.cached_tokens == 4
    assert final.usage.output_tokens == 3
    assert final.usage.total_tokens == 13
    assert final.output == [events[-2].item]  # type: ignore[attr-defined]
    msg = final.output[0]
    assert isinstance(msg, OutputMessage) and msg.content[0].text == "Hello"
    # in-progress snapshots carry usage null and empty output
    assert b'"usage":null' in encode(events[0]) and b'"output":[]' in encode(events[1])


def test_function_call_turn_and_item_done_equals_output() -> None:
    s = ResponseStream(template(), IdFactory(0))
    events = run(
        s,
        [
            Start(input_tokens=5),
            ItemStarted("function_call", name="exec_command"),
            TokensSampled((1,), '{"cmd":'),
            TokensSampled((2,), '"ls"}'),
            ItemFinished(),
            ItemStarted("function_call", name="exec_command"),
            TokensSampled((3,), "{}"),
            ItemFinished(),
            SamplingFinished(),
        ],
    )
    assert types(events)[2:6] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
    ]
    added = events[2].item  # type: ignore[attr-defined]
    assert isinstance(added, FunctionCall) and added.status == "in_progress" and added.name == "exec_command"
    assert added.call_id.startswith("call_") and added.id.startswith("fc_")
    dones = [e.item for e in events if types([e]) == ["response.output_item.done"]]  # type: ignore[attr-defined]
    assert events[-1].response.output == dones  # type: ignore[attr-defined]
    assert dones[0].arguments == '{"cmd":"ls"}' and dones[0].status == "completed"
    assert [d.call_id for d in dones] == [r.call_id for r in s.pending_calls()]


def test_max_output_tokens_ends_incomplete() -> None:
    s = ResponseStream(template(), IdFactory(0))
    events = run(s, TEXT_TURN[:-1] + [SamplingFinished("max_output_tokens")])
    assert types(events)[-1] == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"  # type: ignore[attr-defined]
    assert s.state is RS.INCOMPLETE


def test_pause_and_resume_continue_indices_and_sequence() -> None:
    s = ResponseStream(template(), IdFactory(0))
    first = run(
        s,
        [
            Start(input_tokens=5),
            ItemStarted("function_call", name="f"),
            TokensSampled((1,), "{}"),
            ItemFinished(),
            Pause(),
        ],
    )
    assert types(first)[-1] == "response.done" and s.state is RS.PAUSED
    assert first[-1].response.status == "in_progress"  # type: ignore[attr-defined]
    assert [r.name for r in first[-1].required_input] == ["f"]  # type: ignore[attr-defined]
    second = run(s, [Resume(input_tokens=3), *TEXT_TURN[1:]])
    assert types(second)[0] == "response.in_progress"
    assert second[0].sequence_number == first[-1].sequence_number + 1  # type: ignore[attr-defined]
    assert second[1].output_index == 1  # type: ignore[attr-defined]
    final = second[-1].response  # type: ignore[attr-defined]
    assert len(final.output) == 2 and final.usage.input_tokens == 8 and final.usage.output_tokens == 4


def test_abort_after_start_and_not_after_terminal() -> None:
    s = ResponseStream(template(), IdFactory(0))
    run(s, TEXT_TURN[:3])
    failed = s.abort("server_error", "boom")
    assert types(failed) == ["response.failed"]
    assert failed[0].response.error.code == "server_error"  # type: ignore[attr-defined]
    assert s.abort("server_error", "again") == []
    done = ResponseStream(template(), IdFactory(0))
    run(done, TEXT_TURN)
    assert done.abort("server_error", "late") == []


def test_end_incomplete_from_pause() -> None:
    s = ResponseStream(template(), IdFactory(0))
    run(s, [Start(input_tokens=1), Pause()])
    events = s.end_incomplete("append_timeout")
    assert events[0].response.incomplete_details.reason == "append_timeout"  # type: ignore[attr-defined]
    with pytest.raises(StreamError, match=r"^can't handle EndIncomplete in state INCOMPLETE$"):
        s.end_incomplete("append_timeout")


# -- every (state, input) pair, against a table written here -------------------------------------
#
# One row per legal move, in plain words: (state, input, the events it sends, next state). Every
# other pair raises StreamError and leaves the stream where it was. The table is the same in both
# dialects; only the pause's rendering differs (PAUSE_EVENTS): append announces it, the beta does not.

PAUSE_EVENTS = {"append": ("response.done",), "beta": ()}

LEGAL: list[tuple[str, str, tuple[str, ...], str]] = [
    ("queued", "start", ("response.created", "response.in_progress"), "in progress"),
    ("queued", "fail", ("response.failed",), "failed"),
    ("in progress", "prefilled", (), "in progress"),  # counted in usage, no event
    ("in progress", "item started", ("response.output_item.added", "response.content_part.added"), "in item"),
    ("in progress", "sampling finished", ("response.completed",), "completed"),
    ("in progress", "truncated", ("response.incomplete",), "incomplete"),  # max_output_tokens
    ("in progress", "pause", ("<pause>",), "paused"),
    ("in progress", "end incomplete", ("response.incomplete",), "incomplete"),
    ("in progress", "fail", ("response.failed",), "failed"),
    ("in item", "tokens", ("response.output_text.delta",), "in item"),
    (
        "in item",
        "item finished",
        ("response.output_text.done", "response.content_part.done", "response.output_item.done"),
        "in progress",
    ),
    ("in item", "fail", ("response.failed",), "failed"),
    # Beta: a steer stops the decode at a token boundary; the item in flight closes incomplete.
    (
        "in item",
        "interrupt",
        (
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.incomplete",
        ),
        "incomplete",
    ),
    ("in progress", "interrupt", ("response.incomplete",), "incomplete"),
    ("paused", "resume", ("response.in_progress",), "in progress"),
    ("in progress", "continue", (), "in progress"),  # beta: decoding on past async calls, no event
    # Acknowledgements are numbered wherever the live stream is (beta injects answer async calls
    # while the model still decodes; append ones only come while paused).
    *[
        (state, ack, (event,), state)
        for state in ("in progress", "in item", "paused")
        for ack, event in (
            ("inject accepted", "response.inject.created"),
            ("inject refused", "response.inject.failed"),
            ("steer accepted", "response.steer.accepted"),
        )
    ],
    # Input the core accepted as the response ended goes to its continuation: still acknowledged.
    *[
        (state, ack, (event,), state)
        for state in ("completed", "incomplete", "failed")
        for ack, event in (
            ("inject accepted", "response.inject.created"),
            ("steer accepted", "response.steer.accepted"),
        )
    ],
    ("completed", "steer pending", ("response.steer.pending",), "completed"),  # after response.completed
    ("paused", "end incomplete", ("response.incomplete",), "incomplete"),
    ("paused", "fail", ("response.failed",), "failed"),
    (
        "in progress",
        "compaction started",
        ("response.output_item.added", "response.compaction.compacting"),
        "compacting",
    ),
    ("compacting", "compaction done", ("response.output_item.done",), "in progress"),
    ("compacting", "fail", ("response.failed",), "failed"),
]
STATES = {
    "queued": RS.QUEUED,
    "in progress": RS.IN_PROGRESS,
    "in item": RS.IN_ITEM,
    "paused": RS.PAUSED,
    "compacting": RS.COMPACTING,
    "completed": RS.COMPLETED,
    "incomplete": RS.INCOMPLETE,
    "failed": RS.FAILED,
}
INPUTS: dict[str, tuple[type, object]] = {
    "start": (Start, Start(1)),
    "pause": (Pause, Pause()),
    "resume": (Resume, Resume(1)),
    "continue": (Continue, Continue(1)),
    "fail": (Fail, Fail("x", "y")),
    "end incomplete": (EndIncomplete, EndIncomplete("append_timeout")),
    "interrupt": (Interrupt, Interrupt()),
    "inject accepted": (InjectAccepted, InjectAccepted()),
    "inject refused": (InjectRefused, InjectRefused([], "unknown_call_id", "no such call")),
    "steer accepted": (SteerAccepted, SteerAccepted(SteerRef(id="steer_1", previous_response_id="resp_1"))),
    "steer pending": (
        SteerPending,
        SteerPending(SteerRef(id="steer_1", previous_response_id="resp_1"), (RequiredInput(call_id="c", name="f"),)),
    ),
    "prefilled": (Prefilled, Prefilled(0)),
    "item started": (ItemStarted, ItemStarted("message")),
    "tokens": (TokensSampled, TokensSampled((1,), "a")),
    "item finished": (ItemFinished, ItemFinished()),
    "sampling finished": (SamplingFinished, SamplingFinished()),
    "truncated": (Truncated, SamplingFinished("max_output_tokens")),
    "compaction started": (CompactionStarted, CompactionStarted("cmp_1")),
    "compaction done": (CompactionDone, CompactionDone(CompactionItem(id="cmp_1", encrypted_content="x"))),
}


def test_the_expected_table_names_every_state_and_input() -> None:
    assert set(STATES.values()) == set(RS) and {kind for kind, _ in INPUTS.values()} == set(INPUT_TYPES)
    assert len({(row[0], row[1]) for row in LEGAL}) == len(LEGAL)


def _stream_in(state: RS, dialect: str = "append") -> ResponseStream:
    s = ResponseStream(template(), IdFactory(0), dialect=dialect)
    path = {
        RS.QUEUED: [],
        RS.IN_PROGRESS: [Start(1)],
        RS.IN_ITEM: [Start(1), ItemStarted("message")],
        RS.PAUSED: [Start(1), Pause()],
        RS.COMPACTING: [Start(1), CompactionStarted("cmp_1")],
        RS.COMPLETED: [Start(1), SamplingFinished()],
        RS.INCOMPLETE: [Start(1), SamplingFinished("max_output_tokens")],
        RS.FAILED: [Fail("x", "y")],
    }[state]
    run(s, path)
    assert s.state is state
    return s


@pytest.mark.parametrize(
    ("dialect", "state", "input_name"),
    list(itertools.product(PAUSE_EVENTS, STATES, INPUTS)),
    ids=lambda v: str(v).replace(" ", "_"),
)
def test_every_state_input_pair(dialect: str, state: str, input_name: str) -> None:
    s = _stream_in(STATES[state], dialect)
    kind, event = INPUTS[input_name]
    row = next((r for r in LEGAL if r[0] == state and r[1] == input_name), None)
    if row is None:
        with pytest.raises(StreamError, match=rf"^can't handle {kind.__name__} in state {STATES[state].name}$"):
            s.receive(event)  # type: ignore[arg-type]
        assert s.state is STATES[state]  # an illegal input moves nothing
        return
    _, _, events, nxt = row
    expected = [e for name in events for e in (PAUSE_EVENTS[dialect] if name == "<pause>" else (name,))]
    assert types(s.receive(event)) == expected  # type: ignore[arg-type]
    assert s.state is STATES[nxt]


def test_abort_after_an_illegal_input_ends_the_stream_failed() -> None:
    s = _stream_in(RS.IN_ITEM)
    with pytest.raises(StreamError):
        s.receive(Start(1))
    assert types(s.abort("server_error", "boom")) == ["response.failed"] and s.state is RS.FAILED


def test_warm_up_start_sends_only_created() -> None:
    s = ResponseStream(template(), IdFactory(0))
    events = run(s, [Start(0, warm_up=True), SamplingFinished()])
    assert types(events) == ["response.created", "response.completed"]
    assert [e.sequence_number for e in events] == [0, 1]  # type: ignore[attr-defined]


def test_beta_marks_calls_of_async_tools_and_splits_them_from_owed_calls() -> None:
    s = ResponseStream(template(), IdFactory(0), dialect="beta", async_tools=frozenset({"slow"}))
    events = run(s, [Start(1), ItemStarted("function_call", "slow"), ItemFinished()])
    events += run(s, [ItemStarted("function_call", "fast"), ItemFinished()])
    items = [e.item for e in events if type(e).__name__ == "OutputItemDone"]  # type: ignore[attr-defined]
    assert [i.is_async for i in items] == [True, msgspec.UNSET]
    waits, owed = s.split_calls()
    assert [w.name for w in waits] == ["slow"] and [o.name for o in owed] == ["fast"]
    assert b'"async":true' in encode(items[0]) and b"async" not in encode(items[1])


def test_append_dialect_never_marks_calls_async() -> None:
    s = ResponseStream(template(), IdFactory(0), async_tools=frozenset({"slow"}))
    run(s, [Start(1), ItemStarted("function_call", "slow"), ItemFinished()])
    assert s.split_calls()[0] == [] and b"async" not in encode(s.output[0])


def test_unknown_dialect_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown dialect"):
        ResponseStream(template(), IdFactory(0), dialect="v2")


def test_an_interrupt_closes_the_message_in_flight_incomplete_with_its_text_so_far() -> None:
    s = ResponseStream(template(), IdFactory(0), dialect="beta")
    events = run(s, [Start(5), ItemStarted("message"), TokensSampled((1,), "Hel"), TokensSampled((2,), "lo")])
    events += run(s, [Interrupt()])
    assert types(events)[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    done, final = events[-2].item, events[-1].response  # type: ignore[attr-defined]
    assert isinstance(done, OutputMessage) and done.status == "incomplete" and done.content[0].text == "Hello"
    assert final.incomplete_details.reason == "steered" and final.output == [done]
    assert final.usage.output_tokens == 2 and s.discarded_tokens == 2
    assert [e.sequence_number for e in events] == list(range(len(events)))  # type: ignore[attr-defined]


def test_an_interrupted_call_is_incomplete_is_not_pending_and_counts_only_its_own_tokens() -> None:
    s = ResponseStream(template(), IdFactory(0), dialect="beta", async_tools=frozenset({"f"}))
    run(s, [Start(5), ItemStarted("message"), TokensSampled((1, 2), "ok"), ItemFinished()])
    run(s, [ItemStarted("function_call", "f"), TokensSampled((3,), '{"cmd":'), TokensSampled((4, 5), '"l')])
    events = run(s, [Interrupt()])
    assert types(events) == ["response.output_item.done", "response.incomplete"]  # no arguments.done
    call = events[0].item  # type: ignore[attr-defined]
    assert isinstance(call, FunctionCall) and call.status == "incomplete" and call.arguments == '{"cmd":"l'
    assert s.discarded_tokens == 3 and s.output_tokens == 5
    # It stays in the response's output (the client saw it); the engine keeps it out of the context.
    assert [i.status for i in s.output] == ["completed", "incomplete"]
