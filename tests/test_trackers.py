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
        parse_trackers(["wandb:project"])


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
