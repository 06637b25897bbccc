"""Wire types of the Agents API (beta, `OpenAI-Beta: agents=v1`) as longrun serves it.

The subset longrun serves: function tools and `environment: {"type": "none"}` (docs/agents-api.md).
Field names, nesting and literals follow openai-python 3.63's generated types
(`openai/types/beta/agent_session*.py`, `openai/types/beta/agents/sessions/turn.py`,
`openai/types/beta/agents/session_create_params.py`); request bodies are decoded strictly
(an unknown field is a 400 `unknown_parameter`, as for `POST /v1/responses`).
"""

from __future__ import annotations

from typing import Any, Final, Literal

import msgspec
from msgspec import UNSET, Raw, UnsetType

from ..wire.schemas import Response, guarded_decoder

__all__ = [
    "AGENTS_BETA",
    "AgentOut",
    "AgentSessionOut",
    "DeletedSession",
    "EventsBody",
    "FunctionCallItemOut",
    "FunctionCallOutputItemOut",
    "FunctionToolOut",
    "InputCancel",
    "InputMessage",
    "InputToolResult",
    "MessageItemOut",
    "RequiredFunctionCall",
    "SessionCreateBody",
    "SessionEvent",
    "TokenUsageOut",
    "TurnOut",
    "decode_events_body",
    "decode_session_create",
]

AGENTS_BETA: Final = "agents=v1"  # the `OpenAI-Beta` value every Agents API request carries

# -- requests ----------------------------------------------------------------------------------------


class _In(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class PromptCacheOptionsIn(_In):
    ttl: Literal["30m", "12h"]


class SpendControlIn(_In):
    limit: int | None


class StreamOptionsIn(_In):
    include_obfuscation: bool = True


class AgentIn(_In):
    """`session_create_params.Agent`: every field optional; longrun runs function tools only."""

    model: str | None = None
    instructions: str | None = None
    tools: list[Raw] | None = None
    reasoning: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    service_tier: Literal["auto", "default", "flex", "priority", "fast", "ultrafast"] | None = None
    multi_agent: dict[str, Any] | None = None
    compaction: dict[str, Any] | None = None
    experimental: dict[str, Any] | None = None


class MessageIn(_In):
    """`AgentSessionInputMessageParam`: a user message (its content is checked by the Responses
    item parser when the turn's request is built)."""

    role: Literal["user"]
    content: list[Raw]
    type: Literal["message"] = "message"


class SessionCreateBody(_In):
    environment: dict[str, Any]
    agent: AgentIn | None = None
    agent_id: str | None = None
    input: str | list[MessageIn] | None = None
    metadata: dict[str, str] | None = None
    prompt_cache_options: PromptCacheOptionsIn | None = None
    review: Literal["none", "auto_review"] | None = None
    spend_control: SpendControlIn | None = None
    stream: bool = False
    stream_options: StreamOptionsIn | None = None
    vault_ids: list[str] | None = None


class InputMessage(_In, tag_field="type", tag="agent.session.input.message"):
    input: list[MessageIn]


class InputToolResult(_In, tag_field="type", tag="agent.session.input.tool_result"):
    call_id: str
    success: bool
    turn_id: str
    error: str | None = None
    output: str | list[Raw] | None = None


class InputCancel(_In, tag_field="type", tag="agent.session.input.cancel"):
    pass


InputEvent = InputMessage | InputToolResult | InputCancel


class EventsBody(_In):
    events: list[InputEvent]


# The Responses decoders' guard: JSON nested past msgspec's recursion limit is `NestingTooDeep`
# (a 400 `invalid_json`), never a `RecursionError`.
decode_session_create: Final = guarded_decoder(msgspec.json.Decoder(SessionCreateBody))
decode_events_body: Final = guarded_decoder(msgspec.json.Decoder(EventsBody))


# -- resources ---------------------------------------------------------------------------------------


class InputTokensDetailsOut(msgspec.Struct):
    cached_tokens: int


class OutputTokensDetailsOut(msgspec.Struct):
    reasoning_tokens: int


class TokenUsageOut(msgspec.Struct):
    input_tokens: int
    input_tokens_details: InputTokensDetailsOut
    output_tokens: int
    output_tokens_details: OutputTokensDetailsOut
    total_tokens: int


class FunctionToolOut(msgspec.Struct, kw_only=True):
    """`AgentToolResourceFunction`."""

    type: Literal["function"] = "function"
    name: str
    description: str
    parameters: dict[str, Any]
    defer_loading: bool = False


class MultiAgentOut(msgspec.Struct):
    enabled: bool = False
    max_concurrent_subagents: int | None = None


class ReasoningOut(msgspec.Struct):
    effort: str | None = None
    summary: str | None = None


class TextFormatOut(msgspec.Struct):
    type: str = "text"


class TextOut(msgspec.Struct):
    format: TextFormatOut = msgspec.field(default_factory=TextFormatOut)
    verbosity: str = "medium"


class AgentOut(msgspec.Struct, kw_only=True):
    id: str
    instructions: str | None
    model: str
    multi_agent: MultiAgentOut = msgspec.field(default_factory=MultiAgentOut)
    name: str | None = None
    reasoning: ReasoningOut = msgspec.field(default_factory=ReasoningOut)
    service_tier: str = "auto"
    text: TextOut = msgspec.field(default_factory=TextOut)
    tools: list[FunctionToolOut] = []


class EnvironmentNone(msgspec.Struct):
    type: Literal["none"] = "none"


class RequiredFunctionCall(msgspec.Struct, tag_field="type", tag="function_call", kw_only=True):
    """`RequiredActionSessionRequiredActionResourceFunctionCall`."""

    arguments: Any
    call_id: str
    name: str
    turn_id: str


class SpendControlOut(msgspec.Struct):
    consumed: int | None = None
    limit: int | None = None


class PromptCacheOptionsOut(msgspec.Struct):
    ttl: str


SessionStatus = Literal["idle", "in_progress", "requires_action", "failed", "budget_reached"]


class AgentSessionOut(msgspec.Struct, kw_only=True):
    id: str
    agent: AgentOut
    created_at: int
    environment: EnvironmentNone = msgspec.field(default_factory=EnvironmentNone)
    error: str | None = None
    last_active_at: int
    metadata: dict[str, str] = {}
    object: Literal["agent.session"] = "agent.session"
    required_actions: list[RequiredFunctionCall] = []
    spend_control: SpendControlOut = msgspec.field(default_factory=SpendControlOut)
    status: SessionStatus
    usage: TokenUsageOut | None = None
    vault_ids: list[str] = []
    prompt_cache_options: PromptCacheOptionsOut | None = None


class DeletedSession(msgspec.Struct):
    id: str
    deleted: bool = True
    object: Literal["agent.session.deleted"] = "agent.session.deleted"


class TurnErrorOut(msgspec.Struct):
    code: str
    message: str


TurnStatus = Literal["queued", "in_progress", "waiting", "completed", "failed", "cancelled"]


class TurnOut(msgspec.Struct, kw_only=True):
    id: str
    agent_id: str
    completed_at: int | None = None
    created_at: int
    error: TurnErrorOut | None = None
    object: Literal["agent.session.turn"] = "agent.session.turn"
    session_id: str
    started_at: int | None = None
    status: TurnStatus
    subagent_id: str | None = None
    usage: TokenUsageOut | None = None
    prompt_cache_options: PromptCacheOptionsOut | None = None


class ContentOut(msgspec.Struct, tag_field="type", tag="output_text"):
    text: str


class MessageItemOut(msgspec.Struct, tag_field="type", tag="message", kw_only=True):
    """`AgentSessionMessage` (user or assistant); `content` is the message's content verbatim."""

    id: str | None
    content: list[Raw]
    role: Literal["user", "assistant"]
    status: Literal["in_progress", "completed", "incomplete"]
    turn_id: str
    phase: Literal["commentary", "final_answer"] | None = None


class FunctionCallItemOut(msgspec.Struct, tag_field="type", tag="function_call", kw_only=True):
    id: str
    arguments: Any
    call_id: str
    name: str
    status: Literal["in_progress", "completed", "failed", "incomplete"]
    turn_id: str


class FunctionCallOutputItemOut(msgspec.Struct, tag_field="type", tag="function_call_output", kw_only=True):
    id: str
    call_id: str
    error: str | None
    output: str | list[Raw] | None
    status: Literal["in_progress", "completed", "failed", "incomplete"]
    turn_id: str


SessionItem = MessageItemOut | FunctionCallItemOut | FunctionCallOutputItemOut


class ListPage(msgspec.Struct, kw_only=True):
    """`CursorPage` / `ConversationCursorPage`: both read `data`, `has_more`, and the ids."""

    object: Literal["list"] = "list"
    data: list[Any]
    first_id: str | None
    last_id: str | None
    has_more: bool


# -- events ------------------------------------------------------------------------------------------


class LongrunExt(msgspec.Struct):
    """longrun's extension field on pause and turn-end events (as `longrun` on a Response
    object): the turn's response as it stands, without its output, tools and instructions,
    so a measuring client reads usage and stage timings per step (sim.client.agents_client)."""

    response: Response


class _Event(msgspec.Struct, tag_field="type", kw_only=True):
    event_id: str


class SessionCreated(_Event, tag="agent.session.created"):
    session: AgentSessionOut


class SessionInProgress(_Event, tag="agent.session.in_progress"):
    session: AgentSessionOut


class SessionRequiresAction(_Event, tag="agent.session.requires_action"):
    session: AgentSessionOut
    longrun: LongrunExt | UnsetType = UNSET


class SessionIdle(_Event, tag="agent.session.idle"):
    session: AgentSessionOut


class SessionFailed(_Event, tag="agent.session.failed"):
    session: AgentSessionOut


class TurnCreated(_Event, tag="agent.session.turn.created"):
    session_id: str
    turn: TurnOut
    turn_id: str


class TurnInProgress(_Event, tag="agent.session.turn.in_progress"):
    session_id: str
    turn: TurnOut
    turn_id: str


class TurnCompleted(_Event, tag="agent.session.turn.completed"):
    session_id: str
    turn: TurnOut
    turn_id: str
    usage: TokenUsageOut | None = None
    longrun: LongrunExt | UnsetType = UNSET


class TurnFailed(_Event, tag="agent.session.turn.failed"):
    session_id: str
    turn: TurnOut
    turn_id: str
    usage: TokenUsageOut | None = None
    longrun: LongrunExt | UnsetType = UNSET


class TurnCancelled(_Event, tag="agent.session.turn.cancelled"):
    session_id: str
    turn: TurnOut
    turn_id: str
    usage: TokenUsageOut | None = None
    longrun: LongrunExt | UnsetType = UNSET


class ItemAdded(_Event, tag="agent.session.turn.item.added"):
    item: SessionItem
    output_index: int | None
    session_id: str
    turn_id: str | None


class ItemDone(_Event, tag="agent.session.turn.item.done"):
    item: MessageItemOut | FunctionCallItemOut
    output_index: int
    session_id: str
    turn_id: str | None


class ContentPartAdded(_Event, tag="agent.session.turn.content_part.added"):
    content_index: int
    item_id: str
    output_index: int
    part: ContentOut
    session_id: str
    turn_id: str | None


class ContentPartDone(_Event, tag="agent.session.turn.content_part.done"):
    content_index: int
    item_id: str
    output_index: int
    part: ContentOut
    session_id: str
    turn_id: str | None


class OutputTextDelta(_Event, tag="agent.session.turn.output_text.delta"):
    content_index: int
    delta: str
    item_id: str
    output_index: int
    session_id: str
    turn_id: str | None


class OutputTextDone(_Event, tag="agent.session.turn.output_text.done"):
    content_index: int
    item_id: str
    output_index: int
    session_id: str
    text: str
    turn_id: str | None


class SessionErrorOut(msgspec.Struct):
    code: str | None
    message: str
    param: str | None
    type: str


class ErrorEvent(_Event, tag="error"):
    error: SessionErrorOut
    session_id: str


SessionEvent = (
    SessionCreated
    | SessionInProgress
    | SessionRequiresAction
    | SessionIdle
    | SessionFailed
    | TurnCreated
    | TurnInProgress
    | TurnCompleted
    | TurnFailed
    | TurnCancelled
    | ItemAdded
    | ItemDone
    | ContentPartAdded
    | ContentPartDone
    | OutputTextDelta
    | OutputTextDone
    | ErrorEvent
)
