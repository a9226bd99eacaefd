"""Run first in a script's child process, before the script: step times without changing it.

The rank runs ``python -u script_boot.py SCRIPT ARGS``. This registers torch's global
optimizer hooks and reports one line per step of the first optimizer that steps (``step_s
opt_s``, seconds) on the file descriptor ``NBTRAIN_STEP_FD``, then runs SCRIPT as
``__main__`` with ``sys.argv = [SCRIPT, *ARGS]``. A step lasts from the end of the previous
one (the first: from the first module's forward) to the end of its ``optimizer.step()``;
``opt_s`` is the time inside the optimizers' ``step``. Stdlib and torch only: it must not
import nbtrain (the child may not see the same ``sys.path`` as the worker).
"""

from __future__ import annotations

import contextlib
import os
import runpy
import sys
import time
from typing import Any


def _install(fd: int) -> None:
    import torch
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    clock = time.perf_counter
    state: dict[str, Any] = {"end": None, "pre": 0.0, "opt": 0.0, "first": None}

    def first_forward(module: Any, args: Any) -> None:
        if state["end"] is None:
            state["end"] = clock()
        handle.remove()

    handle = torch.nn.modules.module.register_module_forward_pre_hook(first_forward)

    def pre(opt: Any, args: Any, kwargs: Any) -> None:
        state["pre"] = clock()

    def post(opt: Any, args: Any, kwargs: Any) -> None:
        now = clock()
        state["opt"] += now - state["pre"]
        if state["first"] is None:
            state["first"] = id(opt)
        if id(opt) != state["first"]:
            return  # a second optimizer of the same step (a GAN's): its time counts as opt
        start = state["end"] if state["end"] is not None else state["pre"]
        with contextlib.suppress(OSError):  # the rank stopped reading: goes on unmeasured
            os.write(fd, f"{now - start:.9f} {state['opt']:.9f}\n".encode())
        state["end"], state["opt"] = now, 0.0

    register_optimizer_step_pre_hook(pre)
    register_optimizer_step_post_hook(post)


def main() -> None:
    script, *args = sys.argv[1:]
    fd = int(os.environ.pop("NBTRAIN_STEP_FD", "-1"))
    extra = os.environ.pop("NBTRAIN_SCRIPT_PATH", "")
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    if extra and extra not in sys.path:
        sys.path.insert(1, extra)  # the script's own directory, for its sibling modules
    if fd >= 0:
        _install(fd)
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
