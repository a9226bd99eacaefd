"""AsyncCheckpointer: background persist, one in flight, failures reported, exact resume."""

from __future__ import annotations

import errno
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from nbtrain.runtime.async_ckpt import AsyncCheckpointer
from nbtrain.runtime.rng import capture_rng_state, restore_rng_state
from nbtrain.runtime.snapshot import load_state
from nbtrain.runtime.storage import CheckpointStore, ShardInfo

Events = list[tuple[str, dict[str, Any]]]


def recorder() -> tuple[Events, Any]:
    events: Events = []
    lock = threading.Lock()

    def on_event(kind: str, info: dict[str, Any]) -> None:
        with lock:
            events.append((kind, info))

    return events, on_event


def mem_store(keep: int = 3) -> CheckpointStore:
    return CheckpointStore(f"memory://async-{uuid.uuid4().hex}/c", keep=keep)


def test_save_persists_in_background_and_reports_events(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path / "c"), keep=2)
    events, on_event = recorder()
    w = torch.arange(1000.0)
    with AsyncCheckpointer(store, rank=0, world_size=1, job={"name": "j"}, on_event=on_event) as ck:
        r = ck.save(5, {"w": w}, {"epoch": 2}, manifest_metadata={"epoch": 2})
        assert r.bytes == 4000 and r.blocking_s >= 0 and r.wait_s >= 0
        w.add_(1)  # training continues: the checkpoint holds the value at save time
        done = ck.wait(timeout=60)
    assert done is r and r.error is None and r.committed
    assert r.persist_s is not None and r.commit_s is not None
    kinds = [k for k, _ in events]
    assert kinds == ["snapshot", "persisted", "committed"]
    snap, persisted, committed = (i for _, i in events)
    assert snap["step"] == 5 and snap["bytes"] == 4000 and "blocking_ms" in snap
    assert persisted["persist_ms"] >= 0 and persisted["rank"] == 0
    assert committed["url"] == store.step_url(5) and committed["commit_ms"] >= 0
    got = store.load_shard(5, 0)
    assert torch.equal(got["state"]["w"], torch.arange(1000.0)) and got["meta"] == {"epoch": 2}
    m = store.read_manifest(5)
    assert m.job == {"name": "j"} and m.metadata == {"epoch": 2}


def test_two_ranks_rank0_commits_after_both_shards(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path / "c"))
    ev0, cb0 = recorder()
    ev1, cb1 = recorder()
    ck0 = AsyncCheckpointer(store, rank=0, world_size=2, attempt="g1", on_event=cb0)
    ck1 = AsyncCheckpointer(store, rank=1, world_size=2, attempt="g1", on_event=cb1)
    for step in (10, 20):
        ck0.save(step, {"x": torch.full((3,), float(step))})
        ck1.save(step, {"x": torch.full((3,), float(step + 1))})
    ck1.close(60)
    ck0.close(60)
    assert store.committed() == [20, 10]
    assert [k for k, _ in ev1] == ["snapshot", "persisted"] * 2  # rank 1 never commits
    assert [k for k, _ in ev0].count("committed") == 2
    assert torch.equal(store.load_shard(20, 1)["state"]["x"], torch.full((3,), 21.0))


class SlowStore(CheckpointStore):
    """Records whether a shard write is in progress; the write blocks until released."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.writing = False
        self.release = threading.Event()
        self.entered = threading.Event()

    def write_shard(self, *a: Any, **kw: Any) -> ShardInfo:
        self.writing = True
        self.entered.set()
        try:
            assert self.release.wait(60)
            return super().write_shard(*a, **kw)
        finally:
            self.writing = False


def test_at_most_one_checkpoint_in_flight() -> None:
    store = SlowStore(f"memory://slow-{uuid.uuid4().hex}/c")
    ck = AsyncCheckpointer(store, rank=0, world_size=1)
    overlaps = []
    real = ck.snapshotter.snapshot

    def snapshot(state: Any, **kwargs: Any) -> Any:
        overlaps.append(store.writing)  # the buffers are reused: no write may be running
        return real(state, **kwargs)

    draining = threading.Event()
    real_drain = ck._drain

    def drain() -> None:
        draining.set()
        real_drain()

    ck.snapshotter.snapshot = snapshot  # type: ignore[method-assign]
    ck._drain = drain  # type: ignore[method-assign]
    ck.save(1, {"x": torch.zeros(4)})
    assert store.entered.wait(60) and ck.in_flight
    second = threading.Thread(target=ck.save, args=(2, {"x": torch.ones(4)}))
    second.start()
    assert draining.wait(60)
    # The second save stays parked (however long we look) until the first persist ends.
    second.join(0.5)
    assert second.is_alive() and overlaps == [False]
    store.release.set()
    second.join(60)
    ck.close(60)
    assert overlaps == [False, False]
    assert ck.results[1].wait_s > 0
    assert store.committed() == [2, 1]
    assert torch.equal(store.load_shard(1, 0)["state"]["x"], torch.zeros(4))


def test_snapshot_buffers_are_reused_between_saves() -> None:
    events, on_event = recorder()
    with AsyncCheckpointer(mem_store(), rank=0, world_size=1, on_event=on_event) as ck:
        for step in (1, 2, 3):
            ck.save(step, {"x": torch.randn(100)})
    allocated = [i["allocated_bytes"] for k, i in events if k == "snapshot"]
    assert allocated == [400, 0, 0]


class FullDiskStore(CheckpointStore):
    def __init__(self, url: str, fail_steps: set[int]) -> None:
        super().__init__(url)
        self.fail_steps = fail_steps

    def write_shard(self, step: int, *a: Any, **kw: Any) -> ShardInfo:
        if step in self.fail_steps:
            raise OSError(errno.ENOSPC, "No space left on device")
        return super().write_shard(step, *a, **kw)


def test_full_disk_marks_failed_and_training_goes_on() -> None:
    store = FullDiskStore(f"memory://full-{uuid.uuid4().hex}/c", fail_steps={2})
    events, on_event = recorder()
    with AsyncCheckpointer(store, rank=0, world_size=1, on_event=on_event) as ck:
        for step in (1, 2, 3):
            ck.save(step, {"x": torch.full((2,), float(step))})
            ck.wait(60)
    assert [k for k, _ in events] == [
        "snapshot", "persisted", "committed",
        "snapshot", "failed",
        "snapshot", "persisted", "committed",
    ]  # fmt: skip
    failed = next(i for k, i in events if k == "failed")
    assert failed["step"] == 2 and failed["stage"] == "persist"
    assert "No space left on device" in failed["error"]
    assert [r.step for r in ck.failures] == [2]
    assert store.committed() == [3, 1]


def test_a_failing_rank_makes_the_committer_fail_fast() -> None:
    url = f"memory://fail2-{uuid.uuid4().hex}/c"
    good = CheckpointStore(url)
    bad = FullDiskStore(url, fail_steps={7})
    ev0, cb0 = recorder()
    ck0 = AsyncCheckpointer(good, rank=0, world_size=2, attempt="g", on_event=cb0)
    ck1 = AsyncCheckpointer(bad, rank=1, world_size=2, attempt="g", commit_timeout_s=3600)
    ck0.commit_timeout_s = 3600  # only the failure report can end the wait in time
    ck1.save(7, {"x": torch.zeros(1)})
    ck0.save(7, {"x": torch.zeros(1)})
    r0 = ck0.wait(60)  # would raise TimeoutError if the committer waited for its timeout
    ck0.close()
    ck1.close()
    assert r0 is not None and r0.phase == "commit" and not r0.committed
    assert r0.error is not None and "rank 1 failed to write its shard" in r0.error
    assert "No space left" in r0.error
    assert ("failed" in [k for k, _ in ev0]) and good.committed() == []


def test_close_cancel_abandons_a_commit_waiting_for_a_dead_rank() -> None:
    ck = AsyncCheckpointer(mem_store(), rank=0, world_size=2, commit_timeout_s=3600)
    ck.save(1, {"x": torch.zeros(1)})  # rank 1 never writes
    r = ck.close(60, cancel=True)
    # cancelled while waiting for rank 1, or (cancelled first) never written: not committed
    assert r is not None and r.phase in ("commit", "persist") and r.error is not None
    assert "cancelled" in r.error or "abandoned" in r.error
    assert not r.committed
    with pytest.raises(RuntimeError, match="after close"):
        ck.save(2, {})


def test_commit_timeout_is_reported_as_failed() -> None:
    events, on_event = recorder()
    ck = AsyncCheckpointer(
        mem_store(), rank=0, world_size=2, commit_timeout_s=0.2, on_event=on_event
    )
    ck.save(1, {"x": torch.zeros(1)})
    r = ck.wait(60)
    ck.close()
    assert r is not None and r.error is not None and "timed out after 0.2s" in r.error
    assert "ranks [1]" in r.error and events[-1][0] == "failed"


def test_already_committed_step_is_skipped() -> None:
    store = mem_store()
    events, on_event = recorder()
    with AsyncCheckpointer(store, rank=0, world_size=1, on_event=on_event) as ck:
        ck.save(4, {"x": torch.zeros(1)})
        ck.wait(60)
        r = ck.save(4, {"x": torch.ones(1)})
        ck.wait(60)
    assert r.phase == "skipped" and r.error is None
    assert events[-1] == ("skipped", {"rank": 0, "step": 4, "reason": "already committed"})
    assert torch.equal(store.load_shard(4, 0)["state"]["x"], torch.zeros(1))


def test_broken_event_callback_does_not_kill_the_writer() -> None:
    def on_event(kind: str, info: dict[str, Any]) -> None:
        raise RuntimeError("dashboard bug")

    store = mem_store()
    with AsyncCheckpointer(store, rank=0, world_size=1, on_event=on_event) as ck:
        ck.save(1, {"x": torch.zeros(1)})
        ck.save(2, {"x": torch.zeros(1)})
    assert store.committed() == [2, 1]


def test_retention_after_commits() -> None:
    store = mem_store(keep=2)
    with AsyncCheckpointer(store, rank=0, world_size=1) as ck:
        for step in range(1, 6):
            ck.save(step, {"x": torch.zeros(1)})
    assert store.committed() == [5, 4]
    assert ck.results[-1].pruned == [3]


def test_validation() -> None:
    with pytest.raises(ValueError, match=r"rank must be in 0..1"):
        AsyncCheckpointer(mem_store(), rank=2, world_size=2)
    with pytest.raises(ValueError, match="commit_timeout_s must be > 0"):
        AsyncCheckpointer(mem_store(), rank=0, world_size=1, commit_timeout_s=0)


# -- exact resume at the component level ------------------------------------------------------
class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(6, 16)
        self.drop = torch.nn.Dropout(0.3)  # consumes the torch RNG every step
        self.b = torch.nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.drop(torch.tanh(self.a(x))))


def make() -> tuple[Net, torch.optim.Optimizer, Any]:
    torch.manual_seed(0)
    model = Net().double()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    return model, opt, sched


DATA = torch.randn(64, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def train(model: Net, opt: torch.optim.Optimizer, sched: Any, start: int, steps: int) -> None:
    for s in range(start, start + steps):
        x = DATA[(s * 8) % 64 : (s * 8) % 64 + 8]  # data position = step
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()


def test_resume_continues_exactly(tmp_path: Path) -> None:
    n = 6
    model, opt, sched = make()
    train(model, opt, sched, 0, 2 * n)
    expected = {k: v.clone() for k, v in model.state_dict().items()}

    store = CheckpointStore(str(tmp_path / "c"))
    model, opt, sched = make()
    train(model, opt, sched, 0, n)
    with AsyncCheckpointer(store, rank=0, world_size=1) as ck:
        ck.save(n, {"model": model, "optimizer": opt, "sched": sched}, {"rng": capture_rng_state()})
    torch.manual_seed(12345)  # a new process would start with different RNG states
    model, opt, sched = make()
    res = store.restore_latest(0)
    assert res is not None and res.step == n
    load_state({"model": model, "optimizer": opt, "sched": sched}, res.payload["state"])
    restore_rng_state(res.payload["meta"]["rng"])
    train(model, opt, sched, n, n)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, expected[k], rtol=0, atol=1e-6)


def test_the_writer_reads_a_snapshot_only_once_its_copies_are_done() -> None:
    """On GPUs the snapshot's device-to-host copies are only queued when ``save`` returns; the
    writer must wait for them (``Snapshot.wait``) before it reads the buffers. Gated here by
    hand, as a CUDA event would gate it."""
    import dataclasses

    from nbtrain.runtime.snapshot import HostSnapshotter, Snapshot

    copied = threading.Event()
    asked: list[bool] = []

    class Queued(HostSnapshotter):
        def snapshot(self, state: Any, *, wait: bool = True) -> Snapshot:
            asked.append(wait)
            snap = super().snapshot(state, wait=wait)
            return dataclasses.replace(snap, ready=lambda: copied.wait(60))

    store = mem_store()
    events, on_event = recorder()
    ck = AsyncCheckpointer(store, rank=0, world_size=1, snapshotter=Queued(),
                           on_event=on_event)
    ck.save(1, {"x": torch.ones(3)})
    assert asked == [False]  # the loop does not wait for the copies
    # Nothing is persisted (however long we look) while the copies are in flight.
    with pytest.raises(TimeoutError):
        ck.wait(timeout=0.5)
    assert store.committed() == [] and [k for k, _ in events] == ["snapshot"]
    copied.set()
    assert ck.wait(60) is not None and store.committed() == [1]
    assert [k for k, _ in events] == ["snapshot", "persisted", "committed"]
    ck.close(60)


def test_an_abandoned_writer_never_raises_and_cannot_commit_or_prune(tmp_path: Path) -> None:
    """After a failure the rank abandons its writer: it used to raise ``TimeoutError`` over the
    real failure while a large write ran, and the thread could still commit, prune and clean
    up after its generation ended (while the next one wrote)."""
    store = CheckpointStore(str(tmp_path / "c"), keep=1)
    events, on_event = recorder()
    ck = AsyncCheckpointer(store, rank=0, world_size=1, job={}, on_event=on_event)
    ck.save(1, {"w": torch.zeros(10)}, {})
    assert ck.wait(60).committed  # type: ignore[union-attr]
    big = {"w": torch.randn(64 * 1024 * 1024)}  # 256 MB: still writing when abandoned
    pending = ck.save(2, big, {})
    started = Path(store.step_dir(2))
    deadline = time.monotonic() + 60
    while not started.exists():  # the writer has begun this write
        assert time.monotonic() < deadline
        time.sleep(0.001)
    note = ck.abandon(timeout=0.01)
    assert "still running" in note and "fenced" in note
    ck._thread.join(120)  # let the fenced write finish
    assert pending.error is not None and "abandoned" in pending.error, pending.error
    assert not pending.committed and store.committed() == [1]  # no commit, nothing pruned
    assert [k for k, _ in events].count("committed") == 1
    assert ck.abandon() == ""  # again: nothing left, still no exception


# -- saves that never commit leave nothing behind ---------------------------------------------
def files_of(store: CheckpointStore, step: int) -> list[str]:
    try:
        return sorted(p.rsplit("/", 1)[-1] for p in store.fs.ls(store.step_dir(step),
                                                                detail=False))
    except FileNotFoundError:
        return []


def test_a_commit_that_times_out_removes_its_files(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path / "c"))
    ck = AsyncCheckpointer(store, rank=0, world_size=2, attempt="g", commit_timeout_s=0.2)
    r = ck.save(1, {"x": torch.zeros(1000)})  # rank 1 never writes
    ck.close(60)
    assert r.error is not None and "timed out" in r.error
    assert files_of(store, 1) == [] and not Path(store.step_dir(1)).exists()


class HalfWrittenStore(CheckpointStore):
    """Writes the rank's file, then the disk is full."""

    def write_shard(self, step: int, rank: int, world_size: int, *a: Any,
                    **kw: Any) -> ShardInfo:
        self.fs.makedirs(self.step_dir(step), exist_ok=True)
        with self.fs.open(f"{self.step_dir(step)}/__{rank}_0.distcp", "wb") as f:
            f.write(b"x" * 1000)
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_failed_write_removes_what_it_wrote() -> None:
    url = f"memory://half-{uuid.uuid4().hex}/c"
    ck1 = AsyncCheckpointer(HalfWrittenStore(url), rank=1, world_size=2, attempt="g")
    ck1.save(3, {"x": torch.zeros(1)})
    ck1.close(60)
    store = CheckpointStore(url)
    # Rank 1's half-written file is gone; its failure marker stays for the committer.
    assert files_of(store, 3) == ["rank-00001-of-00002.failed.json"]
    ck0 = AsyncCheckpointer(store, rank=0, world_size=2, attempt="g", commit_timeout_s=3600)
    r = ck0.save(3, {"x": torch.zeros(1)})
    ck0.close(60)
    assert r.error is not None and "rank 1 failed to write its shard" in r.error
    assert files_of(store, 3) == []  # the committer removed its own files and the marker
    solo = AsyncCheckpointer(HalfWrittenStore(url), rank=0, world_size=1, attempt="g")
    solo.save(4, {"x": torch.zeros(1)})  # the committer's own write fails: nothing stays
    solo.close(60)
    assert files_of(store, 4) == []


def test_abandoning_the_committer_removes_the_save_it_did_not_commit(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path / "c"))
    ck1 = AsyncCheckpointer(store, rank=1, world_size=3, attempt="g")
    ck1.save(5, {"x": torch.ones(10)})
    assert ck1.wait(60) is not None
    ck0 = AsyncCheckpointer(store, rank=0, world_size=3, attempt="g", commit_timeout_s=3600)
    ck0.save(5, {"x": torch.zeros(10)})  # rank 2 never writes: the commit waits
    deadline = time.monotonic() + 60
    while "rank-00000-of-00003.json" not in files_of(store, 5):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert ck1.abandon() == ""  # not the committer: it removes nothing (a commit may come)
    assert len(files_of(store, 5)) == 4
    assert ck0.abandon(timeout=60) == ""  # it will never commit step 5 now: all of it goes
    assert files_of(store, 5) == [] and store.committed() == []
