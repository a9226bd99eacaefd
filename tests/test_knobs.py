"""Live knobs without a cluster: the values as a function of history and step, the
controller's book (bounds, unknown knobs, ended jobs, bounded sizes), and the job machine's
side (pending changes reach the ranks, applied ones become history that later generations,
a restarted controller and a replay get)."""

from __future__ import annotations

import itertools
import math

import pytest

from nbtrain.core.job import JobSpec
from nbtrain.core.knobs import (
    HISTORY_MAX,
    PENDING_MAX,
    KnobBook,
    KnobChange,
    KnobError,
    KnobSpec,
    check_change,
    knob_state,
    ramp_weight,
    values_at,
)
from nbtrain.core.lifecycle import JobMachine
from nbtrain.core.lifecycle_types import (
    JobSubmission,
    Launch,
    Rejected,
    SetControl,
    Submitted,
)
from nbtrain.core.machine_events import rank_from_wire, request_from_wire
from tests.test_lifecycle import POLICY, Harness

SPECS = [KnobSpec(name="lr", default=0.1, min=0.0, max=1.0, builtin=True).to_dict(),
         KnobSpec(name="aux_weight", default=0.1, min=0.0, max=1.0).to_dict()]


def change(seq: int, step: int, ramp: int = 0, shape: str = "linear",
           **values: float) -> KnobChange:
    return KnobChange(seq=seq, values=values, step=step, ramp=ramp, shape=shape)


# ============================================================== values as a function of step
def test_jumps_take_effect_after_their_step_in_step_then_seq_order() -> None:
    history = [change(2, 20, lr=0.3), change(1, 10, lr=0.2), change(3, 20, lr=0.4)]
    defaults = {"lr": 0.1, "aux": 1.0}
    assert values_at(defaults, history, 9) == {"lr": 0.1, "aux": 1.0}
    assert values_at(defaults, history, 10)["lr"] == 0.2
    assert values_at(defaults, history, 19)["lr"] == 0.2
    assert values_at(defaults, history, 20)["lr"] == 0.4  # same step: the later seq wins
    assert values_at(defaults, [], 1000) == defaults


def test_ramps_move_every_step_and_land_exactly() -> None:
    defaults = {"lr": 1.0}
    lin = [change(1, 10, ramp=4, lr=0.0)]
    got = [values_at(defaults, lin, s)["lr"] for s in range(9, 16)]
    assert got == [1.0, 0.75, 0.5, 0.25, 0.0, 0.0, 0.0]
    cos = [change(1, 10, ramp=4, shape="cosine", lr=0.0)]
    got = [values_at(defaults, cos, s)["lr"] for s in range(10, 14)]
    assert got[-1] == 0.0 and got[0] == pytest.approx(1 - ramp_weight("cosine", 1, 4))
    assert all(a > b for a, b in itertools.pairwise(got))
    # A change during a ramp starts from where the ramp was.
    both = [change(1, 10, ramp=4, lr=0.0), change(2, 11, ramp=2, lr=1.0)]
    assert values_at(defaults, both, 11)["lr"] == pytest.approx(0.5 + 0.5 * 0.5)
    assert values_at(defaults, both, 12)["lr"] == 1.0


def test_check_change_names_every_problem_and_the_fix() -> None:
    specs = {d["name"]: KnobSpec.from_dict(d) for d in SPECS}
    assert check_change(specs, {"lr": 0.5}) == {"lr": 0.5}
    with pytest.raises(KnobError) as e:
        check_change(specs, {"lr": 2.0, "momentum": 0.9, "aux_weight": math.nan}, ramp=-1,
                     shape="steep", job="job demo")
    text = str(e.value)
    for part in ("lr=2: 2 is above its max 1", "'momentum' is not a knob of job demo",
                 "ctx.knobs.declare('momentum'", "aux_weight must be a finite number",
                 "ramp must be a whole number", "shape must be one of linear, cosine"):
        assert part in text, (part, text)
    with pytest.raises(KnobError, match="at least one knob"):
        check_change(specs, {})
    with pytest.raises(KnobError, match="default 2 is above its max 1"):
        KnobSpec(name="x", default=2, max=1)
    with pytest.raises(KnobError, match="cannot be a knob's name"):
        KnobSpec(name="ramp", default=0)


# ================================================================================= the book
def test_book_refuses_before_declarations_and_bounds_what_it_holds() -> None:
    book = KnobBook()
    with pytest.raises(KnobError, match="has not declared its knobs yet"):
        book.request({"lr": 0.2})
    book.declare([])
    with pytest.raises(KnobError, match="has no knobs: declare them"):
        book.request({"lr": 0.2})
    book.declare([*SPECS, {"name": "bad", "default": "x"}, {"nonsense": 1}])
    assert sorted(book.specs) == ["aux_weight", "lr"]  # malformed declarations dropped
    for i in range(PENDING_MAX):
        assert book.request({"lr": 0.01 * (i + 1)}, who="me").seq == i + 1
    with pytest.raises(KnobError, match=f"at most {PENDING_MAX}"):
        book.request({"lr": 0.5})
    moved = book.applied([{"seq": 1}, {"seq": 2}, {"seq": 99}, {"junk": 0}], step=7)
    assert [(c.seq, c.step) for c in moved] == [(1, 7), (2, 7)]
    assert book.applied([{"seq": 1}], step=9) == []  # recorded once
    assert book.values(7)["lr"] == 0.02 and book.values(6)["lr"] == 0.1
    again = KnobBook.from_wire(book.wire())
    assert again.wire() == book.wire()
    full = KnobBook(specs=book.specs, history=[change(i, i, lr=0.1) for i in range(HISTORY_MAX)])
    with pytest.raises(KnobError, match="the most one job keeps"):
        full.request({"lr": 0.3})


def test_replay_book_takes_applied_changes_only() -> None:
    book = KnobBook.replaying([change(2, 30, lr=0.3).to_dict(), change(1, 10, lr=0.2).to_dict()])
    assert [c.seq for c in book.history] == [1, 2] and book.seq == 2
    with pytest.raises(KnobError, match="must all have been applied"):
        KnobBook.replaying([KnobChange(seq=1, values={"lr": 0.1}).to_dict()])


def test_knob_state_folds_events() -> None:
    events = [
        {"kind": "knobs", "specs": SPECS, "values": {}, "step": 0,
         "history": [change(1, 5, lr=0.2).to_dict()]},
        {"kind": "knob_set", "change": KnobChange(seq=2, values={"aux_weight": 0.5},
                                                  who="ann").to_dict()},
        {"kind": "knob_set", "change": KnobChange(seq=3, values={"lr": 0.05}).to_dict()},
        {"kind": "knob_applied", "step": 12,
         "changes": [change(2, 12, aux_weight=0.5).to_dict()]},
        {"kind": "knob_applied", "step": "garbage", "changes": [{"x": 1}]},
    ]
    state = knob_state(events, 20)
    assert state.values == {"lr": 0.2, "aux_weight": 0.5}
    assert [(c.seq, c.step) for c in state.history] == [(1, 5), (2, 12)]
    assert [c.seq for c in state.pending] == [3]
    assert "step 12: aux_weight=0.5" in repr(state)
    assert KnobBook.replaying(state.changes()).history == list(state.history)


# ========================================================================= the job machine
def _running(h: Harness, job: str = "a") -> Launch:
    h.submit(job)
    launch = h.launches(job)[-1]
    h.steps(job, launch.generation, 3)
    return launch


def _declare(h: Harness, job: str, gen: int) -> None:
    h.feed(rank_from_wire, job, {"kind": "knobs", "rank": 0, "generation": gen, "specs": SPECS,
                                 "values": {}, "step": 0, "history": []})


def _set(h: Harness, job: str, **arg: object) -> list[object]:
    return h.feed(request_from_wire, job, "set", arg)


def test_machine_sends_pending_changes_and_records_them_applied() -> None:
    h = Harness()
    launch = _running(h)
    gen = launch.generation
    out = _set(h, "a", values={"lr": 0.5}, who="ann")
    assert [c.reason for c in out if isinstance(c, Rejected)] == [
        "job job-a has not declared its knobs yet: a job declares them when its ranks start "
        "training; wait until job.knobs lists them"]
    _declare(h, "a", gen)
    out = _set(h, "a", values={"lr": 0.5}, who="ann", ramp=10)
    ctl = [c for c in out if isinstance(c, SetControl)]
    assert ctl and [dict(k)["values"] for k in ctl[-1].knobs] == [{"lr": 0.5}]
    assert h.events("a", "knob_set")[-1]["change"]["who"] == "ann"
    assert h.m.status("a").knob_seq == 1
    out = _set(h, "a", values={"aux_weight": 3.0})
    assert "aux_weight=3: 3 is above its max 1" in next(
        c.reason for c in out if isinstance(c, Rejected))
    out = _set(h, "a", values="lr=0.1")
    assert any(isinstance(c, Rejected) for c in out)
    # Rank 0 says every rank applied it at step 40: no longer pending, in the history.
    applied = {**ctl[-1].knobs[0], "step": 40}
    out = h.feed(rank_from_wire, "a", {"kind": "knob_applied", "rank": 0, "generation": gen,
                                       "step": 40, "changes": [applied], "values": {}})
    assert [c.knobs for c in out if isinstance(c, SetControl)] == [()]
    carried = h.m.carry("a")
    assert [c["step"] for c in carried.knobs["history"]] == [40]
    # The next generation starts with that history (a recovery re-applies it at step 40).
    h.fail("a", gen, 1)
    h.fail("a", gen, 0, peer=True)
    h.advance(1.0)
    nxt = h.launches("a")[-1]
    assert nxt.generation > gen
    assert [c["step"] for c in nxt.knobs["history"]] == [40]
    # The ranks' declarations, and the controller's own knobs (its straggler settings).
    assert [s for s in nxt.knobs["specs"] if s["by"] == "ranks"] == SPECS
    assert {s["name"] for s in nxt.knobs["judged"]} == {
        s["name"] for s in nxt.knobs["specs"] if s["by"] == "controller"} >= {
        "straggler_ratio", "straggler_window"}


def test_machine_refuses_a_change_on_an_ended_job_and_restores_carried_knobs() -> None:
    h = Harness()
    launch = _running(h)
    _declare(h, "a", launch.generation)
    _set(h, "a", values={"lr": 0.3})
    h.feed(rank_from_wire, "a", {"kind": "knob_applied", "rank": 0,
                                 "generation": launch.generation, "step": 5,
                                 "changes": [{"seq": 1}], "values": {}})
    carried = h.m.carry("a")
    for rank in (0, 1):
        h.exit("a", launch.generation, rank)
    assert h.state("a") == "SUCCEEDED"
    out = _set(h, "a", values={"lr": 0.2})
    assert "has ended (SUCCEEDED): its knobs can no longer change" in next(
        c.reason for c in out if isinstance(c, Rejected))
    # A restarted controller continues the knobs from what it journaled (as JSON).
    import json

    from nbtrain.engine.controller import _carried_from
    from nbtrain.engine.wire import plain

    carried = _carried_from(json.loads(json.dumps(plain(carried))))
    m = JobMachine()
    spec = JobSpec(job_id="a", name="job-a", world_size=2, steps=1000)
    m.handle(Submitted(1.0, 1.0, JobSubmission(spec=spec, policy=POLICY, carried=carried)))
    assert [c["step"] for c in m.carry("a").knobs["history"]] == [5]


def test_replayed_submission_launches_with_the_history() -> None:
    h = Harness()
    history = (change(2, 20, ramp=5, aux_weight=0.4).to_dict(), change(1, 10, lr=0.2).to_dict())
    spec = JobSpec(job_id="b", name="replay", world_size=2, steps=1000)
    h.feed(Submitted, JobSubmission(spec=spec, policy=POLICY, knob_history=history))
    launch = h.launches("b")[-1]
    assert [c["seq"] for c in launch.knobs["history"]] == [1, 2]
    assert h.m.status("b").knob_seq == 2


def test_views_say_who_changed_what_and_when() -> None:
    from nbtrain.ui.eventlog import EventLog

    log = EventLog()
    asked = log.add({"kind": "knob_set", "time": 1.0, "change": KnobChange(
        seq=1, values={"lr": 0.2}, who="ann", ramp=10, shape="cosine").to_dict()})
    assert asked is not None and "knob change by ann: lr=0.2 over 10 steps (cosine)" in asked.text
    done = log.add({"kind": "knob_applied", "time": 1.0, "step": 37,
                    "changes": [change(1, 37, lr=0.2).to_dict()], "values": {}})
    assert done is not None and done.text.startswith("knobs applied at step 37 on every rank")
    # Only the optimizer's built-ins: nothing to say.
    assert log.add({"kind": "knobs", "time": 1.0, "specs": SPECS[:1], "values": {}}) is None


def test_rank_builtins_act_on_every_param_group() -> None:
    """The built-ins on a real optimizer (one process): lr absolute, lr_factor relative to
    each group's own LR, weight_decay, grad_clip before the step; untouched ones left alone."""
    import torch

    from nbtrain.runtime.knobs import RankKnobs

    model = torch.nn.Linear(4, 1).double()
    opt = torch.optim.SGD([{"params": [model.weight], "lr": 0.1},
                           {"params": [model.bias], "lr": 0.2}], weight_decay=0.01)
    knobs = RankKnobs()
    knobs.declare("lr", max=1.0)
    with pytest.raises(KnobError, match="needs a default"):
        knobs.declare("aux")
    knobs.bind({"optimizer": opt})
    knobs.start(0, None)
    assert knobs.specs["lr"].default == 0.1 and knobs.specs["lr"].max == 1.0
    knobs.apply([{"seq": 1, "values": {"lr_factor": 0.5}}], 3)
    assert [g["lr"] for g in opt.param_groups] == [0.05, 0.1]  # ratios kept
    knobs.apply([{"seq": 2, "values": {"lr": 0.4, "weight_decay": 0.0}}], 5)
    assert [g["lr"] for g in opt.param_groups] == [0.2, 0.2]  # 0.4 x the factor 0.5
    assert [g["weight_decay"] for g in opt.param_groups] == [0.0, 0.0]
    knobs.apply([{"seq": 3, "values": {"grad_clip": 1.0}}], 6)
    model.weight.grad = torch.full_like(model.weight, 100.0)
    model.bias.grad = torch.full_like(model.bias, 100.0)
    before = model.weight.detach().clone()
    opt.step()
    grads = torch.cat([model.weight.grad.flatten(), model.bias.grad.flatten()])
    assert float(grads.norm()) == pytest.approx(1.0)
    assert not torch.equal(before, model.weight)
    meta = knobs.checkpoint_meta()
    assert [c["step"] for c in meta["history"]] == [3, 5, 6] and meta["values"]["lr"] == 0.4
    # A fresh rank restored at step 5 (a resume= checkpoint, no controller history): the
    # values in force there, not the later grad_clip.
    fresh = RankKnobs()
    fresh.bind({"optimizer": torch.optim.SGD(model.parameters(), lr=0.1)})
    fresh.start(5, meta)
    assert fresh.values["lr"] == 0.4 and fresh.values["grad_clip"] == 0.0


def test_report_lists_the_changes() -> None:
    from nbtrain.ui.report import knob_table

    assert knob_table([]) == ""
    text = knob_table([{"kind": "knob_applied", "step": 12, "changes": [
        KnobChange(seq=1, values={"lr": 0.01}, who="ann", ramp=5, step=12).to_dict()]}])
    assert "<h2>Knob changes</h2>" in text and "<td>12</td>" in text
    assert "lr=0.01" in text and "5 steps (linear)" in text and "ann" in text
