"""Experiment trackers: TensorBoard event files, MLflow runs, Weights & Biases runs, and any
object that implements :class:`Tracker`.

``submit(..., trackers=["tensorboard:runs", "mlflow:http://mlflow:5000", "wandb:my-project"])``.
Ranks never write them (they need no credentials, and a tracker sees recoveries, preemptions
and checkpoints, which ranks do not). Each tracker gets every step of rank 0 (the metrics the
job reports, ``train/<name>``, and the phase times, ``time/<phase>_s``), each committed
checkpoint (``nbtrain/checkpoint_step``), each fault (``nbtrain/faults``, with its cause), and
the job's end. One thread per tracked job does the I/O, off the event loop that feeds it.

Where a tracker runs (``TrackerSpec.where``):

- ``"controller"`` (TensorBoard and MLflow by default): inside the scheduler process, so it
  records the job whether or not a notebook follows it; the scheduler's machine needs the
  package and the tracking server's credentials.
- ``"client"`` (W&B by default, and every :class:`Tracker` object): in the notebook that
  submitted the job, fed from what its handle follows; the credentials stay with the user
  (``wandb login`` on their machine), and nothing of theirs is unpickled in the controller.
  It records while that kernel follows the job (after a restart of the kernel,
  ``cluster.job(name).track("wandb:PROJECT")`` feeds a new run from the job's retained
  history on).

TensorBoard files are written here directly (TFRecord framing around ``Event`` protocol
buffers holding scalar summaries): the controller must not import torch, and tensorboardX
does. MLflow goes through ``mlflow-skinny`` (``pip install nbtrain[trackers]`` where the
scheduler runs); its local file store (``mlflow:file:///path``) is in maintenance mode upstream
and is enabled for these runs.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import struct
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from nbtrain.core.records import JOB_ROW_COLUMNS, METRICS, RANK, STEP, TIME

logger = logging.getLogger(__name__)

__all__ = ["Tracker", "TrackerSink", "TrackerSpec", "parse_trackers", "split_trackers"]

KINDS = ("tensorboard", "mlflow", "wandb")
WHERE = ("controller", "client")
#: Positions of the phase times in a job row.
_TIME_COLUMNS = [(i, name) for i, name in enumerate(JOB_ROW_COLUMNS) if name.endswith("_s")]


@dataclass(frozen=True)
class TrackerSpec:
    kind: str  # "tensorboard" | "mlflow" | "wandb"
    target: str  # a log directory, an MLflow tracking URI, or a W&B project
    experiment: str = ""  # MLflow experiment name (default "nbtrain")
    #: "controller" or "client" (see the module's docs); "" = the kind's default.
    where: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"tracker kind must be one of {', '.join(KINDS)}, got "
                             f"{self.kind!r}: e.g. 'tensorboard:runs', 'mlflow:file:///mlruns' "
                             "or 'wandb:PROJECT'")
        if not self.target:
            raise ValueError(f"the {self.kind} tracker needs a target: 'tensorboard:LOGDIR', "
                             "'mlflow:TRACKING_URI' or 'wandb:PROJECT'")
        if self.where not in ("", *WHERE):
            raise ValueError(f"TrackerSpec(where={self.where!r}): 'controller' (in the "
                             "scheduler process) or 'client' (in this notebook)")
        if not self.where:
            object.__setattr__(self, "where", "client" if self.kind == "wandb" else "controller")


def split_trackers(items: Sequence[Any] | None) -> tuple[list[TrackerSpec], list[Any]]:
    """``submit(trackers=...)`` parsed: (the specs the controller runs, what the client runs:
    client-side specs and :class:`Tracker` objects)."""
    controller: list[TrackerSpec] = []
    client: list[Any] = []
    for item in items or ():
        if isinstance(item, (str, TrackerSpec)):
            [spec] = parse_trackers([item])
            (client if spec.where == "client" else controller).append(spec)
        elif isinstance(item, Tracker):
            client.append(item)
        else:
            raise TypeError(f"a tracker is 'KIND:TARGET', a TrackerSpec or an object with "
                            f"scalars(), fault() and close() (nbtrain.Tracker), got "
                            f"{type(item).__name__}")
    return controller, client


def parse_trackers(items: Sequence[str | TrackerSpec] | None) -> list[TrackerSpec]:
    """``"tensorboard:runs"``, ``"mlflow:file:///tmp/mlruns"``, ``"wandb:PROJECT"`` or
    ``TrackerSpec``s; local paths made absolute (the controller may run in another
    directory)."""
    out = []
    for item in items or ():
        spec = item if isinstance(item, TrackerSpec) else TrackerSpec(*_split(str(item)))
        target = spec.target
        if spec.kind == "tensorboard" and "://" not in target:
            target = str(Path(target).expanduser().resolve())
        elif spec.kind == "mlflow" and target.startswith("file:") and not target.startswith(
                "file:///"):
            target = "file://" + str(Path(target[5:].lstrip("/") if target[5:7] != "//"
                                          else target[7:]).expanduser().resolve())
        out.append(TrackerSpec(spec.kind, target, spec.experiment, spec.where))
    return out


def _split(item: str) -> tuple[str, str]:
    kind, sep, target = item.partition(":")
    if not sep:
        raise ValueError(f"a tracker is 'KIND:TARGET' (tensorboard:LOGDIR, "
                         f"mlflow:TRACKING_URI), got {item!r}")
    return kind, target


# ============================================================================ writers
@runtime_checkable
class Tracker(Protocol):
    """What a tracker implements; pass an instance in ``submit(..., trackers=[...])`` (it
    runs in the submitting notebook). Calls come from one thread, in order; an exception is
    reported (``job.tracker_errors`` on the controller side, a log warning on the client)
    and never touches the job. A ``flush()`` method, if present, is called whenever the
    queue of updates runs empty (batch your requests until then)."""

    def scalars(self, step: int, values: Mapping[str, float], wall: float) -> None:
        """Values at ``step`` (``train/loss``, ``time/step_s``, ...; ``wall``: Unix time).
        A recovered job sends a step again from its restored checkpoint on."""

    def fault(self, step: int, index: int, cause: str, wall: float) -> None:
        """The job's ``index``-th fault (1, 2, ...) at ``step``, with its cause."""

    def close(self, state: str) -> None:
        """The job ended in ``state`` (SUCCEEDED, FAILED or CANCELLED)."""




class TensorBoardWriter:
    """Scalars in a TensorBoard event file (``events.out.tfevents.*``) under ``logdir``."""

    def __init__(self, logdir: str, run: str) -> None:
        directory = Path(logdir) / run
        directory.mkdir(parents=True, exist_ok=True)
        now = time.time()
        name = f"events.out.tfevents.{int(now)}.{socket.gethostname()}.{os.getpid()}.nbtrain"
        self.path = directory / name
        self._f = open(self.path, "ab")  # noqa: SIM115 (closed in close())
        self._record(_field_double(1, now) + _field_bytes(3, b"brain.Event:2"))

    def scalars(self, step: int, values: Mapping[str, float], wall: float) -> None:
        summary = b"".join(_field_bytes(1, _field_bytes(1, tag.encode()) + _field_float(2, v))
                           for tag, v in values.items())
        self._record(_field_double(1, wall) + _field_varint(2, step) + _field_bytes(5, summary))

    def fault(self, step: int, index: int, cause: str, wall: float) -> None:
        self.scalars(step, {"nbtrain/faults": float(index)}, wall)

    def close(self, state: str) -> None:
        self._f.flush()
        self._f.close()

    def _record(self, data: bytes) -> None:
        header = struct.pack("<Q", len(data))
        self._f.write(header + struct.pack("<I", _masked_crc(header)) + data
                      + struct.pack("<I", _masked_crc(data)))
        self._f.flush()


class MLflowWriter:
    """One MLflow run per job: params from the job's spec, metrics per step, faults as tags."""

    def __init__(self, uri: str, experiment: str, run: str, params: Mapping[str, Any]) -> None:
        if uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.tracking import MlflowClient

        self._client = MlflowClient(tracking_uri=uri)
        name = experiment or "nbtrain"
        found = self._client.get_experiment_by_name(name)
        exp_id = found.experiment_id if found is not None else self._client.create_experiment(
            name)
        self.run_id = self._client.create_run(exp_id, run_name=run).info.run_id
        from mlflow.entities import Param

        self._client.log_batch(self.run_id, params=[Param(str(k), str(v)[:500])
                                                    for k, v in params.items()])
        self._pending: list[Any] = []
        self.requests = 0  # log_batch requests for metrics (the batching's test reads it)

    def scalars(self, step: int, values: Mapping[str, float], wall: float) -> None:
        from mlflow.entities import Metric

        ms = int(wall * 1000)
        self._pending.extend(Metric(tag.replace("/", "."), float(v), ms, step)
                             for tag, v in values.items())
        if len(self._pending) >= MLFLOW_BATCH_MAX:
            self.flush()

    def flush(self) -> None:
        """One ``log_batch`` request per ``MLFLOW_BATCH_MAX`` metrics (MLflow's own limit),
        not one per step."""
        while self._pending:
            batch, self._pending = (self._pending[:MLFLOW_BATCH_MAX],
                                    self._pending[MLFLOW_BATCH_MAX:])
            self._client.log_batch(self.run_id, metrics=batch)
            self.requests += 1

    def fault(self, step: int, index: int, cause: str, wall: float) -> None:
        self.scalars(step, {"nbtrain/faults": float(index)}, wall)
        self.flush()
        self._client.set_tag(self.run_id, f"nbtrain.fault.{index}", cause[:5000])

    def close(self, state: str) -> None:
        self.flush()
        status = {"SUCCEEDED": "FINISHED", "FAILED": "FAILED"}.get(state, "KILLED")
        self._client.set_terminated(self.run_id, status)


class WandbWriter:
    """One W&B run per job. ``WANDB_MODE=offline`` (or ``wandb offline``) keeps it on disk
    for ``wandb sync``. The x axis is ``nbtrain/step``: W&B's own step must only grow, and a
    recovered job sends steps again from its restored checkpoint."""

    def __init__(self, project: str, run: str, params: Mapping[str, Any]) -> None:
        import wandb

        self._run = wandb.init(project=project, name=run, config=dict(params),
                               reinit="create_new")
        self._run.define_metric("nbtrain/step")
        self._run.define_metric("*", step_metric="nbtrain/step")
        self.dir = str(self._run.dir)

    def scalars(self, step: int, values: Mapping[str, float], wall: float) -> None:
        self._run.log({"nbtrain/step": step, **values})

    def fault(self, step: int, index: int, cause: str, wall: float) -> None:
        self._run.log({"nbtrain/step": step, "nbtrain/faults": float(index)})
        self._run.summary[f"nbtrain/fault_{index}"] = cause[:5000]

    def close(self, state: str) -> None:
        self._run.summary["nbtrain/state"] = state
        self._run.finish(exit_code=0 if state == "SUCCEEDED" else 1)


#: Metrics per MLflow ``log_batch`` request (the tracking server's limit).
MLFLOW_BATCH_MAX = 1000


# ============================================================================ the sink
#: Rows a job's trackers may be behind before new rows are dropped (and counted).
ROWS_BEHIND_MAX = 100_000


class TrackerSink:
    """Feeds one job's trackers from a thread of its own (the controller only enqueues)."""

    def __init__(self, specs: Sequence[TrackerSpec | Tracker], run: str,
                 params: Mapping[str, Any], on_error: Any = None) -> None:
        self.specs = list(specs)
        self.run = run
        self.params = dict(params)
        self.on_error = on_error  # called with a message when a tracker fails
        self._queue: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self._faults = 0
        #: Rows enqueued and not written yet, and rows dropped because a tracker fell
        #: ``ROWS_BEHIND_MAX`` behind (the controller's memory stays bounded).
        self._behind = 0
        self.dropped = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"nbtrain-trackers-{run}",
                                        daemon=True)
        self._thread.start()

    # -- called on the controller's event loop: enqueue only --------------------------------
    def rows(self, rows: Sequence[Sequence[Any]]) -> None:
        """Job rows (``JOB_ROW_COLUMNS``); rank 0's are written."""
        mine = [r for r in rows if int(r[RANK]) == 0]
        if not mine:
            return
        with self._lock:
            if self._behind + len(mine) > ROWS_BEHIND_MAX:
                first = self.dropped == 0
                self.dropped += len(mine)
                if first:
                    self._error(f"the trackers fell {self._behind} rows behind; rows are "
                                "dropped until they catch up (a slow tracking server?)")
                return
            self._behind += len(mine)
        self._queue.put(("rows", mine))

    def event(self, event: Mapping[str, Any]) -> None:
        kind = event.get("kind")
        if kind == "checkpoint" and event.get("phase") == "committed":
            self._queue.put(("scalars", int(event["step"]),
                             {"nbtrain/checkpoint_step": float(event["step"])},
                             float(event.get("time", time.time()))))
        elif kind == "fault":
            self._queue.put(("fault", int(event.get("step", 0)), str(event.get("cause", "")),
                             float(event.get("time", time.time()))))
        elif kind == "state" and event.get("state") in ("SUCCEEDED", "FAILED", "CANCELLED"):
            self._queue.put(("end", str(event["state"])))

    def wait(self, timeout: float | None = None) -> None:
        """Until everything enqueued is written and the writers are closed (tests)."""
        self._thread.join(timeout)

    # -- the thread --------------------------------------------------------------------------
    def _run(self) -> None:
        writers: list[Tracker] = []
        for spec in self.specs:
            try:
                writers.append(self._open(spec))
            except Exception as exc:
                what = (f"{spec.kind} tracker at {spec.target}" if isinstance(spec, TrackerSpec)
                        else f"tracker {type(spec).__name__}")
                self._error(f"{what} could not start: {type(exc).__name__}: {exc}")
        while True:
            if self._queue.empty():
                for w in writers:
                    if callable(getattr(w, "flush", None)):
                        self._safely(w, "flush")
            item = self._queue.get()
            if item[0] == "rows":
                with self._lock:
                    self._behind -= len(item[1])
            if item[0] == "end":
                for w in writers:
                    self._safely(w, "close", item[1])
                return
            if item[0] == "fault":
                self._faults += 1  # once per fault, whatever the number of trackers
            for w in writers:
                if item[0] == "rows":
                    for row in item[1]:
                        self._safely(w, "scalars", *_row_scalars(row))
                elif item[0] == "scalars":
                    self._safely(w, "scalars", item[1], item[2], item[3])
                elif item[0] == "fault":
                    self._safely(w, "fault", item[1], self._faults, item[2], item[3])

    def _open(self, spec: TrackerSpec | Tracker) -> Tracker:
        if not isinstance(spec, TrackerSpec):
            return spec  # the user's own
        if spec.kind == "tensorboard":
            return TensorBoardWriter(spec.target, self.run)
        if spec.kind == "wandb":
            return WandbWriter(spec.target, self.run, self.params)
        return MLflowWriter(spec.target, spec.experiment, self.run, self.params)

    def _safely(self, writer: Tracker, method: str, *args: Any) -> None:
        try:
            getattr(writer, method)(*args)
        except Exception as exc:  # a tracker's failure never touches the job
            self._error(f"{type(writer).__name__}.{method} failed: {type(exc).__name__}: "
                        f"{exc}")

    def _error(self, message: str) -> None:
        logger.warning("nbtrain trackers of %s: %s", self.run, message)
        if self.on_error is not None:
            self.on_error(message)


def _row_scalars(row: Sequence[Any]) -> tuple[int, dict[str, float], float]:
    values = {f"time/{name}": float(row[i]) for i, name in _TIME_COLUMNS}
    if len(row) > METRICS and isinstance(row[METRICS], Mapping):
        values.update({f"train/{k}": float(v) for k, v in row[METRICS].items()})
    return int(row[STEP]), values, float(row[TIME])


# ============================================================================ protobuf + crc
def _varint(n: int) -> bytes:
    out = bytearray()
    n &= (1 << 64) - 1
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _field_varint(field: int, value: int) -> bytes:
    return _varint(field << 3) + _varint(value)


def _field_double(field: int, value: float) -> bytes:
    return _varint((field << 3) | 1) + struct.pack("<d", value)


def _field_float(field: int, value: float) -> bytes:
    return _varint((field << 3) | 5) + struct.pack("<f", value)


def _field_bytes(field: int, value: bytes) -> bytes:
    return _varint((field << 3) | 2) + _varint(len(value)) + value


def _crc32c_table() -> list[int]:
    table = []
    for i in range(256):
        crc = i
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table.append(crc)
    return table


_CRC_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), as TFRecord files use."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _CRC_TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _masked_crc(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF
