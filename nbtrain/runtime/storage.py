"""Committed checkpoints on any fsspec storage, with a two-phase commit.

Layout under the root URL (format 2, the one jobs write)::

    step-00000123/__0_0.distcp               rank 0's tensor chunks and objects (DCP's layout)
    step-00000123/rank-00000-of-00002.pt     rank 0's own: RNG states, data position, step
    step-00000123/rank-00000-of-00002.json   receipt: the rank's files, sizes, sha256, index
    step-00000123/.metadata                  DCP's metadata (pickle), for DCP's own readers
    step-00000123/dcp-index.json             the same as JSON, what nbtrain reads
    step-00000123/manifest.json              written last: the checkpoint is committed

The step directory is a ``torch.distributed.checkpoint`` checkpoint (``dcp.load``,
``dcp_to_torch_save``): replicated tensors once, sharded tensors per owner (see
:mod:`nbtrain.runtime.dcp_write`). Format 1, written before sharded checkpoints, has no DCP
files: each rank's ``.pt`` shard holds a full copy of the state; it is still read.

Phase one: every rank writes its files under temporary names, flushes and fsyncs them (local
files), renames them into place, then writes its receipt the same way; a receipt therefore
proves its files are durable. Phase two: one rank waits (with a deadline) for all receipts of
the same attempt, writes DCP's metadata and the index from them, then the manifest, each
atomically. A checkpoint is committed when its manifest is present and valid; a crash at any
moment leaves either a committed checkpoint or a directory without a manifest, which readers
ignore and ``cleanup_incomplete`` removes.

Reading verifies the manifest's own checksum, each shard's size and sha256, and loads with
``torch.load(..., weights_only=True)``, so a checkpoint directory cannot run code. Problems
raise ``CheckpointError`` naming the file and what is wrong; ``restore_latest`` falls back to
the previous committed checkpoint and reports what it skipped.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pickle
import posixpath
import re
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import fsspec
import torch
from fsspec.core import url_to_fs

from nbtrain.core.checkpoint_policy import DEFAULT_COMMIT_TIMEOUT_S
from nbtrain.runtime.dcp_read import IndexReader, sha256_of
from nbtrain.runtime.dcp_write import (
    INDEX_FILE,
    METADATA_FILE,
    DcpShard,
    data_file,
    index_from_receipts,
    metadata_from_index,
    write_items,
)

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "CheckpointError",
    "CheckpointStore",
    "Manifest",
    "PersistTimes",
    "RestoreResult",
    "ShardInfo",
    "split_checkpoint_url",
]

FORMAT_NAME = "nbtrain-checkpoint"
#: 1: each rank's shard a full copy of the state; 2: DCP layout (sharded, replicated once).
FORMAT_VERSION = 2
FULL_COPY_VERSION = 1
READABLE_VERSIONS = (1, 2)
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step-(\d{8,})$")
_TMP = ".tmp-"
_CHUNK = 8 << 20
# Object stores have no rename, but a PUT is atomic: write the final name directly there.
_NO_RENAME = {"s3", "s3a", "gs", "gcs", "abfs", "az", "adl", "oss"}


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written, committed or read. ``path`` names the file."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = path
        self.problem = problem


@dataclass
class PersistTimes:
    """Where a checkpoint's persist time went, in seconds, summed over its files: hashing the
    bytes, handing them to the file (the page cache, or the store's client), fsync (local
    files), and the committer's wait for the other ranks' receipts. What is left of the
    persist's wall time is serialization and waiting for a CPU."""

    checksum_s: float = 0.0
    write_s: float = 0.0
    fsync_s: float = 0.0
    commit_wait_s: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return {"checksum_s": self.checksum_s, "write_s": self.write_s,
                "fsync_s": self.fsync_s, "commit_wait_s": self.commit_wait_s}


@dataclass(frozen=True)
class ShardInfo:
    rank: int
    file: str  # name inside the step directory
    bytes: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    step: int
    world_size: int
    shards: tuple[ShardInfo, ...]  # each rank's own file (format 1: its full copy)
    job: dict[str, Any]
    metadata: dict[str, Any]
    attempt: str
    created_unix: float
    path: str
    version: int = FULL_COPY_VERSION
    #: Format 2: the DCP files (data files by rank; ``.metadata`` and the index rank -1).
    files: tuple[ShardInfo, ...] = ()

    @property
    def bytes(self) -> int:
        return sum(s.bytes for s in self.shards) + sum(f.bytes for f in self.files)

    @property
    def sharded(self) -> bool:
        """Written in DCP's layout (format 2)."""
        return self.version >= 2


@dataclass(frozen=True)
class Receipt:
    """What a rank's receipt says: its own shard, its DCP data file, and that file's index
    entries (``dcp``: ``{"entries", "held", "paths"}``)."""

    shard: ShardInfo
    files: tuple[ShardInfo, ...] = ()
    dcp: dict[str, Any] | None = None


@dataclass
class RestoreResult:
    step: int
    payload: Any
    manifest: Manifest
    skipped: list[tuple[int, str]] = field(default_factory=list)  # (step, why) newest first
    shard_rank: int = -1  # the shard read (another rank's when the world size changed)


def shard_name(rank: int, world_size: int) -> str:
    return f"rank-{rank:05d}-of-{world_size:05d}.pt"


def split_checkpoint_url(url: str) -> tuple[str, int | None]:
    """``.../step-00000123`` -> (root, 123); any other URL -> (url, None)."""
    trimmed = url.rstrip("/")
    m = _STEP_DIR.match(posixpath.basename(trimmed))
    if m is None:
        return url, None
    return trimmed[: -len(posixpath.basename(trimmed))].rstrip("/") or "/", int(m.group(1))


class _HashingWriter:
    """File-like that hashes and counts what torch.save writes: one pass over the bytes."""

    def __init__(self, raw: BinaryIO, times: PersistTimes | None = None) -> None:
        self.raw = raw
        self.sha = hashlib.sha256()
        self.count = 0
        self.times = times if times is not None else PersistTimes()

    def write(self, data: Any) -> int:
        t0 = time.perf_counter()
        self.sha.update(data)
        t1 = time.perf_counter()
        n = self.raw.write(data)
        t2 = time.perf_counter()
        self.times.checksum_s += t1 - t0
        self.times.write_s += t2 - t1
        self.count += memoryview(data).nbytes
        return n if n is not None else memoryview(data).nbytes

    def flush(self) -> None:
        self.raw.flush()


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


class CheckpointStore:
    """Checkpoints of one job under ``url`` (a local directory or any fsspec URL).

    keep: how many committed checkpoints ``prune`` keeps (>= 1; the newest is never removed).
    storage_options: passed to fsspec (credentials, endpoint, ...).
    """

    def __init__(
        self, url: str, *, keep: int = 3, storage_options: Mapping[str, Any] | None = None
    ) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(
                f"keep must be an integer >= 1, got {keep!r}: the newest committed checkpoint "
                "is always kept, e.g. keep=3"
            )
        self.url = url
        self.keep = keep
        self.fs, self.root = url_to_fs(url, **dict(storage_options or {}))
        self.root = self.root.rstrip("/") or "/"
        self._local = "file" in _protocols(self.fs)
        self._rename = not (_protocols(self.fs) & _NO_RENAME)
        self.fs.makedirs(self.root, exist_ok=True)

    def __repr__(self) -> str:
        return f"CheckpointStore({self.url!r}, keep={self.keep})"

    # -- paths --------------------------------------------------------------------------------
    def step_dir(self, step: int) -> str:
        return f"{self.root}/step-{step:08d}"

    def step_url(self, step: int) -> str:
        """A URL for this checkpoint that ``split_checkpoint_url`` and resume accept."""
        return f"{self.url.rstrip('/')}/step-{step:08d}"

    def _steps_on_disk(self) -> list[int]:
        with contextlib.suppress(Exception):
            self.fs.invalidate_cache(self.root)
        try:
            entries = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        steps = []
        for name in entries:
            m = _STEP_DIR.match(posixpath.basename(str(name).rstrip("/")))
            if m is not None:
                steps.append(int(m.group(1)))
        return sorted(set(steps), reverse=True)

    # -- atomic writes ------------------------------------------------------------------------
    def _write_atomic(self, path: str, write: Callable[[BinaryIO], None],
                      times: PersistTimes | None = None) -> None:
        """Write ``path`` so that readers see either nothing or the whole durable file."""
        if not self._rename:
            with self.fs.open(path, "wb") as f:
                write(f)
            return
        tmp = f"{path}{_TMP}{uuid.uuid4().hex}"
        try:
            if self._local:
                with open(tmp, "wb") as f:
                    write(f)
                    f.flush()
                    t0 = time.perf_counter()
                    os.fsync(f.fileno())
                    t1 = time.perf_counter()
                os.replace(tmp, path)
                t2 = time.perf_counter()
                _fsync_dir(posixpath.dirname(path))
                if times is not None:
                    times.fsync_s += (t1 - t0) + (time.perf_counter() - t2)
            else:
                with self.fs.open(tmp, "wb") as f:
                    write(f)
                self.fs.mv(tmp, path)
        except BaseException:
            with contextlib.suppress(Exception):
                if self._local:
                    os.unlink(tmp)
                else:
                    self.fs.rm(tmp)
            raise

    def _write_json(self, path: str, obj: Any, times: PersistTimes | None = None) -> None:
        data = json.dumps(obj, indent=1, sort_keys=True).encode()

        def write(f: BinaryIO) -> None:
            f.write(data)

        self._write_atomic(path, write, times)

    # -- phase one ----------------------------------------------------------------------------
    def write_shard(
        self, step: int, rank: int, world_size: int, payload: Any, *, attempt: str = "",
        dcp: DcpShard | None = None, times: PersistTimes | None = None,
    ) -> ShardInfo:
        """Persist this rank's files and its receipt. Blocking; call it off the training loop.

        payload: the rank's own shard (format 2: its meta; format 1: everything).
        dcp: the rank's part of a DCP-layout checkpoint (format 2); its data file is written
            first, and its index entries go into the receipt for the committer.
        attempt: an id shared by the ranks of one save (e.g. job generation): the committer
            only accepts receipts of its own attempt, never a stale shard of a crashed one.
        """
        _check_rank(rank, world_size)
        sdir = self.step_dir(step)
        if self.is_committed(step):
            raise CheckpointError(
                f"{sdir}/{MANIFEST}",
                f"step {step} is already committed; a committed checkpoint is never "
                "overwritten (take the next checkpoint at a later step)",
            )
        self.fs.makedirs(sdir, exist_ok=True)
        version = FORMAT_VERSION if dcp is not None else FULL_COPY_VERSION
        files: list[ShardInfo] = []
        part: dict[str, Any] | None = None
        if dcp is not None:
            dname = data_file(rank)
            entries: list[dict[str, Any]] = []

            def write_data(f: BinaryIO) -> None:
                hw = _HashingWriter(f, times)
                entries.extend(write_items(hw, dcp, dname))
                files.append(ShardInfo(rank=rank, file=dname, bytes=hw.count,
                                       sha256=hw.sha.hexdigest()))

            self._write_atomic(f"{sdir}/{dname}", write_data, times)
            part = {"entries": entries, "held": dcp.held, "paths": dcp.paths}
        name = shard_name(rank, world_size)
        obj = {
            "format": FORMAT_NAME,
            "version": version,
            "step": step,
            "rank": rank,
            "world_size": world_size,
            "payload": payload,
        }
        box: list[_HashingWriter] = []

        def write(f: BinaryIO) -> None:
            hw = _HashingWriter(f, times)
            torch.save(obj, hw)  # type: ignore[arg-type]
            box.append(hw)

        self._write_atomic(f"{sdir}/{name}", write, times)
        info = ShardInfo(rank=rank, file=name, bytes=box[0].count, sha256=box[0].sha.hexdigest())
        receipt: dict[str, Any] = {
            "format": FORMAT_NAME,
            "version": version,
            "step": step,
            "world_size": world_size,
            "attempt": attempt,
            "rank": rank,
            "file": name,
            "bytes": info.bytes,
            "sha256": info.sha256,
        }
        if part is not None:
            receipt["files"] = [{"file": f.file, "bytes": f.bytes, "sha256": f.sha256}
                                for f in files]
            receipt["dcp"] = part
        self._write_json(f"{sdir}/{name[:-3]}.json", receipt, times)
        return info

    def write_failure(
        self, step: int, rank: int, world_size: int, error: str, *, attempt: str = ""
    ) -> None:
        """Tell the committer that this rank's shard will not come, so it fails fast instead
        of waiting for its timeout. Best effort: on a full disk this may fail too."""
        _check_rank(rank, world_size)
        name = shard_name(rank, world_size)[:-3] + ".failed.json"
        doc = {
            "format": FORMAT_NAME,
            "step": step,
            "rank": rank,
            "attempt": attempt,
            "error": error,
        }
        with contextlib.suppress(Exception):
            self.fs.makedirs(self.step_dir(step), exist_ok=True)
            self._write_json(f"{self.step_dir(step)}/{name}", doc)

    def _read_failure(self, step: int, rank: int, world_size: int, attempt: str) -> str | None:
        path = f"{self.step_dir(step)}/{shard_name(rank, world_size)[:-3]}.failed.json"
        try:
            with self.fs.open(path, "rb") as f:
                doc = json.loads(f.read())
        except (OSError, ValueError):
            return None
        if isinstance(doc, dict) and doc.get("attempt") == attempt and doc.get("step") == step:
            return str(doc.get("error", "unknown error"))
        return None

    # -- phase two ----------------------------------------------------------------------------
    def commit(
        self,
        step: int,
        world_size: int,
        *,
        attempt: str = "",
        job: Mapping[str, Any] | None = None,
        metadata: Mapping[str, Any] | None = None,
        timeout_s: float = DEFAULT_COMMIT_TIMEOUT_S,
        poll_s: float = 0.02,
        cancelled: Callable[[], bool] | None = None,
        times: PersistTimes | None = None,
    ) -> Manifest:
        """Wait until every rank's receipt of ``attempt`` is there, then (format 2) write
        DCP's metadata and the index, then the manifest. ``times.commit_wait_s`` gets the
        wait."""
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        sdir = self.step_dir(step)
        started = time.monotonic()
        deadline = started + timeout_s
        receipts: dict[int, Receipt] = {}
        while True:
            for rank in range(world_size):
                if rank not in receipts:
                    got = self._read_receipt(step, rank, world_size, attempt)
                    if got is not None:
                        receipts[rank] = got
            if len(receipts) == world_size:
                break
            missing = sorted(set(range(world_size)) - set(receipts))
            for rank in missing:
                why = self._read_failure(step, rank, world_size, attempt)
                if why is not None:
                    raise CheckpointError(
                        f"{sdir}/{shard_name(rank, world_size)}",
                        f"rank {rank} failed to write its shard: {why}; not committing",
                    )
            if time.monotonic() >= deadline:
                raise CheckpointError(
                    sdir,
                    f"commit timed out after {timeout_s:g}s waiting for the shards of ranks "
                    f"{missing} (attempt {attempt!r}); a rank died or persists slower than "
                    "the commit timeout: raise it or check that rank",
                )
            if cancelled is not None and cancelled():
                raise CheckpointError(sdir, f"commit cancelled while waiting for ranks {missing}")
            time.sleep(poll_s)
        if times is not None:
            times.commit_wait_s += time.monotonic() - started
        for rec in receipts.values():
            for info in (rec.shard, *rec.files):
                size = self.fs.size(f"{sdir}/{info.file}")
                if size != info.bytes:
                    raise CheckpointError(
                        f"{sdir}/{info.file}",
                        f"file has {size} bytes but its receipt says {info.bytes}; not "
                        "committing",
                    )
        if cancelled is not None and cancelled():  # its generation ended: never commit now
            raise CheckpointError(sdir, "commit cancelled: its generation ended")
        sharded = [r for r in receipts.values() if r.dcp is not None]
        if sharded and len(sharded) != world_size:
            raise CheckpointError(sdir, "some ranks wrote DCP data files and some did not; "
                                        "not committing")
        files: list[ShardInfo] = [f for r in sorted(receipts) for f in receipts[r].files]
        if sharded:
            files += self._write_dcp_metadata(step, receipts, attempt, times)
        body: dict[str, Any] = {
            "step": step,
            "world_size": world_size,
            "attempt": attempt,
            "created_unix": time.time(),
            "job": dict(job or {}),
            "metadata": dict(metadata or {}),
            "shards": [
                {"rank": s.rank, "file": s.file, "bytes": s.bytes, "sha256": s.sha256}
                for s in sorted((r.shard for r in receipts.values()), key=lambda s: s.rank)
            ],
        }
        version = FULL_COPY_VERSION
        if sharded:
            version = FORMAT_VERSION
            body["layout"] = "dcp"
            body["files"] = [{"rank": f.rank, "file": f.file, "bytes": f.bytes,
                              "sha256": f.sha256} for f in files]
        try:
            digest = hashlib.sha256(_canonical(body)).hexdigest()
        except TypeError as e:
            raise ValueError(
                f"job spec and metadata must be JSON-serializable for the manifest: {e}"
            ) from e
        doc = {"format": FORMAT_NAME, "version": version, "body": body, "sha256": digest}
        self._write_json(f"{sdir}/{MANIFEST}", doc, times)
        return self._manifest_from(body, f"{sdir}/{MANIFEST}", version)

    def _write_dcp_metadata(self, step: int, receipts: Mapping[int, Receipt],
                            attempt: str, times: PersistTimes | None = None) -> list[ShardInfo]:
        """The index (JSON) and DCP's ``.metadata`` (pickle) from the ranks' receipts."""
        sdir = self.step_dir(step)

        def fail(why: str) -> CheckpointError:
            return CheckpointError(sdir, f"not committing: {why}")

        index = index_from_receipts({r: rec.dcp or {} for r, rec in receipts.items()}, fail)
        meta = metadata_from_index(index, checkpoint_id=self.step_url(step), save_id=attempt)
        out: list[ShardInfo] = []
        for name, data in ((INDEX_FILE, json.dumps(index, sort_keys=True).encode()),
                           (METADATA_FILE, pickle.dumps(meta))):
            def write(f: BinaryIO, data: bytes = data) -> None:
                f.write(data)

            self._write_atomic(f"{sdir}/{name}", write, times)
            out.append(ShardInfo(rank=-1, file=name, bytes=len(data),
                                 sha256=hashlib.sha256(data).hexdigest()))
        return out

    def _read_receipt(
        self, step: int, rank: int, world_size: int, attempt: str
    ) -> Receipt | None:
        path = f"{self.step_dir(step)}/{shard_name(rank, world_size)[:-3]}.json"
        try:
            with self.fs.open(path, "rb") as f:
                doc = json.loads(f.read())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return None  # being replaced or garbage from a crash: the rank will rewrite it
        if not isinstance(doc, dict) or doc.get("attempt") != attempt or doc.get("step") != step:
            return None
        try:
            shard = ShardInfo(
                rank=int(doc["rank"]),
                file=str(doc["file"]),
                bytes=int(doc["bytes"]),
                sha256=str(doc["sha256"]),
            )
            files = tuple(ShardInfo(rank=shard.rank, file=str(f["file"]), bytes=int(f["bytes"]),
                                    sha256=str(f["sha256"])) for f in doc.get("files", ()))
        except (KeyError, TypeError, ValueError):
            return None
        dcp = doc.get("dcp")
        return Receipt(shard=shard, files=files, dcp=dcp if isinstance(dcp, dict) else None)

    # -- reading ------------------------------------------------------------------------------
    def read_manifest(self, step: int) -> Manifest:
        """The manifest of ``step``, validated; ``CheckpointError`` if missing or bad."""
        path = f"{self.step_dir(step)}/{MANIFEST}"
        try:
            with self.fs.open(path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            raise CheckpointError(path, "no manifest: the checkpoint was never committed") from None
        try:
            doc = json.loads(raw)
        except ValueError as e:
            raise CheckpointError(path, f"manifest is not valid JSON ({e}): corrupt") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
            raise CheckpointError(path, "not an nbtrain checkpoint manifest (foreign file)")
        version = doc.get("version")
        if version not in READABLE_VERSIONS:
            raise CheckpointError(
                path,
                f"checkpoint format version {version!r}, this nbtrain reads versions "
                f"{', '.join(map(str, READABLE_VERSIONS))}: load it with the nbtrain version "
                "that wrote it",
            )
        body = doc.get("body")
        try:
            digest = hashlib.sha256(_canonical(body)).hexdigest()
        except TypeError:
            digest = ""
        if digest != doc.get("sha256"):
            raise CheckpointError(path, "manifest checksum mismatch: the manifest is corrupt")
        if not isinstance(body, dict) or body.get("step") != step:
            raise CheckpointError(
                path,
                f"manifest is for step {body.get('step') if isinstance(body, dict) else '?'}"
                f", but it lies in the directory of step {step}",
            )
        try:
            return self._manifest_from(body, path, int(version))
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(path, f"manifest is missing or has a bad field: {e!r}") from None

    @staticmethod
    def _manifest_from(body: Mapping[str, Any], path: str,
                       version: int = FULL_COPY_VERSION) -> Manifest:
        def infos(entries: Any) -> tuple[ShardInfo, ...]:
            return tuple(ShardInfo(rank=int(s["rank"]), file=str(s["file"]),
                                   bytes=int(s["bytes"]), sha256=str(s["sha256"]))
                         for s in entries)

        shards = infos(body["shards"])
        files = infos(body.get("files", ()))
        if version >= 2 and (body.get("layout") != "dcp"
                             or {INDEX_FILE, METADATA_FILE} - {f.file for f in files}):
            raise ValueError(f"a format {version} manifest names no DCP index and metadata")
        world_size = int(body["world_size"])
        if sorted(s.rank for s in shards) != list(range(world_size)):
            raise ValueError(f"shards {[s.rank for s in shards]} for world_size {world_size}")
        return Manifest(
            step=int(body["step"]),
            world_size=world_size,
            shards=shards,
            job=dict(body.get("job") or {}),
            metadata=dict(body.get("metadata") or {}),
            attempt=str(body.get("attempt", "")),
            created_unix=float(body.get("created_unix", 0.0)),
            path=path,
            version=version,
            files=files,
        )

    def is_committed(self, step: int) -> bool:
        """Whether ``step`` has a valid manifest (shards are verified only when loading)."""
        try:
            self.read_manifest(step)
        except CheckpointError:
            return False
        return True

    # -- can every rank see what every other rank writes? ---------------------------------
    def _probe_path(self, attempt: str, rank: int) -> str:
        return f"{self.root}/.probe-{attempt}-r{rank}"

    def write_probe(self, attempt: str, rank: int) -> str:
        """Write this rank's probe file; "" or why it could not."""
        try:
            self.fs.makedirs(self.root, exist_ok=True)
            with self.fs.open(self._probe_path(attempt, rank), "wb") as f:
                f.write(b"nbtrain storage probe\n")
        except Exception as e:  # any store's error: reported by every rank together
            return f"{type(e).__name__}: {e}"
        return ""

    def unseen_probes(self, attempt: str, ranks: range) -> list[int]:
        """The ranks whose probe file this process cannot see."""
        with contextlib.suppress(AttributeError):
            self.fs.invalidate_cache(self.root)  # listing caches (NFS-like stores)
        return [r for r in ranks if not self.fs.exists(self._probe_path(attempt, r))]

    def remove_probe(self, attempt: str, rank: int) -> None:
        with contextlib.suppress(Exception):
            self.fs.rm(self._probe_path(attempt, rank))

    def committed(self) -> list[int]:
        """Steps with a valid manifest, newest first."""
        return [s for s in self._steps_on_disk() if self.is_committed(s)]

    def latest(self) -> int | None:
        """The newest committed step, or None."""
        for s in self._steps_on_disk():
            if self.is_committed(s):
                return s
        return None

    def manifests(self) -> list[Manifest]:
        """Manifests of the committed checkpoints, newest first (for ``job.checkpoints``)."""
        out = []
        for s in self._steps_on_disk():
            with contextlib.suppress(CheckpointError):
                out.append(self.read_manifest(s))
        return out

    def _verify_file(self, manifest: Manifest, info: ShardInfo) -> str:
        path = f"{self.step_dir(manifest.step)}/{info.file}"
        try:
            with self.fs.open(path, "rb") as f:
                n, sha = sha256_of(f)
        except FileNotFoundError:
            raise CheckpointError(path, "shard listed in the manifest is missing") from None
        if n != info.bytes:
            raise CheckpointError(
                path, f"shard has {n} bytes, the manifest says {info.bytes}: truncated or replaced"
            )
        if sha != info.sha256:
            raise CheckpointError(
                path, "shard sha256 does not match the manifest: the file is corrupt"
            )
        return path

    def verify(self, step: int, *, ranks: list[int] | None = None) -> Manifest:
        """Check the manifest and the size and sha256 of the shards of ``ranks`` (all if None)."""
        manifest = self.read_manifest(step)
        for info in manifest.shards:
            if ranks is None or info.rank in ranks:
                self._verify_file(manifest, info)
        if ranks is None:
            for info in manifest.files:
                self._verify_file(manifest, info)
        return manifest

    def dcp_reader(self, manifest: Manifest) -> IndexReader:
        """A DCP ``StorageReader`` over a format-2 checkpoint: its index verified and read
        now, each data file verified before the first read from it."""
        if not manifest.sharded:
            raise CheckpointError(manifest.path, f"format {manifest.version} has no DCP files "
                                                 "(each rank's shard holds a full copy)")
        sdir = self.step_dir(manifest.step)
        files = {f.file: f for f in manifest.files}
        path = self._verify_file(manifest, files[INDEX_FILE])
        try:
            with self.fs.open(path, "rb") as f:
                index = json.loads(f.read())
        except ValueError as e:
            raise CheckpointError(path, f"index is not valid JSON ({e})") from None
        if not isinstance(index, dict) or not isinstance(index.get("items"), dict):
            raise CheckpointError(path, "not an nbtrain DCP index")

        def open_file(name: str) -> Any:
            return self.fs.open(f"{sdir}/{name}", "rb")

        def verify(name: str) -> None:
            info = files.get(name)
            if info is None:
                raise CheckpointError(f"{sdir}/{name}", "the index names a file the manifest "
                                                        "does not list")
            self._verify_file(manifest, info)

        return IndexReader(index, open_file, verify, checkpoint_id=self.step_url(manifest.step))

    def load_shard(self, step: int, rank: int, *, manifest: Manifest | None = None) -> Any:
        """This rank's payload at ``step``, checksum-verified, loaded with weights_only=True."""
        manifest = manifest or self.read_manifest(step)
        infos = [s for s in manifest.shards if s.rank == rank]
        if not infos:
            raise CheckpointError(
                manifest.path,
                f"no shard for rank {rank}: this checkpoint has world_size "
                f"{manifest.world_size} (ranks 0..{manifest.world_size - 1})",
            )
        path = self._verify_file(manifest, infos[0])
        try:
            if self._local:
                obj = torch.load(path, map_location="cpu", weights_only=True)
            else:
                with self.fs.open(path, "rb") as f:
                    obj = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as e:  # truncated zip, unknown class refused by weights_only, ...
            raise CheckpointError(path, f"cannot be loaded: {type(e).__name__}: {e}") from None
        if not isinstance(obj, dict) or obj.get("format") != FORMAT_NAME:
            raise CheckpointError(path, "not an nbtrain checkpoint shard (foreign file)")
        if obj.get("version") != manifest.version:
            raise CheckpointError(
                path,
                f"shard format version {obj.get('version')!r}, its manifest's is "
                f"{manifest.version}: files were mixed between checkpoints",
            )
        if obj.get("step") != step or obj.get("rank") != rank:
            raise CheckpointError(
                path,
                f"shard says step {obj.get('step')} rank {obj.get('rank')}, expected step "
                f"{step} rank {rank}: files were moved between checkpoints",
            )
        return obj["payload"]

    def restore_latest(
        self,
        rank: int,
        *,
        world_size: int | None = None,
        verify_all: bool = True,
        at_or_before: int | None = None,
    ) -> RestoreResult | None:
        """Load the newest committed checkpoint that is intact; None if there is none at all.

        Falls back past corrupt, foreign, version-mismatched or incomplete checkpoints and lists
        them in ``skipped``. A checkpoint written at another ``world_size`` holds data-parallel
        (replicated) state: this rank reads shard ``rank % its world size``
        (``RestoreResult.shard_rank`` says which). ``verify_all`` checks every rank's shard,
        not only this one, so all ranks fall back to the same step without talking to each
        other (the price: every rank reads every shard once). Raises ``CheckpointError`` when
        checkpoints exist but none can be loaded, rather than silently starting from scratch.
        """
        skipped: list[tuple[int, str]] = []
        for step in self._steps_on_disk():
            if at_or_before is not None and step > at_or_before:
                continue
            try:
                manifest = self.read_manifest(step)
                shard = rank
                if world_size is not None and manifest.world_size != world_size:
                    shard = rank % manifest.world_size
                if verify_all:
                    self.verify(step, ranks=[s.rank for s in manifest.shards if s.rank != shard])
                payload = self.load_shard(step, shard, manifest=manifest)
            except CheckpointError as e:
                skipped.append((step, str(e)))
                continue
            return RestoreResult(step=step, payload=payload, manifest=manifest, skipped=skipped,
                                 shard_rank=shard)
        committed_like = [s for s, why in skipped if "never committed" not in why]
        if committed_like:
            raise CheckpointError(
                self.url,
                "no loadable checkpoint: " + "; ".join(why for _, why in skipped),
            )
        return None

    # -- housekeeping -------------------------------------------------------------------------
    def cleanup_incomplete(self) -> list[str]:
        """Remove step directories without a manifest that are older than the newest committed
        checkpoint, and leftover temporary files in committed ones.

        Newer directories without a manifest may still be being written by a live writer, so
        they stay. Directories with an unreadable manifest (corrupt, foreign, or written by
        another format version) stay too: they are not ours to delete; ``restore_latest``
        reports them.
        """
        steps = self._steps_on_disk()
        newest = next((s for s in steps if self.is_committed(s)), None)
        removed: list[str] = []
        if newest is None:
            return removed
        for s in steps:
            if s > newest:
                continue
            sdir = self.step_dir(s)
            if not self.fs.exists(f"{sdir}/{MANIFEST}"):
                with contextlib.suppress(FileNotFoundError):
                    self.fs.rm(sdir, recursive=True)
                    removed.append(sdir)
            elif self.is_committed(s):
                for name in self.fs.ls(sdir, detail=False):
                    if _TMP in posixpath.basename(str(name)):
                        with contextlib.suppress(FileNotFoundError):
                            self.fs.rm(str(name))
                            removed.append(str(name))
        return removed

    def prune(self) -> list[int]:
        """Delete committed checkpoints beyond the newest ``keep``; returns the removed steps."""
        committed = self.committed()
        doomed = committed[self.keep :]
        for s in doomed:
            # Remove the manifest first: a crash half-way leaves an incomplete directory, never
            # a committed checkpoint with missing shards.
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(f"{self.step_dir(s)}/{MANIFEST}")
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(self.step_dir(s), recursive=True)
        return doomed


def _protocols(fs: fsspec.AbstractFileSystem) -> set[str]:
    p = fs.protocol
    return {p} if isinstance(p, str) else set(p)


def _check_rank(rank: int, world_size: int) -> None:
    if not (isinstance(world_size, int) and world_size >= 1):
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if not (isinstance(rank, int) and 0 <= rank < world_size):
        raise ValueError(f"rank must be in 0..{world_size - 1}, got {rank!r}")


def _fsync_dir(path: str) -> None:
    """Make a rename durable: the directory entry lives in the directory's own blocks."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
