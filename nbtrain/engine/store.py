"""The controller's durable state: one SQLite database (WAL) in its state directory.

Like Slurm's ``StateSaveLocation``: everything the controller must not lose goes here, so a
scheduler that restarts on the same directory restores every job (see
``ClusterController._restore``). What it holds, per job: the submission (spec, recipe bytes,
settings, checkpoint URL, ``resume=`` source, trackers, the owner's token hash), the latest
status and what a restarted machine needs to continue it (``CarriedHistory``), the result,
and its history: events, step rows and the ranks' output, each addressed by the same
absolute positions as the in-memory :class:`~nbtrain.engine.joblog.JobLog`, so a client
reads old positions from here and new ones from memory without a seam. Besides the jobs,
small notes by key (:meth:`ControllerStore.put_note`: the cluster's goodput series).

One writer thread owns the write connection: callers on the scheduler's event loop only
enqueue (never wait on disk); the thread commits whatever has queued in one transaction
(``synchronous=FULL``: durable at commit), and step rows and output lines at most every
``GATHER_S`` (a commit per message would cost a running job's controller an fsync each).
:meth:`ControllerStore.barrier` returns a future done once everything enqueued before it is
committed: a handler awaits it before it acknowledges a decision ("recorded before
acknowledged"). Reads use their own connections (WAL lets them run beside the writer); call
them from a thread (``asyncio.to_thread``), or at start-up. The store never unpickles anything.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import logging
import queue
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nbtrain.core.jobevents import renamed_fields

logger = logging.getLogger(__name__)

__all__ = ["DB_NAME", "ControllerStore", "StoredJob", "open_readonly"]

DB_NAME = "controller.sqlite"
SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS jobs (
    job_id TEXT PRIMARY KEY,
    seq INTEGER NOT NULL,
    name TEXT NOT NULL,
    submission TEXT NOT NULL,
    recipe BLOB NOT NULL,
    settings TEXT NOT NULL,
    checkpoint_url TEXT NOT NULL,
    restore TEXT,
    token_hash TEXT NOT NULL,
    trackers TEXT,
    state TEXT NOT NULL,
    status TEXT NOT NULL,
    carried TEXT,
    ended REAL,
    result BLOB,
    result_error TEXT
);
CREATE INDEX IF NOT EXISTS jobs_by_name ON jobs (name, seq);
CREATE INDEX IF NOT EXISTS jobs_by_seq ON jobs (seq);
CREATE TABLE IF NOT EXISTS events (job_id TEXT NOT NULL, pos INTEGER NOT NULL,
    data TEXT NOT NULL, PRIMARY KEY (job_id, pos)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS rows (job_id TEXT NOT NULL, pos INTEGER NOT NULL,
    data TEXT NOT NULL, PRIMARY KEY (job_id, pos)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS output (job_id TEXT NOT NULL, pos INTEGER NOT NULL,
    data TEXT NOT NULL, PRIMARY KEY (job_id, pos)) WITHOUT ROWID;
"""

#: Where :meth:`ControllerStore.put_note` keeps its values in the meta table (apart from the
#: schema version and the epoch).
_NOTE = "note:"

#: The per-job history tables (the same positions as a ``JobLog``'s tails).
HISTORY = ("events", "rows", "output")
#: History written lazily (see ``ControllerStore._gather``): what a running job sends often.
_LAZY = ("rows", "output")
#: How long the writer waits for more of the lazy history before it commits (seconds).
GATHER_S = 0.25


@dataclass(frozen=True)
class StoredJob:
    """One job as the journal has it."""

    job_id: str
    seq: int
    name: str
    submission: dict[str, Any]
    recipe: bytes
    settings: dict[str, Any]
    checkpoint_url: str
    restore: list[Any] | None
    token_hash: str
    trackers: list[dict[str, Any]] | None
    state: str
    status: dict[str, Any]
    carried: dict[str, Any] | None
    ends: dict[str, int]  # history table -> its end position (next position to write)


def _delete_history(table: str, job_id: str) -> tuple[str, tuple[Any, ...]]:
    return f"DELETE FROM {table} WHERE job_id = ?", (job_id,)


def _connect(path: Path, *, readonly: bool = False) -> sqlite3.Connection:
    if readonly:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, check_same_thread=False,
                               timeout=30.0)
    else:
        conn = sqlite3.connect(path, check_same_thread=False, timeout=30.0,
                               isolation_level=None)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")
    return conn


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), default=_plain_default)


def _plain_default(value: Any) -> Any:
    if isinstance(value, set | frozenset | tuple):
        return list(value)
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


class ControllerStore:
    """The journal of one controller's state directory (see the module docstring)."""

    def __init__(self, state_dir: str | Path) -> None:
        self.dir = Path(state_dir).expanduser()
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise OSError(f"nbtrain's controller cannot create its state directory "
                          f"{self.dir}: {exc}; set NBTRAIN_STATE_DIR (or Settings.state_dir) "
                          "to a writable directory on the scheduler's machine") from exc
        self.path = self.dir / DB_NAME
        self._conn = _connect(self.path)
        self._conn.executescript(_SCHEMA)
        self._reader = _connect(self.path, readonly=True)
        self._read_lock = threading.Lock()
        version = self._meta("schema")
        if version is not None and int(version) > SCHEMA_VERSION:
            raise RuntimeError(f"the state directory {self.dir} was written by a newer nbtrain "
                               f"(schema {version}, this one reads {SCHEMA_VERSION}): upgrade "
                               "nbtrain on the scheduler, or use another state directory")
        #: How many controllers have started on this directory (this one included).
        self.epoch = int(self._meta("epoch") or 0) + 1
        self._conn.execute("BEGIN")
        self._set_meta("schema", str(SCHEMA_VERSION))
        self._set_meta("epoch", str(self.epoch))
        self._conn.execute("COMMIT")
        row = self._conn.execute("SELECT COALESCE(MAX(seq), -1) FROM jobs").fetchone()
        self._next_seq = int(row[0]) + 1
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.commits = 0
        self.write_errors = 0
        self.last_error = ""
        self._closed = False
        self._thread = threading.Thread(target=self._writer, name="nbtrain-store",
                                        daemon=True)
        self._thread.start()

    # ================================================================== writes (enqueue only)
    def add_job(self, *, job_id: str, name: str, submission: Mapping[str, Any],
                recipe: bytes, settings: Mapping[str, Any], checkpoint_url: str,
                restore: Sequence[Any] | None, token_hash: str,
                trackers: Sequence[Mapping[str, Any]] | None,
                status: Mapping[str, Any]) -> None:
        seq = self._next_seq
        self._next_seq += 1
        self._put(lambda: (
            "INSERT OR REPLACE INTO jobs (job_id, seq, name, submission, recipe, settings, "
            "checkpoint_url, restore, token_hash, trackers, state, status) "
            "VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
            (job_id, seq, name, _dumps(submission), bytes(recipe), _dumps(settings),
             checkpoint_url, None if restore is None else _dumps(list(restore)), token_hash,
             None if not trackers else _dumps(list(trackers)), str(status["state"]),
             _dumps(status))))

    def drop_job(self, job_id: str) -> None:
        """A submission the machine rejected: it never was a job (nor its first events)."""
        self._put(lambda: ("DELETE FROM jobs WHERE job_id = ?", (job_id,)))
        for table in HISTORY:
            self._put(functools.partial(_delete_history, table, job_id))

    def put_status(self, job_id: str, status: Mapping[str, Any], carried: Any) -> None:
        """The job's status and ``carried`` (a ``CarriedHistory`` or its plain dict, None for
        an ended job), both turned into JSON on the writer thread."""
        from nbtrain.engine.wire import plain

        self._put(lambda: (
            "UPDATE jobs SET state = ?, status = ?, carried = ?, ended = ? WHERE job_id = ?",
            (str(status["state"]), _dumps(status),
             None if carried is None else _dumps(plain(carried)), status.get("ended"),
             job_id)))

    def put_result(self, job_id: str, result: bytes | None, error: str | None) -> None:
        self._put(lambda: ("UPDATE jobs SET result = ?, result_error = ? WHERE job_id = ?",
                           (result, error, job_id)))

    def add_history(self, table: str, job_id: str, start: int,
                    items: Iterable[Any]) -> None:
        """Items of ``table`` (events, rows, output) at positions ``start, start + 1, ...``;
        serialised on the writer thread."""
        assert table in HISTORY, table
        self._queue.put(("history", table, job_id, start, list(items)))

    def put_note(self, key: str, value: Any) -> None:
        """A small JSON value kept under ``key``, replacing the one before (what the
        controller would otherwise know only in memory, e.g. the cluster's goodput series);
        serialised on the writer thread, so pass a value nobody changes afterwards."""
        self._put(lambda: ("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)",
                           (_NOTE + key, _dumps(value))))

    def barrier(self) -> concurrent.futures.Future[None]:
        """Done once everything enqueued before it is committed (or failed to be)."""
        fut: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._queue.put(("barrier", fut))
        return fut

    def close(self, timeout: float = 10.0) -> None:
        if self._closed:
            return
        self._closed = True
        done = self.barrier()
        self._queue.put(None)
        try:
            done.result(timeout)
        except Exception:
            logger.warning("nbtrain store: closing before the journal drained", exc_info=True)
        self._thread.join(timeout)
        with self._read_lock:
            self._reader.close()

    def _put(self, statement: Callable[[], tuple[str, tuple[Any, ...]]]) -> None:
        """Enqueue one statement; its arguments are built (serialised) on the writer thread,
        so the caller pays a queue put and nothing else."""
        self._queue.put(("sql", statement))

    # ================================================================== the writer thread
    def _writer(self) -> None:
        while True:
            batch = self._gather(self._queue.get())
            # Barriers are answered whatever happens to the batch: a handler waiting on one
            # must never wait forever.
            barriers = [item[1] for item in batch if item is not None and item[0] == "barrier"]
            try:
                self._commit([item for item in batch
                              if item is not None and item[0] != "barrier"])
            finally:
                for fut in barriers:
                    if not fut.done():
                        fut.set_result(None)
            if None in batch:
                self._conn.close()
                return

    def _gather(self, first: Any) -> list[Any]:
        """``first`` and whatever queued meanwhile, for one transaction (one fsync for all).
        While the batch holds only step rows and output lines (a running job sends them
        several times a second), it waits up to ``GATHER_S`` for more: a commit per
        ``GATHER_S`` instead of one per message. Anything else (a status, an event, a
        barrier, the close) ends the wait at once, and everything before it is committed
        with it, in order."""
        batch = [first]
        deadline = time.monotonic() + GATHER_S
        urgent = False
        while len(batch) < 5_000:
            item = batch[-1]
            urgent = urgent or item is None or item[0] != "history" or item[1] not in _LAZY
            left = 0.0 if urgent else deadline - time.monotonic()
            try:
                batch.append(self._queue.get(timeout=left) if left > 0
                             else self._queue.get_nowait())
            except queue.Empty:
                break
        return batch

    def _commit(self, writes: list[tuple[Any, ...]]) -> None:
        """One transaction of ``writes``; a failure is logged and counted, never raised (the
        writer thread must live on)."""
        try:
            self._conn.execute("BEGIN")
            for item in writes:
                self._write_one(item)
            self._conn.execute("COMMIT")
            self.commits += 1
        except Exception as exc:  # the disk is full, the directory went away, ...
            self.write_errors += 1
            self.last_error = f"{type(exc).__name__}: {exc}"
            logger.exception("nbtrain store: a journal write failed")
            try:
                if self._conn.in_transaction:
                    self._conn.execute("ROLLBACK")
            except Exception:
                logger.exception("nbtrain store: rolling back failed")

    def _write_one(self, item: tuple[Any, ...]) -> None:
        """One queued write; a bad one is logged and skipped, the batch goes on."""
        try:
            if item[0] == "sql":
                self._conn.execute(*item[1]())
            else:
                _, table, job_id, start, items = item
                self._conn.executemany(
                    f"INSERT OR REPLACE INTO {table} (job_id, pos, data) VALUES (?,?,?)",
                    [(job_id, start + i, _dumps(x)) for i, x in enumerate(items)])
        except sqlite3.OperationalError:
            raise  # the database itself is in trouble (disk full, locked): the batch fails
        except Exception as exc:
            self.write_errors += 1
            self.last_error = f"{type(exc).__name__}: {exc}"
            logger.exception("nbtrain store: one journal write failed (skipped)")

    # ================================================================== reads (any thread)
    def _meta(self, key: str) -> str | None:
        row = self._conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else str(row[0])

    def _set_meta(self, key: str, value: str) -> None:
        self._conn.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)",
                           (key, value))

    def note(self, key: str) -> Any:
        """The value last kept with :meth:`put_note` (None: none, or unreadable)."""
        with self._read_lock:
            row = self._reader.execute("SELECT value FROM meta WHERE key = ?",
                                       (_NOTE + key,)).fetchone()
        try:
            return None if row is None else json.loads(row[0])
        except ValueError:
            return None

    def jobs(self, *, newest_ended: int | None = None) -> list[StoredJob]:
        """Jobs in submit order: every live one, and the newest ``newest_ended`` ended ones
        (all of them when None)."""
        with self._read_lock:
            return read_jobs(self._reader, newest_ended=newest_ended)

    def job(self, key: str) -> StoredJob | None:
        """A job by id, or the newest of that name."""
        with self._read_lock:
            return read_job(self._reader, key)

    def history(self, table: str, job_id: str, start: int, limit: int
                ) -> tuple[int, list[Any]]:
        """(position of the first item returned, items from ``start`` on)."""
        with self._read_lock:
            return read_history(self._reader, table, job_id, start, limit)

    def result(self, job_id: str) -> tuple[bytes | None, str | None]:
        with self._read_lock:
            row = self._reader.execute("SELECT result, result_error FROM jobs WHERE job_id = ?",
                                       (job_id,)).fetchone()
        return (None, None) if row is None else (row[0], row[1])

    def ends(self, job_id: str) -> dict[str, int]:
        """The end position of each history table of a job."""
        with self._read_lock:
            return _ends(self._reader, job_id)

# ====================================================================== reading a directory
TERMINAL = ("SUCCEEDED", "FAILED", "CANCELLED")
_JOB_COLUMNS = ("job_id, seq, name, submission, recipe, settings, checkpoint_url, restore, "
                "token_hash, trackers, state, status, carried")


def open_readonly(state_dir: str | Path) -> sqlite3.Connection:
    """A read-only connection to a state directory's journal (no controller needed)."""
    path = Path(state_dir).expanduser()
    if path.is_dir():
        path = path / DB_NAME
    if not path.exists():
        raise FileNotFoundError(f"no nbtrain controller state at {path}: pass the state "
                                "directory of a controller (Settings.state_dir)")
    return _connect(path, readonly=True)


def _ends(conn: sqlite3.Connection, job_id: str) -> dict[str, int]:
    out = {}
    for table in HISTORY:
        row = conn.execute(f"SELECT COALESCE(MAX(pos), -1) FROM {table} WHERE job_id = ?",
                           (job_id,)).fetchone()
        out[table] = int(row[0]) + 1
    return out


def _stored(conn: sqlite3.Connection, row: Sequence[Any]) -> StoredJob:
    return StoredJob(
        job_id=row[0], seq=int(row[1]), name=row[2], submission=json.loads(row[3]),
        recipe=bytes(row[4]), settings=json.loads(row[5]), checkpoint_url=row[6],
        restore=None if row[7] is None else json.loads(row[7]), token_hash=row[8],
        trackers=None if row[9] is None else json.loads(row[9]), state=row[10],
        status=json.loads(row[11]), carried=None if row[12] is None else json.loads(row[12]),
        ends=_ends(conn, row[0]))


def read_jobs(conn: sqlite3.Connection, *, newest_ended: int | None = None
              ) -> list[StoredJob]:
    t0 = time.perf_counter()
    rows = conn.execute(f"SELECT {_JOB_COLUMNS} FROM jobs WHERE state NOT IN "
                        f"{TERMINAL} ORDER BY seq").fetchall()
    limit = -1 if newest_ended is None else max(0, int(newest_ended))
    rows += conn.execute(f"SELECT {_JOB_COLUMNS} FROM (SELECT * FROM jobs WHERE state IN "
                         f"{TERMINAL} ORDER BY seq DESC LIMIT ?)", (limit,)).fetchall()
    out = sorted((_stored(conn, r) for r in rows), key=lambda j: j.seq)
    logger.debug("nbtrain store: read %d jobs in %.3f s", len(out), time.perf_counter() - t0)
    return out


def read_job(conn: sqlite3.Connection, key: str) -> StoredJob | None:
    row = conn.execute(f"SELECT {_JOB_COLUMNS} FROM jobs WHERE job_id = ?", (key,)).fetchone()
    if row is None:
        row = conn.execute(f"SELECT {_JOB_COLUMNS} FROM jobs WHERE name = ? ORDER BY seq DESC "
                           "LIMIT 1", (key,)).fetchone()
    return None if row is None else _stored(conn, row)


def read_history(conn: sqlite3.Connection, table: str, job_id: str, start: int, limit: int
                 ) -> tuple[int, list[Any]]:
    assert table in HISTORY, table
    rows = conn.execute(f"SELECT pos, data FROM {table} WHERE job_id = ? AND pos >= ? "
                        "ORDER BY pos LIMIT ?", (job_id, max(0, start), limit)).fetchall()
    if not rows:
        return max(0, start), []
    if table == "rows":
        return int(rows[0][0]), [json.loads(r[1]) for r in rows]
    # events and output lines of an older version say "gen": read in today's names
    return int(rows[0][0]), [renamed_fields(json.loads(r[1])) for r in rows]
