"""Other client processes, as other users' kernels would be."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Mapping
from pathlib import Path


def run_client(script: str, *, env: Mapping[str, str] | None = None
               ) -> subprocess.Popen[str]:
    """Start another client process running ``script`` (Python, dedented) from the repo root,
    with the test recipes importable and pickled by value."""
    prelude = ("import cloudpickle, sys, json\n"
               "sys.path.insert(0, '.')\n"
               "from tests import recipes\n"
               "cloudpickle.register_pickle_by_value(recipes)\n")
    return subprocess.Popen([sys.executable, "-c", prelude + textwrap.dedent(script)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})},
                            cwd=Path(__file__).resolve().parent.parent)
