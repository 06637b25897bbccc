"""The slot table that gives each design its KV semantics on a real engine (sim/engine/slots.py)."""

from __future__ import annotations

import pytest

from sim.engine.slots import SlotAction, SlotTable


def test_a_paused_response_keeps_its_slot_and_others_do_not_take_it() -> None:
    t = SlotTable(2)
    g = t.acquire(key=1, owner="resp_a")
    assert g is not None and g.slot == 0 and not g.resident
    t.release(g.slot, pin_for="resp_a")  # paused at a tool call: the KV stays
    other = t.acquire(key=2, owner="")
    assert other is not None and other.slot == 1
    t.release(other.slot, pin_for=None)
    again = t.acquire(key=1, owner="resp_a")
    assert again is not None and again.slot == 0 and again.resident
    assert t.counts["held"] == 1


def test_create_turns_follow_their_conversation_with_affinity_and_not_without() -> None:
    sticky, rotating = SlotTable(2, affinity=True), SlotTable(2, affinity=False)
    for table in (sticky, rotating):
        for key in (1, 2):  # conversation 1 on slot 0, conversation 2 on slot 1
            g = table.acquire(key=key, owner="")
            assert g is not None
            table.release(g.slot, pin_for=None)
    s = sticky.acquire(key=1, owner="")
    r = rotating.acquire(key=1, owner="")
    assert s is not None and s.slot == 0  # its own prefix is there
    assert r is not None and r.slot == 0  # least recently used: slot 0 served conversation 1 first
    sticky.release(s.slot, pin_for=None)
    rotating.release(r.slot, pin_for=None)
    s2, r2 = sticky.acquire(key=1, owner=""), rotating.acquire(key=1, owner="")
    assert s2 is not None and s2.slot == 0
    assert r2 is not None and r2.slot == 1  # LRU moved it away from its prefix


@pytest.mark.parametrize("on_full", ["wait", "drop", "swap"])
def test_when_every_slot_is_pinned(on_full: str) -> None:
    t = SlotTable(1, on_full=on_full)  # type: ignore[arg-type]
    g = t.acquire(key=1, owner="resp_a")
    assert g is not None
    t.release(g.slot, pin_for="resp_a")
    newcomer = t.acquire(key=2, owner="resp_b")
    if on_full == "wait":
        assert newcomer is None and t.pinned("resp_a") == 0  # nothing changed
        return
    assert newcomer is not None and newcomer.slot == 0 and t.pinned("resp_a") is None
    t.release(newcomer.slot, pin_for="resp_b")
    t.unpin("resp_b")
    back = t.acquire(key=1, owner="resp_a")
    assert back is not None
    if on_full == "swap":
        assert newcomer.actions == (SlotAction("save", 0, "longrun-resp_a.bin"),)
        assert back.actions == (SlotAction("restore", 0, "longrun-resp_a.bin"),) and back.resident
    else:
        assert newcomer.actions == () and back.actions == () and not back.resident
        assert t.counts["dropped"] == 1


def test_a_busy_slot_is_never_granted_twice() -> None:
    t = SlotTable(1)
    assert t.acquire(key=1, owner="") is not None
    assert t.acquire(key=1, owner="") is None
    t.release(0, pin_for=None)
    assert t.acquire(key=1, owner="") is not None


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        SlotTable(0)
    with pytest.raises(ValueError):
        SlotTable(1, on_full="evict")  # type: ignore[arg-type]
