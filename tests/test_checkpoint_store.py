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

from nbtrain.runtime.checksum import Checksum
from nbtrain.runtime.storage import (
    MANIFEST,
    CheckpointError,
    CheckpointStore,
    split_checkpoint_url,
)

DATA = Path(__file__).parent / "data" / "checkpoints"


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
    assert m.shards[1].checksum == Checksum.of_bytes(shard, "xxh3_128")
    assert m.shards[1].bytes == len(shard)
    doc = json.loads(read(store, f"{store.step_dir(7)}/{MANIFEST}"))
    assert doc["body"]["shards"][1]["xxh3_128"] == m.shards[1].checksum.hex
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
    with pytest.raises(CheckpointError,
                       match=r"rank-00000-of-00002.pt: xxh3_128 checksum does not match"):
        store.load_shard(2, 0)
    res = store.restore_latest(0)
    assert res is not None and res.step == 1
    assert "rank-00000-of-00002.pt" in res.skipped[0][1]


def test_truncated_shard(store: CheckpointStore) -> None:
    checkpoint(store, 1)
    checkpoint(store, 2)
    path = f"{store.step_dir(2)}/rank-00001-of-00002.pt"
    rewrite(store, path, read(store, path)[:100])
    with pytest.raises(CheckpointError,
                       match=r"rank-00001-of-00002.pt: file has 100 bytes, the manifest says"):
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
    entry["bytes"], entry["xxh3_128"] = len(data), Checksum.of_bytes(data).hex
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


# -- checksums streamed while reading ---------------------------------------------------------
def dcp_state() -> dict[str, Any]:
    return {"model": {"w": torch.arange(4096.0).reshape(64, 64), "b": torch.arange(64.0)},
            "opt": {"lr": 0.25, "step": 5}}


def dcp_checkpoint(store: CheckpointStore, step: int, world: int = 2) -> None:
    from nbtrain.runtime.dcp_write import plan_shard

    for r in range(world):
        shard = plan_shard(dcp_state(), rank=r, world_size=world)
        store.write_shard(step, r, world, {"meta": {"step": step}}, attempt="a", dcp=shard)
    store.commit(step, world, attempt="a")


def test_dcp_files_are_read_once_and_verified_as_they_are_read(
        store: CheckpointStore, monkeypatch: pytest.MonkeyPatch) -> None:
    from nbtrain.runtime.dcp_read import load_full

    dcp_checkpoint(store, 3)
    manifest = store.read_manifest(3)
    sizes = {f.file: f.bytes for f in (*manifest.files, *manifest.shards)}
    got: dict[str, int] = {}
    real_open = store.fs.open

    class Counting:
        def __init__(self, f: Any, name: str) -> None:
            self.f, self.name = f, name

        def read(self, n: int = -1) -> bytes:
            data = self.f.read(n)
            got[self.name] = got.get(self.name, 0) + len(data)
            return bytes(data)

        def __getattr__(self, attr: str) -> Any:
            return getattr(self.f, attr)

        def __enter__(self) -> Counting:
            return self

        def __exit__(self, *exc: object) -> None:
            self.f.close()

    def counting_open(path: str, mode: str = "rb", **kw: Any) -> Any:
        f = real_open(path, mode, **kw)
        return Counting(f, path.rsplit("/", 1)[-1]) if mode == "rb" else f

    monkeypatch.setattr(store.fs, "open", counting_open)
    state = load_full(store.dcp_reader(manifest))
    assert torch.equal(state["model"]["w"], dcp_state()["model"]["w"])
    assert state["opt"] == {"lr": 0.25, "step": 5}
    # Each data file and the index read exactly once, every byte: no verification pass.
    for name in ("__0_0.distcp", "__1_0.distcp", "dcp-index.json"):
        assert got[name] == sizes[name], (name, got, sizes)


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_damaged_dcp_data_file_fails_the_load_naming_it(store: CheckpointStore,
                                                          damage: str) -> None:
    from nbtrain.runtime.dcp_read import load_full

    dcp_checkpoint(store, 4)
    path = f"{store.step_dir(4)}/__0_0.distcp"
    data = bytearray(read(store, path))
    if damage == "flip":
        data[len(data) // 3] ^= 0x01
    else:
        data = data[: len(data) // 2]
    rewrite(store, path, bytes(data))
    expect = (r"__0_0.distcp: xxh3_128 checksum does not match" if damage == "flip"
              else r"__0_0.distcp: file has \d+ bytes, the manifest says")
    manifest = store.read_manifest(4)
    with pytest.raises(CheckpointError, match=expect):
        load_full(store.dcp_reader(manifest))
    with pytest.raises(CheckpointError, match=expect):
        store.verify(4)


def test_reading_part_of_a_file_still_verifies_all_of_it(store: CheckpointStore) -> None:
    from nbtrain.runtime.dcp_read import load_into

    dcp_checkpoint(store, 6, world=1)  # one data file: w, b and the optimizer's values
    index = json.loads(read(store, f"{store.step_dir(6)}/dcp-index.json"))
    w = index["items"]["model.w"]["chunks"][0]
    path = f"{store.step_dir(6)}/__0_0.distcp"
    data = bytearray(read(store, path))
    data[w["offset"] + w["length"] // 2] ^= 0x01  # inside w, which the load below skips
    rewrite(store, path, bytes(data))
    only_b = {"model": {"b": torch.zeros(64)}}
    with pytest.raises(CheckpointError, match=r"__0_0.distcp: xxh3_128 checksum does not"):
        load_into(only_b, store.dcp_reader(store.read_manifest(6)))


def test_a_damaged_index_is_refused_before_it_is_parsed(store: CheckpointStore) -> None:
    dcp_checkpoint(store, 5)
    path = f"{store.step_dir(5)}/dcp-index.json"
    rewrite(store, path, read(store, path).replace(b'"items"', b'"itemz"'))
    with pytest.raises(CheckpointError, match=r"dcp-index.json: xxh3_128 checksum does not"):
        store.dcp_reader(store.read_manifest(5))


def test_checkpoints_with_sha256_checksums_still_load(tmp_path: Path) -> None:
    """Written by nbtrain before xxh3 (tests/data/checkpoints/README.md)."""
    import shutil

    from nbtrain.runtime.dcp_read import load_full

    shutil.copytree(DATA, tmp_path / "old")
    v1 = CheckpointStore(str(tmp_path / "old" / "sha256-format1"))
    assert v1.committed() == [3]
    assert v1.read_manifest(3).shards[0].checksum.algo == "sha256"
    for rank in (0, 1):
        res = v1.restore_latest(rank)
        assert res is not None and res.step == 3 and res.skipped == []
        assert torch.equal(res.payload["state"]["w"], torch.arange(6.0).reshape(2, 3) + rank)
    v2 = CheckpointStore(str(tmp_path / "old" / "sha256-format2"))
    manifest = v2.verify(5)
    assert manifest.sharded and {f.checksum.algo for f in manifest.files} == {"sha256"}
    state = load_full(v2.dcp_reader(manifest))
    assert torch.equal(state["model"]["w"], torch.arange(12.0).reshape(3, 4))
    assert torch.equal(state["model"]["b"], torch.full((4,), 0.5))
    assert state["opt"] == {"lr": 0.25, "step": 5}
    assert v2.load_shard(5, 1) == {"meta": {"step": 5, "rank": 1}}
    # ... and their sha256 still catches a flipped byte, naming the file.
    path = tmp_path / "old" / "sha256-format2" / "step-00000005" / "__1_0.distcp"
    data = bytearray(path.read_bytes())
    data[100] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"__1_0.distcp: sha256 checksum does not match"):
        load_full(v2.dcp_reader(manifest))


# -- commit: one listing per poll -------------------------------------------------------------
class Requests:
    """Counts what the committer asks the store: listings, and opens by file name."""

    def __init__(self, store: CheckpointStore, monkeypatch: pytest.MonkeyPatch) -> None:
        self.listings = 0
        self.opens: dict[str, int] = {}
        real_ls, real_open = store.fs.ls, store.fs.open

        def ls(path: str, *a: Any, **kw: Any) -> Any:
            self.listings += 1
            return real_ls(path, *a, **kw)

        def open_(path: str, mode: str = "rb", **kw: Any) -> Any:
            if mode == "rb":
                name = path.rsplit("/", 1)[-1]
                self.opens[name] = self.opens.get(name, 0) + 1
            return real_open(path, mode, **kw)

        monkeypatch.setattr(store.fs, "ls", ls)
        monkeypatch.setattr(store.fs, "open", open_)


def test_commit_polls_with_one_listing_and_backs_off(store: CheckpointStore,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    store.write_shard(6, 0, 4, payload(6, 0), attempt="g")
    store.write_shard(6, 1, 4, payload(6, 1), attempt="old")  # a crashed earlier attempt's
    asked = Requests(store, monkeypatch)
    t0 = time.monotonic()
    with pytest.raises(CheckpointError) as err:
        store.commit(6, 4, attempt="g", timeout_s=0.6)
    took = time.monotonic() - t0
    assert "waiting for the shards of ranks [1, 2, 3] (attempt 'g')" in str(err.value)
    assert "rank 1's receipt there is of attempt 'old'" in str(err.value)
    assert 0.6 <= took < 5
    # 5 ms doubling to 250 ms: about 7 polls in 0.6 s (at 20 ms, 30 polls of 7 requests).
    assert 4 <= asked.listings <= 10, asked.listings
    assert asked.opens == {"rank-00000-of-00004.json": 1, "rank-00001-of-00004.json": 1}


def test_commit_reads_each_receipt_once_as_it_arrives(store: CheckpointStore,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    asked = Requests(store, monkeypatch)
    store.write_shard(8, 0, 3, payload(8, 0), attempt="g")

    def late() -> None:
        for r in (1, 2):
            time.sleep(0.15)
            store.write_shard(8, r, 3, payload(8, r), attempt="g")

    writer = threading.Thread(target=late)
    writer.start()
    manifest = store.commit(8, 3, attempt="g", timeout_s=30)
    writer.join()
    assert manifest.world_size == 3 and store.committed() == [8]
    receipts = {k: v for k, v in asked.opens.items() if k.endswith("-of-00003.json")}
    assert receipts == {f"rank-0000{r}-of-00003.json": 1 for r in range(3)}
    assert asked.listings < 40


def test_commit_cancelled_while_polling_and_bad_poll_settings(store: CheckpointStore) -> None:
    store.write_shard(9, 0, 2, payload(9, 0), attempt="g")
    calls: list[int] = []

    def cancelled() -> bool:
        calls.append(1)
        return len(calls) >= 3

    with pytest.raises(CheckpointError, match=r"commit cancelled while waiting for ranks \[1\]"):
        store.commit(9, 2, attempt="g", timeout_s=60, cancelled=cancelled)
    with pytest.raises(ValueError, match="poll_s must be"):
        store.commit(9, 2, attempt="g", poll_s=(0.5, 0.1))


# -- saves that never commit are removed ------------------------------------------------------
def names(store: CheckpointStore, step: int) -> list[str]:
    try:
        return sorted(p.rsplit("/", 1)[-1] for p in store.fs.ls(store.step_dir(step),
                                                                detail=False))
    except FileNotFoundError:
        return []


def test_a_failed_commit_removes_its_attempt(store: CheckpointStore) -> None:
    for r in (0, 1):
        store.write_shard(2, r, 3, payload(2, r), attempt="g")
    store.write_shard(2, 2, 3, payload(2, 2), attempt="other")  # not ours: stays
    with pytest.raises(CheckpointError, match="timed out"):
        store.commit(2, 3, attempt="g", timeout_s=0.05)
    removed = store.discard(2, 3, "g")
    assert len(removed) == 4
    assert names(store, 2) == ["rank-00002-of-00003.json", "rank-00002-of-00003.pt"]
    assert store.discard(2, 3, "other") and names(store, 2) == []
    assert not store.fs.exists(store.step_dir(2))  # the emptied directory went too


def test_a_rank_whose_write_failed_removes_its_own_files(local: CheckpointStore) -> None:
    from nbtrain.runtime.dcp_write import plan_shard

    shard = plan_shard(dcp_state(), rank=1, world_size=2)
    with pytest.raises(Exception, match=r"pickle|lambda|Can.t"):  # its data file is written
        local.write_shard(3, 1, 2, {"f": lambda: 0}, attempt="g", dcp=shard)
    assert names(local, 3) == ["__1_0.distcp"]
    local.write_failure(3, 1, 2, "PicklingError", attempt="g")
    (Path(local.step_dir(3)) / "rank-00001-of-00002.pt.tmp-dead").write_bytes(b"half")
    local.write_shard(3, 0, 2, payload(3, 0), attempt="g")  # another rank's: stays
    local.discard(3, 2, "g", rank=1)
    # Its failure marker stays: the committer reads it to fail at once.
    assert names(local, 3) == ["rank-00000-of-00002.json", "rank-00000-of-00002.pt",
                               "rank-00001-of-00002.failed.json"]
    with pytest.raises(CheckpointError, match="rank 1 failed to write its shard"):
        local.commit(3, 2, attempt="g", timeout_s=30)
    local.discard(3, 2, "g")
    assert names(local, 3) == []


def test_after_its_generation_ended_only_files_its_receipt_names_go(
        store: CheckpointStore) -> None:
    for r in (0, 1):
        store.write_shard(4, r, 2, payload(4, r), attempt="g1")
    # The next generation already rewrote rank 1's shard under the same name (another size).
    rewrite(store, f"{store.step_dir(4)}/rank-00001-of-00002.pt", b"a newer generation's")
    store.discard(4, 2, "g1", ended=True)
    assert names(store, 4) == ["rank-00001-of-00002.pt"]


def test_a_committed_step_is_never_discarded(store: CheckpointStore) -> None:
    checkpoint(store, 5)
    before = names(store, 5)
    assert store.discard(5, 2, "a") == [] and store.discard(5, 2, "a", rank=0) == []
    assert names(store, 5) == before and store.load_shard(5, 1)["step"] == 5


def test_cleanup_at_a_generation_start_removes_every_uncommitted_save(
        local: CheckpointStore) -> None:
    local.write_shard(1, 0, 2, payload(1, 0), attempt="g1")  # never committed, no newer
    assert local.cleanup_incomplete() == []  # after a commit: nothing committed, stays
    checkpoint(local, 2)
    local.write_shard(3, 0, 2, payload(3, 0), attempt="g1")  # newer: stays after a commit
    assert local.cleanup_incomplete() == [local.step_dir(1)]
    assert local.write_probe("g1", 0) == "" and local.write_probe("g2", 1) == ""
    stray = local_file(local, 2, "manifest.json.tmp-0123")
    stray.write_bytes(b"{")
    removed = local.cleanup_incomplete(start_of="g2")
    assert set(removed) == {local.step_dir(3), str(stray), f"{local.root}/.probe-g1-r0"}
    assert local.unseen_probes("g2", range(1, 2)) == []  # its own probes stay
    assert local.committed() == [2] and local.load_shard(2, 0)["step"] == 2
    # A directory whose manifest is unreadable is not ours to remove, even at a start.
    checkpoint(local, 4)
    _forge_manifest(local, 4, version=99)
    assert local.cleanup_incomplete(start_of="g3") == [f"{local.root}/.probe-g2-r1"]
    assert os.path.exists(local.step_dir(4))


# -- local data files written with O_DIRECT ---------------------------------------------------
@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 8 << 20, (8 << 20) + 12345, (17 << 20) + 7])
def test_a_direct_file_holds_exactly_what_was_written(tmp_path: Path, size: int) -> None:
    from nbtrain.runtime.direct_io import DirectFile

    data = random.Random(size).randbytes(size)
    path = tmp_path / "f"
    rng = random.Random(-size)
    with DirectFile(str(path)) as f:
        pos = 0
        while pos < size:  # pieces of any size, as torch.save writes them
            n = rng.randint(1, 3 << 20)
            f.write(memoryview(data)[pos:pos + n])
            pos += n
        f.seal()
        os.fsync(f.fileno())
    assert path.read_bytes() == data


def test_a_direct_file_falls_back_where_o_direct_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    from nbtrain.runtime.direct_io import DirectFile

    if not getattr(os, "O_DIRECT", 0):
        pytest.skip("no O_DIRECT on this platform")
    data = random.Random(1).randbytes((9 << 20) + 5)
    real_open, real_write = os.open, os.write
    direct_fds: set[int] = set()

    def open_at_first(path: str, flags: int, *a: Any) -> int:  # a FUSE-like mount
        fd = real_open(path, flags, *a)
        (direct_fds.add if flags & os.O_DIRECT else direct_fds.discard)(fd)
        return fd

    def refuse_direct_writes(fd: int, b: Any) -> int:
        if fd in direct_fds:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, b)

    def refuse_at_open(path: str, flags: int, *a: Any) -> int:  # tmpfs-like
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)

    for name, opener in (("refused-at-write", open_at_first), ("refused-at-open",
                                                               refuse_at_open)):
        monkeypatch.setattr(os, "open", opener)
        monkeypatch.setattr(os, "write", refuse_direct_writes)
        path = tmp_path / name
        with DirectFile(str(path)) as f:
            f.write(data[:100])
            f.write(data[100:])
            f.seal()
            assert not f.direct
        monkeypatch.setattr(os, "open", real_open)
        monkeypatch.setattr(os, "write", real_write)
        assert path.read_bytes() == data, name


def test_direct_and_buffered_writes_make_the_same_checkpoint(tmp_path: Path) -> None:
    big = {"w": torch.arange(3 << 20, dtype=torch.float32), "step": 1}  # 12 MB
    stores = [CheckpointStore(str(tmp_path / n), direct_io=d) for n, d in (("d", True),
                                                                           ("b", False))]
    for s in stores:
        s.write_shard(1, 0, 1, big, attempt="a")
        s.commit(1, 1, attempt="a")
    files = [local_file(s, 1, "rank-00000-of-00001.pt").read_bytes() for s in stores]
    assert files[0] == files[1]
    assert torch.equal(stores[0].load_shard(1, 0)["w"], big["w"])
