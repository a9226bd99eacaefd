"""Live straggler trials on this machine: clean jobs and a real noisy neighbour.

Shared by ``benchmarks/stragglers.py`` (the live figures) and by trace recording for offline
tuning (``python benchmarks/_straggler_live.py record DIR``): every trial returns the job's
per-rank per-step phase times as a :class:`LiveTrace` and the straggler events it raised.

The noisy neighbour is a real CPU-bound process, not the fault injector: each rank's worker
process (every thread of it) is pinned to its own core with ``sched_setaffinity``, and a
``taskset -c CORE python -c 'while True: pass'`` is started on one rank's core once the job
is past warm-up. The kernel then shares that core between the rank and the hog, so the rank
computes at about half speed, and its peers wait for it in the all-reduce.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]

PHASE_COLUMNS = ("data_s", "compute_s", "comm_s", "opt_s")


@dataclass
class LiveTrace:
    """One job's timings, steps in order (only steps every rank reported, generation 0)."""

    label: str
    steps: npt.NDArray[np.int64]  # (S,)
    step_s: FloatArray  # (S, n)
    phases: FloatArray  # (S, 4, n), PHASES order
    end_time: FloatArray  # (S,) wall-clock end of the step on the last rank to finish it
    hog_rank: int | None = None
    onset_step: int | None = None  # first step that ended after the hog started
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return int(self.phases.shape[2])

    def save(self, path: Path) -> None:
        # float16 seconds (3 significant digits: enough for timings that vary by percents),
        # end times as float32 offsets from the first: a 2,000-step trace is ~50 KB
        t0 = float(self.end_time[0]) if self.end_time.size else 0.0
        np.savez_compressed(
            path, steps=self.steps.astype(np.int32), step_s=self.step_s.astype(np.float16),
            phases=self.phases.astype(np.float16),
            end_time=(self.end_time - t0).astype(np.float32), t0=np.float64(t0),
            meta=json.dumps({"label": self.label, "hog_rank": self.hog_rank,
                             "onset_step": self.onset_step, **self.meta}))

    @classmethod
    def load(cls, path: Path) -> LiveTrace:
        with np.load(path) as z:
            meta = json.loads(str(z["meta"]))
            t0 = float(z["t0"]) if "t0" in z.files else 0.0
            return cls(label=meta.pop("label"), steps=z["steps"].astype(np.int64),
                       step_s=z["step_s"].astype(np.float64),
                       phases=z["phases"].astype(np.float64),
                       end_time=z["end_time"].astype(np.float64) + t0,
                       hog_rank=meta.pop("hog_rank"), onset_step=meta.pop("onset_step"),
                       meta=meta)


def trace_of(job: Any, label: str) -> LiveTrace:
    """The job's generation-0 rows as arrays (steps that some rank missed are dropped)."""
    m = job.metrics
    m = m[m["generation"] == m["generation"].min()]
    n = int(m["rank"].max()) + 1
    by_step = m.groupby("step")["rank"].nunique()
    complete = np.array(sorted(by_step[by_step == n].index), dtype=np.int64)
    m = m[m["step"].isin(complete)].sort_values(["step", "rank"])
    s = len(complete)
    step_s = m["step_s"].to_numpy(np.float64).reshape(s, n)
    phases = np.stack([m[c].to_numpy(np.float64).reshape(s, n) for c in PHASE_COLUMNS], axis=1)
    end_time = m["time"].to_numpy(np.float64).reshape(s, n).max(axis=1)
    return LiveTrace(label, complete, step_s, phases, end_time)


def straggler_events(job: Any) -> list[dict[str, Any]]:
    return [dict(e) for e in job.events if e["kind"] in ("straggler", "mitigation")]


def worker_pids(cluster: Any) -> dict[str, int]:
    pids: dict[str, int] = cluster.client.run(os.getpid)
    return pids


def pin_process(pid: int, core: int) -> None:
    """Pin every thread of ``pid`` to ``core`` (a process's affinity covers only the threads
    created after it is set: gloo's and torch's threads already run)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(int(tid), {core})


def unpin_process(pid: int) -> None:
    cores = set(range(os.cpu_count() or 1))
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(int(tid), cores)


@contextlib.contextmanager
def cpu_hog(core: int | None, nice: int = 0) -> Iterator[subprocess.Popen[bytes]]:
    """A CPU-bound process pinned to ``core`` (None: free to move between cores, a busy
    machine rather than a straggler), at ``nice``, for the duration of the block."""
    pin = [] if core is None else ["taskset", "-c", str(core)]
    niced = ["nice", "-n", str(nice)] if nice else []
    proc = subprocess.Popen([*niced, *pin, sys.executable, "-c", "while True: pass"])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait(10)


def wait_until(cond: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.05)


def clean_run(cluster: Any, recipe: Any, steps: int, label: str,
              timeout: float = 600.0) -> tuple[LiveTrace, list[dict[str, Any]]]:
    """One healthy job: nothing injected, nothing pinned (as a user runs it)."""
    job = cluster.submit(recipe, world_size=2, steps=steps, checkpoint=None, name=label)
    state = job.wait(timeout)
    if state.value != "SUCCEEDED":
        raise RuntimeError(f"clean run {label} ended {state.value}: {job.reason}")
    return trace_of(job, label), straggler_events(job)


def hog_run(cluster: Any, recipe: Any, *, hog_rank: int, onset_after: int, steps: int,
            label: str, stop_on_confirm: bool = False,
            timeout: float = 600.0) -> tuple[LiveTrace, list[dict[str, Any]]]:
    """A job whose ranks are pinned one per core; a CPU hog joins ``hog_rank``'s core once
    rank 0 passed step ``onset_after`` and stays until the job ends (or a verdict on the
    hogged rank is confirmed, with ``stop_on_confirm``)."""
    cores = sorted(os.sched_getaffinity(0))
    job = cluster.submit(recipe, world_size=2, steps=steps, checkpoint=None, name=label)
    wait_until(lambda: job.status.value == "RUNNING" and len(job.slots) == 2, 120,
               f"{label} to run")
    pids = worker_pids(cluster)
    slot_pids = [pids[addr] for addr in job.slots]
    for rank, pid in enumerate(slot_pids):
        pin_process(pid, cores[rank % len(cores)])
    core = cores[hog_rank % len(cores)]
    try:
        wait_until(lambda: job.step >= onset_after or job.done, timeout, f"{label} step")
        started = time.time()
        with cpu_hog(core):
            deadline = time.monotonic() + timeout
            while not job.done and time.monotonic() < deadline:
                if stop_on_confirm and any(
                        e["kind"] == "straggler" and e["state"] == "confirmed"
                        and float(e.get("time") or 0.0) >= started for e in job.events):
                    break
                time.sleep(0.1)
            if not job.done:
                job.stop()
        job.wait(120)
    finally:
        for pid in slot_pids:
            with contextlib.suppress(OSError):
                unpin_process(pid)
    trace = trace_of(job, label)
    after = np.flatnonzero(trace.end_time > started)
    trace.hog_rank = hog_rank
    trace.onset_step = int(trace.steps[after[0]]) if after.size else None
    trace.meta["hog_core"] = core
    return trace, straggler_events(job)


def confirmed_events(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e["kind"] == "straggler" and e["state"] == "confirmed"]


@dataclass
class HogVerdict:
    """What one pinned-hog trial showed."""

    right: bool  # the first confirmed verdict after the onset: the hogged rank, compute; no
    # other rank confirmed after the onset
    latency: int | None  # steps from the onset to that verdict
    before_onset: int  # confirmed verdicts before the hog started (false, or another load)
    text: str
    latency_s: float | None = None  # seconds of training from the onset to that verdict


def judge_hog(trace: LiveTrace, events: list[dict[str, Any]]) -> HogVerdict:
    onset = trace.onset_step
    confirmed = confirmed_events(events)
    if onset is None:
        return HogVerdict(False, None, len(confirmed), "the job ended before the hog started")
    before = [e for e in confirmed if int(e["step"]) < onset]
    after = [e for e in confirmed if int(e["step"]) >= onset]
    first = after[0] if after else None
    right = (first is not None and first["rank"] == trace.hog_rank
             and first["phase"] == "compute"
             and all(e["rank"] == trace.hog_rank for e in after))
    latency = int(first["step"]) - onset if first is not None else None
    latency_s = None
    if first is not None:
        at = np.flatnonzero(trace.steps <= int(first["step"]))
        start = np.flatnonzero(trace.steps >= onset)
        if at.size and start.size:
            latency_s = float(trace.end_time[at[-1]] - trace.end_time[start[0]])
    seen = (f"first confirmed rank {first['rank']} {first['phase']} {latency} steps "
            f"({latency_s or 0.0:.2f} s) after" if first is not None
            else "nothing confirmed after")
    return HogVerdict(right, latency, len(before),
                      f"hog on rank {trace.hog_rank}'s core from step {onset}: {seen}; "
                      f"{len(before)} confirmed before", latency_s)


def _hog_figures(verdicts: list[HogVerdict]) -> dict[str, Any]:
    """Rate of right verdicts (with the trial count) and the latency of the right ones."""
    right = [v for v in verdicts if v.right and v.latency is not None]
    steps = sorted(v.latency for v in right if v.latency is not None)
    secs = sorted(v.latency_s for v in right if v.latency_s is not None)
    return {
        "trials": len(verdicts),
        "right": round(len(right) / len(verdicts), 3) if verdicts else None,
        "latency_steps": float(np.median(steps)) if steps else None,
        "latency_s": round(float(np.median(secs)), 2) if secs else None,
        "latencies": [v.latency for v in verdicts],
        "confirmed_before_onset": sum(v.before_onset for v in verdicts),
    }


def live_noise_trials(cluster: Any, quick: bool, save: Path | None = None) -> dict[str, Any]:
    """Live figures of issues 15 and 31, on a quiet machine and on a loaded one: healthy jobs
    (how often a straggler is confirmed that is not there) and trials with a CPU hog pinned to
    one rank's core (the right rank and phase confirmed, and how many steps after the onset).
    ``--quick`` runs 6 hog trials per condition, the full mode 20; each stops at its first
    confirmed verdict after the onset, or 400 steps after it.

    The loaded machine has a second CPU hog free to move between cores. Beside the healthy
    jobs it runs at full priority (the harder case for false alarms). Beside the pinned-hog
    trials it runs at ``nice 19``, as background work on a shared box does: at full priority
    on two cores the kernel's load balancing puts it on the other rank's core, and both ranks
    then lose half a core (measured: the hogged rank's progress 0.86 of its peer's with a
    full-priority floating hog, 0.53 with a niced one, 0.49 with none), so there is no
    straggler left to find."""
    clean_plan = [("mlp", 2000), ("mlp-heavy", 1000)]
    hog_trials = 6 if quick else 20
    if not quick:
        clean_plan = clean_plan * 4
    out: dict[str, Any] = {}
    lines: list[str] = []
    load: list[float] = []
    for condition in ("quiet", "loaded"):
        steps = confirmed = suspects = 0
        verdicts: list[HogVerdict] = []
        with contextlib.ExitStack() as stack:
            if condition == "loaded":
                busy = stack.enter_context(cpu_hog(None))
            for i, (model, n) in enumerate(clean_plan):
                trace, events = clean_run(cluster, recipe_of(model), n,
                                          f"{condition}-clean-{model}-{i}")
                load.append(os.getloadavg()[0])
                got = confirmed_events(events)
                sus = [e for e in events if e["kind"] == "straggler" and e["state"] == "suspect"]
                steps += len(trace.steps)
                confirmed += len(got)
                suspects += len(sus)
                lines.append(f"  {condition} clean {model:<9} {len(trace.steps):>5} steps "
                             f"{float(np.median(trace.step_s)) * 1e3:6.1f} ms/step: "
                             f"{len(sus):>3} suspect, {len(got)} confirmed "
                             + " ".join(f"(rank {e['rank']} {e['phase']} at {e['step']})"
                                        for e in got))
                if save is not None:
                    trace.save(save / f"bench-{trace.label}.npz")
            if condition == "loaded":  # the background hog niced for the trials (docstring)
                busy.kill()
                busy.wait(10)
                stack.enter_context(cpu_hog(None, nice=19))
            for i in range(hog_trials):
                rank = i % 2
                trace, events = hog_run(cluster, recipe_of("mlp-heavy"), hog_rank=rank,
                                        onset_after=100, steps=500,
                                        label=f"{condition}-hog-r{rank}-{i}",
                                        stop_on_confirm=True)
                load.append(os.getloadavg()[0])
                verdict = judge_hog(trace, events)
                verdicts.append(verdict)
                lines.append(f"  {condition} hog trial {i}: {verdict.text}")
                if save is not None:
                    trace.save(save / f"bench-{trace.label}.npz")
        prefix = "live_" if condition == "quiet" else "live_loaded_"
        hog = _hog_figures(verdicts)
        out.update({
            f"{prefix}clean_steps": steps,
            f"{prefix}clean_confirmed": confirmed,
            f"{prefix}clean_confirmed_per_10k": round(1e4 * confirmed / steps, 2),
            f"{prefix}clean_suspects_per_10k": round(1e4 * suspects / steps, 1),
            **{f"{prefix}hog_{k}": v for k, v in hog.items()},
            f"{prefix}targets_met": bool(
                confirmed * 1e4 / steps <= 1 and hog["right"] is not None
                and hog["right"] >= 0.9 and hog["latency_steps"] is not None
                and hog["latency_steps"] <= 50),
        })
    print("live, healthy jobs (2 ranks) and a CPU hog pinned to one rank's core "
          "(DigitsMLP hidden=512 layers=3), quiet and beside a second CPU hog (full "
          "priority beside the healthy jobs, nice 19 beside the trials):")
    print("\n".join(lines))
    out["live_load1_max"] = round(max(load), 2)
    out["live_load1_median"] = round(float(np.median(load)), 2)
    return out


RECIPES: dict[str, dict[str, Any]] = {
    "mlp": {"hidden": 256, "layers": 2, "batch_size": 128},
    "mlp-heavy": {"hidden": 512, "layers": 3, "batch_size": 256},
    "mlp-xl": {"hidden": 1024, "layers": 3, "batch_size": 512},
}


def recipe_of(name: str) -> Any:
    from nbtrain.examples import DigitsMLP

    return DigitsMLP(**RECIPES[name])


def record(out: Path, plan: list[str]) -> None:
    """Record the trials named in ``plan`` ("clean:mlp:1500", "hog:mlp-heavy:1:300:1200")."""
    import nbtrain

    out.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.TemporaryDirectory(prefix="nbtrain-traces-")
    settings = nbtrain.Settings.load(checkpoint_root=tmp.name)
    with tmp, nbtrain.connect(n_workers=2, settings=settings, gpus=False) as cluster:
        for i, item in enumerate(plan):
            kind, model, *rest = item.split(":")
            stamp = time.strftime("%H%M%S")
            if kind == "clean":
                label = f"clean-{model}-{stamp}-{i}"
                trace, events = clean_run(cluster, recipe_of(model), int(rest[0]), label)
            elif kind == "busy":  # healthy job on a busy machine: a hog on no core in particular
                label = f"busy-{model}-{stamp}-{i}"
                with cpu_hog(None):
                    trace, events = clean_run(cluster, recipe_of(model), int(rest[0]), label)
            else:
                hog_rank, onset, steps = (int(x) for x in rest)
                label = f"hog-{model}-r{hog_rank}-{stamp}-{i}"
                trace, events = hog_run(cluster, recipe_of(model), hog_rank=hog_rank,
                                        onset_after=onset, steps=steps, label=label)
            trace.meta["model"] = model
            trace.meta["load1"] = os.getloadavg()[0]
            trace.save(out / f"{label}.npz")
            (out / f"{label}.events.json").write_text(json.dumps(events, default=str))
            confirmed = [(e["rank"], e["phase"]) for e in events
                         if e["kind"] == "straggler" and e["state"] == "confirmed"]
            print(f"{label}: {len(trace.steps)} steps, "
                  f"{float(np.median(trace.step_s)) * 1e3:.1f} ms/step median, onset "
                  f"{trace.onset_step}, {sum(e['kind'] == 'straggler' for e in events)} "
                  f"straggler events, confirmed {confirmed}", flush=True)


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "record":
        record(Path(sys.argv[2]), sys.argv[3:])
    else:
        print("usage: python benchmarks/_straggler_live.py record DIR clean:mlp:1500 "
              "hog:mlp:1:300:1200 ...", file=sys.stderr)
        sys.exit(2)


def replay(trace: LiveTrace, settings: Any = None) -> list[Any]:
    """The verdicts the detector gives on a recorded trace (offline, same code as live)."""
    from nbtrain.core.records import StepFrame
    from nbtrain.core.straggler import StragglerDetector

    det = StragglerDetector(trace.world_size, settings, start_step=int(trace.steps[0]))
    out = []
    for k, step in enumerate(trace.steps):
        frame = StepFrame(step=int(step), step_s=trace.step_s[k], phases=trace.phases[k])
        out += det.observe_frame(frame)
    return out


@dataclass
class ReplayScore:
    clean_steps: int = 0
    clean_suspects: int = 0
    clean_confirmed: int = 0
    hog_trials: int = 0
    hog_right: int = 0
    hog_latency: list[int] = field(default_factory=list)
    hog_wrong_confirmed: int = 0
    lines: list[str] = field(default_factory=list)


def score_replay(traces: list[LiveTrace], settings: Any = None) -> ReplayScore:
    """Clean traces (and hog traces before the onset): verdicts are false. Hog traces: the
    first confirmed verdict after the onset must name the hogged rank in compute."""
    from nbtrain.core.straggler import Verdict

    sc = ReplayScore()
    for trace in traces:
        verdicts = replay(trace, settings)
        onset = trace.onset_step if trace.hog_rank is not None else None
        clean_end = onset if onset is not None else int(trace.steps[-1]) + 1
        sc.clean_steps += int(np.sum(trace.steps < clean_end))
        false = [d for d in verdicts if d.step < clean_end]
        sc.clean_suspects += sum(d.state is Verdict.SUSPECT for d in false)
        sc.clean_confirmed += sum(d.state is Verdict.CONFIRMED for d in false)
        note = ""
        if onset is not None:
            sc.hog_trials += 1
            after = [d for d in verdicts if d.step >= onset and d.state is Verdict.CONFIRMED]
            wrong = [d for d in after if d.rank != trace.hog_rank]
            sc.hog_wrong_confirmed += len(wrong)
            first = after[0] if after else None
            ok = (first is not None and first.rank == trace.hog_rank
                  and first.phase.value == "compute" and not wrong)
            sc.hog_right += ok
            if first is not None:
                sc.hog_latency.append(first.step - onset)
            note = (f" hog rank {trace.hog_rank} from {onset}: first confirmed "
                    + (f"rank {first.rank} {first.phase.value} at +{first.step - onset}"
                       if first else "none") + f", wrong {len(wrong)}")
        sc.lines.append(
            f"{trace.label:<34} {len(trace.steps):>5} steps  false suspect "
            f"{sum(d.state is Verdict.SUSPECT for d in false):>3} confirmed "
            f"{sum(d.state is Verdict.CONFIRMED for d in false):>2}{note}")
    return sc
