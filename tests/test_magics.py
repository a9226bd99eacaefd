"""``%load_ext nbtrain``: the ``%nbtrain`` magic in a real IPython shell on a real cluster."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from IPython.core.interactiveshell import InteractiveShell

import nbtrain
from nbtrain import JobState
from nbtrain.ui.dashboard import TextProgress
from tests.conftest import wait_for
from tests.recipes import Regression


@pytest.fixture
def shell() -> Iterator[Any]:
    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "nbtrain")
    yield ip
    for name in ("cluster", "job", "other", "j"):
        ip.user_ns.pop(name, None)


def magic(shell: Any, capsys: pytest.CaptureFixture[str], line: str) -> tuple[Any, str]:
    result = shell.run_line_magic("nbtrain", line)
    return result, capsys.readouterr().out


def test_misuse_is_one_line_with_the_fix(shell: Any, capsys: pytest.CaptureFixture[str]) -> None:
    _, out = magic(shell, capsys, "")
    assert "%nbtrain connect [ADDRESS]" in out and "%nbtrain jobs" in out
    _, out = magic(shell, capsys, "jobs")
    assert out.startswith("%nbtrain: no cluster in `cluster`: run `%nbtrain connect`")
    _, out = magic(shell, capsys, "launch everything")
    assert out.startswith("%nbtrain: unknown command 'launch'")
    _, out = magic(shell, capsys, "connect --workers two")
    assert "invalid int value: 'two'" in out
    _, out = magic(shell, capsys, "set somejob lr=fast")
    assert "takes numbers, got 'lr=fast'" in out
    _, out = magic(shell, capsys, "set somejob")
    assert "needs at least one knob" in out


def test_magics_list_attach_show_and_steer_a_job(shell: Any, free_cluster: nbtrain.Cluster,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    _, out = magic(shell, capsys, f"connect {free_cluster.address} --as other")
    assert out.startswith("connected: `other` =")
    other = shell.user_ns["other"]
    assert isinstance(other, nbtrain.Cluster) and other.address == free_cluster.address
    _, out = magic(shell, capsys, f"connect {free_cluster.address} --as other")
    assert "already a cluster" in out

    job = other.submit(Regression(step_sleep=0.01), world_size=2, steps=10**6, name="magic",
                       checkpoint=None)
    try:
        wait_for(lambda: job.step >= 5, 120, "training")
        _, out = magic(shell, capsys, "jobs --cluster other")
        line = next(row for row in out.splitlines() if row.startswith("magic "))
        assert "RUNNING" in line and job.id[:10] in line

        _, out = magic(shell, capsys, "attach magic --as j --cluster other")
        assert out.startswith("attached: `j` =")
        assert shell.user_ns["j"].id == job.id
        _, out = magic(shell, capsys, "status magic --cluster other")
        assert out.startswith("magic: RUNNING at step")

        view, _ = magic(shell, capsys, "dashboard magic --display text --cluster other")
        assert isinstance(view, TextProgress)

        _, out = magic(shell, capsys, "preempt magic --cluster other")
        assert "preempt requested for magic" in out
        wait_for(lambda: job.status is JobState.PREEMPTED, 120, "preempted")
        magic(shell, capsys, "resume magic --cluster other")
        wait_for(lambda: job.status is JobState.RUNNING and job.generation == 1, 120,
                 "resumed")

        # Live knobs of a Recipe's optimizer (declared by nbtrain for the tracked optimizer).
        _, out = magic(shell, capsys, "set magic lr=0.01 --cluster other")
        assert "lr=0.01 applied by every rank of magic at step" in out, out
        _, out = magic(shell, capsys, "knobs magic --cluster other")
        assert "lr=0.01" in out and "by " in out
        _, out = magic(shell, capsys, "set magic momentum=0.5 --cluster other")
        assert "%nbtrain: cannot set the knobs of job magic: 'momentum' is not a knob" in out

        _, out = magic(shell, capsys, "stop nosuchjob --cluster other")
        assert "%nbtrain: no job with id or name 'nosuchjob'" in out and "its jobs: " in out
        _, out = magic(shell, capsys, "stop --cluster other")
        assert "needs a job's name or id" in out
        magic(shell, capsys, "stop magic --cluster other")
        assert job.wait(120) is JobState.CANCELLED
    finally:
        job.stop()
        job.wait(120)
        _, out = magic(shell, capsys, "close --cluster other")
    assert "closed `other`" in out and "other" not in shell.user_ns
