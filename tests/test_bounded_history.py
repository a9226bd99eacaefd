"""History outlives the scheduler and memory stays bounded: a real journal (SQLite in a
temporary state directory) fed like a long 64-rank job, the controller's job log and a job
handle keeping only their windows, and a run read back with no cluster (``load_run``)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

import nbtrain
from nbtrain.core.job import JobSpec
from nbtrain.core.lifecycle_types import JobSubmission
from nbtrain.engine.job import JobHandle
from nbtrain.engine.joblog import JobLog
from nbtrain.engine.store import ControllerStore
from nbtrain.engine.wire import submission_to_wire

RANKS = 64


def _rows(step: int) -> list[list[Any]]:
    return [[step, 1e9 + step, 0.01, 0.0, 0.008, 0.001, 0.001, {"loss": 1.0 / step}]]


def _store_with_job(tmp: Path, job_id: str = "j1", name: str = "long") -> ControllerStore:
    store = ControllerStore(tmp / "state")
    spec = JobSpec(job_id=job_id, name=name, world_size=RANKS, steps=None)
    store.add_job(job_id=job_id, name=name, submission=submission_to_wire(
        JobSubmission(spec=spec)), recipe=b"", settings={}, checkpoint_url=str(tmp / "ck"),
        restore=None, token_hash="0" * 64, trackers=None, status={"state": "RUNNING"})
    return store


def test_the_job_log_keeps_a_window_and_the_journal_keeps_everything(tmp_path: Path) -> None:
    store = _store_with_job(tmp_path)
    keep = 2_000
    log = JobLog(rows_kept=keep, sink=lambda t, at, items: store.add_history(t, "j1", at,
                                                                             items))
    steps = 400  # 64 ranks x 400 steps = 25,600 rows, >12x the window
    for step in range(1, steps + 1):
        for rank in range(RANKS):
            log.add_rows(0, rank, _rows(step))
        assert len(log.rows.items) <= keep + keep // 8
    store.barrier().result(60)
    assert log.rows.end == RANKS * steps
    assert log.rows.base >= RANKS * steps - keep - keep // 8
    at, old = store.history("rows", "j1", 0, 100)
    assert at == 0 and [r[:3] for r in old[:2]] == [[0, 0, 1], [0, 1, 1]]
    at, tail = store.history("rows", "j1", log.rows.base, 10)
    assert at == log.rows.base and [tuple(r) for r in tail] == log.rows.items[:10]
    assert store.ends("j1")["rows"] == RANKS * steps
    store.close()


def test_a_handle_keeps_its_window_and_counts_every_row() -> None:
    handle = JobHandle(JobSpec(job_id="h1", name="h", world_size=RANKS, steps=None))
    keep = handle._rows.keep
    pos = 0
    for step in range(1, 1_200 + 1):  # 76,800 rows > the handle's 50,000
        rows = [[0, r, *_rows(step)[0]] for r in range(RANKS)]
        handle.follow_update({"rows_at": pos, "rows": rows, "rows_end": pos + len(rows),
                       "events_end": 0, "status": {"state": "RUNNING"}})
        pos += len(rows)
        assert len(handle._rows.items) <= keep + keep // 8
    assert handle._rows.end == pos == RANKS * 1_200
    at, rows = handle._rows.since(pos - 3, 10)
    assert at == pos - 3 and len(rows) == 3
    assert handle.rows_since(pos - 3) == (rows, pos)


def test_a_handle_drops_what_a_restarted_controller_lost() -> None:
    handle = JobHandle(JobSpec(job_id="h2", name="h", world_size=2, steps=None))
    rows = [[0, r, *_rows(s)[0]] for s in range(1, 11) for r in range(2)]
    handle.follow_update({"rows_at": 0, "rows": rows, "rows_end": 20, "events_end": 0,
                   "status": {"state": "RUNNING"}})
    # The restarted controller journaled 16 rows; what it writes next lands at 16.
    handle.follow_update({"rows_at": 16, "rows": [], "rows_end": 16, "events_end": 0,
                   "status": {"state": "RUNNING"}})
    assert handle._rows.end == 16
    handle.follow_update({"rows_at": 16, "rows": rows[16:18], "rows_end": 18, "events_end": 0,
                   "status": {"state": "RUNNING"}})
    assert handle._rows.end == 18 and handle._rows.items[-1] == tuple(rows[17])


def test_a_run_reads_back_without_a_cluster(tmp_path: Path) -> None:
    store = _store_with_job(tmp_path, "r1", "readback")
    log = JobLog(rows_kept=10, sink=lambda t, at, items: store.add_history(t, "r1", at, items))
    for step in range(1, 51):
        log.add_rows(0, 0, _rows(step))
    log.add_event({"kind": "state", "state": "SUCCEEDED", "reason": "done", "time": 1.0})
    log.add_output({"rank": 0, "gen": 0, "time": 1.0, "lines": [("stdout", "hello")]})
    store.put_status("r1", {"state": "SUCCEEDED", "reason": "completed", "step": 50,
                            "faults": [], "ended": time.time()}, None)
    store.close()
    run = nbtrain.load_run(tmp_path / "state", "readback")
    assert run.state == "SUCCEEDED" and run.spec.world_size == RANKS
    assert len(run.metrics) == 50 and run.metrics["loss"].iloc[-1] == pytest.approx(1 / 50)
    assert run.events[-1]["state"] == "SUCCEEDED"
    assert run.logs() and "hello" in run.logs()[0]
    with pytest.raises(LookupError, match="readback"):
        nbtrain.load_run(tmp_path / "state", "nope")
    with pytest.raises(FileNotFoundError, match="no nbtrain controller state"):
        nbtrain.load_run(tmp_path / "elsewhere", "readback")


def test_metrics_read_the_journal_for_rows_both_windows_dropped() -> None:
    """A live embedded cluster whose controller keeps 100 rows per job in memory and whose
    handles keep 60: the whole run still comes back, from the journal."""
    from nbtrain import JobState, Settings
    from tests.recipes import Regression

    settings = Settings.load(rows_kept=100, handle_rows_kept=60, token_file="")
    with nbtrain.connect(n_workers=2, gpus=False, settings=settings) as c:
        job = c.submit(Regression(), world_size=2, steps=200, checkpoint=None)
        assert job.wait(180) is JobState.SUCCEEDED, job.reason
        assert len(job._rows.items) <= 60 + 60 // 8 and job.row_count == 400
        m = job.metrics
        assert len(m) == 400
        assert sorted(m[m["rank"] == 0]["step"]) == list(range(1, 201))
        assert "loss" in m.columns and m["loss"].notna().all()
        rows, end = job.rows_since(0)
        assert end == 400 and len(rows) == 400


def test_a_failing_journal_write_never_leaves_a_waiter_hanging(tmp_path: Path) -> None:
    """A batch the database refuses is counted and logged; the barriers queued with it are
    answered and the writer thread lives on for the next batch."""
    store = _store_with_job(tmp_path, "w1", "writes")
    store.barrier().result(30)
    store._put(lambda: ("INSERT INTO no_such_table VALUES (1)", ()))
    store.barrier().result(30)  # would wait forever if the failure lost the barrier
    assert store.write_errors == 1 and "no_such_table" in store.last_error
    store.put_status("w1", {"state": "SUCCEEDED", "reason": "done"}, None)
    store.barrier().result(30)
    assert store.job("w1") is not None and store.job("w1").state == "SUCCEEDED"  # type: ignore[union-attr]
    store.close()


def test_a_rejected_submission_leaves_nothing_in_the_journal(tmp_path: Path) -> None:
    store = _store_with_job(tmp_path, "r9", "rejected")
    store.add_history("events", "r9", 0, [{"kind": "state", "state": "QUEUED", "time": 1.0}])
    store.drop_job("r9")
    store.barrier().result(30)
    assert store.job("r9") is None and store.ends("r9") == {"events": 0, "rows": 0,
                                                             "output": 0}
    store.close()


def test_slots_of_departed_hosts_are_forgotten_and_the_jobs_go_on() -> None:
    """Hosts that come and go under new names (autoscaled pods): the book of slots and the
    gang scheduler's topology keep what was recently there, a running job keeps its slots
    through every forgetting, and new jobs still start on new hosts."""
    from nbtrain.core.lifecycle_types import Publish, WorkerLeft
    from tests.test_lifecycle import Harness

    h = Harness(workers=0, slot_forget_s=60.0)
    stay = [h.join(host="stay"), h.join(host="stay")]
    h.submit("long", world_size=2)
    [launch] = h.launches("long")
    assert set(launch.addresses) == set(stay)
    h.steps("long", 0, 5)
    pods_seen = 0
    for i in range(120):  # a new pod every 10 s for 20 minutes, each gone after 10 s
        address = h.join(host=f"pod-{i}")
        pods_seen += 1
        h.advance(10.0)
        h.feed(WorkerLeft, address)
        h.advance(1.5)
        in_book = len(h.m.inventory.records())
        assert in_book <= 2 + 60 / 11.5 + 2, in_book  # "stay"'s two and the last minute's
        sched_slots = set(h.m.sched.owner_map())  # type: ignore[union-attr]
        assert sched_slots == {r.slot for r in h.m.inventory.records()}
    assert h.state("long") == "RUNNING"
    assert h.m.sched.owner_map()["stay#0"] == "long"  # type: ignore[union-attr]
    forgotten = [c.event for c in h.of(Publish)
                 if c.job_id is None and c.event.get("what") == "forgotten"]
    assert len(forgotten) >= pods_seen - 8  # all but the last minute's
    assert "slot_forget_s" in forgotten[0]["reason"]
    # A job that needs a new host still starts there.
    pod = [h.join(host="late"), h.join(host="late")]
    h.submit("late", world_size=2)
    assert set(h.launches("late")[-1].addresses) == set(pod)
