"""A process that is busy (a Python spin) ``BUSY_MS`` out of every ``BUSY_MS + IDLE_MS``:
``python benchmarks/_burner.py BUSY_MS IDLE_MS``. Runs until killed. ``frameworks.py`` puts
it beside a torchrun peer to measure what a small, steady foreign CPU load costs ranks that
already fill the machine's cores."""

from __future__ import annotations

import sys
import time


def main() -> None:
    busy_s, idle_s = float(sys.argv[1]) / 1000, float(sys.argv[2]) / 1000
    while True:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < busy_s:
            pass
        time.sleep(idle_s)


if __name__ == "__main__":
    main()
