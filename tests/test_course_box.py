"""The course in a Binder-sized box, short version (``benchmarks/course_box.py`` runs every
notebook, in a venv built from ``binder/`` alone): notebook 04 under papermill beside a
JupyterLab server, both in a 2 GB memory cgroup (no swap) on 2 CPUs, with this suite's venv.
It fails when papermill fails, when the cgroup's OOM killer touched a process, or when the
whole tree's peak PSS went over the limit; and the run must hold what a headless run writes:
text progress, the summary, the picture and the HTML report."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import nbformat
import pytest

from tests.conftest import load_file_module

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.timeout(600)


def test_the_headless_notebook_fits_binders_box_and_writes_its_report(tmp_path: Path) -> None:
    if os.geteuid() != 0 or shutil.which("taskset") is None:
        pytest.skip("needs root (a memory cgroup) and taskset, as CI has them")
    box = load_file_module(REPO / "benchmarks" / "course_box.py", "nbtrain_course_box")
    report = tmp_path / "report.html"
    result = box.run_notebook(REPO / "notebooks" / "04_headless_report.ipynb",
                              Path(sys.prefix), REPO, tmp_path, box.LIMIT_MB,
                              parameters={"steps": "60", "report_path": str(report)})
    assert result["passed"], f"{result['why']}\n{result['log_tail']}"
    assert result["oom_kills"] == 0 and 0 < result["peak_mb"] <= box.LIMIT_MB
    assert result["peak_procs"] >= 4  # JupyterLab, papermill, the kernel, workers: all seen

    nb = nbformat.read(result["executed"], as_version=4)
    streams = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                      for o in c.get("outputs", []) if o.output_type == "stream")
    assert "[headless] SUCCEEDED: completed 60 steps" in streams
    assert f"report written to {report}" in streams
    rich = [o.get("data", {}) for c in nb.cells if c.cell_type == "code"
            for o in c.get("outputs", []) if o.output_type in ("execute_result",
                                                                "display_data")]
    assert any("final loss" in d.get("text/html", "") for d in rich)  # the summary table
    assert any("image/svg+xml" in d for d in rich)  # the static picture
    page = report.read_text()
    assert "nbtrain report: headless" in page and "cdn.bokeh.org" not in page
