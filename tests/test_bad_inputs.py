"""Bad inputs are refused where they enter, with the value and the fix; nothing of them
reaches the cluster, and the next normal job runs (the start of the shared-cluster issue's
bad-input suite: names and paths, NaN, types)."""

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
