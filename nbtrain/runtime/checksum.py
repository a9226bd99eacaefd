"""Checksums of checkpoint files, computed while the bytes stream by: no second pass.

Writing: :class:`HashingWriter` is the file ``torch.save`` writes into; it hashes each chunk
on its way to the file. Reading: :class:`StreamCheck` hashes the bytes of one file in the
order a reader takes them (reading and hashing the gaps it skips, and the rest of the file at
the end), then checks size and digest; :func:`read_verified` reads a whole file that way.
Either raises :class:`~nbtrain.runtime.errors.CheckpointError` naming the file when the last
byte is read, so a corrupt file is refused before anything loaded from it is handed on.

New files get xxh3-128 (``xxhash``: about 20 GB/s on one core and it releases the GIL, where
sha256 did 1.8 GB/s; crc32c did 15 GB/s). The algorithm is named where a checksum is stored
(``{"file": ..., "bytes": ..., "xxh3_128": hex}``); entries of checkpoints written before
(``"sha256": hex``) verify as they were written. It guards against corruption, not forgery:
the manifest's own checksum stays sha256, and loading is ``weights_only`` either way.

:func:`without_zip_crc` turns off ``torch.save``'s own CRC-32 of every zip record while
nbtrain writes a checkpoint (our checksum already covers every byte; the CRC-32 cost as
much CPU as the rest of the write). ``torch.load`` does not check it, but the setting is
process-wide: a ``torch.save`` that another thread runs at that moment writes zero CRCs
too, which ``torch.load`` reads and ``unzip -t`` reports.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import xxhash

from nbtrain.runtime.errors import CheckpointError

__all__ = [
    "ALGO",
    "ALGOS",
    "Checksum",
    "HashingWriter",
    "StreamCheck",
    "read_verified",
    "without_zip_crc",
]

#: The checksum new files get; ALGOS: those a stored entry may name (sha256: before xxh3).
ALGO = "xxh3_128"
ALGOS = ("xxh3_128", "sha256")
CHUNK = 8 << 20


class Hasher(Protocol):
    def update(self, data: Any, /) -> None: ...

    def hexdigest(self) -> str: ...


def new_hasher(algo: str) -> Hasher:
    if algo == "xxh3_128":
        return xxhash.xxh3_128()
    if algo == "sha256":
        return hashlib.sha256()
    raise ValueError(f"unknown checksum {algo!r}: this nbtrain knows {', '.join(ALGOS)}")


@dataclass(frozen=True)
class Checksum:
    algo: str
    hex: str

    def entry(self) -> dict[str, str]:
        """The JSON fields that store it: ``{algo: hex}``."""
        return {self.algo: self.hex}

    @staticmethod
    def of_entry(entry: Mapping[str, Any]) -> Checksum:
        """The checksum a stored entry names; ``KeyError`` if it names none this nbtrain
        knows (written by a newer one)."""
        for algo in ALGOS:
            if algo in entry:
                return Checksum(algo, str(entry[algo]))
        raise KeyError(f"no checksum ({' or '.join(ALGOS)}) among the fields {sorted(entry)}")

    @staticmethod
    def of_bytes(data: bytes, algo: str = ALGO) -> Checksum:
        h = new_hasher(algo)
        h.update(data)
        return Checksum(algo, h.hexdigest())


class HashingWriter:
    """File-like that hashes and counts what is written through it, timing the hashing and the
    writes (``checksum_s``, ``write_s``)."""

    def __init__(self, raw: Any, algo: str = ALGO) -> None:
        self.raw = raw
        self.hasher = new_hasher(algo)
        self.algo = algo
        self.count = 0
        self.checksum_s = 0.0
        self.write_s = 0.0

    def write(self, data: Any) -> int:
        t0 = time.perf_counter()
        self.hasher.update(data)
        t1 = time.perf_counter()
        self.raw.write(data)
        self.checksum_s += t1 - t0
        self.write_s += time.perf_counter() - t1
        n = memoryview(data).nbytes
        self.count += n
        return n

    def flush(self) -> None:
        self.raw.flush()

    @property
    def checksum(self) -> Checksum:
        return Checksum(self.algo, self.hasher.hexdigest())


class StreamCheck:
    """Verifies one file while it is read front to back.

    Read through :meth:`read_at` (any offsets; bytes are hashed in file order, a gap is read
    and hashed, a re-read of earlier bytes is not hashed again), then :meth:`finish`, which
    hashes the rest of the file and raises ``CheckpointError`` naming ``path`` when the size
    or the digest is not the expected one.
    """

    def __init__(self, path: str, nbytes: int, expected: Checksum) -> None:
        self.path = path
        self.nbytes = nbytes
        self.expected = expected
        self.hasher = new_hasher(expected.algo)
        self.pos = 0  # bytes hashed so far, from the start of the file

    def _take(self, f: Any, n: int | None) -> bytes:
        """Read and hash up to ``n`` bytes (all that is left if None) from ``self.pos``."""
        parts = []
        while n is None or n > 0:
            chunk = f.read(CHUNK if n is None else min(n, CHUNK))
            if not chunk:
                break
            self.hasher.update(chunk)
            self.pos += len(chunk)
            parts.append(chunk)
            if n is not None:
                n -= len(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def read_at(self, f: Any, offset: int, length: int) -> bytes:
        if offset < self.pos:  # bytes already hashed: read them again, hash nothing twice
            f.seek(offset)
            data = f.read(length)
            f.seek(self.pos)
            return bytes(data)
        while self.pos < offset:  # skip to it, hashing what lies between
            if not self._take(f, min(offset - self.pos, CHUNK)):
                break
        return self._take(f, length)

    def finish(self, f: Any) -> None:
        while self._take(f, CHUNK):
            pass
        if self.pos != self.nbytes:
            raise CheckpointError(
                self.path, f"file has {self.pos} bytes, the manifest says {self.nbytes}: "
                           "truncated or replaced")
        if self.hasher.hexdigest() != self.expected.hex:
            raise CheckpointError(
                self.path, f"{self.expected.algo} checksum does not match the manifest: the "
                           "file is corrupt")


def read_verified(f: Any, path: str, nbytes: int, expected: Checksum) -> bytes:
    """The whole file, read once and hashed as it is read; ``CheckpointError`` naming
    ``path`` if its size or checksum is not the expected one."""
    check = StreamCheck(path, nbytes, expected)
    data = check._take(f, None)
    check.finish(f)
    return data


_crc_lock = threading.Lock()
_crc_off = 0  # writers inside without_zip_crc
_crc_saved = True


@contextlib.contextmanager
def without_zip_crc() -> Iterator[None]:
    """``torch.save`` without its per-record zip CRC-32 for the duration (see the module
    docstring); nested and concurrent uses restore the setting once the last one ends."""
    global _crc_off, _crc_saved
    import torch  # here: the notebook's side reads checkpoints' receipts without torch

    get = getattr(torch.serialization, "get_crc32_options", None)
    set_ = getattr(torch.serialization, "set_crc32_options", None)
    if get is None or set_ is None:  # torch < 2.6 always computes it
        yield
        return
    with _crc_lock:
        if _crc_off == 0:
            _crc_saved = bool(get())
            set_(False)
        _crc_off += 1
    try:
        yield
    finally:
        with _crc_lock:
            _crc_off -= 1
            if _crc_off == 0:
                set_(_crc_saved)
