"""Which llama.cpp slot serves a turn, and what happens to the KV a paused response holds.

A llama.cpp server runs ``--parallel N`` slots; each keeps the KV of the last prompt (and output)
it served, and reuses its longest common prefix with the next prompt sent to it. This table
decides, without I/O, which slot a turn takes, so each design's KV semantics are explicit:

* a turn of a paused response (``hold_kv``: `append`, the beta's long responses) runs on the slot
  its response pinned: its KV stays resident across the tool wait, as the post's prototype keeps it;
* a create turn (`http`, `http_prev`, `ws`) takes a free slot and relies on the engine's prefix
  cache, as a real server does: with ``affinity`` the slot that last served its conversation if it
  is free (sticky routing), without it the least recently used free slot;
* when every slot is busy or pinned, ``on_full`` says what a turn that needs one does:
  ``wait`` until a turn ends or a pin is released; ``drop`` unpin the least recently used paused
  response (its KV is lost: its next turn prefills again); ``swap`` save that slot's KV to host
  memory (llama.cpp's slot save) and restore it into a free slot when its response resumes.

`acquire` returns a `Grant` (the slot, and the slot actions the adapter must run first), or None:
wait for `release`/`unpin` and ask again. Ties go to the lowest index, so a run is repeatable.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final, Literal

__all__ = ["ON_FULL", "Grant", "OnFull", "SlotAction", "SlotTable"]

OnFull = Literal["wait", "drop", "swap"]
ON_FULL: Final[tuple[OnFull, ...]] = ("wait", "drop", "swap")


@dataclass(frozen=True, slots=True)
class SlotAction:
    """A llama.cpp slot operation to run before the turn: ``POST /slots/{slot}?action=…``."""

    action: Literal["save", "restore", "erase"]
    slot: int
    filename: str = ""


@dataclass(frozen=True, slots=True)
class Grant:
    slot: int
    actions: tuple[SlotAction, ...] = ()
    resident: bool = False  # the slot holds this response's pinned KV (held or restored)


@dataclass(slots=True)
class _Slot:
    busy: bool = False
    pinned_by: str | None = None  # a paused response whose KV this slot keeps
    last_key: int | None = None  # the conversation it served last (its KV is that prefix)
    last_used: int = -1


@dataclass(slots=True)
class SlotTable:
    """The slots of one engine. ``swap_prefix`` names the saved files (one per response)."""

    n_slots: int
    affinity: bool = True
    on_full: OnFull = "wait"
    swap_prefix: str = "longrun"
    slots: list[_Slot] = field(default_factory=list)
    swapped: dict[str, str] = field(default_factory=dict)  # response -> its saved file
    _tick: int = 0
    counts: dict[str, int] = field(
        default_factory=lambda: {"held": 0, "affine": 0, "other": 0, "dropped": 0, "saved": 0, "restored": 0}
    )

    def __post_init__(self) -> None:
        if self.n_slots < 1:
            raise ValueError(f"n_slots must be >= 1, got {self.n_slots}")
        if self.on_full not in ON_FULL:
            raise ValueError(f"on_full must be one of {ON_FULL}, got {self.on_full!r}")
        self.slots = [_Slot() for _ in range(self.n_slots)]

    def pinned(self, owner: str) -> int | None:
        for i, slot in enumerate(self.slots):
            if slot.pinned_by == owner:
                return i
        return None

    def acquire(self, key: int, owner: str) -> Grant | None:
        """A slot for a turn of conversation `key`; `owner` is the response that may hold KV
        (its pin, if any, is honoured). None: nothing is free; wait and ask again."""
        held = self.pinned(owner) if owner else None
        if held is not None:
            if self.slots[held].busy:
                return None  # its own previous turn has not released the slot yet
            self.counts["held"] += 1
            return self._take(held, key, ())
        free = [i for i, s in enumerate(self.slots) if not s.busy and s.pinned_by is None]
        actions: list[SlotAction] = []
        if not free:
            victim = self._victim()
            if victim is None or self.on_full == "wait":
                return None
            loser = self.slots[victim].pinned_by
            assert loser is not None
            if self.on_full == "swap":
                filename = f"{self.swap_prefix}-{_safe(loser)}.bin"
                actions.append(SlotAction("save", victim, filename))
                self.swapped[loser] = filename
                self.counts["saved"] += 1
            else:
                self.counts["dropped"] += 1
            self.slots[victim].pinned_by = None
            self.slots[victim].last_key = None
            free = [victim]
        restored = owner in self.swapped
        if restored:
            slot = min(free, key=lambda i: self.slots[i].last_used)
            actions.append(SlotAction("restore", slot, self.swapped.pop(owner)))
            self.counts["restored"] += 1
            return self._take(slot, key, tuple(actions), resident=True)
        if self.affinity:
            mine = [i for i in free if self.slots[i].last_key == key]
            if mine:
                self.counts["affine"] += 1
                return self._take(mine[0], key, tuple(actions))
        self.counts["other"] += 1
        return self._take(min(free, key=lambda i: self.slots[i].last_used), key, tuple(actions))

    def release(self, slot: int, *, pin_for: str | None) -> None:
        """The turn on `slot` ended; `pin_for`: a paused response that keeps the slot's KV."""
        s = self.slots[slot]
        s.busy = False
        if pin_for:
            for other in self.slots:
                if other.pinned_by == pin_for:
                    other.pinned_by = None
            s.pinned_by = pin_for

    def unpin(self, owner: str) -> list[SlotAction]:
        """The response ended: its slot's KV becomes ordinary (reusable, overwritable) prefix
        cache; a saved copy is no longer needed (the actions delete nothing on the engine:
        llama.cpp keeps saved files until overwritten)."""
        self.swapped.pop(owner, None)
        for s in self.slots:
            if s.pinned_by == owner:
                s.pinned_by = None
        return []

    def _take(self, slot: int, key: int, actions: tuple[SlotAction, ...], *, resident: bool = False) -> Grant:
        s = self.slots[slot]
        s.busy = True
        s.last_key = key
        self._tick += 1
        s.last_used = self._tick
        return Grant(slot, actions, resident=resident or s.pinned_by is not None)

    def _victim(self) -> int | None:
        """The least recently used slot pinned by a response that is not running a turn."""
        paused = [i for i, s in enumerate(self.slots) if s.pinned_by is not None and not s.busy]
        return min(paused, key=lambda i: self.slots[i].last_used) if paused else None


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in name)
