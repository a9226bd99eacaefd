"""Headless: papermill runs notebooks/04_headless_report.ipynb with NBTRAIN_DISPLAY=text;
it exits 0 and the executed notebook holds the progress lines, the summary, the picture, and
the HTML report it wrote."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "notebooks" / "04_headless_report.ipynb"

pytestmark = pytest.mark.timeout(420)


def test_papermill_text_mode_writes_the_report(tmp_path: Path) -> None:
    out = tmp_path / "executed.ipynb"
    report = tmp_path / "report.html"
    env = {k: v for k, v in os.environ.items() if not k.startswith("NBTRAIN_")}
    env["NBTRAIN_DISPLAY"] = "text"
    env["NBTRAIN_PROGRESS_INTERVAL_S"] = "0.5"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-m", "papermill", str(NOTEBOOK), str(out), "-k", "python3",
         "--cwd", str(tmp_path), "-p", "steps", "60", "-p", "report_path", str(report),
         "--no-progress-bar"],
        env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]

    nb = nbformat.read(out, as_version=4)
    streams = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                      for o in c.get("outputs", []) if o.output_type == "stream")
    assert "[headless] RUNNING" in streams or "[headless] SUCCEEDED" in streams
    assert "[headless] SUCCEEDED: completed 60 steps" in streams
    assert f"report written to {report}" in streams
    rich = [o.get("data", {}) for c in nb.cells if c.cell_type == "code"
            for o in c.get("outputs", []) if o.output_type in ("execute_result",
                                                                "display_data")]
    assert any("final loss" in d.get("text/html", "") for d in rich)  # the summary table
    assert any("image/svg+xml" in d for d in rich)  # the static picture
    page = report.read_text()
    assert "nbtrain report: headless" in page and "cdn.bokeh.org" not in page


COURSE = sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))


@pytest.mark.parametrize("path", COURSE, ids=[p.stem for p in COURSE])
def test_every_course_notebook_takes_parameters_and_ends_with_what_you_learned(
        path: Path) -> None:
    import papermill

    nb = nbformat.read(path, as_version=4)
    tagged = [c for c in nb.cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(tagged) == 1, f"{path.name}: one cell tagged 'parameters' for papermill"
    params = papermill.inspect_notebook(str(path))
    assert params, f"{path.name}: its parameters cell assigns no names"
    last = [c for c in nb.cells if c.cell_type == "markdown"][-1]
    assert last.source.startswith("## What you learned"), path.name


def test_papermill_runs_the_quick_start_with_its_parameters(tmp_path: Path) -> None:
    """No NBTRAIN_DISPLAY: the notebook's own `display` parameter, set by papermill, decides."""
    out = tmp_path / "quickstart.ipynb"
    env = {k: v for k, v in os.environ.items() if not k.startswith("NBTRAIN_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-m", "papermill", str(REPO / "notebooks" / "01_quickstart.ipynb"),
         str(out), "-k", "python3", "--cwd", str(tmp_path), "-p", "display", "text",
         "-p", "steps", "60", "--no-progress-bar"],
        env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    nb = nbformat.read(out, as_version=4)
    streams = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                      for o in c.get("outputs", []) if o.output_type == "stream")
    assert "[digits] SUCCEEDED: completed 60 steps" in streams
    assert "final_loss" in streams and "my-loop" in streams  # the function's job and %nbtrain
