"""Workers forked from a preloaded forkserver (nbtrain's default) against Dask's spawn.

Each mode runs in a fresh process: ``connect(n_workers=4)`` (the embedded cluster), a 4-rank
``DigitsMLP`` job trained to step 30, then the proportional set size (PSS,
``/proc/PID/smaps_rollup``) of the notebook-side process and every process under it, and
how long ``connect()`` took and how long until the job's first step (the workers' start and
their first imports of torch, where Dask's spawned workers import it).
``NBTRAIN_WORKER_START=spawn`` is the peer.

Usage: ``python benchmarks/worker_start.py [--quick]`` (``--quick``: one run per mode, else
three, medians). Last stdout line: JSON with ``fork_pss_mb``, ``spawn_pss_mb``,
``pss_ratio`` (fork / spawn), ``fork_connect_s``, ``spawn_connect_s``, ``fork_first_step_s``,
``spawn_first_step_s``, ``first_step_ratio``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from course_box import pss_mb  # PSS of a set of processes, as the course box reads it


def one_run() -> dict[str, float]:
    import psutil

    import nbtrain
    from nbtrain.examples import DigitsMLP

    t0 = time.monotonic()
    with nbtrain.connect(n_workers=4) as cluster:
        connect_s = time.monotonic() - t0
        job = cluster.submit(DigitsMLP(), world_size=4, steps=10**6, checkpoint=None,
                             name="memory")
        while job.step < 1:
            time.sleep(0.05)
        first_step_s = time.monotonic() - t0
        while job.step < 30:
            time.sleep(0.2)
        me = psutil.Process()
        total = pss_mb([me.pid, *(p.pid for p in me.children(recursive=True))])
        job.stop()
        job.wait(120)
    return {"pss_mb": round(total, 1), "connect_s": round(connect_s, 2),
            "first_step_s": round(first_step_s, 2)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="one run per mode (else 3)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(one_run()))
        return
    runs: dict[str, list[dict[str, float]]] = {"fork": [], "spawn": []}
    for i in range(1 if args.quick else 3):
        for mode in runs:  # alternating, so a busier moment does not favour one mode
            out = subprocess.run([sys.executable, __file__, "--child"], check=True,
                                 capture_output=True, text=True,
                                 env=dict(os.environ, NBTRAIN_WORKER_START=mode))
            runs[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"run {i + 1} {mode:5s}: {runs[mode][-1]}", flush=True)
    fig = {f"{m}_{k}": statistics.median(r[k] for r in rs) for m, rs in runs.items()
           for k in ("pss_mb", "connect_s", "first_step_s")}
    fig["pss_ratio"] = round(fig["fork_pss_mb"] / fig["spawn_pss_mb"], 3)
    fig["first_step_ratio"] = round(fig["fork_first_step_s"] / fig["spawn_first_step_s"], 3)
    print(json.dumps({**fig, "runs": len(runs["fork"]), "workers": 4}))


if __name__ == "__main__":
    main()
