"""papermill: every course notebook takes parameters, and the quick start runs with its own.

(Notebook 04, the headless report, runs under papermill in ``tests/test_course_box.py``,
inside a Binder-sized memory box beside JupyterLab.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.timeout(420)


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
