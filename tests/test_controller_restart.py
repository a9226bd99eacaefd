"""The controller survives its own death: SIGKILL the scheduler of a supervised standalone
cluster (``nbtrain cluster``'s supervision) and every job comes back from the journal.

Real processes throughout: ``dask scheduler --preload nbtrain.engine.preload``, ``dask worker``
processes that Dask ends with their scheduler and the supervisor starts again, torch gloo
ranks, and a client that follows through the outage.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

import nbtrain
from nbtrain import JobState, Settings
from nbtrain.engine.remote import NOTICE_WITHIN_S
from nbtrain.engine.standalone import standalone_cluster
from tests.conftest import wait_for
from tests.recipes import Regression, assert_params_equal, single_process_params


def _connect(address: str, token_file: Path) -> nbtrain.Cluster:
    return nbtrain.connect(address, settings=Settings.load(token_file=str(token_file)))


def _faults(job: nbtrain.JobHandle) -> list[str]:
    return [f["what"] for f in job.faults]


@pytest.mark.slow
def test_scheduler_killed_while_checkpoints_commit_loses_no_committed_step(
        tmp_path: Path) -> None:
    """A checkpoint every step, so the kill lands inside a commit or next to one: the resumed
    job starts at or after the newest checkpoint committed on disk at the kill (none lost, a
    half-written one never used) and ends with the uninterrupted run's parameters."""
    from nbtrain.runtime.storage import CheckpointStore

    out = tmp_path / "out"
    out.mkdir()
    with standalone_cluster(2, logs=tmp_path / "logs", supervise=True) as cc, \
            _connect(cc.address, tmp_path / "tokens.json") as c:
        job = c.submit(Regression(out_dir=str(out), step_sleep=0.01), world_size=2,
                       steps=150, checkpoint=1, name="committing")
        wait_for(lambda: job.step >= 40, 180, "the job training")
        cc.kill_scheduler()
        on_disk = max(CheckpointStore(job.checkpoint_dir).committed(), default=0)
        assert on_disk >= 30, on_disk
        assert job.wait(300) is JobState.SUCCEEDED, job.reason
        [restart] = [f for f in job.faults if f["what"] == "controller"]
        assert restart["resume_step"] >= on_disk, (restart, on_disk)
        resumed = [e for e in job.events if e["kind"] == "rank_started" and e["rank"] == 0
                   and e["generation"] == job.generation]
        assert resumed and int(resumed[0]["start_step"]) == restart["resume_step"]
        # One count of lost steps in the goodput (continued from the journal's) and the
        # restart's fault, whichever checkpoint the ranks restored (the unit tests in
        # test_goodput.py force each case).
        assert job.goodput()["lost_steps"] == restart["lost_steps"], (job.goodput(), restart)
        assert_params_equal(out, single_process_params(150))


@pytest.mark.slow
def test_a_training_job_resumes_exactly_and_the_queue_held_jobs_and_ownership_survive(
        tmp_path: Path) -> None:
    """A full cluster: one job training, three queued behind it, one held. After the kill the
    training job resumes from its last checkpoint and ends with the uninterrupted run's
    parameters, charged no restart; the queued ones start in their order, the held one stays
    held until its owner resumes it; the owner steers, a stranger still cannot."""
    out = tmp_path / "out"
    out.mkdir()
    with standalone_cluster(2, logs=tmp_path / "logs", supervise=True) as cc, \
            _connect(cc.address, tmp_path / "tokens.json") as c:
        running = c.submit(Regression(out_dir=str(out), step_sleep=0.02), world_size=2,
                           steps=300, checkpoint=10, name="durable")
        queued = [c.submit(Regression(), world_size=2, steps=20, checkpoint=None,
                           name=f"queued-{i}") for i in range(3)]
        held = c.submit(Regression(), world_size=2, steps=20, checkpoint=None, name="held")
        held.preempt()
        wait_for(lambda: running.step >= 40 and held.status is JobState.PREEMPTED, 180,
                 "one job training, three queued, one held")
        killed, down_from = time.time(), time.monotonic()
        # Down longer than a follow call, so the handles surely see the outage.
        cc.kill_scheduler(down_s=2 * NOTICE_WITHIN_S)
        wait_for(lambda: running.unreachable_since is not None, 30, "the handles noticing")
        assert "controller unreachable since" in running.reason
        assert "controller unreachable" in repr(running)
        wait_for(lambda: running.unreachable_since is None and running.step >= 60, 180,
                 "the running job resumed after the restart")
        [started] = [t for t, name, what in cc.history
                     if name == cc.scheduler.name and what == "started" and t > down_from]
        assert started >= down_from + 2 * NOTICE_WITHIN_S, "held down for down_s"
        with _connect(cc.address, tmp_path / "stranger.json") as stranger:
            theirs = stranger.job("durable")
            assert theirs.id == running.id
            with pytest.raises(PermissionError):
                theirs.stop()
        assert [j.status for j in queued] == [JobState.QUEUED] * 3
        assert held.status is JobState.PREEMPTED
        assert running.wait(300) is JobState.SUCCEEDED, running.reason
        [restart] = [f for f in running.faults if f["what"] == "controller"]
        assert restart["resume_step"] >= 40 - 10 and restart["time"] >= killed - 1
        assert running.restarts == 0, "a controller restart is charged to no restart budget"
        # The goodput went on from the journal: it spans the job's whole life, the outage
        # included (as recovery), not just the time since the restart.
        snap, goodput = running.snapshot(), running.goodput()
        assert snap.ended is not None
        assert goodput["wall_s"] == pytest.approx(snap.ended - snap.submitted, abs=1.0)
        assert goodput["recovery_s"] >= 2 * NOTICE_WITHIN_S, goodput
        assert goodput["lost_steps"] == restart["lost_steps"], (goodput, restart)
        assert running.generation >= 1, "the resumed generation is numbered above the old one"
        assert_params_equal(out, single_process_params(300))
        for job in queued:
            assert job.wait(300) is JobState.SUCCEEDED, job.reason
        starts = [j.started_at for j in queued]
        assert all(s is not None for s in starts) and starts == sorted(starts), starts  # type: ignore[type-var]
        assert held.status is JobState.PREEMPTED
        held.resume()
        assert held.wait(300) is JobState.SUCCEEDED, held.reason


def test_an_error_inside_the_controller_fails_only_its_job(
        free_cluster: nbtrain.Cluster) -> None:
    """A rank sends step rows the machine cannot read: that job ends FAILED with the
    controller's traceback as its cause; the other job, and the controller's clock, go on."""
    from tests.recipes import bad_rows_train

    bad = free_cluster.submit(bad_rows_train, world_size=1, name="bad-rows")
    good = free_cluster.submit(Regression(), world_size=1, steps=60, checkpoint=None,
                               name="good")
    assert bad.wait(120) is JobState.FAILED
    assert "nbtrain controller error" in bad.reason and "ValueError" in bad.reason
    assert bad.error is not None and "Traceback" in bad.error
    assert good.wait(120) is JobState.SUCCEEDED, good.reason
    log = free_cluster.snapshot()["log"]
    assert any(e.get("kind") == "controller_error" and e.get("job") == bad.id for e in log)


@pytest.mark.slow
def test_the_readme_plain_dask_recipe_survives_a_scheduler_kill(tmp_path: Path) -> None:
    """The README's recipe for plain ``dask scheduler`` / ``dask worker`` commands: each in a
    shell restart loop, the controller preloaded on a state directory. SIGKILL the scheduler:
    the loops start it and the workers again, and the job ends exactly."""
    import os
    import signal
    import subprocess

    from nbtrain.engine.standalone import BIN, free_port

    port = free_port()
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}",
           "NBTRAIN_STATE_DIR": str(tmp_path / "state"), "NBTRAIN_OPERATOR_TOKEN": "op"}
    loops = {
        "scheduler": f"while true; do dask scheduler --host 127.0.0.1 --port {port} "
                     "--no-dashboard --preload nbtrain.engine.preload; sleep 1; done",
        "workers": f"while true; do dask worker tcp://127.0.0.1:{port} --nworkers 2 "
                   "--nthreads 1 --no-dashboard; sleep 1; done",
    }
    logs = {k: open(tmp_path / f"{k}.log", "wb") for k in loops}  # noqa: SIM115
    procs = {k: subprocess.Popen(["bash", "-c", cmd], env=env, stdout=logs[k],
                                 stderr=subprocess.STDOUT, start_new_session=True)
             for k, cmd in loops.items()}
    try:
        c = _connect(f"tcp://127.0.0.1:{port}", tmp_path / "tokens.json") if _up(port) \
            else None
        assert c is not None, "the scheduler did not start"
        with c:
            wait_for(lambda: len(c.free_slots) == 2, 120, "two slots")
            job = c.submit(Regression(out_dir=str(out), step_sleep=0.02), world_size=2,
                           steps=150, checkpoint=10, name="plain")
            wait_for(lambda: job.step >= 40, 180, "the job training")
            children = subprocess.run(["pgrep", "-P", str(procs["scheduler"].pid)],
                                      capture_output=True, text=True).stdout.split()
            assert len(children) == 1, children
            os.kill(int(children[0]), signal.SIGKILL)
            # (The loop restarts it within seconds, which the handle may not notice: an
            # outage shorter than a follow call; the job's faults record the restart.)
            assert job.wait(300) is JobState.SUCCEEDED, job.reason
            assert "controller" in _faults(job)
            assert_params_equal(out, single_process_params(150))
    finally:
        for proc in procs.values():
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        for f in logs.values():
            f.close()


def _up(port: int, timeout: float = 60.0) -> bool:
    import socket

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return True
        time.sleep(0.1)
    return False


@pytest.mark.slow
def test_kills_in_a_preemption_grace_period_and_right_after_a_shrink(tmp_path: Path) -> None:
    """SIGKILL while a victim's ranks checkpoint to release their slots for a priority job,
    and again right after an elastic job was asked to shrink: both jobs end exactly, the
    priority one first, the elastic one at the size its user asked for."""
    outs = {k: tmp_path / k for k in ("low", "elastic")}
    for o in outs.values():
        o.mkdir()
    with standalone_cluster(2, logs=tmp_path / "logs", supervise=True) as cc, \
            _connect(cc.address, tmp_path / "tokens.json") as c:
        low = c.submit(Regression(out_dir=str(outs["low"]), step_sleep=0.1), world_size=2,
                       steps=40, checkpoint=None, name="low")
        wait_for(lambda: low.step >= 5, 180, "the low job training")
        high = c.submit(Regression(), world_size=2, steps=10, checkpoint=None, priority=5,
                        name="high")
        cc.kill_scheduler()  # the victim's ranks are at their agreed step or checkpointing
        assert high.wait(300) is JobState.SUCCEEDED, high.reason
        assert low.wait(300) is JobState.SUCCEEDED, low.reason
        assert high.ended_at is not None and low.ended_at is not None
        assert high.ended_at < low.ended_at
        assert_params_equal(outs["low"], single_process_params(40))

        elastic = c.submit(Regression(out_dir=str(outs["elastic"]), step_sleep=0.02),
                           world_size=2, min_size=1, steps=120, checkpoint=10,
                           name="elastic")
        wait_for(lambda: elastic.step >= 20, 180, "the elastic job training")
        elastic.resize(1)
        cc.kill_scheduler()
        assert elastic.wait(300) is JobState.SUCCEEDED, elastic.reason
        assert elastic.target_size == 1 and elastic.size_bounds == (1, 2)
        assert_params_equal(outs["elastic"], single_process_params(120), ranks=(0,))



@pytest.mark.slow
def test_a_stop_in_progress_survives_a_scheduler_kill(tmp_path: Path) -> None:
    """The user's stop is journaled with the job: a job still stopping when the scheduler
    dies (its rank 1 hung, so it cannot end) ends CANCELLED after the restart instead of
    training again."""
    settings = Settings.load(token_file=str(tmp_path / "tokens.json"), hang_floor_s=3600.0)
    with standalone_cluster(2, logs=tmp_path / "logs", supervise=True) as cc, \
            nbtrain.connect(cc.address, settings=settings) as c:
        job = c.submit(Regression(step_sleep=0.01), world_size=2, steps=10**6, checkpoint=5,
                       name="stopping", faults=[nbtrain.Fault("hang", rank=1, step=12)])
        wait_for(lambda: any(e["kind"] == "fault_injected" for e in job.events), 180,
                 "rank 1 hanging as step 12 starts")
        job.stop()
        wait_for(lambda: job.status is JobState.STOPPING, 30, "the stop recorded")
        cc.kill_scheduler()
        assert job.wait(300) is JobState.CANCELLED, job.reason
        head, _, rest = job.reason.partition(": ")
        assert head in ("stopped by user at step 5", "stopped by user at step 10"), job.reason
        assert rest.startswith("the controller restarted while it was stopping, so it ends "
                               "at its newest committed checkpoint"), job.reason
        assert job.generation == 0  # no new generation was started


def test_a_controller_on_thousands_of_ended_jobs_keeps_the_newest_in_memory(
        tmp_path: Path) -> None:
    """Replay is bounded by ``jobs_kept``, not by the history: 3,000 ended jobs in the
    journal, 50 of them in memory after the start, any older one still found by name."""
    from nbtrain.core.job import JobSpec
    from nbtrain.core.lifecycle_types import JobSubmission
    from nbtrain.engine.store import ControllerStore
    from nbtrain.engine.wire import submission_to_wire

    state = tmp_path / "state"
    store = ControllerStore(state)
    for i in range(3_000):
        jid = f"{i:08x}"
        spec = JobSpec(job_id=jid, name=f"old-{i}", world_size=1, steps=10)
        status = {"job_id": jid, "name": spec.name, "state": "SUCCEEDED", "step": 10,
                  "reason": "completed", "owner": "someone", "faults": []}
        store.add_job(job_id=jid, name=spec.name,
                      submission=submission_to_wire(JobSubmission(spec=spec)), recipe=b"",
                      settings={}, checkpoint_url=str(tmp_path / jid), restore=None,
                      token_hash="0" * 64, trackers=None, status=status)
        store.put_status(jid, status, None)
        store.add_history("events", jid, 0, [{"kind": "state", "state": "SUCCEEDED",
                                              "reason": "completed", "time": float(i)}])
    store.close(60)
    settings = Settings.load(state_dir=str(state), jobs_kept=50, token_file="")
    with nbtrain.connect(n_workers=1, gpus=False, settings=settings) as c:
        listed = c.jobs
        assert [j.name for j in listed] == [f"old-{i}" for i in range(2_950, 3_000)]
        restored = [e for e in c.snapshot()["log"] if e["kind"] == "restored"]
        assert restored and restored[-1]["jobs"] == 50 and restored[-1]["live"] == 0
        followed = c.rpc("nbtrain_follow", cursors={f"{9:08x}": [0, 0, 0]}, timeout=0)
        update = followed["jobs"][f"{9:08x}"]
        assert "gone" not in update and update["status"]["state"] == "SUCCEEDED"
        assert [e["state"] for e in update["events"]] == ["SUCCEEDED"]
        old = c.job("old-7")
        assert old.status is JobState.SUCCEEDED and old.id == f"{7:08x}"
        assert [e["state"] for e in old.events if e["kind"] == "state"] == ["SUCCEEDED"]


def test_the_stimulus_log_replays_into_the_same_decisions() -> None:
    """The events the live controller fed its machine, replayed into a fresh machine with the
    same settings, give the same job statuses: the machine's decisions are a function of
    them alone."""
    from nbtrain.core.lifecycle import JobMachine

    with nbtrain.connect(n_workers=2, gpus=False, settings=Settings.load(token_file="")) as c:
        job = c.submit(Regression(), world_size=2, steps=30, checkpoint=10, name="replayed")
        assert job.wait(120) is JobState.SUCCEEDED, job.reason
        assert c._local is not None
        ctl = c._local.scheduler.plugins["nbtrain"]
        stimuli = list(ctl.stimuli)
        assert len(stimuli) < ctl.stimuli.maxlen, "the log must hold the whole run here"
        fresh = JobMachine(ctl.machine.config, ctl.machine.sched_config)
        for event in stimuli:
            fresh.handle(event)
        assert fresh.status(job.id) == ctl.machine.status(job.id)
