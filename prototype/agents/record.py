"""An Agents API session as the response store keeps it (docs/agents-api.md#sessions-in-the-store).

One record per session, under `session_key(id)`, in the same store as the responses (memory,
SQLite or Redis: one interface, one schema). It holds what any server process needs to answer
for the session: its view as a `GET` returns it, its turns and items, the response its next turn
continues, the Idempotency-Keys it applied, and which process runs its active turn (`owner`)
for how long that claim holds without renewal (`lease_until`). What lives only in the owner's
memory (the running turn's task, its registered calls, the event subscribers, the last context)
is not here: a record with an active turn whose owner's lease has run out is a turn that no
process runs any more.
"""

from __future__ import annotations

from typing import Final

import msgspec

from ..ids import IdFactory
from ..wire.schemas import guarded_decoder
from . import wire as w
from .events import SS, TS, TurnRecord
from .machine import IdempotencyKeys, SessionCore

__all__ = [
    "SESSION_KEY_PREFIX",
    "SessionRecord",
    "decode_record",
    "encode_record",
    "record_of",
    "restore",
    "session_key",
]

SESSION_KEY_PREFIX: Final = "agents/session/"  # never a response id: those are `resp_...`


def session_key(session_id: str) -> str:
    return SESSION_KEY_PREFIX + session_id


class SessionRecord(msgspec.Struct, kw_only=True):
    session: w.AgentSessionOut  # the session as `GET /v1/agents/sessions/{id}` answered when saved
    created: float  # clock time of the create, for the list's order
    turns: list[w.TurnOut] = []
    items: list[w.SessionItem] = []
    last_response_id: str | None = None  # the response the next turn continues
    keys: dict[str, str] = {}  # Idempotency-Key -> SHA-256 (hex) of the body it applied
    prompt_cache_ttl: str | None = None
    active_turn: str | None = None
    owner: str | None = None  # the server process whose runner runs `active_turn`
    lease_until: float = 0.0  # clock time the owner's claim lasts to unless renewed


encode_record: Final = msgspec.json.Encoder().encode
decode_record: Final = guarded_decoder(msgspec.json.Decoder(SessionRecord))


def record_of(core: SessionCore, *, owner: str | None, lease_until: float) -> SessionRecord:
    """What the store keeps of the session now; `owner` runs its active turn."""
    active = core.active.id if core.active is not None else None
    return SessionRecord(
        session=core.snapshot(),
        created=core.created,
        turns=[core.turn_view(turn) for turn in core.turns],
        items=[item for _, item in core.items],
        last_response_id=core.last_response_id,
        keys={key: digest.hex() for key, digest in core.keys.digests.items()},
        prompt_cache_ttl=core.prompt_cache_ttl,
        active_turn=active,
        owner=owner if active is not None else None,
        lease_until=lease_until if active is not None else 0.0,
    )


def restore(record: SessionRecord, *, ids: IdFactory) -> SessionCore:
    """The session from its record. A turn the record has active is restored as active with no
    calls registered: nothing of it runs here, so the caller ends it (`TurnEnded`)."""
    view = record.session
    core = SessionCore(
        view.id,
        view.agent,
        ids=ids,
        now=record.created,
        metadata=view.metadata,
        prompt_cache_ttl=record.prompt_cache_ttl,
    )
    core.created_at, core.last_active_at, core.usage = view.created_at, view.last_active_at, view.usage
    core.turns = [
        TurnRecord(t.id, t.created_at, TS(t.status), t.started_at, t.completed_at, t.error, t.usage)
        for t in record.turns
    ]
    core.items = [(item.turn_id, item) for item in record.items]
    core.last_response_id = record.last_response_id
    core.keys = IdempotencyKeys({key: bytes.fromhex(digest) for key, digest in record.keys.items()})
    if view.status == "failed":
        core.state, core.error = SS.FAILED, view.error
    if record.active_turn is not None:
        core.active = next(t for t in core.turns if t.id == record.active_turn)
        core.state = SS.REQUIRES_ACTION if view.status == "requires_action" else SS.IN_PROGRESS
    return core
