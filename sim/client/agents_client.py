"""The `agents` mode's measuring client: one Agents API session per rollout (docs/agents-api.md).

The rollout's first request creates the session with `stream: true`; that response's event
stream stays open for the session's one turn. Each model step that ends in function calls ends
a harness turn at `agent.session.requires_action`; the next harness turn POSTs the tool results
(one `events` body per step, with an Idempotency-Key, answered 202) and reads on in the same
stream, to the next pause or to the turn's end and `agent.session.idle`. A user message the
harness holds for the next request (an interjection) goes in that POST as an input message:
the session steers the turn with it at the step boundary.

Per step the client reads what append mode's client reads: the turn's response as the server
reports it at the pause or the end (longrun's `longrun` extension field on those events: usage
and stage timings, the output trimmed), the function calls (whole in `turn.item.added`: there
are no argument deltas, so a step that ends in a call has its first token at that event) and the
messages. Subclasses replace `_create`, `_subscribe`, `_turn` and `_post` to carry the same
bodies over another transport (sim.runtime.inprocess).

A turn that ends while the tools run (the server's pause timeout fails it with `request_timeout`)
no longer holds the calls, and the POST of their results is refused `Unknown pending tool call`;
the client then reads the turn (`GET .../turns/{id}`) and reports its error, not the refusal.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Final

import aiohttp
import msgspec

from prototype.agents.wire import AGENTS_BETA, LongrunExt
from prototype.clock import Clock
from prototype.wire.schemas import Response, encode
from prototype.wire.sse import SSEDecoder
from sim.client.tracker import Tracker
from sim.rollout.result import ClientError, Mode, TurnResult

__all__ = ["AgentsClient", "agent_tool"]

TURN_ENDS: Final = frozenset(f"agent.session.turn.{end}" for end in ("completed", "failed", "cancelled"))


class _Event(msgspec.Struct):
    """The fields of a session event this client reads."""

    type: str
    session: dict[str, Any] | None = None
    item: dict[str, Any] | None = None
    turn_id: str | None = None
    longrun: LongrunExt | None = None


_decode_event: Final = msgspec.json.Decoder(_Event).decode


def agent_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A Responses function tool as an agent's (`strict` has no place there)."""
    return {key: value for key, value in tool.items() if key != "strict"}


def _message(item: dict[str, Any]) -> dict[str, Any]:
    content = item.get("content", "")
    if isinstance(content, str):
        content = [{"type": "input_text", "text": content}]
    return {"role": "user", "content": content}


class AgentsClient:
    def __init__(self, base_url: str, clock: Clock, *, api_key: str = "sk-longrun") -> None:
        self.mode: Mode = "agents"
        self.url = base_url.rstrip("/") + "/agents/sessions"
        self.clock = clock
        self.api_key = api_key
        self.session_id: str | None = None
        self.turn_id: str | None = None
        self.http: aiohttp.ClientSession | None = None
        self._events: AsyncIterator[_Event] | None = None
        self._posts = 0
        self._idle = False  # the session's turn ended: the next input starts another turn

    async def turn(self, new_items: list[dict[str, Any]], **settings: Any) -> TurnResult:
        if self._events is None:
            messages = [_message(item) for item in new_items]
            agent: dict[str, Any] = {"model": settings["model"], "tools": [agent_tool(t) for t in settings["tools"]]}
            if settings.get("instructions") is not None:
                agent["instructions"] = settings["instructions"]
            body = {"environment": {"type": "none"}, "agent": agent, "input": messages, "stream": True}
            data = encode(body)
            tracker = Tracker(self.clock, self.clock.now(), len(data))
            self._events = self._decoded(self._create(data))
        else:
            assert self.session_id is not None and self.turn_id is not None
            if self._idle:
                # A new turn (a message held past the answer): the create's stream has ended, so
                # subscribe to the session's events first, as openai-python's `sessions.stream` does.
                await self._events.aclose()  # type: ignore[attr-defined]
                self._events = self._decoded(await self._subscribe(self.session_id))
                self._idle = False
            events = [self._input(item) for item in new_items]
            data = encode({"events": events})
            tracker = Tracker(self.clock, self.clock.now(), len(data))
            self._posts += 1
            try:
                await self._post(self.session_id, data, f"{self.session_id}-{self._posts}")
            except ClientError as exc:
                raise await self._ended_under(exc) from None
        return await self._read(tracker)

    async def _ended_under(self, refused: ClientError) -> ClientError:
        """The error to report for tool results the server refused as `Unknown pending tool call`.

        This client posts results only after `requires_action`, when the calls are registered, so
        the refusal means the turn ended while the tools ran (the pause timeout: `request_timeout`).
        The turn as `GET .../turns/{id}` shows it says why; a failed turn's error (as its stream's
        `error` event gives it, status 400 as a stream error's) is the rollout's. The API takes no
        result for a call of an ended turn, so the turn cannot be resumed with them."""
        body = refused.body.get("error") if isinstance(refused.body, dict) else None
        if refused.status != 400 or not isinstance(body, dict):
            return refused
        if not str(body.get("message", "")).startswith("Unknown pending tool call"):
            return refused
        assert self.session_id is not None and self.turn_id is not None
        turn = await self._turn(self.session_id, self.turn_id)
        error = turn.get("error")
        if turn.get("status") != "failed" or not isinstance(error, dict):
            return refused
        self._idle = True  # the session went idle after the turn's end
        message = f"turn {self.turn_id} failed before its tool results were sent: {error.get('message')}"
        return ClientError(400, {"type": "server_error", "code": error.get("code"), "message": message})

    def _input(self, item: dict[str, Any]) -> dict[str, Any]:
        if item.get("type") == "function_call_output":
            return {
                "type": "agent.session.input.tool_result",
                "turn_id": self.turn_id,
                "call_id": item["call_id"],
                "success": True,
                "output": item["output"],
            }
        return {"type": "agent.session.input.message", "input": [_message(item)]}

    async def _read(self, tracker: Tracker) -> TurnResult:
        assert self._events is not None
        ended: Response | None = None
        async for event in self._events:
            kind = event.type
            tracker.events += 1
            tracker.log.append((self.clock.now(), kind))
            item = event.item
            if kind == "agent.session.created" and event.session is not None:
                self.session_id = event.session["id"]
            elif kind == "agent.session.turn.created":
                self.turn_id = event.turn_id
            elif kind == "agent.session.turn.output_text.delta" and tracker.first_token_at is None:
                tracker.first_token_at = self.clock.now()
            elif kind == "agent.session.turn.item.added" and item is not None and item["type"] == "function_call":
                if tracker.first_token_at is None:
                    tracker.first_token_at = self.clock.now()
                tracker.items.append({**item, "status": "completed"})
            elif kind == "agent.session.turn.item.done" and item is not None and item["type"] == "message":
                tracker.items.append(item)
            elif kind == "agent.session.requires_action":
                return tracker.ended(self._response(event))
            elif kind in TURN_ENDS:
                ended = self._response(event)
            elif kind == "agent.session.idle" and ended is not None:
                self._idle = True
                return tracker.ended(ended)
        raise ClientError(502, "the session's event stream ended before the turn did")

    @staticmethod
    def _response(event: _Event) -> Response:
        if event.longrun is None:
            raise ClientError(502, f"{event.type} without the longrun extension field")
        return event.longrun.response

    async def _decoded(self, chunks: AsyncIterator[bytes]) -> AsyncIterator[_Event]:
        decoder = SSEDecoder()
        async for chunk in chunks:
            for sse in decoder.feed(chunk):
                yield _decode_event(sse.data)

    # -- transport ---------------------------------------------------------------------------------

    def _headers(self) -> dict[str, str]:
        return {
            "Authorization": f"Bearer {self.api_key}",
            "OpenAI-Beta": AGENTS_BETA,
            "Content-Type": "application/json",
        }

    async def _create(self, data: bytes) -> AsyncIterator[bytes]:
        """POST the create and yield its event stream's bytes as they arrive."""
        if self.http is None:
            self.http = aiohttp.ClientSession()
        async with self.http.post(self.url, data=data, headers=self._headers()) as resp:
            if resp.status != 200:
                raise ClientError(resp.status, await resp.json())
            async for chunk in resp.content.iter_any():
                yield chunk

    async def _subscribe(self, session_id: str) -> AsyncIterator[bytes]:
        """`GET .../events`, subscribed when this returns (the response's headers are in)."""
        assert self.http is not None
        resp = await self.http.get(f"{self.url}/{session_id}/events", headers=self._headers())
        if resp.status != 200:
            raise ClientError(resp.status, await resp.json())

        async def chunks() -> AsyncIterator[bytes]:
            try:
                async for chunk in resp.content.iter_any():
                    yield chunk
            finally:
                resp.close()

        return chunks()

    async def _turn(self, session_id: str, turn_id: str) -> dict[str, Any]:
        """`GET .../turns/{turn_id}`: the turn as the server keeps it."""
        assert self.http is not None
        async with self.http.get(f"{self.url}/{session_id}/turns/{turn_id}", headers=self._headers()) as resp:
            if resp.status != 200:
                raise ClientError(resp.status, await resp.json())
            return await resp.json()  # type: ignore[no-any-return]

    async def _post(self, session_id: str, data: bytes, key: str) -> None:
        assert self.http is not None
        headers = {**self._headers(), "Idempotency-Key": key}
        async with self.http.post(f"{self.url}/{session_id}/events", data=data, headers=headers) as resp:
            if resp.status != 202:
                raise ClientError(resp.status, await resp.json())

    async def close(self) -> None:
        if self._events is not None:
            await self._events.aclose()  # type: ignore[attr-defined]
        if self.http is not None:
            await self.http.close()
