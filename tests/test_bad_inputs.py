"""The shared-cluster issue's bad-input suite: 80-odd bad inputs through the public API, the
handlers (as a client of another version would send them) and the magics: names and paths,
NaN and infinity, wrong types, negative and huge values, unicode, wrong-owner calls and
forged tokens. Each is refused where it enters with the value and the fix; nothing of it
reaches the cluster, no slot is left held, the controller keeps serving and the next normal
job runs. (Forged rank events and rendezvous: ``test_read_ownership``; settings:
``test_settings``.)"""

from __future__ import annotations

from typing import Any

import pytest

import nbtrain
from nbtrain import JobState
from nbtrain.core.job import NAME_MAX, JobSpec, check_name, default_name
from tests.recipes import Regression, regression_train

BAD_NAMES = ["/etc/x", "..", ".", "a/b", "a\\b", "x" * 300, "", " lead", "tab\there",
             "nul\x00", "ünï", "-flag", 7, None]


@pytest.mark.parametrize("name", BAD_NAMES, ids=repr)
def test_a_job_name_that_could_leave_its_directory_is_refused(name: Any) -> None:
    with pytest.raises(ValueError, match="is not allowed: use letters, digits and"):
        check_name(name)
    with pytest.raises(ValueError, match="name='mlp-lr3'"):
        JobSpec(job_id="j", name=name, world_size=1, steps=1)


def test_good_and_default_names() -> None:
    for name in ("mlp", "mlp-lr3", "run_2.final", "tp+fsdp", "lr=3e-4,bs@64", "A" * NAME_MAX):
        assert check_name(name) == name
    assert check_name(default_name("<lambda>", "abcd1234")) == "lambda-abcd"
    assert check_name(default_name("../..", "abcd1234")) == "job-abcd"
    assert len(default_name("x" * 500, "abcd1234")) <= NAME_MAX


@pytest.mark.parametrize("field, value, words", [
    ("priority", float("nan"), "priority must be an integer"),
    ("priority", 1.5, "priority must be an integer"),
    ("priority", True, "priority must be an integer"),
    ("restart_window_s", float("nan"), "finite number of seconds"),
    ("restart_window_s", float("inf"), "finite number of seconds"),
    ("restart_window_s", "1h", "finite number of seconds"),
    ("world_size", True, "world_size must be a positive integer"),
])
def test_numbers_that_break_the_queue_or_the_budget_are_refused(
        field: str, value: Any, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        JobSpec(**{"job_id": "j", "name": "ok", "world_size": 1, "steps": 1, field: value})


def test_bad_submits_leave_nothing_behind_and_the_next_job_runs(
        free_cluster: nbtrain.Cluster) -> None:
    before = [j.id for j in free_cluster.jobs]
    for kwargs in ({"name": "/etc/x"}, {"name": ".."}, {"name": "x" * 300},
                   {"priority": float("nan")}, {"restart_window_s": float("nan")},
                   {"world_size": True}):
        with pytest.raises(ValueError):
            free_cluster.submit(Regression(), **{"world_size": 1, "steps": 5, **kwargs})
    assert [j.id for j in free_cluster.jobs] == before
    assert len(free_cluster.free_slots) == 2
    unnamed = free_cluster.submit(lambda ctx, config: regression_train(ctx, config),
                                  world_size=1, steps=5)
    assert unnamed.name.startswith("lambda-")
    assert unnamed.wait(120) is JobState.SUCCEEDED, unnamed.reason


@pytest.mark.parametrize("field, value, words", [
    ("name", "../../escape", "is not allowed"), ("name", "/etc/x", "is not allowed"),
    ("priority", float("nan"), "priority must be an integer"),
    ("restart_window_s", float("nan"), "finite number of seconds")])
def test_the_controller_checks_again_what_an_older_client_would_send(
        free_cluster: nbtrain.Cluster, tmp_path: Any, field: str, value: Any,
        words: str) -> None:
    """A client of another version (or none at all) sends the submission by hand: the
    controller refuses it with the same words, and keeps serving."""
    from nbtrain.core.lifecycle_types import JobSubmission
    from nbtrain.engine.wire import submission_to_wire

    wire = submission_to_wire(JobSubmission(spec=JobSpec(job_id="forged01", name="ok",
                                                         world_size=1, steps=5)))
    wire["spec"][field] = value
    before = [j.id for j in free_cluster.jobs]
    with pytest.raises(ValueError, match=words):
        free_cluster.rpc("nbtrain_submit", job=wire, recipe=b"", settings={},
                         checkpoint_url=str(tmp_path / "ck"), restore=None, token="",
                         trackers=None)
    assert [j.id for j in free_cluster.jobs] == before
    job = free_cluster.submit(Regression(), world_size=1, steps=5, name="after-forged")
    assert job.wait(120) is JobState.SUCCEEDED, job.reason


def test_forged_tokens_are_refused_and_the_owner_still_steers(
        free_cluster: nbtrain.Cluster) -> None:
    job = free_cluster.submit(Regression(step_sleep=0.02), world_size=1, steps=10**6,
                              name="owned")
    forged = ["", job.token[:-1], job.token + "x", job.token.upper(), 12345, None,
              ["list"], {"token": job.token}]
    for token in forged:
        with pytest.raises(PermissionError, match="belongs to"):
            free_cluster.rpc("nbtrain_request", job_id=job.id, what="stop", token=token)
    assert not job.status.terminal
    job.stop()
    assert job.wait(120) is JobState.CANCELLED


def test_detector_settings_that_would_allocate_without_bound_are_refused(
        free_cluster: nbtrain.Cluster) -> None:
    job = free_cluster.submit(Regression(step_sleep=0.02), world_size=1, steps=10**6,
                              name="tuned")
    for change in ({"noise_steps": 10**9}, {"window": 10**6}, {"ratio": float("nan")}):
        with pytest.raises(ValueError, match="invalid StragglerSettings"):
            job.tune_stragglers(**change)
        with pytest.raises(ValueError, match="invalid StragglerSettings"):  # by hand, too
            free_cluster.rpc("nbtrain_request", job_id=job.id, what="stragglers",
                             arg=change, token=job.token)
    for arg in ({"bogus": 1}, [1, 2], "window"):  # not settings at all
        with pytest.raises(ValueError):
            free_cluster.rpc("nbtrain_request", job_id=job.id, what="stragglers", arg=arg,
                             token=job.token)
    job.tune_stragglers(window=10)  # a sane change still goes through
    assert not job.status.terminal
    job.stop()
    assert job.wait(120) is JobState.CANCELLED


@pytest.mark.parametrize("call, words", [
    ({"op": "nbtrain_follow", "cursors": {f"j{i}": [0, 0] for i in range(5_000)}},
     "at most 1,000 jobs"),
    ({"op": "nbtrain_follow", "cursors": {"x": "everything"}}, "must be 2 or 3 integers"),
    ({"op": "nbtrain_follow", "cursors": {"x": [0, 0, 0, 0, 0]}}, "must be 2 or 3 integers"),
    ({"op": "nbtrain_follow", "cursors": ["x"]}, "cursors must map job ids"),
    ({"op": "nbtrain_job", "key": "x" * 10_000}, "a string of 1 to 200 characters"),
    ({"op": "nbtrain_job", "key": 42}, "a string of 1 to 200 characters"),
    ({"op": "nbtrain_request", "job_id": "nosuchjob", "what": "stop"}, "no job 'nosuchjob'"),
    ({"op": "nbtrain_result", "job_id": "nosuchjob"}, "no job 'nosuchjob'"),
    ({"op": "nbtrain_rendezvous", "job_id": "nosuchjob", "generation": 0, "rank": 0},
     "no job 'nosuchjob'"),
])
def test_malformed_calls_from_any_client_are_refused_and_the_controller_serves_on(
        free_cluster: nbtrain.Cluster, call: dict[str, Any], words: str) -> None:
    """What a client of another version (or a hostile one) could send the handlers: a clear
    refusal, never a controller error, an allocation without bound or a hang."""
    op = call.pop("op")
    with pytest.raises((ValueError, TypeError, LookupError), match=words):
        free_cluster.rpc(op, **call)
    assert free_cluster.snapshot()["slots"]  # still serving


@pytest.mark.parametrize("settings, words", [
    ({"event_batch_max": 10**9}, "event_batch_max must be an integer from 1 to 100,000"),
    ({"checkpoint_commit_timeout_s": float("nan")}, "must be a finite number of seconds"),
    ({"checkpoint_keep": -1}, "checkpoint_keep must be an integer from 1"),
    ({"quiet_workers": "yes"}, "quiet_workers must be True or False"),
    ({"checkpoint_root": "x" * (2 << 20)}, "bytes without its recipe, more than 1,048,576"),
])
def test_job_settings_an_older_client_sends_are_checked_by_the_controller(
        free_cluster: nbtrain.Cluster, tmp_path: Any, settings: dict[str, Any],
        words: str) -> None:
    from nbtrain.core.lifecycle_types import JobSubmission
    from nbtrain.engine.wire import submission_to_wire

    wire = submission_to_wire(JobSubmission(spec=JobSpec(job_id="forged02", name="ok",
                                                         world_size=1, steps=5)))
    before = [j.id for j in free_cluster.jobs]
    with pytest.raises(ValueError, match=words):
        free_cluster.rpc("nbtrain_submit", job=wire, recipe=b"", settings=settings,
                         checkpoint_url=str(tmp_path / "ck"), restore=None, token="",
                         trackers=None)
    assert [j.id for j in free_cluster.jobs] == before
    assert len(free_cluster.free_slots) == 2


def test_bad_control_calls_are_refused_in_the_client_and_by_the_controller(
        free_cluster: nbtrain.Cluster) -> None:
    job = free_cluster.submit(Regression(step_sleep=0.02), world_size=1, steps=10**6,
                              name="controlled", min_size=1, max_size=2)
    try:
        for n in (True, 2.5, "2", None):
            with pytest.raises(TypeError, match="must be an integer"):
                job.resize(n)  # type: ignore[arg-type]
            with pytest.raises(TypeError, match="must be an integer"):  # by hand, too
                free_cluster.rpc("nbtrain_request", job_id=job.id, what="resize",
                                 arg={"size": n}, token=job.token)
        with pytest.raises(ValueError, match=r"may run with 1 to 2 ranks"):
            job.resize(3)
        with pytest.raises(ValueError, match="unknown request 'explode'"):
            free_cluster.rpc("nbtrain_request", job_id=job.id, what="explode",
                             token=job.token)
        with pytest.raises((ValueError, TypeError)):
            free_cluster.rpc("nbtrain_request", job_id=job.id, what="inject",
                             arg={"kind": "meteor", "rank": -3}, token=job.token)
        with pytest.raises(ValueError):
            job.inject("meteor", rank=0)
        assert not job.status.terminal and not job.faults
    finally:
        job.stop()
        assert job.wait(120) is JobState.CANCELLED
    assert len(free_cluster.free_slots) == 2


def test_a_strangers_steering_is_refused_with_the_owner_and_the_fix(
        free_cluster: nbtrain.Cluster) -> None:
    job = free_cluster.submit(Regression(step_sleep=0.02), world_size=1, steps=10**6,
                              name="not-yours", min_size=1, max_size=2)
    stranger = nbtrain.connect(free_cluster.address,
                               settings=nbtrain.Settings.load(token_file=""), operator_token="")
    try:
        theirs = stranger.job("not-yours")
        for act in (theirs.stop, theirs.preempt, theirs.checkpoint,
                    lambda: theirs.resize(2), lambda: theirs.tune_stragglers(window=10),
                    lambda: theirs.inject("kill", rank=0)):
            with pytest.raises(PermissionError, match=r"job not-yours \(.*\) belongs to"):
                act()
        assert not job.status.terminal and job.size == 1 and not job.faults
    finally:
        stranger.close()
        job.stop()
        assert job.wait(120) is JobState.CANCELLED


def test_bad_input_through_the_magics_is_one_line_and_nothing_runs(
        free_cluster: nbtrain.Cluster, capsys: pytest.CaptureFixture[str]) -> None:
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "nbtrain")
    shell.user_ns["cl"] = free_cluster
    before = [j.id for j in free_cluster.jobs]
    try:
        for line, words in (("status ../../etc --cluster cl", "no job with id or name"),
                            ("stop '' --cluster cl", "needs a job's name or id"),
                            ("preempt " + "x" * 500 + " --cluster cl", "1 to 200 characters"),
                            ("attach ünï --cluster cl", "no job with id or name"),
                            ("connect --workers -1 --as cl2", "n_workers must be >= 1"),
                            ("status x --cluster nosuch", "no cluster in `nosuch`"),
                            ("jobs --cluster cl --workers", "expected one argument")):
            capsys.readouterr()
            assert shell.run_line_magic("nbtrain", line) is None
            out = capsys.readouterr().out
            assert out.startswith("%nbtrain: ") and words in out, (line, out)
    finally:
        shell.user_ns.pop("cl", None)
        shell.user_ns.pop("cl2", None)
    assert [j.id for j in free_cluster.jobs] == before
    assert len(free_cluster.free_slots) == 2


def test_a_cluster_full_of_jobs_refuses_more_and_names_the_bound() -> None:
    """``jobs_max``: no client can fill the controller's memory with queued jobs."""
    with nbtrain.connect(n_workers=1, settings=nbtrain.Settings.load(jobs_max=2)) as c:
        running = c.submit(Regression(step_sleep=0.02), world_size=1, steps=10**6, name="one")
        queued = c.submit(Regression(), world_size=1, steps=5, name="two")
        with pytest.raises(ValueError, match=r"already holds 2 jobs .* jobs_max is 2"):
            c.submit(Regression(), world_size=1, steps=5, name="three")
        with pytest.raises(ValueError, match="at most 8 trackers"):
            c.rpc("nbtrain_submit", job={}, recipe=b"", settings={}, checkpoint_url="",
                  trackers=[{"kind": "tensorboard", "target": "x"}] * 9)
        running.stop()
        assert queued.wait(120) is JobState.SUCCEEDED, queued.reason
        again = c.submit(Regression(), world_size=1, steps=5, name="three")
        assert again.wait(120) is JobState.SUCCEEDED, again.reason
