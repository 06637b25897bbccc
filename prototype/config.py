"""The server's configuration, one tree of msgspec Structs (docs/protocol.md#server-options).

`ServerConfig` holds what the whole server reads; each unit takes its sub-struct whole:
`WebSocketConfig` goes to the WebSocket session and its connection core, `ModelLimits` to the
engine. `python -m prototype.server` generates its options from this tree (prototype/options.py),
and a comparison nests it (`sim.harness.experiment.CompareConfig.server`), so a virtual run can
set every field the live server has. A limit that may be switched off is `None` (`none` on the
command line).
"""

from __future__ import annotations

from typing import Annotated, Final, Literal, get_args

import msgspec
from msgspec import Meta

from .pipeline import ALL_OPTIMIZATIONS, CostProfile, Optimization, load_profile

__all__ = [
    "AgentsConfig",
    "CONTEXT_WINDOW",
    "MAX_CACHE_BYTES",
    "MAX_CONNECTIONS",
    "MAX_IN_FLIGHT",
    "MAX_MESSAGE_BYTES",
    "MAX_NAMED_LANES",
    "MAX_OUTPUT_TOKENS",
    "MAX_QUEUED_CREATES",
    "MAX_SUBSCRIBERS",
    "MAX_SUBSCRIBER_BYTES",
    "STEER_BOUNDARIES",
    "ModelLimits",
    "ServerConfig",
    "SteerBoundary",
    "WebSocketConfig",
]

# Full-history replays and Codex's ~17k-character prompt plus tool schemas arrive
# in one frame or body; 64 MiB covers a 10M-character history with room to spare.
MAX_MESSAGE_BYTES: Final = 64 * 1024 * 1024
# Per-connection and per-server limits. Codex never queues more than one create; a cache entry
# of a 10M-character history is about 20 MiB.
MAX_QUEUED_CREATES: Final = 64
MAX_CACHE_BYTES: Final = 256 * 1024 * 1024
MAX_CONNECTIONS: Final = 1024
MAX_IN_FLIGHT: Final = 16  # responses in flight per connection, across lanes; more wait
MAX_NAMED_LANES: Final = 32  # distinct `stream_id`s per connection (the default lane does not count)
# The Agents API's event streams, per session. One subscriber falls at most MAX_SUBSCRIBER_BYTES
# behind before it is dropped: about 11,000 text deltas (~370 bytes of SSE each), minutes of a
# paced turn and well above what a reader that keeps up has queued (its writer moves 64 KiB batches
# to the socket), yet no more than Linux's default ceiling on one socket's send buffer
# (net.ipv4.tcp_wmem), so a stalled reader costs the server what its kernel would allow it anyway.
# The SDK's helper keeps one stream per session; 16 leaves room for observers while bounding what
# one session's streams hold to 16 x 4 MiB.
MAX_SUBSCRIBERS: Final = 16
MAX_SUBSCRIBER_BYTES: Final = 4 * 1024 * 1024
# gpt-5's context window and output limit, in tokens (docs/contract.md).
CONTEXT_WINDOW: Final = 400_000
MAX_OUTPUT_TOKENS: Final = 128_000

SteerBoundary = Literal["item", "token"]
STEER_BOUNDARIES: Final[tuple[SteerBoundary, ...]] = get_args(SteerBoundary)


class WebSocketConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """WebSocket mode: a connection's lifetime, its queues and cache, the server's sockets."""

    lifetime_s: Annotated[
        float,
        Meta(
            gt=0,
            description="WebSocket connection lifetime in seconds (the WebSocket-mode guide: 60 minutes)",
            extra={"flag": "--connection-lifetime-s"},
        ),
    ] = 3600.0
    append_timeout_s: Annotated[
        float,
        Meta(
            gt=0,
            description="append mode: a response paused longer than this ends incomplete (append_timeout); "
            "300 s is within the retention of idle prompt caches",
        ),
    ] = 300.0
    reject_concurrent: Annotated[
        bool, Meta(description="answer a create sent while one is in flight with 409 instead of queueing it")
    ] = False
    refuse: Annotated[
        bool,
        Meta(
            description="answer WebSocket upgrades with 426 (clients fall back to HTTP)",
            extra={"flag": "--refuse-websocket"},
        ),
    ] = False
    max_queued: Annotated[
        Annotated[int, Meta(ge=0)] | None,
        Meta(
            description="per connection: creates waiting behind the one in flight; one more gets a 429 error event",
            extra={"flag": "--max-queued-creates"},
        ),
    ] = MAX_QUEUED_CREATES
    max_cache_bytes: Annotated[
        Annotated[int, Meta(ge=0)] | None,
        Meta(description="per connection: the connection cache's entries together hold at most this"),
    ] = MAX_CACHE_BYTES
    max_in_flight: Annotated[
        int, Meta(ge=1, description="per connection: responses in flight across lanes; more wait")
    ] = MAX_IN_FLIGHT
    max_named_lanes: Annotated[
        int, Meta(ge=0, description="per connection: distinct stream_ids (websocket_stream_limit_reached beyond)")
    ] = MAX_NAMED_LANES
    max_connections: Annotated[
        Annotated[int, Meta(ge=1)] | None, Meta(description="open WebSocket connections; further upgrades get HTTP 503")
    ] = MAX_CONNECTIONS
    ping_interval_s: Annotated[
        Annotated[float, Meta(gt=0)] | None,
        Meta(
            description="keepalive: ping a connection once this many seconds pass with no frame from the client "
            "(aiohttp's heartbeat: no pong within half of it closes the socket); none: no server pings, as OpenAI "
            "documents none (docs/protocol.md#silent-sockets)",
            extra={"flag": "--ws-ping-interval-s"},
        ),
    ] = None
    inject_messages: Annotated[
        bool,
        Meta(
            description="what-if: the beta's response.inject also commits user and developer messages "
            "(the beta takes client-owned tool outputs only)"
        ),
    ] = False


class AgentsConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The Agents API's sessions (docs/agents-api.md#sessions-in-the-store): how long a process's
    claim on a running turn lasts in the store, and how many idle sessions it keeps in memory."""

    lease_s: Annotated[
        float,
        Meta(
            gt=0,
            description="a running turn's claim in the store lasts this long unless the process running it "
            "renews it (every third of it); past it, any process ends the turn failed",
            extra={"flag": "--agents-lease-s"},
        ),
    ] = 30.0
    max_idle_sessions: Annotated[
        int,
        Meta(
            ge=0,
            description="idle sessions a process keeps in memory with their last context; the least recently "
            "used beyond it are read back from the store when next used (their next turn reloads its context)",
            extra={"flag": "--agents-max-idle-sessions"},
        ),
    ] = 1000


class ModelLimits(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The model's limits, in tokens: a prompt longer than the context window less the output
    limit is a 400 `context_length_exceeded`."""

    context_window: Annotated[
        Annotated[int, Meta(ge=1)] | None, Meta(description="the model's context window in tokens (gpt-5: 400000)")
    ] = CONTEXT_WINDOW
    max_output_tokens: Annotated[
        Annotated[int, Meta(ge=1)] | None,
        Meta(description="the model's output limit (gpt-5: 128000), kept free in the context window"),
    ] = MAX_OUTPUT_TOKENS


class ServerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    api_key: Annotated[
        str | None, Meta(description="require 'Authorization: Bearer KEY' (checked before a WebSocket upgrade)")
    ] = None
    profile: Annotated[
        str | CostProfile,
        Meta(
            description="cost profile of the API stages: local (real CPU work only), hosted (calibrated waits), "
            "a JSON file, or the values"
        ),
    ] = "local"
    disable: Annotated[
        frozenset[Optimization],
        Meta(description="connection-cache optimizations switched off: " + ", ".join(o.value for o in Optimization)),
    ] = frozenset()
    open_responses: Annotated[
        bool,
        Meta(
            description="accept the Open Responses spec's request fields OpenAI's lacks (frequency_penalty, "
            "presence_penalty)"
        ),
    ] = False
    sse_done: Annotated[bool, Meta(description="end SSE streams with 'data: [DONE]'")] = False
    sse_keepalive_s: Annotated[
        Annotated[float, Meta(gt=0)] | None,
        Meta(
            description="what-if: an SSE stream silent this many seconds gets a comment line (': keepalive'); "
            "none: no comments, as OpenAI documents none (docs/protocol.md#silent-sockets)"
        ),
    ] = None
    idle_timeout_s: Annotated[
        float,
        Meta(
            ge=0,
            description="what-if: an intermediary in front of the server (a load balancer) closes a WebSocket or an "
            "SSE stream that carried no frame either way for this many seconds (0 = none); in-process transports "
            "only: live, put `python -m sim record --idle-timeout-s` in front (docs/protocol.md#silent-sockets)",
        ),
    ] = 0.0
    max_message_bytes: Annotated[
        int, Meta(ge=1, description="largest request body (413 beyond) and WebSocket frame (close 1009 beyond)")
    ] = MAX_MESSAGE_BYTES
    render_threads: Annotated[
        int, Meta(ge=0, description="threads that tokenize long texts off the event loop (0: on the loop)")
    ] = 1
    steer_boundary: Annotated[
        SteerBoundary,
        Meta(
            description="where a steer accepted mid-decode stops the response: at the end of the output item in "
            "flight (the steering guide's rule), or at the next token, cutting the item off (docs/beta.md#steering)"
        ),
    ] = "item"
    multi_agent_holds_calls: Annotated[
        bool,
        Meta(
            description="a beta response created with multi_agent.enabled waits at each function call for its "
            "injected output (what OpenAIHostedMultiAgentModel expects); off, the what-if: it ends completed "
            "owing the call, as without multi_agent, and an inject gets response_already_completed "
            "(docs/beta.md#hosted-multi-agent)"
        ),
    ] = True
    max_subscribers: Annotated[
        Annotated[int, Meta(ge=1)] | None,
        Meta(
            description="Agents API: event streams open at once per session (the create's stream counts); "
            "one more GET .../events gets a 429 too_many_subscribers"
        ),
    ] = MAX_SUBSCRIBERS
    max_subscriber_bytes: Annotated[
        Annotated[int, Meta(ge=1)] | None,
        Meta(
            description="Agents API: bytes of events one stream may fall behind its session; past it the stream "
            "gets an error event subscriber_too_slow and ends (the turn runs on)"
        ),
    ] = MAX_SUBSCRIBER_BYTES
    websocket: WebSocketConfig = WebSocketConfig()
    agents: AgentsConfig = AgentsConfig()
    model: ModelLimits = ModelLimits()

    @property
    def cost_profile(self) -> CostProfile:
        """The profile, a built-in or a file's resolved by name."""
        return self.profile if isinstance(self.profile, CostProfile) else load_profile(self.profile)

    @property
    def profile_name(self) -> str:
        """The profile as a person names it: its built-in name or file, or the values' `name`."""
        return self.profile if isinstance(self.profile, str) else self.profile.name

    @property
    def optimizations(self) -> frozenset[Optimization]:
        return ALL_OPTIMIZATIONS - self.disable
