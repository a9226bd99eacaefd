"""Committed checkpoints on any fsspec storage, with a two-phase commit.

Layout under the root URL (format 2, the one jobs write)::

    step-00000123/__0_0.distcp               rank 0's tensor chunks and objects (DCP's layout)
    step-00000123/rank-00000-of-00002.pt     rank 0's own: RNG states, data position, step
    step-00000123/rank-00000-of-00002.json   receipt: the rank's files, sizes, checksums, index
    step-00000123/.metadata                  DCP's metadata (pickle), for DCP's own readers
    step-00000123/dcp-index.json             the same as JSON, what nbtrain reads
    step-00000123/manifest.json              written last: the checkpoint is committed

The step directory is a ``torch.distributed.checkpoint`` checkpoint (``dcp.load``,
``dcp_to_torch_save``): replicated tensors once, sharded tensors per owner (see
:mod:`nbtrain.runtime.dcp_write`). Format 1, written before sharded checkpoints, has no DCP
files: each rank's ``.pt`` shard holds a full copy of the state; it is still read.

Phase one: every rank writes its files under temporary names, hashing them on the way
(xxh3-128, :mod:`nbtrain.runtime.checksum`), flushes and fsyncs them (local files), renames
them into place, then writes its receipt the same way; a receipt therefore proves its files
are durable. Phase two: one rank waits (with a deadline; one directory listing per poll,
backing off) for all receipts of the same attempt, writes DCP's metadata and the index from
them, then the manifest, each atomically. A checkpoint is committed when its manifest is
present and valid; a crash at any moment leaves either a committed checkpoint or a directory
without a manifest, which readers ignore.

Reading verifies the manifest's own checksum (sha256), and each file's size and checksum as
it is read (one read per file; manifests and receipts written before xxh3 name sha256, and
verify so), and loads with ``torch.load(..., weights_only=True)``, so a checkpoint directory
cannot run code. Problems raise ``CheckpointError`` naming the file and what is wrong;
``restore_latest`` falls back to the previous committed checkpoint and reports what it
skipped.

Saves that never commit are removed, and what may be removed when is what keeps a live
writer's files safe. ``discard``: a rank whose write failed removes its own files, by name,
while its generation is live (no other generation writes then); a committer whose commit
failed removes the files of its attempt that receipts name, the receipts, failure markers
and the DCP index and metadata it wrote, never a file of a rank still writing (no receipt
yet); once a generation has ended (its writers are fenced), only files that a receipt of
the attempt names, at the size it says, go, since the next generation may be writing the
same step under the same names. ``cleanup_incomplete`` after each commit removes directories
without a manifest older than the newest committed checkpoint (a newer one may be the same
generation's next save, in progress) and leftover temporary files; at a generation's start,
while its ranks wait in a collective and so none of them saves, it removes every directory
without a manifest, and probe files of other attempts. Nothing is removed from a step that
has a manifest but temporary files, and a directory whose manifest cannot be read (corrupt,
foreign, another format version) is left alone. The one race left is a writer that does
not know its generation ended (a rank cut off from the controller but not from storage):
what it removes can fail a commit of the next generation, which then retries, and a
checkpoint that lost a file that way is skipped by restore, never loaded.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import pickle
import posixpath
import re
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import fsspec
from fsspec.core import url_to_fs

from nbtrain.core.checkpoint_policy import DEFAULT_COMMIT_TIMEOUT_S
from nbtrain.runtime.checksum import (
    Checksum,
    HashingWriter,
    StreamCheck,
    read_verified,
    without_zip_crc,
)
from nbtrain.runtime.dcp_names import INDEX_FILE, METADATA_FILE, data_file
from nbtrain.runtime.direct_io import DirectFile, open_for_write
from nbtrain.runtime.errors import CheckpointError

if TYPE_CHECKING:  # imported where used: they import torch.distributed.checkpoint, which
    # the notebook's side (listing checkpoints, reading manifests) must not pay for
    from nbtrain.runtime.dcp_read import IndexReader
    from nbtrain.runtime.dcp_write import DcpShard

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
#: Commit polls: the first interval and the longest (it doubles in between).
COMMIT_POLL_S = (0.005, 0.25)
# Object stores have no rename, but a PUT is atomic: write the final name directly there.
_NO_RENAME = {"s3", "s3a", "gs", "gcs", "abfs", "az", "adl", "oss"}


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
    checksum: Checksum

    def entry(self, *, rank: bool = True) -> dict[str, Any]:
        """As a manifest (or, without the rank, a receipt) stores it."""
        out: dict[str, Any] = {"file": self.file, "bytes": self.bytes, **self.checksum.entry()}
        if rank:
            out["rank"] = self.rank
        return out

    @staticmethod
    def of_entry(entry: Mapping[str, Any], rank: int | None = None) -> ShardInfo:
        """From a stored entry (its checksum under the algorithm's name: ``sha256`` in
        checkpoints written before xxh3); ``KeyError``/``ValueError`` if a field is bad."""
        return ShardInfo(rank=int(entry["rank"]) if rank is None else rank,
                         file=str(entry["file"]), bytes=int(entry["bytes"]),
                         checksum=Checksum.of_entry(entry))


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


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


class CheckpointStore:
    """Checkpoints of one job under ``url`` (a local directory or any fsspec URL).

    keep: how many committed checkpoints ``prune`` keeps (>= 1; the newest is never removed).
    storage_options: passed to fsspec (credentials, endpoint, ...).
    direct_io: write local data files with ``O_DIRECT`` (:mod:`nbtrain.runtime.direct_io`):
        at disk speed with little CPU, and no page cache taken. Where the file system
        refuses it they are written the ordinary way; turn it off where direct writes are
        slow (a network file system with small write sizes).
    """

    def __init__(
        self, url: str, *, keep: int = 3, storage_options: Mapping[str, Any] | None = None,
        direct_io: bool = True,
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
        self.direct_io = direct_io
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
    def _write_atomic(self, path: str, write: Callable[[HashingWriter], None],
                      times: PersistTimes | None = None, *,
                      bulk: bool = False) -> tuple[int, Checksum]:
        """Write ``path`` so that readers see either nothing or the whole durable file; its
        size and checksum, hashed on the way (``write`` gets a file that hashes). ``bulk``:
        a large file, written with ``O_DIRECT`` where the store allows it."""
        if not self._rename:
            with self.fs.open(path, "wb") as f:
                hw = HashingWriter(f)
                write(hw)
            _add_times(times, hw)
            return hw.count, hw.checksum
        tmp = f"{path}{_TMP}{uuid.uuid4().hex}"
        try:
            if self._local:
                with open_for_write(tmp, direct=bulk and self.direct_io) as f:
                    hw = HashingWriter(f)
                    write(hw)
                    t0 = time.perf_counter()
                    if isinstance(f, DirectFile):
                        f.seal()
                    else:
                        f.flush()
                    hw.write_s += time.perf_counter() - t0
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
                    hw = HashingWriter(f)
                    write(hw)
                self.fs.mv(tmp, path)
        except BaseException:
            with contextlib.suppress(Exception):
                if self._local:
                    os.unlink(tmp)
                else:
                    self.fs.rm(tmp)
            raise
        _add_times(times, hw)
        return hw.count, hw.checksum

    def _write_bytes(self, path: str, data: bytes,
                     times: PersistTimes | None = None) -> tuple[int, Checksum]:
        def write(f: HashingWriter) -> None:
            f.write(data)

        return self._write_atomic(path, write, times)

    def _write_json(self, path: str, obj: Any, times: PersistTimes | None = None) -> None:
        self._write_bytes(path, json.dumps(obj, indent=1, sort_keys=True).encode(), times)

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
        times: where the time went is added to it.
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
        with without_zip_crc():  # our checksum covers every byte already
            if dcp is not None:
                from nbtrain.runtime.dcp_write import write_items

                dname = data_file(rank)
                entries: list[dict[str, Any]] = []

                def write_data(f: HashingWriter) -> None:
                    entries.extend(write_items(f, dcp, dname))

                n, checksum = self._write_atomic(f"{sdir}/{dname}", write_data, times,
                                                 bulk=True)
                files.append(ShardInfo(rank=rank, file=dname, bytes=n, checksum=checksum))
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

            def write(f: HashingWriter) -> None:
                import torch

                torch.save(obj, f)  # type: ignore[arg-type]

            n, checksum = self._write_atomic(f"{sdir}/{name}", write, times,
                                             bulk=version == FULL_COPY_VERSION)
        info = ShardInfo(rank=rank, file=name, bytes=n, checksum=checksum)
        receipt: dict[str, Any] = {
            "format": FORMAT_NAME,
            "version": version,
            "step": step,
            "world_size": world_size,
            "attempt": attempt,
            **info.entry(),
        }
        if part is not None:
            receipt["files"] = [f.entry(rank=False) for f in files]
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

    def _read_doc(self, path: str) -> dict[str, Any] | None:
        """A small JSON file of ours, or None if it is missing or not a JSON object."""
        try:
            with self.fs.open(path, "rb") as f:
                doc = json.loads(f.read())
        except (OSError, ValueError):  # gone, or garbage from a crash
            return None
        return doc if isinstance(doc, dict) else None

    def _listing(self, path: str) -> dict[str, dict[str, Any]]:
        """One listing of a directory: name -> fsspec's entry (size, type, times)."""
        with contextlib.suppress(Exception):
            self.fs.invalidate_cache(path)  # listing caches (NFS-like stores)
        try:
            entries = self.fs.ls(path, detail=True)
        except (FileNotFoundError, NotADirectoryError):
            return {}
        return {posixpath.basename(str(e["name"]).rstrip("/")): e for e in entries}

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
        poll_s: tuple[float, float] = COMMIT_POLL_S,
        cancelled: Callable[[], bool] | None = None,
        times: PersistTimes | None = None,
    ) -> Manifest:
        """Wait until every rank's receipt of ``attempt`` is there, then (format 2) write
        DCP's metadata and the index, then the manifest. ``times.commit_wait_s`` gets the
        wait.

        Waiting costs one listing of the step directory per poll; a receipt or failure marker
        is read when it appears or changes. Polls start ``poll_s[0]`` apart and back off,
        doubling, to ``poll_s[1]`` (again from the start when a receipt arrives): a commit
        that waits on a slow rank costs the store a few requests a second, and one whose
        ranks are done is noticed within milliseconds. ``cancelled`` is asked at every poll
        and once more before anything is written.
        """
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if not 0 < poll_s[0] <= poll_s[1]:
            raise ValueError(f"poll_s must be (first, longest) with 0 < first <= longest, got "
                             f"{poll_s!r}, e.g. {COMMIT_POLL_S}")
        sdir = self.step_dir(step)
        started = time.monotonic()
        deadline = started + timeout_s
        receipts: dict[int, Receipt] = {}
        others: dict[int, str] = {}  # rank -> the attempt its receipt belongs to
        seen: dict[str, tuple[Any, ...]] = {}  # file -> the version of it last read
        delay = poll_s[0]
        while True:
            listing = self._listing(sdir)
            arrived = False
            for rank in range(world_size):
                if rank in receipts:
                    continue
                base = shard_name(rank, world_size)[:-3]
                for name in (f"{base}.json", f"{base}.failed.json"):
                    entry = listing.get(name)
                    if entry is None or seen.get(name) == _version(entry):
                        continue
                    seen[name] = _version(entry)
                    doc = self._read_doc(f"{sdir}/{name}")
                    if doc is None or doc.get("step") != step:
                        continue
                    if doc.get("attempt") != attempt:
                        if not name.endswith(".failed.json"):
                            others[rank] = str(doc.get("attempt"))
                    elif name.endswith(".failed.json"):
                        raise CheckpointError(
                            f"{sdir}/{shard_name(rank, world_size)}",
                            f"rank {rank} failed to write its shard: "
                            f"{doc.get('error', 'unknown error')}; not committing",
                        )
                    elif (got := _receipt(doc)) is not None:
                        receipts[rank] = got
                        others.pop(rank, None)
                        arrived = True
                        break  # its failure marker, if any, is of an earlier try
            if len(receipts) == world_size:
                break
            missing = sorted(set(range(world_size)) - set(receipts))
            now = time.monotonic()
            if now >= deadline:
                stale = "".join(f"; rank {r}'s receipt there is of attempt {a!r}"
                                for r, a in sorted(others.items()))
                raise CheckpointError(
                    sdir,
                    f"commit timed out after {timeout_s:g}s waiting for the shards of ranks "
                    f"{missing} (attempt {attempt!r}){stale}; a rank died or persists slower "
                    "than the commit timeout: raise it or check that rank",
                )
            if cancelled is not None and cancelled():
                raise CheckpointError(sdir, f"commit cancelled while waiting for ranks {missing}")
            delay = poll_s[0] if arrived else delay
            time.sleep(min(delay, deadline - now))
            delay = min(2 * delay, poll_s[1])
        if times is not None:
            times.commit_wait_s += time.monotonic() - started
        for rec in receipts.values():
            for info in (rec.shard, *rec.files):
                size = _listed_size(listing.get(info.file) or {})
                if size is None:  # not listed, or listed without its size
                    try:
                        size = int(self.fs.size(f"{sdir}/{info.file}"))
                    except FileNotFoundError:
                        size = None
                if size != info.bytes:
                    raise CheckpointError(
                        f"{sdir}/{info.file}",
                        f"file has {size} bytes but its receipt says {info.bytes}; not "
                        "committing" if size is not None else
                        "file named by its rank's receipt is missing; not committing",
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
            "shards": [s.entry() for s in sorted((r.shard for r in receipts.values()),
                                                 key=lambda s: s.rank)],
        }
        version = FULL_COPY_VERSION
        if sharded:
            version = FORMAT_VERSION
            body["layout"] = "dcp"
            body["files"] = [f.entry() for f in files]
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

        from nbtrain.runtime.dcp_write import index_from_receipts, metadata_from_index

        index = index_from_receipts({r: rec.dcp or {} for r, rec in receipts.items()}, fail)
        meta = metadata_from_index(index, checkpoint_id=self.step_url(step), save_id=attempt)
        out: list[ShardInfo] = []
        for name, data in ((INDEX_FILE, json.dumps(index, sort_keys=True).encode()),
                           (METADATA_FILE, pickle.dumps(meta))):
            n, checksum = self._write_bytes(f"{sdir}/{name}", data, times)
            out.append(ShardInfo(rank=-1, file=name, bytes=n, checksum=checksum))
        return out

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
            return tuple(ShardInfo.of_entry(s) for s in entries)

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

    def _open_checked(self, manifest: Manifest, info: ShardInfo) -> tuple[Any, StreamCheck]:
        """An open file of the checkpoint and what verifies it as it is read."""
        path = f"{self.step_dir(manifest.step)}/{info.file}"
        try:
            f = self.fs.open(path, "rb")
        except FileNotFoundError:
            raise CheckpointError(path, "file listed in the manifest is missing") from None
        return f, StreamCheck(path, info.bytes, info.checksum)

    def _read_checked(self, manifest: Manifest, info: ShardInfo) -> bytes:
        """A whole file of the checkpoint, read once and verified as it is read."""
        f, check = self._open_checked(manifest, info)
        with f:
            return read_verified(f, check.path, info.bytes, info.checksum)

    def verify(self, step: int, *, ranks: list[int] | None = None) -> Manifest:
        """Check the manifest and the size and checksum of the shards of ``ranks`` (all if
        None, and then the DCP files too): one read of each file."""
        manifest = self.read_manifest(step)
        infos = [i for i in manifest.shards if ranks is None or i.rank in ranks]
        for info in infos + (list(manifest.files) if ranks is None else []):
            f, check = self._open_checked(manifest, info)
            with f:
                check.finish(f)
        return manifest

    def dcp_reader(self, manifest: Manifest) -> IndexReader:
        """A DCP ``StorageReader`` over a format-2 checkpoint: its index verified and read
        now; each data file verified as it is read (``CheckpointError`` naming the file,
        before the load returns, when its size or checksum is wrong)."""
        if not manifest.sharded:
            raise CheckpointError(manifest.path, f"format {manifest.version} has no DCP files "
                                                 "(each rank's shard holds a full copy)")
        sdir = self.step_dir(manifest.step)
        files = {f.file: f for f in manifest.files}
        raw = self._read_checked(manifest, files[INDEX_FILE])
        path = f"{sdir}/{INDEX_FILE}"
        try:
            index = json.loads(raw)
        except ValueError as e:
            raise CheckpointError(path, f"index is not valid JSON ({e})") from None
        if not isinstance(index, dict) or not isinstance(index.get("items"), dict):
            raise CheckpointError(path, "not an nbtrain DCP index")

        def open_file(name: str) -> tuple[Any, StreamCheck]:
            info = files.get(name)
            if info is None:
                raise CheckpointError(f"{sdir}/{name}", "the index names a file the manifest "
                                                        "does not list")
            return self._open_checked(manifest, info)

        from nbtrain.runtime.dcp_read import IndexReader

        return IndexReader(index, open_file, checkpoint_id=self.step_url(manifest.step))

    def load_shard(self, step: int, rank: int, *, manifest: Manifest | None = None) -> Any:
        """This rank's payload at ``step``, checksum-verified as it is read (one read of the
        file, into memory), loaded with weights_only=True."""
        manifest = manifest or self.read_manifest(step)
        infos = [s for s in manifest.shards if s.rank == rank]
        if not infos:
            raise CheckpointError(
                manifest.path,
                f"no shard for rank {rank}: this checkpoint has world_size "
                f"{manifest.world_size} (ranks 0..{manifest.world_size - 1})",
            )
        path = f"{self.step_dir(step)}/{infos[0].file}"
        data = self._read_checked(manifest, infos[0])
        import torch  # here, not at the top: the notebook's side lists checkpoints without it

        try:
            obj = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as e:  # unknown class refused by weights_only, ...
            raise CheckpointError(path, f"cannot be loaded: {type(e).__name__}: {e}") from None
        del data
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
    def discard(self, step: int, world_size: int, attempt: str, *, rank: int | None = None,
                ended: bool = False) -> list[str]:
        """Remove the files of ``attempt`` at ``step`` that no commit will use; the paths
        removed. Best effort: never raises (cleaning up must not hide the failure that caused
        it), and removes nothing once the step has a manifest.

        rank: that rank's own files, after its write failed (by name, its temporaries too;
            its failure marker stays for the committer). None: the committer's, after its
            commit failed: the files that receipts of ``attempt`` name, the receipts, the
            attempt's failure markers, the DCP index and metadata; a rank still writing
            keeps its files, which the next commit or the job's next start removes.
        ended: the attempt's generation has ended (its writer is fenced): another generation
            may write this step under the same names now, so only files that a receipt of
            ``attempt`` names, at the size it says, go (and failure markers of ``attempt``).
        """
        try:
            return self._discard(step, world_size, attempt, rank, ended)
        except Exception:
            return []

    def _discard(self, step: int, world_size: int, attempt: str, rank: int | None,
                 ended: bool) -> list[str]:
        sdir = self.step_dir(step)
        listing = self._listing(sdir)
        if not listing or MANIFEST in listing:
            return []
        doomed: list[str] = []
        ranks = [rank] if rank is not None else sorted(
            {r for r in map(_owner_rank, listing) if r is not None and r < world_size})
        for r in ranks:
            base = shard_name(r, world_size)[:-3]
            doc = self._read_doc(f"{sdir}/{base}.json") if f"{base}.json" in listing else None
            rec = (_receipt(doc) if doc is not None and doc.get("attempt") == attempt
                   and doc.get("step") == step else None)
            if rec is not None:
                doomed.append(f"{base}.json")
                doomed += [i.file for i in (*rec.files, rec.shard) if i.file in listing and (
                    not ended or _listed_size(listing[i.file]) == i.bytes)]
            elif rank is not None and not ended:  # its write failed before its receipt
                own = (data_file(r), shard_name(r, world_size))
                doomed += [n for n in listing if n in own or n.startswith(
                    tuple(f"{o}{_TMP}" for o in (*own, f"{base}.json")))]
            marker = f"{base}.failed.json"
            if marker in listing and (rank is None or ended):
                doc = self._read_doc(f"{sdir}/{marker}")
                if doc is not None and doc.get("attempt") == attempt:
                    doomed.append(marker)
        if rank is None and not ended:
            doomed += [n for n in listing if n.split(_TMP)[0] in (INDEX_FILE, METADATA_FILE,
                                                                    MANIFEST)]
        removed = []
        for name in doomed:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(f"{sdir}/{name}")
                removed.append(f"{sdir}/{name}")
        if removed and not self._listing(sdir):
            with contextlib.suppress(Exception):
                self.fs.rmdir(sdir)
        return removed

    def cleanup_incomplete(self, *, start_of: str | None = None) -> list[str]:
        """Remove what no commit will use: step directories without a manifest that are older
        than the newest committed checkpoint, and leftover temporary files in committed ones;
        with ``start_of``, every step directory without a manifest and the probe files of
        other attempts too. Returns the paths removed.

        After a commit (the default) a newer directory without a manifest may be the next
        save of the same generation, in progress: it stays. ``start_of=attempt`` is for the
        start of a generation, while none of its ranks saves (they wait in a collective): no
        writer of the job that could still commit is live then (one of an ended generation
        may still be running, but it is fenced), so every uncommitted directory goes, the
        leftovers of saves that never committed. Directories with an unreadable manifest
        (corrupt, foreign, or written by another format version) stay: they are not ours to
        delete; ``restore_latest`` reports them.
        """
        steps = self._steps_on_disk()
        newest = next((s for s in steps if self.is_committed(s)), None)
        removed: list[str] = []
        if start_of is not None:
            mine = f".probe-{start_of}-r"
            for name in self._listing(self.root):
                if name.startswith(".probe-") and not name.startswith(mine):
                    with contextlib.suppress(FileNotFoundError):
                        self.fs.rm(f"{self.root}/{name}")
                        removed.append(f"{self.root}/{name}")
        elif newest is None:
            return removed
        for s in steps:
            if start_of is None and newest is not None and s > newest:
                continue
            sdir = self.step_dir(s)
            if not self.fs.exists(f"{sdir}/{MANIFEST}"):
                with contextlib.suppress(FileNotFoundError):
                    self.fs.rm(sdir, recursive=True)
                    removed.append(sdir)
            elif self.is_committed(s):
                for name in self._listing(sdir):
                    if _TMP in name:
                        with contextlib.suppress(FileNotFoundError):
                            self.fs.rm(f"{sdir}/{name}")
                            removed.append(f"{sdir}/{name}")
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


def _add_times(times: PersistTimes | None, hw: HashingWriter) -> None:
    if times is not None:
        times.checksum_s += hw.checksum_s
        times.write_s += hw.write_s


def _receipt(doc: Mapping[str, Any]) -> Receipt | None:
    """What a receipt of the right step and attempt says; None if a field is bad."""
    try:
        shard = ShardInfo.of_entry(doc)
        files = tuple(ShardInfo.of_entry(f, rank=shard.rank) for f in doc.get("files", ()))
    except (KeyError, TypeError, ValueError):
        return None
    dcp = doc.get("dcp")
    return Receipt(shard=shard, files=files, dcp=dcp if isinstance(dcp, dict) else None)


_RANK_FILE = re.compile(r"^rank-(\d{5,})-of-\d{5,}\.")


def _owner_rank(name: str) -> int | None:
    """The rank whose receipt or failure marker ``name`` is (None for other files)."""
    m = _RANK_FILE.match(name)
    return int(m.group(1)) if m is not None and name.endswith(".json") else None


def _listed_size(entry: Mapping[str, Any]) -> int | None:
    size = entry.get("size")
    return int(size) if isinstance(size, (int, float)) else None


def _version(entry: Mapping[str, Any]) -> tuple[Any, ...]:
    """What tells one version of a listed file from another: its size and whatever time or
    tag the store lists."""
    return tuple(entry.get(k) for k in ("size", "mtime", "created", "LastModified", "ETag",
                                        "etag", "last_modified", "ino"))


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
