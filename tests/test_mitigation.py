"""Mitigation policies: verdicts and a passed-in clock in, actions with reasons out."""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pytest

from nbtrain.core.mitigation import (
    Action,
    ActionKind,
    AlertPolicy,
    ExcludeScope,
    MitigationContext,
    MitigationSettings,
    ReplacePolicy,
    SlotInfo,
    make_policy,
    policy_names,
    register_policy,
)
from nbtrain.core.records import Phase, StepFrame
from nbtrain.core.straggler import HINTS, Diagnosis, StragglerDetector, Verdict

PLACEMENT = {
    0: SlotInfo("w0", "hostA"),
    1: SlotInfo("w1", "hostA"),
    2: SlotInfo("w2", "hostB"),
    3: SlotInfo("w3", "hostB"),
}


def verdict(
    rank: int, state: Verdict, *, phase: Phase = Phase.COMPUTE, share: float = 0.3,
    since: int = 100,
) -> Diagnosis:
    return Diagnosis(
        rank=rank, phase=phase, state=state, step=since + 10, since_step=since,
        ratio=1.5, excess_s=0.03, step_share=share, slow_steps=7, window=8, hint=HINTS[phase],
    )


def ctx(now: float, *, spares: Sequence[SlotInfo] = (), step: int = 0,
        placement: Mapping[int, SlotInfo] = PLACEMENT) -> MitigationContext:
    return MitigationContext(now=now, step=step, placement=placement, spares=spares)


def kinds(actions: list[Action]) -> list[tuple[str, int | None, str]]:
    return [(a.kind.value, a.rank, a.level) for a in actions]


# -- registry ----------------------------------------------------------------------------------


def test_default_policy_is_alert_and_unknown_names_list_the_choices() -> None:
    assert isinstance(make_policy(), AlertPolicy)
    assert make_policy().name == "alert"
    assert isinstance(make_policy(MitigationSettings(policy="replace")), ReplacePolicy)
    with pytest.raises(ValueError, match=r"unknown mitigation policy 'evict'.*'alert'.*'replace'"):
        make_policy(MitigationSettings(policy="evict"))


def test_a_later_policy_registers_by_name() -> None:
    class Shrink(AlertPolicy):
        name = "shrink-test"

    register_policy("shrink-test", Shrink)
    register_policy("shrink-test", Shrink)  # idempotent
    assert "shrink-test" in policy_names()
    assert isinstance(make_policy(MitigationSettings(policy="shrink-test")), Shrink)
    with pytest.raises(ValueError, match="already registered"):
        register_policy("shrink-test", AlertPolicy)


def test_settings_are_validated_with_the_values() -> None:
    with pytest.raises(ValueError, match=r"alert_on must be 'suspect' or 'confirmed', got 'x'"):
        MitigationSettings(alert_on="x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"exclude must be 'host' or 'slot', got 'rack'"):
        MitigationSettings(exclude="rack")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"cooldown_s must be a number of seconds >= 0, got -1"):
        MitigationSettings(cooldown_s=-1)
    s = MitigationSettings(alert_on="confirmed", exclude="slot")  # type: ignore[arg-type]
    assert s.alert_on is Verdict.CONFIRMED and s.exclude is ExcludeScope.SLOT


# -- alert -------------------------------------------------------------------------------------


def test_by_default_only_confirmed_stragglers_are_alerted() -> None:
    policy = make_policy()
    assert policy.settings.alert_on is Verdict.CONFIRMED
    assert policy.decide([verdict(2, Verdict.SUSPECT)], ctx(0.0)) == []  # the early signal
    assert kinds(policy.decide([verdict(2, Verdict.CONFIRMED)], ctx(1.0))) == [
        ("alert", 2, "critical")
    ]


def test_alert_once_per_episode_and_once_more_when_confirmed() -> None:
    policy = make_policy(MitigationSettings(alert_on=Verdict.SUSPECT))
    suspect = [verdict(2, Verdict.SUSPECT)]
    first = policy.decide(suspect, ctx(0.0, step=110))
    assert kinds(first) == [("alert", 2, "warning")]
    assert first[0].slot == SlotInfo("w2", "hostB")
    assert "rank 2 compute suspect" in first[0].reason
    assert policy.decide(suspect, ctx(1.0)) == []  # level-triggered input, no repeats
    confirmed = policy.decide([verdict(2, Verdict.CONFIRMED)], ctx(2.0))
    assert kinds(confirmed) == [("alert", 2, "critical")]
    assert policy.decide([verdict(2, Verdict.CONFIRMED)], ctx(3.0)) == []
    assert policy.decide([], ctx(4.0)) == []  # cleared: nothing to do


def test_a_flapping_rank_is_not_realerted_within_the_cooldown() -> None:
    policy = make_policy(MitigationSettings(alert_on=Verdict.SUSPECT, alert_cooldown_s=60))
    alerts = []
    for t in range(0, 300, 2):  # suspect on even, cleared on odd seconds
        alerts += policy.decide([verdict(1, Verdict.SUSPECT)], ctx(float(t)))
        alerts += policy.decide([], ctx(t + 1.0))
    assert [a.time for a in alerts] == [0.0, 60.0, 120.0, 180.0, 240.0]
    assert isinstance(policy, AlertPolicy) and policy.suppressed > 100


def test_a_muted_episode_still_escalates_once_when_confirmed() -> None:
    policy = make_policy(MitigationSettings(alert_on=Verdict.SUSPECT, alert_cooldown_s=60))
    policy.decide([verdict(1, Verdict.SUSPECT)], ctx(0.0))
    policy.decide([], ctx(1.0))
    assert policy.decide([verdict(1, Verdict.SUSPECT)], ctx(2.0)) == []
    assert kinds(policy.decide([verdict(1, Verdict.CONFIRMED)], ctx(3.0))) == [
        ("alert", 1, "critical")
    ]


def test_alert_on_confirmed_ignores_suspects() -> None:
    policy = make_policy(MitigationSettings(alert_on=Verdict.CONFIRMED))
    assert policy.decide([verdict(0, Verdict.SUSPECT)], ctx(0.0)) == []
    assert kinds(policy.decide([verdict(0, Verdict.CONFIRMED)], ctx(1.0))) == [
        ("alert", 0, "critical")
    ]


def test_alert_policy_never_acts_on_the_job() -> None:
    policy = make_policy()
    actions = policy.decide([verdict(r, Verdict.CONFIRMED) for r in range(4)],
                            ctx(0.0, spares=[SlotInfo("w9", "hostC")]))
    assert {a.kind for a in actions} == {ActionKind.ALERT}
    assert policy.excluded(0.0) == {}


# -- replace -----------------------------------------------------------------------------------


def replace_policy(**kw: Any) -> ReplacePolicy:
    """A replace policy that alerts from suspects on and acts on the first confirmed verdict
    (``persist_s=0``): these tests are about what a replacement does; the hold on a
    confirmed verdict has tests of its own below."""
    kw = {"alert_on": Verdict.SUSPECT, "persist_s": 0.0, **kw}
    policy = make_policy(MitigationSettings(policy="replace", **kw))
    assert isinstance(policy, ReplacePolicy)
    return policy


def test_replace_swaps_a_confirmed_straggler_for_a_spare_and_excludes_its_host() -> None:
    policy = replace_policy(exclude_for_s=1800)
    spares = [SlotInfo("w4", "hostA"), SlotInfo("w5", "hostC")]
    assert kinds(policy.decide([verdict(2, Verdict.SUSPECT)], ctx(10.0, spares=spares))) == [
        ("alert", 2, "warning")
    ]
    actions = policy.decide([verdict(2, Verdict.CONFIRMED)], ctx(20.0, spares=spares))
    assert kinds(actions) == [("alert", 2, "critical"), ("replace", 2, "critical")]
    rep = actions[1]
    assert rep.slot == SlotInfo("w2", "hostB")
    assert rep.spare == SlotInfo("w5", "hostC")  # a host the job does not use yet
    assert (rep.exclude, rep.exclude_until) == ("hostB", 1820.0)
    assert "moving it from w2 on hostB to w5 on hostC" in rep.reason
    assert "excluding host hostB for 1800 s" in rep.reason
    assert policy.excluded(20.0) == {"hostB": 1820.0}
    assert policy.decide([], ctx(1819.0)) == []
    expired = policy.decide([], ctx(1820.0))
    assert [(a.kind, a.exclude) for a in expired] == [(ActionKind.INCLUDE, "hostB")]
    assert policy.excluded(1820.0) == {}


def test_flapping_straggler_cannot_cause_a_restart_storm() -> None:
    cooldown = 600.0
    policy = replace_policy(cooldown_s=cooldown, exclude=ExcludeScope.SLOT)
    spares = [SlotInfo(f"s{i}", "hostC") for i in range(50)]
    placement = dict(PLACEMENT)
    actions: list[Action] = []
    rng = np.random.default_rng(0)
    horizon = 6 * 3600
    for t in range(0, horizon, 5):  # ranks confirmed slow on and off, every few seconds
        state = Verdict.CONFIRMED if rng.random() < 0.5 else Verdict.SUSPECT
        verdicts = [verdict(int(rng.integers(4)), state)] if rng.random() < 0.7 else []
        new = policy.decide(verdicts, ctx(float(t), spares=spares, placement=placement))
        for a in new:  # the engine carries the replacements out at once
            if a.kind is ActionKind.REPLACE and a.rank is not None and a.spare is not None:
                placement[a.rank] = a.spare
                spares.remove(a.spare)
        actions += new
    restarts = sorted({a.time for a in actions if a.kind is ActionKind.REPLACE})
    assert horizon / cooldown - 1 <= len(restarts) <= horizon / cooldown + 1
    assert all(b - a >= cooldown for a, b in itertools.pairwise(restarts))
    deferred = [a for a in actions if "cooldown" in a.reason]
    assert deferred, "a deferred replacement is itself an event"


def test_cooldown_deferral_is_told_once_per_episode_then_acted_on() -> None:
    policy = replace_policy(cooldown_s=100)
    spares = [SlotInfo("w8", "hostC"), SlotInfo("w9", "hostD")]
    first = policy.decide([verdict(0, Verdict.CONFIRMED)], ctx(0.0, spares=spares))
    assert ActionKind.REPLACE in {a.kind for a in first}
    moved = {0: SlotInfo("w8", "hostC"), **{r: PLACEMENT[r] for r in (1, 2, 3)}}
    v = [verdict(3, Verdict.CONFIRMED)]
    told = policy.decide(v, ctx(30.0, spares=spares[1:], placement=moved))
    assert [a.kind for a in told if "cooldown" in a.reason] == [ActionKind.ALERT]
    assert "waits 70 s more" in next(a.reason for a in told if "cooldown" in a.reason)
    again = policy.decide(v, ctx(60.0, spares=spares[1:], placement=moved))
    assert again == []
    later = policy.decide(v, ctx(100.0, spares=spares[1:], placement=moved))
    assert [(a.kind, a.rank, a.spare) for a in later] == [
        (ActionKind.REPLACE, 3, SlotInfo("w9", "hostD"))
    ]


def test_replace_acts_only_on_a_verdict_confirmed_without_a_break_for_persist_s() -> None:
    policy = make_policy(MitigationSettings(policy="replace"))  # the defaults
    assert isinstance(policy, ReplacePolicy) and policy.settings.persist_s == 30.0
    spares = [SlotInfo("w9", "hostC")]
    confirmed = [verdict(1, Verdict.CONFIRMED)]

    def replacements(t: float, verdicts: list[Diagnosis]) -> list[Action]:
        actions = policy.decide(verdicts, ctx(t, spares=spares))
        return [a for a in actions if a.kind is ActionKind.REPLACE]

    assert replacements(0.0, confirmed) == []  # alerted, not acted on
    assert replacements(29.0, confirmed) == []
    assert replacements(29.5, [verdict(1, Verdict.SUSPECT)]) == []  # the run breaks...
    assert replacements(40.0, confirmed) == []  # ...and starts over
    assert replacements(69.0, confirmed) == []
    done = replacements(70.0, confirmed)
    assert [a.rank for a in done] == [1]
    assert "confirmed for 30 s" in done[0].reason


def test_a_replacement_deferred_by_the_cooldown_needs_the_verdict_to_last_through_it() -> None:
    policy = replace_policy(cooldown_s=100, persist_s=10)
    spares = [SlotInfo("w8", "hostC"), SlotInfo("w9", "hostD")]
    first = policy.decide([verdict(0, Verdict.CONFIRMED)], ctx(0.0, spares=spares))
    assert first == [a for a in first if a.kind is not ActionKind.REPLACE]  # held 0 s < 10 s
    first = policy.decide([verdict(0, Verdict.CONFIRMED)], ctx(10.0, spares=spares))
    assert [a.rank for a in first if a.kind is ActionKind.REPLACE] == [0]
    moved = {0: SlotInfo("w8", "hostC"), **{r: PLACEMENT[r] for r in (1, 2, 3)}}
    late = [verdict(3, Verdict.CONFIRMED)]
    policy.decide(late, ctx(40.0, spares=spares[1:], placement=moved))
    told = policy.decide(late, ctx(50.0, spares=spares[1:], placement=moved))  # held 10 s
    assert [a.kind for a in told] == [ActionKind.ALERT]
    assert "only if it stays confirmed" in told[0].reason
    policy.decide([], ctx(60.0, spares=spares[1:], placement=moved))  # it cleared meanwhile
    policy.decide(late, ctx(105.0, spares=spares[1:], placement=moved))  # back: a new run
    at_end = policy.decide(late, ctx(110.0, spares=spares[1:], placement=moved))
    assert ActionKind.REPLACE not in {a.kind for a in at_end}  # cooldown over, held 5 s
    later = policy.decide(late, ctx(115.0, spares=spares[1:], placement=moved))
    assert [(a.kind, a.rank) for a in later] == [(ActionKind.REPLACE, 3)]
    assert "confirmed for 10 s" in later[0].reason


def test_no_spare_outside_the_slow_host_falls_back_to_an_alert_with_the_fix() -> None:
    policy = replace_policy()
    spares = [SlotInfo("w4", "hostA")]
    actions = policy.decide([verdict(1, Verdict.CONFIRMED)], ctx(0.0, spares=spares))
    assert [a.kind for a in actions] == [ActionKind.ALERT, ActionKind.ALERT]
    assert "no spare slot" in actions[1].reason and "exclude='slot'" in actions[1].reason
    assert policy.decide([verdict(1, Verdict.CONFIRMED)], ctx(1.0, spares=spares)) == []

    same_host = replace_policy(exclude="slot")
    actions = same_host.decide([verdict(1, Verdict.CONFIRMED)], ctx(0.0, spares=spares))
    rep = [a for a in actions if a.kind is ActionKind.REPLACE]
    assert [(a.spare, a.exclude) for a in rep] == [(SlotInfo("w4", "hostA"), "w1")]
    assert same_host.excluded(0.0) == {"w1": 1800.0}


def test_a_rank_without_a_known_slot_is_alerted_not_replaced() -> None:
    policy = replace_policy()
    actions = policy.decide([verdict(7, Verdict.CONFIRMED)],
                            ctx(0.0, spares=[SlotInfo("x", "hostC")]))
    assert [a.kind for a in actions] == [ActionKind.ALERT, ActionKind.ALERT]
    assert "gave no slot" in actions[1].reason


def test_small_stragglers_are_only_alerted() -> None:
    policy = replace_policy(min_step_share=0.05)
    spares = [SlotInfo("w9", "hostC")]
    actions = policy.decide([verdict(0, Verdict.CONFIRMED, share=0.03)], ctx(0.0, spares=spares))
    assert ActionKind.REPLACE not in {a.kind for a in actions}
    assert any("min_step_share=5%" in a.reason for a in actions)


def test_spares_on_excluded_hosts_or_in_use_are_not_picked() -> None:
    policy = replace_policy(cooldown_s=0)
    spares = [SlotInfo("w2", "hostB"), SlotInfo("x1", "hostC"), SlotInfo("x2", "hostD")]
    first = policy.decide([verdict(0, Verdict.CONFIRMED)], ctx(0.0, spares=spares))
    rep = next(a for a in first if a.kind is ActionKind.REPLACE)
    assert rep.spare == SlotInfo("x1", "hostC")  # w2 is in use by rank 2
    assert policy.excluded(0.0) == {"hostA": 1800.0}
    placement = {**PLACEMENT, 0: SlotInfo("x1", "hostC")}
    spares2 = [SlotInfo("w7", "hostA"), SlotInfo("x2", "hostD")]
    second = policy.decide(
        [verdict(3, Verdict.CONFIRMED)], ctx(10.0, spares=spares2, placement=placement)
    )
    rep2 = next(a for a in second if a.kind is ActionKind.REPLACE)
    assert rep2.spare == SlotInfo("x2", "hostD")  # hostA is still excluded


def test_several_confirmed_stragglers_share_one_restart() -> None:
    policy = replace_policy(cooldown_s=600)
    spares = [SlotInfo("x1", "hostC"), SlotInfo("x2", "hostD")]
    verdicts = [verdict(0, Verdict.CONFIRMED, share=0.1), verdict(2, Verdict.CONFIRMED, share=0.4)]
    actions = policy.decide(verdicts, ctx(0.0, spares=spares))
    reps = [a for a in actions if a.kind is ActionKind.REPLACE]
    assert [(a.rank, a.spare.slot if a.spare else None) for a in reps] == [(2, "x1"), (0, "x2")]
    assert len({a.time for a in reps}) == 1 and policy.replacements == 2


def test_one_rank_slow_in_two_phases_is_moved_once() -> None:
    policy = replace_policy()
    verdicts = [verdict(1, Verdict.CONFIRMED, phase=Phase.DATA),
                verdict(1, Verdict.CONFIRMED, phase=Phase.COMPUTE)]
    actions = policy.decide(verdicts, ctx(0.0, spares=[SlotInfo("x", "hostC"),
                                                         SlotInfo("y", "hostD")]))
    assert [a.rank for a in actions if a.kind is ActionKind.REPLACE] == [1]


def test_actions_serialise_for_the_event_plane() -> None:
    policy = replace_policy()
    actions = policy.decide([verdict(2, Verdict.CONFIRMED)],
                            ctx(5.0, step=120, spares=[SlotInfo("x", "hostC")]))
    events = json.loads(json.dumps([a.to_event() for a in actions]))
    assert [e["kind"] for e in events] == ["alert", "replace"]
    assert events[1]["host"] == "hostB" and events[1]["spare_slot"] == "x"
    assert events[1]["diagnosis"]["phase"] == "compute" and events[1]["step"] == 120


def test_settings_change_while_running_keeps_the_memory() -> None:
    policy = replace_policy(cooldown_s=600)
    spares = [SlotInfo("x1", "hostC"), SlotInfo("x2", "hostD")]
    policy.decide([verdict(0, Verdict.CONFIRMED)], ctx(0.0, spares=spares))
    policy.update_settings(cooldown_s=50)
    actions = policy.decide([verdict(3, Verdict.CONFIRMED)], ctx(60.0, spares=spares[1:]))
    assert [a.rank for a in actions if a.kind is ActionKind.REPLACE] == [3]
    assert policy.excluded(60.0) == {"hostA": 1800.0, "hostB": 1860.0}


# -- detector and policy together ------------------------------------------------------------


def test_detector_verdicts_drive_a_replacement_end_to_end() -> None:
    """A slow rank is alerted, confirmed and moved; after the restart all is quiet."""
    rng = np.random.default_rng(1)
    det = StragglerDetector(4)
    policy = replace_policy()
    placement = dict(PLACEMENT)
    spares = [SlotInfo("w9", "hostC")]
    actions: list[Action] = []
    prev_opt = None
    slow_rank: int | None = None
    restarted_at = None
    for t in range(400):
        data = 0.01 * np.exp(rng.normal(0, 0.05, 4))
        compute = 0.05 * np.exp(rng.normal(0, 0.05, 4))
        opt = 0.01 * np.exp(rng.normal(0, 0.05, 4))
        if t >= 60 and restarted_at is None:
            compute[3] *= 1.5  # a co-located load on hostB slows rank 3
        before = opt if prev_opt is None else prev_opt
        ready = before + data + compute
        done = ready.max() + 0.01
        prev_opt = opt
        det.observe_frame(StepFrame.from_arrays(
            t, step_s=done - before + opt, data_s=data, compute_s=compute,
            comm_s=done - ready, opt_s=opt,
        ))
        new = policy.decide(det.active(), ctx(t * 0.1, step=t, spares=spares,
                                               placement=placement))
        actions += new
        replace = [a for a in new if a.kind is ActionKind.REPLACE]
        if replace and restarted_at is None:
            restarted_at = t + 20  # the engine restarts the gang a little later
            slow_rank = replace[0].rank
        if restarted_at is not None and t == restarted_at:
            target = replace_target(actions)
            assert slow_rank is not None and target is not None
            placement[slow_rank] = target
            spares = [SlotInfo("w3", "hostB")]  # the old slot is free but its host excluded
            det.reset(4, start_step=t + 1)
            prev_opt = None
    assert [(a.kind.value, a.rank, a.level) for a in actions] == [
        ("alert", 3, "warning"), ("alert", 3, "critical"), ("replace", 3, "critical"),
    ]
    assert actions[0].step < 75 and actions[2].diagnosis is not None
    assert actions[2].diagnosis.phase is Phase.COMPUTE
    assert actions[2].exclude == "hostB"
    assert placement[3] == SlotInfo("w9", "hostC")


def replace_target(actions: list[Action]) -> SlotInfo | None:
    return next((a.spare for a in actions if a.kind is ActionKind.REPLACE), None)
