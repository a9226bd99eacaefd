"""Live views: what a refresh costs, and whether the served page moves while the kernel is busy.

Part 1, the kernel-side widget (``display="widget"``): what one tick takes on the kernel,
for 2 and 16 ranks.

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

Part 2, the served job page (:mod:`nbtrain.ui.jobpage`, run by the scheduler): its refresh
at 16 and 64 ranks, with the page in a Bokeh document whose change events are serialised as
the server would send them; peer: the widget's tick above at the same ranks and rows.

Part 3, in a real headless Chromium: an embedded cluster (the quick start's) trains a job
while this process's main thread, the "kernel", blocks in ``job.wait()``, then spins in a
pure-Python loop (holding the GIL the in-process scheduler also needs). The browser polls
the page's step-time data; ``busy_kernel_updates_per_s`` counts how often the data it holds
advanced per second during the wait (target >= 1), ``busy_python_updates_per_s`` during
the spin. Skipped (figures null) when Chromium is missing.

Run: ``python benchmarks/dashboard.py --quick`` (about two minutes on two cores).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import threading
import time
from collections.abc import Mapping
from typing import Any

import comm
from comm.base_comm import BaseComm

from nbtrain.core.job import JobSpec
from nbtrain.engine.job import JobHandle
from nbtrain.engine.pages import REFRESH_MS


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
            job.follow_update({"rows": [(0, rank, *row) for row in
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


class SyntheticFeed:
    """A job page's feed with step rows made up at a fixed rate (no cluster)."""

    def __init__(self, world_size: int) -> None:
        self.job_id = f"bench{world_size}"
        self.can_control = True
        self.world_size = world_size
        self.rows: list[Any] = []

    def feed(self, step: int, n: int) -> None:
        for rank in range(self.world_size):
            self.rows += [(0, rank, *row) for row in rows_for(step, n, rank, 1.7e9)]

    def rows_since(self, position: int) -> tuple[list[Any], int]:
        return self.rows[position:], len(self.rows)

    def events_since(self, position: int) -> tuple[list[dict[str, Any]], int]:
        return [], position

    def status(self) -> Mapping[str, Any]:
        return {"name": self.job_id, "state": "RUNNING", "reason": "training",
                "world_size": self.world_size, "step": len(self.rows) // self.world_size}

    def request(self, what: str, arg: Any = None) -> None:
        raise NotImplementedError


def run_page(world_size: int, ticks: int, steps_per_tick: int) -> dict[str, float]:
    """The served page's refresh, in a document whose change events are serialised."""
    from bokeh.core.serialization import Serializer
    from bokeh.document import Document

    from nbtrain.ui.jobpage import JobPage

    feed = SyntheticFeed(world_size)
    page = JobPage(feed)
    doc = Document()
    doc.add_root(page.layout)
    sent = {"events": 0, "bytes": 0}

    def on_change(event: Any) -> None:
        sent["events"] += 1
        sent["bytes"] += len(json.dumps(Serializer().encode(event.to_serializable(
            Serializer())), default=str))

    doc.on_change(on_change)
    costs = []
    step = 1
    for _ in range(ticks):
        feed.feed(step, steps_per_tick)
        step += steps_per_tick
        started = time.perf_counter()
        page.refresh()
        costs.append(time.perf_counter() - started)
    ordered = sorted(costs)
    return {"median_ms": statistics.median(costs) * 1e3,
            "p95_ms": ordered[int(0.95 * (len(ordered) - 1))] * 1e3,
            "events_per_tick": sent["events"] / ticks,
            "kb_per_tick": sent["bytes"] / ticks / 1024}


LAST_STEP_JS = """() => {
  if (!window.Bokeh) return null;
  for (const view of Bokeh.index) {
    const src = view.model.document && view.model.document.get_model_by_name('steptime-r0');
    if (src && src.data.step.length) return src.data.step[src.data.step.length - 1];
  }
  return null;
}"""


def watch_page(url: str, seconds: float, marks: dict[str, float],
               out: dict[str, Any]) -> None:
    """In its own thread: open ``url`` in headless Chromium; for each phase the main thread
    announces in ``marks`` ("wait", then "spin"), count the updates of the page's data."""
    from playwright.sync_api import sync_playwright

    args = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync"]
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=_chromium(), args=args)
            page = browser.new_page()
            page.goto(url)
            page.wait_for_function(f"() => ({LAST_STEP_JS})() > 0", timeout=120_000)
            marks["ready"] = time.monotonic()
            for phase in ("wait", "spin"):
                while phase not in marks:
                    time.sleep(0.02)
                first = last = page.evaluate(LAST_STEP_JS)
                changes, started = 0, time.monotonic()
                while time.monotonic() - started < seconds:
                    page.wait_for_timeout(100)
                    now = page.evaluate(LAST_STEP_JS)
                    if now != last:
                        changes, last = changes + 1, now
                elapsed = time.monotonic() - started
                out[phase] = {"updates_per_s": round(changes / elapsed, 2),
                              "steps_seen_per_s": round(((last or 0) - (first or 0))
                                                        / elapsed, 1)}
            browser.close()
    except Exception as exc:  # reported in the figures, never hangs the main thread
        out["error"] = repr(exc)


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def busy_kernel(seconds: float) -> dict[str, Any]:
    """Part 3: the page in Chromium while this process's main thread is busy."""
    import nbtrain
    from nbtrain.examples import DigitsMLP

    if _chromium() is None:
        return {"skipped": "chromium not installed"}
    out: dict[str, Any] = {}
    marks: dict[str, float] = {}
    with nbtrain.connect(n_workers=2) as cluster:
        job = cluster.submit(DigitsMLP(), world_size=2, steps=10**7, name="busy",
                             checkpoint=None)
        watcher = threading.Thread(target=watch_page, daemon=True,
                                   args=(job.page().url, seconds, marks, out))
        watcher.start()
        while "ready" not in marks and watcher.is_alive():
            time.sleep(0.1)
        marks["wait"] = time.monotonic()
        with contextlib.suppress(TimeoutError):
            job.wait(seconds + 1)  # the "kernel" blocks in job.wait()
        marks["spin"] = time.monotonic()
        spin_until = time.monotonic() + seconds + 1
        while time.monotonic() < spin_until:
            pass  # a cell computing in pure Python: it holds the GIL most of the time
        watcher.join(60)
        job.stop()
        job.wait(120)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="60 ticks per case")
    parser.add_argument("--ticks", type=int, default=300)
    parser.add_argument("--hz", type=float, default=4.0, help="refresh rate (4, the default)")
    parser.add_argument("--steps-per-s", type=float, default=50.0,
                        help="training steps per second per rank (50)")
    parser.add_argument("--busy-s", type=float, default=10.0,
                        help="seconds the browser watches each busy phase (10)")
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
    print(f"\nthe served job page (scheduler side), {per_tick} rows per rank per tick:")
    print(f"{'ranks':>5} {'median ms':>10} {'p95 ms':>8} {'duty %':>7} {'events':>7} "
          f"{'KB/tick':>8} {'vs widget':>9}")
    page_hz = 1000 / REFRESH_MS
    for world in (16, 64):
        run_page(world, 5, per_tick)
        page = run_page(world, ticks, per_tick)
        widget = run_pull(world, ticks, per_tick)
        ratio = page["median_ms"] / widget["median_ms"]
        duty = page["median_ms"] / 1e3 * page_hz * 100
        print(f"{world:>5} {page['median_ms']:>10.2f} {page['p95_ms']:>8.2f} {duty:>7.2f} "
              f"{page['events_per_tick']:>7.1f} {page['kb_per_tick']:>8.1f} {ratio:>9.2f}")
        results[f"page_ranks_{world}"] = {
            "refresh_ms_median": round(page["median_ms"], 3),
            "refresh_ms_p95": round(page["p95_ms"], 3),
            "scheduler_duty_pct_at_page_rate": round(duty, 3),
            "events_per_tick": round(page["events_per_tick"], 1),
            "kb_per_tick": round(page["kb_per_tick"], 1),
            "page_over_widget_cost": round(ratio, 2)}

    print(f"\nthe page in headless Chromium while the kernel is busy ({args.busy_s:g} s each):")
    busy = busy_kernel(args.busy_s)
    print(json.dumps(busy))
    results["busy_kernel_updates_per_s"] = (busy.get("wait") or {}).get("updates_per_s")
    results["busy_python_updates_per_s"] = (busy.get("spin") or {}).get("updates_per_s")
    results["busy_kernel_steps_seen_per_s"] = (busy.get("wait") or {}).get("steps_seen_per_s")
    if "error" in busy or "skipped" in busy:
        results["busy_kernel_note"] = busy.get("error") or busy.get("skipped")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
