"""A handle's typed status (core.jobrecord.JobStatus.from_dict): what the controller said,
parsed once; the spec stands in for what it did not say or said wrong."""

from __future__ import annotations

from nbtrain.core.job import JobSpec
from nbtrain.core.jobrecord import JobStatus
from nbtrain.engine.job import JobHandle


def _spec() -> JobSpec:
    return JobSpec(job_id="j1", name="tiny", world_size=2, steps=10)


def test_a_full_status_round_trips() -> None:
    blank = JobStatus.before_news(_spec(), submitted=1.0)
    full = JobStatus.from_dict({**blank.to_dict(), "state": "RUNNING", "step": 4,
                                "slots": ["tcp://a", "tcp://b"], "size": 2,
                                "started": 2.0, "faults": [{"what": "hang"}]}, blank)
    assert (full.state, full.step, full.slots, full.size, full.started) == (
        "RUNNING", 4, ("tcp://a", "tcp://b"), 2, 2.0)
    assert JobStatus.from_dict(full.to_dict(), blank) == full


def test_a_bad_record_keeps_the_fallback_field_by_field() -> None:
    blank = JobStatus.before_news(_spec(), submitted=1.0)
    got = JobStatus.from_dict({"state": "EXPLODED", "step": "many", "generation": None,
                               "slots": 7, "goodput": "high", "error": None, "restarts": "2",
                               "reason": "why", "unknown_field": 1}, blank)
    assert got.state == "QUEUED" and got.step == 0 and got.generation == -1
    assert got.slots == () and got.goodput == {} and got.error is None
    assert (got.restarts, got.reason) == (2, "why")


def test_the_handle_reads_its_typed_status() -> None:
    spec = _spec()
    handle = JobHandle(spec, status={"state": "PREEMPTED", "step": 3, "owner": "ana",
                                     "hidden": "not yours", "target_size": 2})
    assert handle.status.value == "PREEMPTED" and handle.step == 3 and handle.owner == "ana"
    assert handle.hidden == "not yours" and handle.snapshot().target_size == 2
    handle.follow_update({"status": {"state": "SUCCEEDED", "step": 10}})
    assert handle.done and handle.step == 10 and handle.hidden == ""
    assert handle.owner == ""  # a new status replaces the old one whole
    bare = JobHandle(spec)
    assert (bare.status.value, bare.generation, bare.size, bare.target_size) == (
        "QUEUED", -1, 0, 2)
    assert bare.reason == "waiting for the scheduler"
