"""The controller runs inside the Dask scheduler's process: importing it must not pull torch."""

from __future__ import annotations

import subprocess
import sys


def test_controller_imports_without_torch() -> None:
    code = ("import sys; import nbtrain.engine.controller, nbtrain.engine.handlers, "
            "nbtrain.engine.workers, nbtrain.engine.tasks; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout


def test_package_names_resolve_lazily() -> None:
    import nbtrain

    assert nbtrain.JobState.RUNNING.value == "RUNNING"
    assert "connect" in dir(nbtrain)
