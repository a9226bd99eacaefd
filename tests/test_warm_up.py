"""A rank waits for its worker's warm-up imports: two threads importing torch's modules at once
can deadlock on Python's import locks (a rank on a just-restarted worker importing FSDP while
the warm-up imported ``torch._dynamo``; Python broke it with an error and the job restarted
once more than its faults)."""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace

import pytest

from nbtrain.engine import workers


def test_a_rank_waits_until_the_warm_up_thread_is_done(monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()
    done: list[bool] = []

    def slow_warm_up() -> None:
        release.wait(10)
        done.append(True)

    monkeypatch.setattr(workers, "_warm_up", slow_warm_up)
    workers.NbtrainWorker(quiet=False, warm_up=True).setup(SimpleNamespace(nanny=object()))
    assert not workers.wait_for_warm_up(timeout=0.2)  # still importing
    threading.Timer(0.2, release.set).start()
    assert workers.wait_for_warm_up(timeout=10)
    assert done, "the wait returned before the warm-up ended"


def test_a_failed_warm_up_still_lets_ranks_start(monkeypatch: pytest.MonkeyPatch,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    def broken() -> None:
        raise ImportError("no torch here")

    monkeypatch.setattr(workers, "_warm_up", broken)
    with caplog.at_level(logging.WARNING, logger=workers.__name__):
        workers.NbtrainWorker(quiet=False, warm_up=True).setup(SimpleNamespace(nanny=object()))
        assert workers.wait_for_warm_up(timeout=10)
    assert "warming up torch failed" in caplog.text


def test_a_warm_up_that_never_ends_is_waited_for_only_until_the_timeout(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    release = threading.Event()
    monkeypatch.setattr(workers, "_warm_up", lambda: release.wait(10))
    try:
        with caplog.at_level(logging.WARNING, logger=workers.__name__):
            workers.NbtrainWorker(quiet=False, warm_up=True).setup(
                SimpleNamespace(nanny=object()))
            assert not workers.wait_for_warm_up(timeout=0.1)
        assert "warm-up still runs after 0 s; the rank starts anyway" in caplog.text
    finally:
        release.set()
        assert workers.wait_for_warm_up(timeout=10)


def test_the_rank_task_starts_only_after_the_warm_up(monkeypatch: pytest.MonkeyPatch) -> None:
    from nbtrain.engine import tasks
    from nbtrain.runtime import loop

    started: list[object] = []
    monkeypatch.setattr(loop, "run_rank", lambda launch: started.append(launch) or {})
    release = threading.Event()
    monkeypatch.setattr(workers, "_warm_up", lambda: release.wait(10))
    workers.NbtrainWorker(quiet=False, warm_up=True).setup(SimpleNamespace(nanny=object()))
    rank = threading.Thread(target=tasks.run_rank_task, args=("launch",))
    rank.start()
    rank.join(0.3)
    assert rank.is_alive() and not started, "the rank ran beside the warm-up's imports"
    release.set()
    rank.join(10)
    assert started == ["launch"]
