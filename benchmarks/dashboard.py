"""Dashboard refresh cost: what one tick takes on the kernel, for 2 and 16 ranks.

A real :class:`~nbtrain.engine.job.JobHandle` (no controller) is fed step rows through the
controller's own entry point at a given training rate, and a real
:class:`~nbtrain.ui.dashboard.JobDashboard` refreshes from it as its poller would, at
``--hz``. Widgets sit on a comm that JSON-encodes every message (what ipykernel does before
sending), so serialising the Bokeh patches is part of the measured cost; the browser side and
the network are not.

Peer, in the same run: the same plots updated the push way, one ``stream`` per rank per step
row as each row arrives (what a naive event callback would do), without the per-tick
batching. Figures: milliseconds per tick (median, p95), kernel duty (share of one core the
view takes at ``--hz``), comm messages per second, and the push/pull cost ratio.

Run: ``python benchmarks/dashboard.py --quick`` (well under a minute on two cores).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import comm
from comm.base_comm import BaseComm

from nbtrain.core.job import JobSpec
from nbtrain.engine.job import JobHandle


class EncodingComm(BaseComm):
    """Counts messages and JSON-encodes them, as the kernel would before sending."""

    messages = 0
    encoded_bytes = 0

    def publish_msg(self, msg_type: str, data: Any = None, metadata: Any = None,
                    buffers: Any = None, **keys: Any) -> None:
        EncodingComm.messages += 1
        EncodingComm.encoded_bytes += len(json.dumps(data))


def make_job(world_size: int) -> JobHandle:
    spec = JobSpec(job_id=f"bench{world_size}", name=f"bench-{world_size}",
                   world_size=world_size, steps=10**9)
    return JobHandle(spec, checkpoint_url="memory://bench",
                     status={"state": "RUNNING", "reason": "training"})


def rows_for(step0: int, n: int, rank: int, t0: float) -> list[list[Any]]:
    return [[s, t0 + s * 0.02, 0.02 + 1e-4 * rank, 1e-3, 0.012, 4e-3, 2e-3, {"loss": 1 / s}]
            for s in range(step0, step0 + n)]


def run_pull(world_size: int, ticks: int, steps_per_tick: int) -> dict[str, float]:
    from nbtrain.ui.dashboard import JobDashboard

    job = make_job(world_size)
    dash = JobDashboard(job, start=False)
    EncodingComm.messages = EncodingComm.encoded_bytes = 0
    costs = []
    step = 1
    for _ in range(ticks):
        for rank in range(world_size):
            job._apply({"rows": [(0, rank, *row) for row in
                                 rows_for(step, steps_per_tick, rank, 1.7e9)]})
        step += steps_per_tick
        started = time.perf_counter()
        dash.refresh()
        costs.append(time.perf_counter() - started)
    return _figures(costs, ticks)


def run_push(world_size: int, ticks: int, steps_per_tick: int) -> dict[str, float]:
    """The same plots, one stream call per rank per row, as rows arrive."""
    from nbtrain.ui.dashboard import JobDashboard

    job = make_job(world_size)
    dash = JobDashboard(job, start=False)
    EncodingComm.messages = EncodingComm.encoded_bytes = 0
    costs = []
    step = 1
    for _ in range(ticks):
        started = time.perf_counter()
        for s in range(step, step + steps_per_tick):
            for rank in range(world_size):
                row = (0, rank, *rows_for(s, 1, rank, 1.7e9)[0])
                for plot in (dash.step_plot, dash.split_plot, dash.loss_plot, dash.rate_plot):
                    plot.add([row])
        costs.append(time.perf_counter() - started)
        step += steps_per_tick
    return _figures(costs, ticks)


def _figures(costs: list[float], ticks: int) -> dict[str, float]:
    ordered = sorted(costs)
    return {"median_ms": statistics.median(costs) * 1e3,
            "p95_ms": ordered[int(0.95 * (len(ordered) - 1))] * 1e3,
            "messages_per_tick": EncodingComm.messages / ticks,
            "kb_per_tick": EncodingComm.encoded_bytes / ticks / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="60 ticks per case")
    parser.add_argument("--ticks", type=int, default=300)
    parser.add_argument("--hz", type=float, default=4.0, help="refresh rate (4, the default)")
    parser.add_argument("--steps-per-s", type=float, default=50.0,
                        help="training steps per second per rank (50)")
    args = parser.parse_args()
    ticks = 60 if args.quick else args.ticks
    per_tick = max(1, round(args.steps_per_s / args.hz))
    comm.create_comm = lambda **kw: EncodingComm(**kw)

    results: dict[str, Any] = {"hz": args.hz, "steps_per_s": args.steps_per_s,
                               "rows_per_rank_per_tick": per_tick, "ticks": ticks}
    print(f"refresh at {args.hz:g} Hz, {args.steps_per_s:g} steps/s per rank "
          f"({per_tick} rows per rank per tick), {ticks} ticks per case")
    print(f"{'ranks':>5} {'mode':>5} {'median ms':>10} {'p95 ms':>8} {'duty %':>7} "
          f"{'msgs/tick':>9} {'KB/tick':>8}")
    for world in (2, 16):
        run_pull(world, 5, per_tick)  # warm-up: first Bokeh model creation, imports
        pull = run_pull(world, ticks, per_tick)
        push = run_push(world, ticks, per_tick)
        for mode, fig in (("pull", pull), ("push", push)):
            duty = fig["median_ms"] / 1e3 * args.hz * 100
            print(f"{world:>5} {mode:>5} {fig['median_ms']:>10.2f} {fig['p95_ms']:>8.2f} "
                  f"{duty:>7.2f} {fig['messages_per_tick']:>9.1f} {fig['kb_per_tick']:>8.1f}")
        results[f"ranks_{world}"] = {
            "tick_ms_median": round(pull["median_ms"], 3),
            "tick_ms_p95": round(pull["p95_ms"], 3),
            "kernel_duty_pct": round(pull["median_ms"] / 1e3 * args.hz * 100, 3),
            "messages_per_tick": round(pull["messages_per_tick"], 1),
            "kb_per_tick": round(pull["kb_per_tick"], 1),
            "push_tick_ms_median": round(push["median_ms"], 3),
            "push_over_pull_cost": round(push["median_ms"] / pull["median_ms"], 2),
            "push_over_pull_messages": round(push["messages_per_tick"]
                                             / max(pull["messages_per_tick"], 1e-9), 2),
        }
    print(json.dumps(results))


if __name__ == "__main__":
    main()
