"""Typed reading of job events and the cluster log's entries (nbtrain.core.eventrecords,
nbtrain.core.clusterevents): parsed once, read by attribute, never raising on a bad record."""

from __future__ import annotations

import dataclasses

import pytest

from nbtrain.core import clusterevents as ce
from nbtrain.core.eventrecords import (
    _RECORDS,
    CheckpointRecord,
    EventRecord,
    FaultInjectedRecord,
    FaultRecord,
    GoodputRecord,
    StragglerRecord,
    parse_event,
)
from nbtrain.core.jobevents import fault_event, state_event, tracker_event
from nbtrain.ui.eventlog import EventLog


@pytest.mark.parametrize("kind", sorted(_RECORDS))
def test_every_kind_parses_an_empty_and_a_garbage_event(kind: str) -> None:
    empty = parse_event({"kind": kind})
    assert type(empty) is _RECORDS[kind] and empty.kind == kind
    garbage = {f.name: object() for f in dataclasses.fields(_RECORDS[kind])}
    garbage["kind"] = kind
    record = parse_event(garbage)  # never raises
    assert record.kind == kind
    EventLog(show_suspects=True).add({"kind": kind})  # a view folds it without raising


def test_fields_are_typed_and_defaults_stand_in_for_bad_values() -> None:
    ck = parse_event({"kind": "checkpoint", "phase": "committed", "step": "12", "bytes": "x",
                      "blocking_ms": 1, "time": 1.7e9})
    assert isinstance(ck, CheckpointRecord)
    assert (ck.phase, ck.step, ck.bytes, ck.blocking_ms, ck.time) == ("committed", 12, None,
                                                                       1.0, 1.7e9)
    st = parse_event({"kind": "straggler", "rank": None, "ratio": "slow"})
    assert isinstance(st, StragglerRecord)
    assert (st.rank, st.state, st.phase, st.ratio) == (-1, "suspect", "step", None)


def test_a_fault_built_by_the_schema_reads_back() -> None:
    ev = fault_event(1.7e9, what="hang", cause="c", rank=1, host="h", step=3, error="e",
                     generation=2, detect_s=0.5)
    rec = parse_event(dict(ev))
    assert isinstance(rec, FaultRecord)
    assert (rec.what, rec.rank, rec.host, rec.step, rec.generation, rec.detect_s) == (
        "hang", 1, "h", 3, 2, 0.5)
    assert rec.raw == ev


def test_nested_and_derived_fields() -> None:
    inj = parse_event({"kind": "fault_injected", "rank": 2, "step": 5,
                       "fault": {"kind": "slow", "factor": 2.5}})
    assert isinstance(inj, FaultInjectedRecord)
    assert (inj.fault_kind, inj.factor, inj.target_rank) == ("slow", 2.5, 2)
    good = parse_event({"kind": "goodput", "fraction": 0.5, "queued_s": 3, "note_s": "x"})
    assert isinstance(good, GoodputRecord) and good.parts == {"queued_s": 3.0}


def test_unknown_and_missing_kinds() -> None:
    rec = parse_event({"kind": "from_the_future", "rank": 1, "x": 2})
    assert type(rec) is EventRecord and rec.kind == "from_the_future" and rec.rank == 1
    assert parse_event({}).kind == "?"
    alert = EventLog().add({"kind": "from_the_future", "rank": 1, "x": 2})
    assert alert is not None and alert.text == "from_the_future: rank 1: x=2"


def test_shell_events_go_through_the_schema() -> None:
    assert tracker_event("disk full") == {"kind": "tracker", "error": "disk full"}
    alert = EventLog().add(dict(tracker_event("disk full")))
    assert alert is not None and alert.text == "tracker: disk full"
    assert EventLog().add(dict(state_event(1.7e9, "FAILED", "x"))).level == "error"


# ---------------------------------------------------------------- the cluster's log
def test_cluster_log_constructors_say_their_kind() -> None:
    built = [
        ce.worker_joined_event(slot="h#0", address="tcp://a", host="h"),
        ce.worker_left_event(slot="h#0", address="tcp://a", host="h", restarting=False),
        ce.worker_refused_event(address="tcp://a", host="h", reason="two workers"),
        ce.worker_slot_event("forgotten", slot="h#0", host="h", reason="gone"),
        ce.slot_lost_event(slot="h#0", host="h", reason="not back"),
        ce.job_line_event("preemption", "j1", "j preempted"),
        ce.job_line_event("scheduler", "j1", "held"),
        ce.job_line_event("resize", "j1", "j resized 2 -> 1 ranks"),
        ce.restored_event(jobs=2, live=1, epoch=3, state_dir="/s", seconds=0.1),
        ce.shutdown_event("j1"),
        ce.restart_event(addresses=("tcp://a",), reason="r", results={"tcp://a": "OK"}),
        ce.abort_event(job="j1", generation=0, addresses=["tcp://a"], reason="r",
                       results=None),
        ce.refused_event(job="j1", count=3, reason="unsealed"),
        ce.controller_error_event(job=None, event="Tick", error="boom"),
    ]
    assert {e["kind"] for e in built} == set(ce.CLUSTER_KINDS)
    for entry in built:
        parsed = ce.parse_cluster_event(entry)
        assert parsed.kind == entry["kind"] and parsed.text


def test_cluster_log_entries_read_by_attribute() -> None:
    e = ce.parse_cluster_event(dict(ce.worker_left_event(slot="h#0", address="tcp://a",
                                                         host="h", restarting=True)))
    assert (e.kind, e.what, e.job, e.reason, e.time) == ("worker", "left", None, "", None)
    assert e.text == "what=left, slot=h#0, address=tcp://a, host=h, restarting=True"
    r = ce.parse_cluster_event(ce.restored_event(jobs=2, live=1, epoch=3, state_dir="/s",
                                                 seconds=0.5))
    assert r.time is not None and r.text.startswith("jobs=2, live=1, epoch=3")
    j = ce.parse_cluster_event({"kind": "scheduler", "job": "j1", "reason": "why",
                                "time": "bad"})
    assert (j.job, j.text, j.time) == ("j1", "why", None)
    assert ce.parse_cluster_event({}).kind == ""
