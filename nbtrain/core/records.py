"""Per-rank, per-step timing records: what the rank loop measures and the detector reads.

One record per rank per step. The phases partition a rank's step so that a slow rank and the
ranks waiting for it can be told apart even though DDP's all-reduce makes their total step
times equal: the slow rank shows a high ``compute_s`` (or ``data_s``/``opt_s``) and a low
``comm_s``, its peers the opposite.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]


class Phase(str, enum.Enum):
    """The parts of a training step that are timed separately, in column order."""

    DATA = "data"  # waiting for the next batch (loader, I/O, host-to-device copy)
    COMPUTE = "compute"  # forward + backward, excluding time spent waiting for other ranks
    COMM = "comm"  # waiting for the gradient all-reduce after this rank's backward was done
    OPT = "opt"  # optimizer step (and anything after the all-reduce up to the step's end)


PHASES: tuple[Phase, ...] = (Phase.DATA, Phase.COMPUTE, Phase.COMM, Phase.OPT)

#: Columns of a step row as one rank sends it (a list, to keep messages small); a dict of the
#: step's metrics may follow. ``time`` is wall-clock time at the end of the step.
#: This is the only definition: the runtime, the controller and the views import it.
ROW_COLUMNS = ("step", "time", "step_s", "data_s", "compute_s", "comm_s", "opt_s")
#: A job's step row as the controller and the views keep it: generation and rank first.
JOB_ROW_COLUMNS = ("generation", "rank", *ROW_COLUMNS)
#: Positions in a job row; ``METRICS`` is the optional metrics dict after the columns.
GEN, RANK, STEP, TIME, STEP_S, DATA_S, COMPUTE_S, COMM_S, OPT_S = range(len(JOB_ROW_COLUMNS))
METRICS = len(JOB_ROW_COLUMNS)


@dataclass(frozen=True, slots=True)
class StepRecord:
    """The timings of one step on one rank, in seconds.

    ``comm_s`` is the time this rank waited for the gradient all-reduce to finish after its own
    backward was done; ``compute_s`` excludes that wait. ``step_s`` is the whole step, loop top
    to loop top; it is about equal across ranks under DDP and is used only for scale.
    """

    rank: int
    step: int
    step_s: float
    data_s: float
    compute_s: float
    comm_s: float
    opt_s: float

    def __post_init__(self) -> None:
        if self.rank < 0 or self.step < 0:
            raise ValueError(
                f"StepRecord needs rank >= 0 and step >= 0, got rank={self.rank} "
                f"step={self.step}"
            )
        for name in ("step_s", "data_s", "compute_s", "comm_s", "opt_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0.0):
                raise ValueError(
                    f"StepRecord {name} must be a finite number of seconds >= 0, got {value!r} "
                    f"(rank {self.rank}, step {self.step}); clamp tiny negative differences of "
                    "perf_counter readings at 0 before building the record"
                )

    @classmethod
    def from_row(cls, rank: int, row: Sequence[Any]) -> StepRecord:
        """A record from one step row of the rank loop's event stream.

        The row's leading columns are ``ROW_COLUMNS`` (the runtime's ``STEP_COLUMNS``);
        anything after them (the step's metrics) is ignored.
        """
        if len(row) < len(ROW_COLUMNS):
            raise ValueError(
                f"a step row needs the columns {ROW_COLUMNS}, got {len(row)} values: {row!r}"
            )
        step, _, step_s, data_s, compute_s, comm_s, opt_s = row[: len(ROW_COLUMNS)]
        return cls(
            rank=rank,
            step=int(step),
            step_s=float(step_s),
            data_s=float(data_s),
            compute_s=float(compute_s),
            comm_s=float(comm_s),
            opt_s=float(opt_s),
        )

    def phase_s(self, phase: Phase) -> float:
        """The seconds this record spent in ``phase``."""
        return float(getattr(self, f"{phase.value}_s"))


@dataclass(frozen=True)
class StepFrame:
    """All ranks' timings of one step as columns (index = rank).

    The detector works on frames: the engine's records are grouped into them, and the simulator
    and the benchmark build them directly, which keeps replays of thousands of ranks cheap.
    ``phases`` has shape (len(PHASES), world_size), rows in the order of ``PHASES``.
    """

    step: int
    step_s: FloatArray
    phases: FloatArray

    def __post_init__(self) -> None:
        if self.phases.ndim != 2 or self.phases.shape[0] != len(PHASES):
            raise ValueError(
                f"StepFrame.phases must have shape ({len(PHASES)}, world_size), "
                f"got {self.phases.shape}"
            )
        if self.step_s.shape != (self.phases.shape[1],):
            raise ValueError(
                f"StepFrame.step_s must have shape ({self.phases.shape[1]},), "
                f"got {self.step_s.shape}"
            )

    @property
    def world_size(self) -> int:
        return int(self.phases.shape[1])

    @classmethod
    def from_records(cls, records: Sequence[StepRecord]) -> StepFrame:
        """One frame from exactly one record per rank 0..n-1 of the same step."""
        if not records:
            raise ValueError("StepFrame.from_records needs at least one record")
        step = records[0].step
        n = len(records)
        by_rank = sorted(records, key=lambda r: r.rank)
        ranks = [r.rank for r in by_rank]
        if ranks != list(range(n)) or any(r.step != step for r in by_rank):
            raise ValueError(
                f"StepFrame.from_records needs one record of step {step} for each rank 0..{n - 1}, "
                f"got ranks {ranks} and steps {sorted({r.step for r in by_rank})}"
            )
        step_s = np.array([r.step_s for r in by_rank], dtype=np.float64)
        phases = np.array(
            [[r.data_s for r in by_rank], [r.compute_s for r in by_rank],
             [r.comm_s for r in by_rank], [r.opt_s for r in by_rank]],
            dtype=np.float64,
        )
        return cls(step=step, step_s=step_s, phases=phases)

    @classmethod
    def from_arrays(
        cls,
        step: int,
        *,
        step_s: FloatArray,
        data_s: FloatArray,
        compute_s: FloatArray,
        comm_s: FloatArray,
        opt_s: FloatArray,
    ) -> StepFrame:
        """A frame from per-rank columns (each of length world_size)."""
        phases = np.stack([data_s, compute_s, comm_s, opt_s]).astype(np.float64, copy=False)
        return cls(step=step, step_s=np.asarray(step_s, dtype=np.float64), phases=phases)


__all__ = [
    "COMM_S", "COMPUTE_S", "DATA_S", "GEN", "JOB_ROW_COLUMNS", "METRICS", "OPT_S", "PHASES",
    "RANK", "ROW_COLUMNS", "STEP", "STEP_S", "TIME", "FloatArray", "Phase", "StepFrame",
    "StepRecord",
]
