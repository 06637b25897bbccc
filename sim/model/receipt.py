"""A sampled turn's receipt: the prompt tokens it found cached and the tokens it decoded.

The simulator's models (`SimulatedModel`, `sim.engine.model.EngineModel`) take an optional
`Receipt` in ``sample``. The rule, the same for both: a turn whose stream started reports
``(cached, decoded)`` to it exactly once, when the stream ends however it ends (run out, closed
early by the service, an error raised in it, even before its first event): ``cached`` is the
``cached_tokens`` of the `Prefilled` event it yielded (0 if none), ``decoded`` the number of
token ids in the `TokensSampled` events it yielded. A stream never started reports nothing.

`counted` keeps the rule for any model's events, as they pass. `SimulatedModel` keeps it as it
yields, without that extra async-generator step per event: the virtual path samples every token
of every turn through it.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable

from prototype.model import ModelEvent, Prefilled, TokensSampled

__all__ = ["Receipt", "counted"]

Receipt = Callable[[tuple[int, int]], None]  # takes (cached, decoded), once per turn (module docstring)


async def counted(events: AsyncGenerator[ModelEvent, None], receipt: Receipt) -> AsyncGenerator[ModelEvent, None]:
    """`events` passed through as they are, their turn's counts to `receipt` when they end."""
    cached = decoded = 0
    try:
        async for event in events:
            if type(event) is TokensSampled:  # the model's event types are final: no isinstance call per event
                decoded += len(event.token_ids)
            elif type(event) is Prefilled:
                cached = event.cached_tokens
            yield event
    finally:
        await events.aclose()  # closed early by the service: the model's cleanup runs now
        receipt((cached, decoded))
