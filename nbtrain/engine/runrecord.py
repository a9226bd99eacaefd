"""A job's record read back from a controller's state directory, with no cluster running
(like Ray's ``Result.from_path``): ``nbtrain.load_run(state_dir, "my-job")``.

It reads the journal (SQLite, read-only) that the controller writes: the job's spec and final
status, its events, step rows and the ranks' output; the checkpoints are listed from the job's
checkpoint directory. Nothing is unpickled unless you ask for :meth:`RunRecord.result`.
"""

from __future__ import annotations

from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from nbtrain.core.job import JobSpec
from nbtrain.engine.store import open_readonly, read_history, read_job, read_jobs

__all__ = ["RunRecord", "load_run"]


@dataclass(frozen=True)
class RunRecord:
    """One job as its controller journaled it."""

    state_dir: Path
    job_id: str
    spec: JobSpec
    status: dict[str, Any]
    checkpoint_url: str
    events: list[dict[str, Any]]
    output: list[dict[str, Any]]
    _rows: list[list[Any]]

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def state(self) -> str:
        return str(self.status.get("state", ""))

    @property
    def faults(self) -> list[dict[str, Any]]:
        return [dict(f) for f in self.status.get("faults", [])]

    @property
    def metrics(self) -> pd.DataFrame:
        """One row per rank per step, as ``JobHandle.metrics``."""
        from nbtrain.engine.job import row_frame

        return row_frame([tuple(r) for r in self._rows])

    @property
    def checkpoints(self) -> list[dict[str, Any]]:
        """Committed checkpoints of the job, newest first (read from their directory)."""
        from nbtrain.engine.checkpoints import committed_checkpoints

        return committed_checkpoints(self.checkpoint_url)

    def logs(self, rank: int | None = None) -> list[str]:
        from nbtrain.runtime.output import format_lines

        return format_lines([o for o in self.output if rank is None or o["rank"] == rank])

    def result(self, *, trust: bool = False) -> Any:
        """The training function's return value on rank 0, read as data only (numbers,
        strings, lists, dicts, NumPy arrays, tensors; anything else raises
        ``UntrustedResultError``); ``trust=True`` unpickles it in full, running whatever
        code the job's owner put in it: only for a job you trust."""
        from nbtrain.engine.safeload import result_loads

        with closing(open_readonly(self.state_dir)) as conn:
            row = conn.execute("SELECT result, result_error FROM jobs WHERE job_id = ?",
                               (self.job_id,)).fetchone()
        if row is None or row[1]:
            raise RuntimeError(f"job {self.name} has no result: "
                               f"{row[1] if row else 'not in the journal'}")
        if row[0] is None:
            return None
        return result_loads(row[0], job=f"{self.name} ({self.job_id})",
                            owner=str(self.status.get("owner", "")), trusted=trust)

    def __repr__(self) -> str:
        return (f"<RunRecord {self.name} ({self.job_id}) {self.state} step "
                f"{self.status.get('step')}: {self.status.get('reason', '')}>")


def load_run(state_dir: str | Path, key: str) -> RunRecord:
    """The record of job ``key`` (its id, or the newest job of that name) in the controller
    state directory ``state_dir`` (``Settings.state_dir``). Raises LookupError naming the
    jobs it holds when there is none."""
    path = Path(state_dir).expanduser()
    with closing(open_readonly(path)) as conn:
        stored = read_job(conn, key)
        if stored is None:
            names = [j.name for j in read_jobs(conn, newest_ended=50)]
            raise LookupError(f"no job with id or name {key!r} in {path}; its newest jobs: "
                              f"{', '.join(dict.fromkeys(reversed(names))) or 'none'}")
        history = {t: _all(conn, t, stored.job_id) for t in ("events", "rows", "output")}
    from nbtrain.engine.wire import submission_from_wire

    return RunRecord(state_dir=path, job_id=stored.job_id,
                     spec=submission_from_wire(stored.submission).spec, status=stored.status,
                     checkpoint_url=stored.checkpoint_url, events=history["events"],
                     output=history["output"], _rows=history["rows"])


def _all(conn: Any, table: str, job_id: str) -> list[Any]:
    out: list[Any] = []
    pos = 0
    while True:
        at, items = read_history(conn, table, job_id, pos, 50_000)
        if not items:
            return out
        out.extend(items)
        pos = at + len(items)
