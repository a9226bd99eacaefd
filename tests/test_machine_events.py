"""The machine's typed events, read once at the boundary: every request and rank message
kind to its event, unknown kinds and unreadable fields refused with a reason, records of an
older version (``gen``) still read, and the controller serving on."""

from __future__ import annotations

from typing import Any

import pytest

import nbtrain
from nbtrain.core.faults import Fault
from nbtrain.core.jobevents import RANK_KINDS, generation_of, renamed_fields
from nbtrain.core.lifecycle_types import Rejected, SetControl
from nbtrain.core.machine_events import (
    REQUEST_KINDS,
    CheckpointRequested,
    FaultInjectionRequested,
    KnobChangeRequested,
    PreemptRequested,
    RankCheckpoint,
    RankDevice,
    RankEvent,
    RankFaultInjected,
    RankKnobApplied,
    RankKnobs,
    RankPhase,
    RankStarted,
    RankSteps,
    ResumeRequested,
    SizeRequested,
    StopRequested,
    StragglerTuningRequested,
    UnknownKind,
    rank_from_wire,
    request_from_wire,
)
from nbtrain.engine.store import renamed_fields as store_renames
from tests.test_lifecycle import Harness, run_to_running


def _req(what: str, arg: Any = None) -> Any:
    return request_from_wire(1.0, 2.0, "j", what, arg)


def _rank(kind: str, **fields: Any) -> RankEvent:
    return rank_from_wire(1.0, 2.0, "j", {"kind": kind, "rank": 1, "generation": 3, **fields})


def test_every_request_kind_reads_into_its_own_event() -> None:
    fault = Fault(kind="raise", rank=1, step=5)
    events = [_req("stop"), _req("preempt"), _req("resume"), _req("checkpoint"),
              _req("inject", fault.to_dict()), _req("stragglers", {"window": 16}),
              _req("resize", {"size": 3, "wait_for_workers": True}),
              _req("set", {"values": {"lr": 0.1}, "ramp": 5, "shape": "cosine", "who": "ann"})]
    assert [type(e) for e in events] == [
        StopRequested, PreemptRequested, ResumeRequested, CheckpointRequested,
        FaultInjectionRequested, StragglerTuningRequested, SizeRequested, KnobChangeRequested]
    assert [e.what for e in events] == list(REQUEST_KINDS)
    assert events[4].fault == fault and _req("inject", fault).fault == fault
    assert events[5].changes == {"window": 16}
    assert (events[6].size, events[6].wait_for_workers) == (3, True)
    knob = events[7]
    assert (dict(knob.values), knob.ramp, knob.shape, knob.who) == ({"lr": 0.1}, 5, "cosine",
                                                                    "ann")
    assert all((e.now, e.wall, e.job_id) == (1.0, 2.0, "j") for e in events)


@pytest.mark.parametrize("what, arg, error, words", [
    ("explode", None, UnknownKind, "unknown request 'explode'; one of stop, preempt"),
    (None, None, UnknownKind, "unknown request None"),
    ("resize", {"size": "2"}, TypeError, "n must be an integer number of ranks, got '2'"),
    ("resize", {"size": True}, TypeError, "must be an integer"),
    ("resize", [2], TypeError, "must be an integer"),
    ("inject", "kill", TypeError, "inject needs a fault as a mapping"),
    ("inject", {"kind": "meteor", "rank": 0}, ValueError, "meteor"),
    ("stragglers", [1, 2], ValueError, "straggler settings must be a mapping"),
    ("set", "lr=0.1", ValueError, "a knob change is a mapping with 'values', got str"),
    ("set", {"values": {"lr": 0.1}, "ramp": "10"}, TypeError, "ramp must be a whole number"),
    ("set", {"values": {"lr": 0.1}, "shape": 3}, TypeError, "shape must be the name"),
])
def test_requests_that_are_no_event_are_refused_with_a_reason(
        what: Any, arg: Any, error: type[Exception], words: str) -> None:
    with pytest.raises(error, match=words):
        _req(what, arg)


def test_every_rank_kind_but_output_reads_into_its_own_event() -> None:
    rows = [[1, 0.0, 0.01, 0.0, 0.008, 0.0, 0.002]]
    steps = _rank("steps", rows=rows)
    assert isinstance(steps, RankSteps) and steps.rows == rows
    assert (steps.generation, steps.rank, steps.job_id) == (3, 1, "j")
    phase = _rank("phase", phase="setup")
    assert isinstance(phase, RankPhase) and phase.phase == "setup"
    device = _rank("device", readings={"sm_clock": 1})
    assert isinstance(device, RankDevice) and device.readings == {"sm_clock": 1}
    started = _rank("rank_started", start_step=12, host="h0")
    assert isinstance(started, RankStarted) and started.start_step == 12
    assert started.logged()["host"] == "h0"  # the job's log keeps the message as sent
    ck = _rank("checkpoint", phase="committed", step=40)
    assert isinstance(ck, RankCheckpoint) and (ck.phase, ck.step) == ("committed", 40)
    snap = _rank("checkpoint", phase="snapshot", blocking_ms=3, wait_ms="1.5")
    assert isinstance(snap, RankCheckpoint) and (snap.blocking_ms, snap.wait_ms) == (3.0, 1.5)
    fired = _rank("fault_injected", fault={"id": "f1", "kind": "raise"})
    assert isinstance(fired, RankFaultInjected) and fired.fault_id == "f1"
    knobs = _rank("knobs", specs=[{"name": "lr"}])
    assert isinstance(knobs, RankKnobs) and knobs.specs == ({"name": "lr"},)
    applied = _rank("knob_applied", step=9, changes=[{"seq": 1}])
    assert isinstance(applied, RankKnobApplied) and (applied.step, applied.changes) == (
        9, ({"seq": 1},))
    machine_kinds = {"steps", "phase", "device", "rank_started", "checkpoint",
                     "fault_injected", "knobs", "knob_applied", "rank_failed",
                     "rank_finished", "data", "memory", "gradnoise"}
    assert machine_kinds == set(RANK_KINDS) - {"log"}
    for kind in machine_kinds - {"steps", "phase", "rank_started", "checkpoint",
                                 "fault_injected"}:
        assert type(_rank(kind)).kind == kind


@pytest.mark.parametrize("msg, error, words", [
    ({"kind": "telemetry"}, UnknownKind, "unknown rank message kind 'telemetry'"),
    ({"kind": "log"}, UnknownKind, "unknown rank message kind 'log'"),  # the views', not ours
    ({}, UnknownKind, "unknown rank message kind None"),
    ({"kind": "steps", "rank": 0, "rows": []}, TypeError, "integer generation and rank"),
    ({"kind": "steps", "generation": 0, "rank": "0", "rows": []}, TypeError, "integer"),
    ({"kind": "steps", "generation": 0, "rank": 0, "rows": "x"}, TypeError, "rows"),
    ({"kind": "phase", "generation": 0, "rank": 0}, TypeError, "needs phase"),
    ({"kind": "rank_started", "generation": 0, "rank": 0}, TypeError, "needs start_step"),
    ({"kind": "checkpoint", "generation": 0, "rank": 0, "phase": "committed"}, TypeError,
     "needs step"),
    ({"kind": "fault_injected", "generation": 0, "rank": 0, "fault": {}}, TypeError,
     "the fault's id"),
    ({"kind": "device", "generation": 0, "rank": 0, "readings": [1]}, TypeError, "readings"),
])
def test_rank_messages_that_are_no_event_are_refused_with_a_reason(
        msg: dict[str, Any], error: type[Exception], words: str) -> None:
    with pytest.raises(error, match=words):
        rank_from_wire(1.0, 2.0, "j", msg)


def test_records_of_an_older_version_say_gen_and_still_read() -> None:
    old = {"kind": "rank_started", "job": "j", "rank": 0, "gen": 2, "start_step": 7}
    event = rank_from_wire(1.0, 2.0, "j", old)
    assert event.generation == 2
    assert event.logged() == {"kind": "rank_started", "job": "j", "rank": 0,
                              "generation": 2, "start_step": 7}
    assert generation_of(old) == 2 and generation_of({"generation": 4, "gen": 1}) == 4
    assert generation_of({}, "?") == "?"
    line = {"rank": 0, "gen": 1, "stream": "stdout", "text": "hi", "time": 0.0}
    assert renamed_fields(line) == {"rank": 0, "generation": 1, "stream": "stdout",
                                    "text": "hi", "time": 0.0}
    assert renamed_fields([1]) == [1] and store_renames is renamed_fields


def test_the_machine_takes_typed_events_as_it_took_their_wire_forms() -> None:
    typed, wire = Harness(), Harness()
    for h in (typed, wire):
        run_to_running(h)
    out = typed.feed(KnobChangeRequested, "a", {"lr": 0.1})
    assert [c.reason for c in out if isinstance(c, Rejected)] == [
        r.reason for r in wire.feed(request_from_wire, "a", "set", {"values": {"lr": 0.1}})
        if isinstance(r, Rejected)]
    typed.feed(CheckpointRequested, "a")
    wire.feed(request_from_wire, "a", "checkpoint")
    assert [c.flags for c in typed.of(SetControl)] == [c.flags for c in wire.of(SetControl)]
    typed.feed(StopRequested, "a")
    wire.feed(request_from_wire, "a", "stop")
    assert typed.m.status("a") == wire.m.status("a")
    assert typed.state("a") == "STOPPING"


def test_an_unknown_rank_message_kind_is_ignored_with_a_reason_and_the_job_goes_on(
        free_cluster: nbtrain.Cluster) -> None:
    from nbtrain.core.job import JobState
    from tests.recipes import unknown_kind_train

    job = free_cluster.submit(unknown_kind_train, world_size=1, steps=20, checkpoint=None,
                              name="newer-rank")
    assert job.wait(120) is JobState.SUCCEEDED, job.reason
    notes = [e for e in free_cluster.snapshot()["log"]
             if e.get("kind") == "refused" and e.get("job") == job.id]
    assert [n["reason"] for n in notes] == [
        "unknown rank message kind 'telemetry'; one of steps, phase, device, rank_started, "
        "checkpoint, fault_injected, knobs, knob_applied, rank_failed, rank_finished, data, "
        "memory, gradnoise: ignored"]
    assert not any(e["kind"] == "telemetry" for e in job.events)
