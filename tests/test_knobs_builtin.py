"""The built-in knobs beyond the optimizer's, without a cluster: ``checkpoint_every`` (the
policy's step interval, the rank's knob and its restore) and the straggler settings the
controller judges with (exactly from the step after the agreed one, whatever order the ranks'
rows arrive in; restarts and replays; checked whole; in the machine's history)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from nbtrain.core.checkpoint_policy import CheckpointPolicy, CheckpointPolicyConfig
from nbtrain.core.job import JobSpec
from nbtrain.core.jobrecord import LiveJob
from nbtrain.core.knobflow import applied, request_set
from nbtrain.core.knobs import KnobChange, KnobError, KnobSpec, check_change
from nbtrain.core.lifecycle_types import JobSubmission, Rejected
from nbtrain.core.machine_events import rank_from_wire, request_from_wire
from nbtrain.core.outbox import Outbox
from nbtrain.core.straggler import StragglerSettings
from nbtrain.core.stragglerknobs import StragglerKnobs, fields_of, straggler_specs
from nbtrain.core.stragglerwatch import StragglerWatch
from nbtrain.runtime.knobs import RankKnobs
from tests.test_knobs import _declare, _running, _set
from tests.test_lifecycle import POLICY, Harness


# ============================================================== specs: whole numbers, no ramps
def test_whole_number_and_controller_knobs_take_jumps_only() -> None:
    specs = {s.name: s for s in [
        KnobSpec(name="checkpoint_every", default=0, min=0, builtin=True, integer=True),
        *straggler_specs(StragglerSettings()),
        KnobSpec(name="aux", default=0.1)]}
    assert check_change(specs, {"checkpoint_every": 50.0}) == {"checkpoint_every": 50.0}
    with pytest.raises(KnobError, match=r"checkpoint_every takes whole numbers .* got 2.5"):
        check_change(specs, {"checkpoint_every": 2.5})
    with pytest.raises(KnobError, match=r"checkpoint_every cannot ramp \(it counts whole steps"):
        check_change(specs, {"checkpoint_every": 10}, ramp=5)
    with pytest.raises(KnobError, match=r"straggler_ratio cannot ramp \(the controller applies"):
        check_change(specs, {"straggler_ratio": 1.5, "aux": 0.2}, ramp=5)
    with pytest.raises(KnobError, match=r"checkpoint_every=-1: -1 is below its min 0"):
        check_change(specs, {"checkpoint_every": -1})
    assert check_change(specs, {"aux": 0.3}, ramp=5) == {"aux": 0.3}
    round_trip = {n: KnobSpec.from_dict(s.to_dict()) for n, s in specs.items()}
    assert round_trip == specs
    assert fields_of({"straggler_window": 16.0, "straggler_ratio": 1.5, "aux": 1.0}) == {
        "window": 16, "ratio": 1.5}


# ============================================================== checkpoint_every
def test_the_policy_takes_a_new_step_interval_aligned_to_its_multiples() -> None:
    policy = CheckpointPolicy(CheckpointPolicyConfig(every_steps=10), now=0.0)
    due = [s for s in range(1, 31) if policy.due(s, 0.0) and policy.record(s, 0.0) is None]
    assert due == [10, 20, 30]
    policy.set_every_steps(4)
    assert [s for s in range(31, 45) if policy.due(s, 0.0) and policy.record(s, 0.0) is None] \
        == [32, 36, 40, 44]
    policy.set_every_steps(0)
    assert policy.every_steps is None and not any(policy.due(s, 0.0) for s in range(45, 200))
    with pytest.raises(ValueError, match="whole number of steps >= 0"):
        policy.set_every_steps(-3)


def _rank_knobs(interval: int, applied: list[tuple[int, int]], at: list[int],
                history: list[dict[str, Any]] | None = None) -> RankKnobs:
    knobs = RankKnobs()
    knobs.provide("checkpoint_every", float(interval),
                  lambda v: applied.append((at[0], int(v))), min=0.0, integer=True)
    knobs.load({"history": history or []})
    knobs.bind({})
    return knobs


def test_a_rank_applies_checkpoint_every_at_the_agreed_step_and_from_a_restore() -> None:
    applied: list[tuple[int, int]] = []
    at = [0]
    knobs = _rank_knobs(10, applied, at)
    knobs.start(0, None)
    assert knobs.specs["checkpoint_every"].integer and applied == []  # untouched: left alone
    for step in range(1, 30):
        at[0] = step
        if step == 12:
            knobs.apply([{"seq": 1, "values": {"checkpoint_every": 5.0}}], step)
        else:
            knobs.at_step(step)
    assert applied == [(12, 5)]
    assert knobs.values["checkpoint_every"] == 5.0
    # A generation restored at step 20 uses the value in force there, and one restored
    # before the change gets it again at its step.
    history = knobs.checkpoint_meta()["history"]
    for start, want in ((20, [(20, 5)]), (8, [(12, 5)])):
        again: list[tuple[int, int]] = []
        at[0] = start
        rerun = _rank_knobs(10, again, at, history)
        rerun.start(start, None)
        for step in range(start + 1, 25):
            at[0] = step
            rerun.at_step(step)
        assert again == want, start  # before its step the plan's own interval stays


def test_declaring_checkpoint_every_bounds_it() -> None:
    knobs = RankKnobs()
    knobs.declare("checkpoint_every", min=10, max=1000)
    knobs.provide("checkpoint_every", 50.0, lambda v: None, min=0.0, integer=True)
    knobs.bind({})
    spec = knobs.specs["checkpoint_every"]
    assert (spec.default, spec.min, spec.max, spec.integer) == (50.0, 10, 1000, True)
    bare = RankKnobs()
    bare.declare("checkpoint_every", min=10)
    with pytest.raises(KnobError, match="this job has none: submit it with a checkpoint"):
        bare.bind({})


# ============================================================== straggler settings
def _row(step: int, slow: float = 0.0) -> list[Any]:
    return [step, float(step), 0.1 + slow, 0.0, 0.09 + slow, 0.005, 0.005]


def _spy(watch: StragglerWatch) -> list[tuple[int, float]]:
    """Which settings the detector judged each step with (its ratio)."""
    judged: list[tuple[int, float]] = []
    real = watch.detector._judge

    def judge(frame: Any) -> Any:
        judged.append((frame.step, watch.detector.settings.ratio))
        return real(frame)

    watch.detector._judge = judge  # type: ignore[method-assign]
    return judged


@pytest.mark.parametrize("seed", range(6))
def test_the_detector_judges_every_step_after_the_agreed_one_with_the_change(seed: int) -> None:
    """Rows of three ranks in batches of random sizes, interleaved at random: the steps up to
    40 are judged with the old ratio, every later one with the new, and the change may be
    known before or after rows past it arrived (rank 0 says it before its own row 40)."""
    rng = random.Random(seed)
    watch = StragglerWatch(3)
    judged = _spy(watch)
    watch.restart(3, 0)
    queues = {r: list(range(1, 81)) for r in range(3)}
    told = False
    while any(queues.values()):
        rank = rng.choice([r for r, q in queues.items() if q])
        if rank == 0 and not told and queues[0][0] == 40:  # knob_applied precedes row 40
            watch.follow([KnobChange(seq=1, values={"straggler_ratio": 1.7}, step=40)])
            told = True
        n = rng.randint(1, 9)
        if rank == 0 and not told:
            n = min(n, 40 - queues[0][0])
        batch, queues[rank] = queues[rank][:n], queues[rank][n:]
        watch.observe(rank, [_row(s) for s in batch])
    assert [s for s, _ in judged] == list(range(1, 81))
    assert all(ratio == (1.2 if s <= 40 else 1.7) for s, ratio in judged), judged


def test_a_restart_judges_with_the_settings_in_force_at_its_first_step() -> None:
    watch = StragglerWatch(2)
    watch.follow([KnobChange(seq=1, values={"straggler_ratio": 1.5}, step=30),
                  KnobChange(seq=2, values={"straggler_ratio": 2.0, "aux": 1.0}, step=60)])
    judged = _spy(watch)
    watch.restart(2, 45)  # a recovery from step 45: the first change in force, not the second
    assert watch.detector.settings.ratio == 1.5
    for rank in (0, 1):
        watch.observe(rank, [_row(s) for s in range(46, 71)])
    assert all(r == (1.5 if s <= 60 else 2.0) for s, r in judged)
    watch.restart(2, 10)  # before both: the job's own settings again
    assert watch.detector.settings == StragglerSettings()
    # job.tune_stragglers changes the base: a knob a change named wins over it.
    watch.update(ratio=1.3, window=12)
    watch.restart(2, 100)
    assert (watch.detector.settings.ratio, watch.detector.settings.window) == (2.0, 12)


def test_a_change_is_checked_whole_with_the_pending_ones() -> None:
    knobs = StragglerKnobs(StragglerSettings())
    ok = knobs.problem(StragglerSettings(), [], {"straggler_window": 16})
    assert ok == ""
    pending = [KnobChange(seq=1, values={"straggler_window": 4})]
    why = knobs.problem(StragglerSettings(), pending, {"straggler_suspect_votes": 5})
    assert "do not go together" in why and "suspect_votes must be between 1 and window=4" in why
    assert knobs.problem(StragglerSettings(), [], {"aux": "x"}) == ""  # not a straggler knob


def test_the_machine_takes_a_straggler_change_only_when_it_goes_together() -> None:
    h = Harness()
    launch = _running(h)
    # The controller's knobs are known before the ranks declare theirs.
    out = _set(h, "a", values={"straggler_window": 2.0}, who="ann")
    assert [c.reason for c in out if isinstance(c, Rejected)] == [
        "cannot set the knobs of job job-a: these straggler settings do not go together: "
        "invalid StragglerSettings: suspect_votes must be between 1 and window=2, got 6"]
    out = _set(h, "a", values={"straggler_window": 16.0}, who="ann")
    assert not [c for c in out if isinstance(c, Rejected)]
    _declare(h, "a", launch.generation)  # the ranks' declarations keep the controller's
    carried = h.m.carry("a")
    assert {s["name"] for s in carried.knobs["specs"]} >= {"lr", "straggler_window"}
    assert [c["values"] for c in carried.knobs["pending"]] == [{"straggler_window": 16.0}]


def test_an_applied_straggler_change_judges_the_steps_after_it_and_is_carried() -> None:
    spec = JobSpec(job_id="a", name="job-a", world_size=2, steps=1000)
    job = LiveJob(JobSubmission(spec=spec, policy=POLICY), 0.0, 0.0)
    out = Outbox()
    out.begin(0.0)
    request_set(job, request_from_wire(0.0, 0.0, "a", "set", {
        "values": {"straggler_ratio": 1.6, "straggler_confirm_s": 5.0}, "who": "ann"}), out)
    [pending] = job.knobs.pending
    judged = _spy(job.stragglers)
    job.stragglers.restart(2, 0)
    for rank in (0, 1):
        job.stragglers.observe(rank, [_row(s) for s in range(1, 10)])
    applied(job, rank_from_wire(0.0, 0.0, "a", {  # type: ignore[arg-type]
        "kind": "knob_applied", "rank": 0, "generation": 0, "step": 10,
        "changes": [{**pending.to_dict(), "step": 10}]}), out)
    for rank in (0, 1):
        job.stragglers.observe(rank, [_row(s) for s in range(10, 20)])
    assert all(r == (1.2 if s <= 10 else 1.6) for s, r in judged) and len(judged) == 19
    assert job.stragglers.detector.settings.confirm_s == 5.0
    assert [(c.step, dict(c.values)) for c in job.knobs.history] == [
        (10, {"straggler_ratio": 1.6, "straggler_confirm_s": 5.0})]
    # A restarted controller continues from the carried book, a replay from the history:
    # both judge with the change from step 11 on.
    carried = job.carry(0.0, 0.0)
    again = LiveJob(JobSubmission(spec=spec, policy=POLICY), 0.0, 0.0)
    again.restore(carried, 0.0, 0.0)
    replay = LiveJob(JobSubmission(spec=spec, policy=POLICY,
                                   knob_history=tuple(c.to_dict() for c in job.knobs.history)),
                     0.0, 0.0)
    for other in (again, replay):
        assert other.stragglers.restart(2, 5) == []
        assert other.stragglers.detector.settings.ratio == 1.2
        other.stragglers.restart(2, 10)
        assert other.stragglers.detector.settings.ratio == 1.6


# ============================================================== applied, never recorded
def test_a_change_the_own_checkpoint_holds_but_the_controller_never_recorded_is_in_force() -> None:
    """The ranks applied change 2 at step 30 and checkpointed at 40; the controller died
    before it journaled their report, so its history has change 1 only. A generation that
    restores its own checkpoint at 40 keeps change 2 at its step (the state was trained with
    it) and names it for rank 0 to report; one restoring another run's (resume=) does not."""
    one = KnobChange(seq=1, values={"aux": 0.2}, step=10).to_dict()
    two = KnobChange(seq=2, values={"aux": 0.7}, step=30).to_dict()
    later = KnobChange(seq=3, values={"aux": 0.9}, step=50).to_dict()  # after the restore

    def started(own: bool) -> RankKnobs:
        knobs = RankKnobs()
        knobs.declare("aux", 0.1, min=0.0, max=1.0)
        knobs.load({"history": [one]})
        knobs.bind({})
        knobs.start(40, {"history": [one, two, later]}, own)
        return knobs

    mine = started(own=True)
    assert mine.values["aux"] == 0.7 and [c.seq for c in mine.recovered] == [2]
    assert mine.seq == 2  # not offered again at the next agreement
    assert [c.seq for c in mine.history] == [1, 2]
    other = started(own=False)
    assert other.values["aux"] == 0.2 and other.recovered == []


def test_the_controllers_knob_names_are_its_own_and_a_clashing_tune_changes_nothing() -> None:
    knobs = RankKnobs()
    knobs.load({"judged": [s.to_dict() for s in straggler_specs(StragglerSettings())]})
    with pytest.raises(KnobError, match="'straggler_ratio' is a knob of the controller's"):
        knobs.declare("straggler_ratio", 1.0)
    knobs.bind({})
    assert knobs.specs["straggler_ratio"].by == "controller"
    watch = StragglerWatch(2)
    watch.follow([KnobChange(seq=1, values={"straggler_suspect_votes": 3}, step=5)])
    watch.restart(2, 10)
    assert watch.detector.settings.suspect_votes == 3
    # The base's own suspect_votes (6) does not fit window=2: refused, nothing changed.
    with pytest.raises(ValueError, match="suspect_votes must be between 1 and window=2"):
        watch.update(window=2)
    assert watch.knobs.base == StragglerSettings() and watch.detector.settings.window == 8
