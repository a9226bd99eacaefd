"""A running job's steady traffic is batched: the journal commits step rows and output lines
a few times a second (not an fsync per rank message), and a follower gets rows a few times
a second (not a reply per rank message), while everything else stays prompt: a status, an
event or a barrier is committed at once with what came before it, and an event answers a
follower at once."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from nbtrain.engine import handlers
from nbtrain.engine import store as store_mod
from nbtrain.engine.joblog import JobLog
from nbtrain.engine.store import GATHER_S, ControllerStore
from tests.conftest import wait_for


def _row(step: int) -> list[Any]:
    return [0, 0, step, 1e9 + step, 0.01, 0.0, 0.008, 0.001, 0.001]


def test_rows_sent_over_a_gather_window_take_a_commit_or_two(tmp_path: Path) -> None:
    store = ControllerStore(tmp_path / "state")
    store.barrier().result(30)
    before = store.commits
    messages = 20  # one every 12.5 ms, a running job's pace: one gather window in all
    assert GATHER_S >= 0.25
    for step in range(messages):
        store.add_history("rows", "j1", step, [_row(step)])
        time.sleep(0.0125)
    # No barrier: the rows are committed by the writer's own gather, within its window.
    wait_for(lambda: store.ends("j1")["rows"] >= messages, 30, "the gathered rows")
    assert store.ends("j1")["rows"] == messages
    # A commit per message would be 20; a commit per window is 1-2 (a few more when the
    # machine stalls this thread between messages).
    assert store.commits - before < messages // 2
    store.close()


def test_a_status_ends_the_wait_and_takes_the_rows_before_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store_mod, "GATHER_S", 120.0)  # rows alone would wait two minutes
    store = ControllerStore(tmp_path / "state")
    store.add_job(job_id="j1", name="n", submission={}, recipe=b"", settings={},
                  checkpoint_url="", restore=None, token_hash="0" * 64, trackers=None,
                  status={"state": "QUEUED"})
    store.barrier().result(30)
    store.add_history("rows", "j1", 0, [_row(0), _row(1)])
    store.add_history("output", "j1", 0, [{"rank": 0, "text": "hello"}])
    store.put_status("j1", {"state": "RUNNING"}, None)  # no barrier: the status alone
    wait_for(lambda: getattr(store.job("j1"), "state", None) == "RUNNING", 60,
             "the status, which ends the writer's wait")
    job = store.job("j1")
    assert job is not None and job.state == "RUNNING"
    # committed with the status (or before it), never after
    assert store.ends("j1") == {"events": 0, "rows": 2, "output": 1}
    store.close()


def test_closing_commits_rows_still_gathering(tmp_path: Path) -> None:
    store = ControllerStore(tmp_path / "state")
    store.add_history("rows", "j1", 0, [_row(0)])
    store.close()
    again = ControllerStore(tmp_path / "state")
    assert again.ends("j1")["rows"] == 1
    again.close()


@dataclass
class _Assets:
    log: JobLog = field(default_factory=lambda: JobLog(rows_kept=1_000))


class _Port:
    """The two things ``handlers._settle`` reads of the controller."""

    def __init__(self) -> None:
        self.assets: dict[str, _Assets] = {"j1": _Assets()}
        self.news = asyncio.Event()

    def wake(self) -> None:
        news, self.news = self.news, asyncio.Event()
        news.set()


def _settle(port: _Port, cursors: dict[str, list[int]], *, within: float) -> Any:
    loop = asyncio.get_running_loop()
    return handlers._settle(port, cursors, loop.time() + within)  # type: ignore[arg-type]


def test_a_follower_with_only_rows_new_waits_for_more(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(handlers, "FOLLOW_ROWS_S", 60.0)

    async def run() -> None:
        port = _Port()
        port.assets["j1"].log.add_rows(0, 0, [_row(1)[2:]])
        settle = asyncio.ensure_future(_settle(port, {"j1": [0, 0, 0]}, within=60.0))
        for step in range(2, 5):  # more rows and output wake it, but do not end the wait
            await asyncio.sleep(0.05)
            port.assets["j1"].log.add_rows(0, 0, [_row(step)[2:]])
            port.assets["j1"].log.add_output({"rank": 0, "generation": 0,
                                              "lines": [["stdout", "x"]]})
            port.wake()
        await asyncio.sleep(0.3)
        assert not settle.done()
        port.assets["j1"].log.add_event({"kind": "state", "state": "SUCCEEDED"})
        port.wake()
        await asyncio.wait_for(settle, 30)  # an event ends it

    asyncio.run(run())


def test_a_follower_is_answered_by_its_deadline_or_a_job_gone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(handlers, "FOLLOW_ROWS_S", 60.0)

    async def run() -> None:
        port = _Port()
        port.assets["j1"].log.add_rows(0, 0, [_row(1)[2:]])
        await asyncio.wait_for(_settle(port, {"j1": [0, 0, 0]}, within=0.1), 30)
        settle = asyncio.ensure_future(_settle(port, {"j1": [0, 0, 0]}, within=60.0))
        await asyncio.sleep(0.1)
        assert not settle.done()
        del port.assets["j1"]
        port.wake()
        await asyncio.wait_for(settle, 30)

    asyncio.run(run())


class _JournalPort:
    """The two things ``handlers._older_from_store`` uses of the controller."""

    def __init__(self, store: ControllerStore) -> None:
        self.store = store

    async def journaled(self) -> bool:
        await asyncio.wrap_future(self.store.barrier())
        return True


def test_rows_older_than_memory_are_read_once_the_gathered_ones_are_committed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store_mod, "GATHER_S", 120.0)  # the newest rows stay gathering
    store = ControllerStore(tmp_path / "state")
    log = JobLog(rows_kept=10, sink=lambda t, at, items: store.add_history(t, "j1", at, items))
    for step in range(40):
        log.add_rows(0, 0, [_row(step)[2:]])
    assert log.rows.base > 0  # memory dropped the oldest rows

    async def run() -> dict[str, Any]:
        update = log.since(0, 0, 1_000)
        await handlers._older_from_store(
            _JournalPort(store), "j1", log, update,  # type: ignore[arg-type]
            {"rows": 0, "events": 0, "output": 0}, 1_000)
        return update

    update = asyncio.run(run())
    assert update["rows_at"] == 0
    assert [row[2] for row in update["rows"]] == list(range(log.rows.base))
    store.close()
