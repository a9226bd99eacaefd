"""Two-phase checkpoint store: commit, verification, fallback, retention, cleanup, SIGKILL."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import random
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nbtrain.runtime.storage import (
    MANIFEST,
    CheckpointError,
    CheckpointStore,
    split_checkpoint_url,
)


def payload(step: int, rank: int) -> dict[str, Any]:
    return {"w": torch.full((64,), float(step * 10 + rank)), "step": step, "rank": rank}


def checkpoint(store: CheckpointStore, step: int, world: int = 2, **kw: Any) -> None:
    for r in range(world):
        store.write_shard(step, r, world, payload(step, r), attempt="a")
    store.commit(step, world, attempt="a", **kw)


def local_file(store: CheckpointStore, step: int, name: str) -> Path:
    return Path(store.step_dir(step)) / name


@pytest.fixture(params=["local", "memory"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> CheckpointStore:
    if request.param == "local":
        return CheckpointStore(str(tmp_path / "ckpt"), keep=3)
    return CheckpointStore(f"memory://nbtrain-test-{uuid.uuid4().hex}/ckpt", keep=3)


@pytest.fixture
def local(tmp_path: Path) -> CheckpointStore:
    return CheckpointStore(str(tmp_path / "ckpt"), keep=3)


def rewrite(store: CheckpointStore, path: str, data: bytes) -> None:
    with store.fs.open(path, "wb") as f:
        f.write(data)


def read(store: CheckpointStore, path: str) -> bytes:
    with store.fs.open(path, "rb") as f:
        return bytes(f.read())


# -- happy path -------------------------------------------------------------------------------
def test_two_phase_commit_and_load(store: CheckpointStore) -> None:
    checkpoint(store, 7, job={"name": "digits"}, metadata={"epoch": 1})
    names = sorted(p.rsplit("/", 1)[-1] for p in store.fs.ls(store.step_dir(7), detail=False))
    assert names == [
        MANIFEST,
        "rank-00000-of-00002.json",
        "rank-00000-of-00002.pt",
        "rank-00001-of-00002.json",
        "rank-00001-of-00002.pt",
    ]
    m = store.read_manifest(7)
    assert (m.step, m.world_size, m.job, m.metadata) == (7, 2, {"name": "digits"}, {"epoch": 1})
    shard = read(store, f"{store.step_dir(7)}/rank-00001-of-00002.pt")
    assert m.shards[1].sha256 == hashlib.sha256(shard).hexdigest()
    assert m.shards[1].bytes == len(shard)
    got = store.load_shard(7, 1)
    assert got["step"] == 7 and torch.equal(got["w"], payload(7, 1)["w"])
    assert store.committed() == [7] and store.latest() == 7
    assert [x.step for x in store.manifests()] == [7]


def test_not_committed_until_every_shard_and_the_manifest(store: CheckpointStore) -> None:
    store.write_shard(3, 0, 2, payload(3, 0))
    assert store.committed() == [] and store.latest() is None
    with pytest.raises(CheckpointError, match="never committed"):
        store.load_shard(3, 0)
    with pytest.raises(CheckpointError, match=r"waiting for the shards of ranks \[1\]"):
        store.commit(3, 2, timeout_s=0.2)
    store.write_shard(3, 1, 2, payload(3, 1))
    store.commit(3, 2, timeout_s=5)
    assert store.committed() == [3]


def test_commit_ignores_shards_of_another_attempt(store: CheckpointStore) -> None:
    store.write_shard(5, 0, 2, payload(5, 0), attempt="gen2")
    store.write_shard(5, 1, 2, payload(5, 1), attempt="gen1")  # stale, from a crashed gen
    with pytest.raises(CheckpointError, match=r"ranks \[1\] \(attempt 'gen2'\)"):
        store.commit(5, 2, attempt="gen2", timeout_s=0.2)
    store.write_shard(5, 1, 2, payload(5, 1), attempt="gen2")
    assert store.commit(5, 2, attempt="gen2").attempt == "gen2"


def test_commit_fails_fast_when_a_rank_reports_failure(store: CheckpointStore) -> None:
    store.write_shard(4, 0, 2, payload(4, 0), attempt="g")
    store.write_failure(4, 1, 2, "OSError: [Errno 28] No space left on device", attempt="g")
    t0 = time.monotonic()
    with pytest.raises(CheckpointError, match="rank 1 failed to write its shard: OSError"):
        store.commit(4, 2, attempt="g", timeout_s=60)
    assert time.monotonic() - t0 < 30  # failed on the report, not on the 60 s timeout
    assert store.committed() == []


def test_committed_checkpoint_is_never_overwritten(store: CheckpointStore) -> None:
    checkpoint(store, 2)
    with pytest.raises(CheckpointError, match="already committed"):
        store.write_shard(2, 0, 2, payload(99, 0))
    assert store.load_shard(2, 0)["step"] == 2


def test_failed_write_leaves_no_file(local: CheckpointStore) -> None:
    with pytest.raises(Exception, match=r"pickle|lambda|Can.t"):
        local.write_shard(1, 0, 1, {"f": lambda: 0})
    assert os.listdir(local.step_dir(1)) == []


def test_no_temporary_files_after_success(local: CheckpointStore) -> None:
    checkpoint(local, 1)
    assert not [n for n in os.listdir(local.step_dir(1)) if ".tmp-" in n]


def test_validation() -> None:
    with pytest.raises(ValueError, match="keep must be an integer >= 1"):
        CheckpointStore("memory://x", keep=0)
    s = CheckpointStore(f"memory://v-{uuid.uuid4().hex}")
    with pytest.raises(ValueError, match=r"rank must be in 0..1"):
        s.write_shard(1, 2, 2, {})


def test_split_checkpoint_url() -> None:
    assert split_checkpoint_url("/a/b/step-00000123") == ("/a/b", 123)
    assert split_checkpoint_url("s3://bk/run/step-00000007/") == ("s3://bk/run", 7)
    assert split_checkpoint_url("/a/b") == ("/a/b", None)
    s = CheckpointStore(f"memory://u-{uuid.uuid4().hex}/r")
    assert split_checkpoint_url(s.step_url(42)) == (s.url, 42)


# -- bad input: clear error and fallback ------------------------------------------------------
def test_corrupt_manifest_falls_back(store: CheckpointStore) -> None:
    checkpoint(store, 1)
    checkpoint(store, 2)
    path = f"{store.step_dir(2)}/{MANIFEST}"
    rewrite(store, path, read(store, path)[:-20])
    with pytest.raises(CheckpointError, match=r"manifest.json: manifest is not valid JSON"):
        store.read_manifest(2)
    res = store.restore_latest(0)
    assert res is not None and res.step == 1
    assert res.skipped[0][0] == 2 and "not valid JSON" in res.skipped[0][1]
    assert torch.equal(res.payload["w"], payload(1, 0)["w"])


def test_manifest_edit_is_caught_by_its_checksum(store: CheckpointStore) -> None:
    checkpoint(store, 1)
    checkpoint(store, 2)
    path = f"{store.step_dir(2)}/{MANIFEST}"
    doc = json.loads(read(store, path))
    doc["body"]["shards"][0]["bytes"] += 1
    rewrite(store, path, json.dumps(doc).encode())
    with pytest.raises(CheckpointError, match="manifest checksum mismatch"):
        store.read_manifest(2)
    assert store.latest() == 1


def test_corrupt_shard_falls_back_with_the_file_named(store: CheckpointStore) -> None:
    checkpoint(store, 1)
    checkpoint(store, 2)
    path = f"{store.step_dir(2)}/rank-00000-of-00002.pt"
    data = bytearray(read(store, path))
    data[len(data) // 2] ^= 0xFF
    rewrite(store, path, bytes(data))
    with pytest.raises(CheckpointError, match=r"rank-00000-of-00002.pt: shard sha256 does not"):
        store.load_shard(2, 0)
    res = store.restore_latest(0)
    assert res is not None and res.step == 1
    assert "rank-00000-of-00002.pt" in res.skipped[0][1]


def test_truncated_shard(store: CheckpointStore) -> None:
    checkpoint(store, 1)
    checkpoint(store, 2)
    path = f"{store.step_dir(2)}/rank-00001-of-00002.pt"
    rewrite(store, path, read(store, path)[:100])
    with pytest.raises(CheckpointError, match="shard has 100 bytes, the manifest says"):
        store.load_shard(2, 1)


def test_other_ranks_corruption_moves_every_rank_back_together(store: CheckpointStore) -> None:
    checkpoint(store, 1)
    checkpoint(store, 2)
    path = f"{store.step_dir(2)}/rank-00001-of-00002.pt"
    rewrite(store, path, read(store, path)[:-1])
    # Rank 0's own shard is intact, but rank 1 cannot load step 2: both must pick step 1.
    r0 = store.restore_latest(0)
    r1 = store.restore_latest(1)
    assert r0 is not None and r1 is not None and r0.step == r1.step == 1
    r0_own = store.restore_latest(0, verify_all=False)
    assert r0_own is not None and r0_own.step == 2  # only with verify_all=False


def _forge_manifest(store: CheckpointStore, step: int, **changes: Any) -> None:
    path = f"{store.step_dir(step)}/{MANIFEST}"
    doc = json.loads(read(store, path))
    doc.update(changes)
    rewrite(store, path, json.dumps(doc).encode())


def test_version_mismatch_names_both_versions(store: CheckpointStore) -> None:
    checkpoint(store, 1)
    checkpoint(store, 2)
    _forge_manifest(store, 2, version=99)
    with pytest.raises(CheckpointError,
                       match="format version 99, this nbtrain reads versions 1, 2"):
        store.read_manifest(2)
    res = store.restore_latest(1)
    assert res is not None and res.step == 1 and "version 99" in res.skipped[0][1]


def test_foreign_manifest_and_foreign_shard(store: CheckpointStore) -> None:
    checkpoint(store, 1)
    _forge_manifest(store, 1, format="something-else")
    with pytest.raises(CheckpointError, match="foreign file"):
        store.read_manifest(1)
    # A foreign shard whose manifest checksums match (copied in by hand): refused by content.
    checkpoint(store, 2)
    path = f"{store.step_dir(2)}/rank-00000-of-00002.pt"
    with store.fs.open(path, "wb") as f:
        torch.save({"just": torch.zeros(2)}, f)
    _rehash(store, 2, 0)
    with pytest.raises(CheckpointError, match="not an nbtrain checkpoint shard"):
        store.load_shard(2, 0)


class Evil:
    def __reduce__(self) -> tuple[Any, ...]:
        return (print, ("this must never run",))


def test_arbitrary_pickle_is_refused_even_with_valid_checksums(store: CheckpointStore) -> None:
    checkpoint(store, 3)
    path = f"{store.step_dir(3)}/rank-00001-of-00002.pt"
    with store.fs.open(path, "wb") as f:
        torch.save({"format": "nbtrain-checkpoint", "payload": Evil()}, f)
    _rehash(store, 3, 1)
    with pytest.raises(CheckpointError, match=r"cannot be loaded: .*Unpickl|weights_only"):
        store.load_shard(3, 1)


def _rehash(store: CheckpointStore, step: int, rank: int) -> None:
    from nbtrain.runtime.storage import _canonical

    mpath = f"{store.step_dir(step)}/{MANIFEST}"
    doc = json.loads(read(store, mpath))
    entry = doc["body"]["shards"][rank]
    data = read(store, f"{store.step_dir(step)}/{entry['file']}")
    entry["bytes"], entry["sha256"] = len(data), hashlib.sha256(data).hexdigest()
    doc["sha256"] = hashlib.sha256(_canonical(doc["body"])).hexdigest()
    rewrite(store, mpath, json.dumps(doc).encode())


def test_another_world_size_reads_the_replicated_shard_of_rank_modulo(
        store: CheckpointStore) -> None:
    checkpoint(store, 1, world=2)
    got = [store.restore_latest(r, world_size=3) for r in range(3)]
    assert [g.shard_rank for g in got if g] == [0, 1, 0]
    assert [g.payload["rank"] for g in got if g] == [0, 1, 0]
    assert all(g is not None and g.step == 1 for g in got)
    shrunk = store.restore_latest(0, world_size=1)
    assert shrunk is not None and shrunk.shard_rank == 0


def test_restore_on_empty_store_and_when_nothing_loads(store: CheckpointStore) -> None:
    assert store.restore_latest(0) is None
    store.write_shard(1, 0, 1, payload(1, 0))  # incomplete only: still a fresh start
    assert store.restore_latest(0) is None
    checkpoint(store, 2, world=1)
    _forge_manifest(store, 2, sha256="0" * 64)
    with pytest.raises(CheckpointError, match=r"no loadable checkpoint: .*checksum mismatch"):
        store.restore_latest(0)


def test_restore_at_or_before(store: CheckpointStore) -> None:
    for s in (1, 2, 3):
        checkpoint(store, s)
    res = store.restore_latest(0, at_or_before=2)
    assert res is not None and res.step == 2


# -- retention and cleanup --------------------------------------------------------------------
def test_prune_keeps_the_newest_k(store: CheckpointStore) -> None:
    for s in range(1, 7):
        checkpoint(store, s)
    assert store.prune() == [3, 2, 1]
    assert store.committed() == [6, 5, 4]
    assert store.prune() == []


def test_prune_counts_only_valid_checkpoints_and_keeps_the_newest(store: CheckpointStore) -> None:
    store.keep = 1
    for s in (1, 2, 3):
        checkpoint(store, s)
    _forge_manifest(store, 3, sha256="bad")  # step 3 no longer counts as committed
    assert store.prune() == [1]
    assert store.committed() == [2]


def test_cleanup_removes_only_older_incomplete_directories(local: CheckpointStore) -> None:
    local.write_shard(1, 0, 2, payload(1, 0))  # incomplete, older than the newest commit
    checkpoint(local, 2)
    local.write_shard(3, 0, 2, payload(3, 0))  # incomplete, newer: a live writer may own it
    stray = local_file(local, 2, "rank-00001-of-00002.pt.tmp-deadbeef")
    stray.write_bytes(b"half")
    removed = local.cleanup_incomplete()
    assert local.step_dir(1) in removed and str(stray) in removed
    assert not os.path.exists(local.step_dir(1)) and not stray.exists()
    assert os.path.exists(local.step_dir(3))
    assert local.committed() == [2] and local.load_shard(2, 1)["step"] == 2


def test_cleanup_leaves_unreadable_checkpoints_alone(store: CheckpointStore) -> None:
    checkpoint(store, 1)
    checkpoint(store, 2)
    _forge_manifest(store, 1, version=99)  # e.g. written by a newer nbtrain
    assert store.cleanup_incomplete() == []
    assert store.fs.exists(f"{store.step_dir(1)}/{MANIFEST}")


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    keep=st.integers(1, 4),
    ops=st.lists(st.sampled_from(["commit", "partial", "corrupt"]), min_size=1, max_size=12),
)
def test_retention_property(keep: int, ops: list[str]) -> None:
    store = CheckpointStore(f"memory://prop-{uuid.uuid4().hex}/c", keep=keep)
    newest = None
    for step, op in enumerate(ops, start=1):
        if op == "commit":
            checkpoint(store, step, world=1)
            newest = step
        elif op == "partial":
            store.write_shard(step, 0, 2, payload(step, 0))
        elif newest is not None:  # corrupt the newest committed one's manifest
            _forge_manifest(store, newest, sha256="bad")
            newest = max((s for s in store.committed()), default=None)
        store.prune()
        store.cleanup_incomplete()
        committed = store.committed()
        assert len(committed) <= keep
        assert (committed[0] if committed else None) == newest
        if newest is not None:
            assert store.load_shard(newest, 0)["step"] == newest


# -- crash consistency: SIGKILL writers at varied moments -------------------------------------
def _writer(url: str, rank: int, world: int, start: int, attempt: str, conn: Any) -> None:
    """Checkpoint forever as one rank of a job; report each commit; die by SIGKILL."""
    from nbtrain.runtime.async_ckpt import AsyncCheckpointer

    torch.set_num_threads(1)
    store = CheckpointStore(url, keep=3)

    def on_event(kind: str, info: dict[str, Any]) -> None:
        if kind == "committed":
            conn.send(info["step"])

    ck = AsyncCheckpointer(
        store, rank=rank, world_size=world, attempt=attempt, on_event=on_event, writer_nice=0
    )
    big = torch.empty(1 << 20)  # 4 MB per shard: a persist takes long enough to be hit
    conn.send("started")
    step = start
    while True:
        big.fill_(float(step * 10 + rank))
        ck.save(step, {"w": big}, {"step": step})
        step += 1


def _check_store(url: str, reported: int | None) -> int | None:
    """Every manifest on disk must point at complete, matching shards; restore finds the
    newest one, which is at least the newest commit a writer reported."""
    store = CheckpointStore(url, keep=3)
    on_disk = sorted(
        (
            int(d.name[5:])
            for d in Path(store.root).iterdir()
            if d.name.startswith("step-") and (d / MANIFEST).exists()
        ),
        reverse=True,
    )
    assert store.committed() == on_disk
    for step in on_disk:
        for rank in (0, 1):
            got = store.load_shard(step, rank)
            assert torch.equal(got["state"]["w"], torch.full((1 << 20,), float(step * 10 + rank)))
            assert got["meta"] == {"step": step}
    newest = on_disk[0] if on_disk else None
    for rank in (0, 1):
        res = store.restore_latest(rank, world_size=2)
        assert (res.step if res else None) == newest
        assert res is None or res.skipped == [] or all(s > res.step for s, _ in res.skipped)
    if reported is not None:
        assert newest is not None and newest >= reported
    return newest


@pytest.mark.slow
def test_sigkill_during_persist_never_leaves_a_loadable_partial_checkpoint(
    tmp_path: Path,
) -> None:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "nbtrain.runtime.async_ckpt", __name__])
    url = str(tmp_path / "ckpt")
    rng = random.Random(20240601)
    newest: int | None = None
    trials = 24
    kills_mid_persist = 0
    for trial in range(trials):
        start = (newest or 0) + 1
        conns, procs = [], []
        for rank in (0, 1):
            parent, child = ctx.Pipe()
            p = ctx.Process(
                target=_writer, args=(url, rank, 2, start, f"t{trial}", child), daemon=True
            )
            p.start()
            child.close()
            conns.append(parent)
            procs.append(p)
        for c in conns:
            assert c.poll(60), "writer did not start"
            assert c.recv() == "started"
        # Let them run a varied time, then SIGKILL one rank, a varied gap, then the other.
        time.sleep(rng.uniform(0.0, 0.4))
        order = [0, 1] if rng.random() < 0.5 else [1, 0]
        os.kill(procs[order[0]].pid, signal.SIGKILL)
        time.sleep(rng.uniform(0.0, 0.05))
        os.kill(procs[order[1]].pid, signal.SIGKILL)
        for p in procs:
            p.join(30)
            assert p.exitcode == -signal.SIGKILL
        reported = None
        while conns[0].poll():
            try:
                msg = conns[0].recv()
            except (EOFError, OSError):  # the writer is dead: its end of the pipe closed
                break
            if isinstance(msg, int):
                reported = msg
        newest = _check_store(url, reported) or newest
        in_progress = [
            d
            for d in Path(url).iterdir()
            if d.name.startswith("step-") and int(d.name[5:]) > (newest or 0)
        ]
        kills_mid_persist += bool(in_progress)
    # Most kills landed while a checkpoint newer than the newest committed was being written.
    assert kills_mid_persist >= trials // 2, kills_mid_persist
    store = CheckpointStore(url, keep=3)
    store.cleanup_incomplete()
    assert _check_store(url, None) == newest
