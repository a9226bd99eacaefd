"""nbtrain's adaptive policy as a pure unit (:mod:`nbtrain.core.autoscale`)."""

from __future__ import annotations

import pytest

from nbtrain.core.autoscale import AutoscaleSettings, SlotUse, Waiting, decide


def _s(**kw: object) -> AutoscaleSettings:
    return AutoscaleSettings(**{"idle_s": 10.0, **kw})  # type: ignore[arg-type]


def test_scales_from_zero_for_a_whole_gang() -> None:
    d = decide([], [Waiting("a", 2)], _s(maximum=4), now=0.0)
    assert d.target == 2 and d.asked == ("a",) and d.retire == ()


def test_a_gang_that_does_not_fit_whole_is_not_asked_for_in_part() -> None:
    slots = [SlotUse("w0", busy=True)]
    d = decide(slots, [Waiting("big", 4), Waiting("small", 1)], _s(maximum=3), now=0.0)
    assert d.asked == ("small",) and d.target == 2
    assert any("big" in r and "maximum=3" in r for r in d.reasons)


def test_busy_slots_are_never_retired() -> None:
    slots = [SlotUse("w0", busy=True), SlotUse("w1", busy=True)]
    d = decide(slots, [], _s(), now=1e6)
    assert d.target == 2 and d.retire == ()


def test_free_slots_a_waiting_gang_needs_are_reserved_even_when_it_waits_for_busy_ones() -> None:
    # w0 runs a rank; w1 is free for ages; a 2-rank gang waits (it cannot fit under
    # maximum=2 beside the running rank): w1 is the gang's, not an idle slot.
    slots = [SlotUse("w0", busy=True), SlotUse("w1", busy=False, idle_since=0.0)]
    d = decide(slots, [Waiting("b", 2)], _s(maximum=2), now=1e6)
    assert d.reserved == 1 and d.retire == () and d.target == 2


def test_idle_slots_retire_after_the_delay_oldest_first() -> None:
    slots = [SlotUse("old", busy=False, idle_since=0.0),
             SlotUse("young", busy=False, idle_since=95.0),
             SlotUse("busy", busy=True)]
    d = decide(slots, [], _s(), now=100.0)
    assert d.target == 2 and d.retire == ("old",)
    assert decide(slots, [], _s(), now=200.0).retire == ("old", "young")
    assert decide(slots, [], _s(), now=200.0).target == 1


def test_minimum_keeps_idle_slots() -> None:
    slots = [SlotUse(f"w{i}", busy=False, idle_since=0.0) for i in range(3)]
    d = decide(slots, [], _s(minimum=2), now=1e6)
    assert d.target == 2 and len(d.retire) == 1


def test_queue_demand_beyond_the_slots_asks_for_more() -> None:
    slots = [SlotUse("w0", busy=True), SlotUse("w1", busy=False, idle_since=0.0)]
    d = decide(slots, [Waiting("a", 2), Waiting("b", 1)], _s(maximum=8), now=1e6)
    assert d.target == 4 and d.retire == () and d.reserved == 1


@pytest.mark.parametrize("bad", [dict(minimum=-1), dict(minimum=3, maximum=2),
                                 dict(idle_s=float("nan")), dict(kind="tpu")])
def test_settings_name_the_problem(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        AutoscaleSettings(**bad)  # type: ignore[arg-type]


def test_a_leaving_slot_is_replaced_early_and_never_offered() -> None:
    slots = [SlotUse("w0", busy=False, idle_since=0.0), SlotUse("bye", busy=False,
                                                               leaving=True)]
    d = decide(slots, [Waiting("a", 2)], _s(maximum=3), now=1e6)
    assert d.target == 3 and "bye" not in d.retire and d.reserved == 1
    assert decide(slots, [Waiting("a", 2)], _s(maximum=2), now=1e6).target == 2
