"""``nbtrain run FILE:FUNCTION`` from a shell: exit status, progress, report, result."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

TRAIN = textwrap.dedent('''
    import torch
    import torch.nn.functional as F
    from torch.utils.data import TensorDataset

    def data():
        g = torch.Generator().manual_seed(1)
        x = torch.randn(256, 8, generator=g)
        return TensorDataset(x, x @ torch.randn(8, 1, generator=g))

    def train(ctx, config):
        model = ctx.prepare(torch.nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=config["lr"])
        ctx.track(model=model, optimizer=opt)
        for x, y in ctx.batches(data(), global_batch_size=32):
            loss = F.mse_loss(model(x), y)
            opt.zero_grad(); loss.backward(); opt.step()
            ctx.report(loss=loss.item())
        print(f"rank {ctx.rank} done at step {ctx.step}")
        return {"steps": ctx.step, "tag": config["tag"]}

    def broken(ctx, config):
        raise RuntimeError("the data path does not exist: /nowhere")
''')


def _run(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "nbtrain", "run", *args], cwd=tmp,
                          capture_output=True, text=True, timeout=300)


def test_run_a_function_in_a_file_succeeds_with_progress_report_and_result(
        tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(TRAIN)
    out = _run(tmp_path, "train.py:train", "--world-size", "2", "--steps", "12",
               "--config", "lr=0.01", "--config", "tag=first", "--checkpoint", "none",
               "--report", "run.html")
    assert out.returncode == 0, out.stderr
    assert "SUCCEEDED: completed 12 steps" in out.stdout
    assert "[rank 1 g0] rank 1 done at step 12" in out.stdout
    assert "result: {'steps': 12, 'tag': 'first'}" in out.stdout
    # one document (written once, not appended); the inlined BokehJS has "<html" in it
    assert (tmp_path / "run.html").read_text().count("<!DOCTYPE html>") == 1


def test_run_exits_1_on_a_failing_job_and_2_on_bad_arguments(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(TRAIN)
    out = _run(tmp_path, "train.py:broken", "--world-size", "2", "--report", "failed.html")
    assert out.returncode == 1
    assert "FAILED" in out.stdout and "the data path does not exist" in out.stderr
    assert (tmp_path / "failed.html").exists()
    assert _run(tmp_path, "train.py:missing").returncode == 2
    assert _run(tmp_path, "train.py").returncode == 2


def test_version() -> None:
    out = subprocess.run([sys.executable, "-m", "nbtrain", "--version"], capture_output=True,
                         text=True, timeout=60, check=True)
    assert out.stdout.startswith("nbtrain ")
