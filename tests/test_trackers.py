"""TensorBoard and MLflow receive a job's metrics from the controller, read back for real."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import pytest

import nbtrain
from nbtrain import JobState
from nbtrain.engine.trackers import TensorBoardWriter, _masked_crc, crc32c, parse_trackers
from tests.conftest import wait_for
from tests.recipes import regression_train

event_pb2 = pytest.importorskip("tensorboardX.proto.event_pb2")

STEPS = 20


def read_scalars(logdir: Path) -> dict[str, dict[int, float]]:
    """Every scalar in the TensorBoard event files under ``logdir``, checking each record's
    framing and checksums as TensorBoard's reader does."""
    out: dict[str, dict[int, float]] = {}
    for path in sorted(logdir.rglob("events.out.tfevents.*")):
        data = path.read_bytes()
        i = 0
        while i < len(data):
            header = data[i:i + 8]
            (length,) = struct.unpack("<Q", header)
            assert struct.unpack("<I", data[i + 8:i + 12])[0] == _masked_crc(header)
            body = data[i + 12:i + 12 + length]
            assert struct.unpack("<I", data[i + 12 + length:i + 16 + length])[0] == (
                _masked_crc(body))
            i += 16 + length
            event = event_pb2.Event.FromString(body)
            for value in event.summary.value:
                out.setdefault(value.tag, {})[event.step] = value.simple_value
    return out


def test_crc32c_and_the_event_file_format(tmp_path: Path) -> None:
    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value
    writer = TensorBoardWriter(str(tmp_path), "run")
    writer.scalars(7, {"train/loss": 0.25, "time/step_s": 0.01}, 1.7e9)
    writer.close("SUCCEEDED")
    events = [event_pb2.Event.FromString(b) for b in _records(writer.path)]
    assert events[0].file_version == "brain.Event:2"
    assert events[1].step == 7 and events[1].wall_time == 1.7e9
    assert {v.tag: v.simple_value for v in events[1].summary.value} == {
        "train/loss": 0.25, "time/step_s": pytest.approx(0.01)}


def _records(path: Path) -> list[bytes]:
    data, out, i = path.read_bytes(), [], 0
    while i < len(data):
        (n,) = struct.unpack("<Q", data[i:i + 8])
        out.append(data[i + 12:i + 12 + n])
        i += 16 + n
    return out


def test_tracker_targets_are_checked_and_made_absolute(tmp_path: Path) -> None:
    [tb, ml] = parse_trackers(["tensorboard:runs", "mlflow:file:./mlruns"])
    assert Path(tb.target).is_absolute() and ml.target.startswith("file:///")
    with pytest.raises(ValueError, match="tracker kind must be one of"):
        parse_trackers(["neptune:project"])


def test_every_step_reaches_tensorboard_and_mlflow(free_cluster: nbtrain.Cluster,
                                                   tmp_path: Path) -> None:
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    mlruns = f"file://{tmp_path / 'mlruns'}"
    job = free_cluster.submit(regression_train, world_size=2, steps=STEPS, checkpoint=10,
                              name="tracked",
                              trackers=[f"tensorboard:{tmp_path / 'tb'}", f"mlflow:{mlruns}"])
    assert job.wait(120) is JobState.SUCCEEDED, job.error
    losses = {int(r["step"]): r["loss"] for _, r in job.metrics[job.metrics["rank"] == 0]
              .iterrows()}

    def scalars() -> dict[str, dict[int, float]]:
        return read_scalars(tmp_path / "tb")

    wait_for(lambda: len(scalars().get("train/loss", {})) == STEPS, 30, "TensorBoard's rows")
    tb = scalars()
    assert tb["train/loss"] == pytest.approx(losses, rel=1e-6)
    assert set(tb["time/step_s"]) == set(range(1, STEPS + 1))
    assert set(tb["nbtrain/checkpoint_step"]) >= {10, 20}
    client = MlflowClient(tracking_uri=mlruns)

    def run() -> Any:
        runs = client.search_runs([client.get_experiment_by_name("nbtrain").experiment_id])
        return runs[0] if runs and runs[0].info.status == "FINISHED" else None

    wait_for(run, 60, "the MLflow run to end")
    history = client.get_metric_history(run().info.run_id, "train.loss")
    assert {m.step: m.value for m in history} == pytest.approx(losses, rel=1e-6)
    assert run().data.params["name"] == "tracked"


def read_wandb(run_dir: Path) -> tuple[list[dict[str, str]], dict[str, str], bool]:
    """(history rows, summary updates, exited) of an offline W&B run, read from its
    ``run-*.wandb`` file: W&B's log format (32 KiB blocks of chunks: crc32, uint16 length,
    uint8 type: 1 full, 2 first, 3 middle, 4 last) around protobuf ``Record``s."""
    from wandb.proto import wandb_internal_pb2 as pb

    [path] = run_dir.glob("run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    history: list[dict[str, str]] = []
    summary: dict[str, str] = {}
    exited = False
    i, buf, block = 7, b"", 32 * 1024
    while i + 7 <= len(data):
        if block - i % block < 7:
            i += block - i % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[i:i + 7])
        if length == 0 and kind == 0:  # the rest of the block is padding
            i += block - i % block
            continue
        buf += data[i + 7:i + 7 + length]
        i += 7 + length
        if kind in (1, 4):
            record = pb.Record.FromString(buf)
            buf = b""
            which = record.WhichOneof("record_type")
            if which == "history":
                history.append({(it.key or "/".join(it.nested_key)): it.value_json
                                for it in record.history.item})
            elif which == "summary":
                summary.update({(it.key or "/".join(it.nested_key)): it.value_json
                                for it in record.summary.update})
            elif which == "exit":
                exited = True
    return history, summary, exited


class Recorder:
    """A user's own tracker (nbtrain.Tracker): it keeps every call."""

    def __init__(self) -> None:
        self.steps: dict[int, dict[str, float]] = {}
        self.faults: list[tuple[int, int, str]] = []
        self.closed: str | None = None

    def scalars(self, step: int, values: Any, wall: float) -> None:
        self.steps.setdefault(step, {}).update(values)

    def fault(self, step: int, index: int, cause: str, wall: float) -> None:
        self.faults.append((step, index, cause))

    def close(self, state: str) -> None:
        self.closed = state


def test_wandb_and_your_own_tracker_run_in_the_notebook_through_a_recovery(
        free_cluster: nbtrain.Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    mine = Recorder()
    assert isinstance(mine, nbtrain.Tracker)
    job = free_cluster.submit(regression_train, world_size=2, steps=STEPS, checkpoint=5,
                              name="wandb-run", trackers=["wandb:nbtrain-tests", mine],
                              faults=[nbtrain.Fault("kill", rank=1, step=12)])
    assert job.wait(180) is JobState.SUCCEEDED, job.error
    wait_for(lambda: mine.closed is not None, 60, "the client-side trackers to close")
    assert mine.closed == "SUCCEEDED"
    assert set(mine.steps) == set(range(1, STEPS + 1))
    [(step, index, cause)] = mine.faults
    assert step == 11  # the step the rank died in
    assert index == 1 and "kill fault was injected" in cause
    rows = job.metrics
    last = rows[(rows["rank"] == 0) & (rows["generation"] == rows["generation"].max())]
    for _, row in last.iterrows():  # the values after the recovery replaced the lost ones
        assert mine.steps[int(row["step"])]["train/loss"] == pytest.approx(row["loss"])
    [run_dir] = (tmp_path / "wandb").glob("offline-run-*")
    history, summary, exited = read_wandb(run_dir)
    assert exited and summary["nbtrain/state"] == '"SUCCEEDED"'
    steps = [int(h["nbtrain/step"]) for h in history if "train/loss" in h]
    assert set(steps) == set(range(1, STEPS + 1)) and steps[-1] == STEPS
    assert len(steps) > STEPS  # the steps after the restored checkpoint came again
    assert [h["nbtrain/faults"] for h in history if "nbtrain/faults" in h] == ["1"]
    assert "kill fault was injected" in summary["nbtrain/fault_1"]


def test_mlflow_metrics_go_in_batches_not_one_request_per_step(tmp_path: Path) -> None:
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    from nbtrain.engine.trackers import MLFLOW_BATCH_MAX, MLflowWriter

    uri = f"file://{tmp_path / 'mlruns'}"
    writer = MLflowWriter(uri, "batches", "run", {"name": "run"})
    for step in range(1, 301):  # 300 steps x 5 values = 1,500 metrics
        writer.scalars(step, {f"train/v{i}": step * 10.0 + i for i in range(5)}, 1.7e9 + step)
    assert writer.requests == 1  # MLflow's limit reached once on the way
    writer.close("SUCCEEDED")
    assert writer.requests == -(-1500 // MLFLOW_BATCH_MAX)
    history = MlflowClient(tracking_uri=uri).get_metric_history(writer.run_id, "train.v3")
    assert {m.step: m.value for m in history} == {s: s * 10.0 + 3 for s in range(1, 301)}


def test_trackers_are_split_between_the_controller_and_the_notebook(tmp_path: Path) -> None:
    from nbtrain.engine.trackers import TrackerSpec, split_trackers

    on_controller, here = split_trackers([f"tensorboard:{tmp_path}", "wandb:p",
                                          TrackerSpec("mlflow", "file:///x", where="client")])
    assert [t.kind for t in on_controller] == ["tensorboard"]
    assert [t.kind for t in here] == ["wandb", "mlflow"]
    with pytest.raises(TypeError, match=r"nbtrain\.Tracker"):
        split_trackers([object()])
