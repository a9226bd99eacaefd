"""What the job machine says to people: queue reasons, rejections, fault causes (pure).

Functions of what the machine knows, returning text (or, for a fault, the ``fault`` event
with its one readable cause); they decide nothing. Every reason names the numbers and, where
there is one, the fix.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from nbtrain.core.job import JobState
from nbtrain.core.jobevents import fault_event
from nbtrain.core.jobrecord import Generation, primary_failure
from nbtrain.core.watchdog import Hang

__all__ = ["LOST", "describe_fault", "fault_list", "gpu_shared_reason", "labels_refused_reason",
           "queue_head_reason", "rejected_reason", "resize_rejected", "restart_budget",
           "resume_rejected",
           "slot_forgotten_reason", "slot_lost_reason", "unit"]

#: The fault kind of a rank whose worker went away.
LOST = "worker died"


def unit(kind: str, kinds: list[str]) -> str:
    """"slots" on a cluster of one kind; "GPU slots" / "CPU slots" where kinds mix or the
    job's kind (``kind``) has no slot yet."""
    return "slots" if not kind or kinds == [kind] else f"{kind.upper()} slots"


def rejected_reason(name: str, size: int, unit: str, free: int, online: int) -> str:
    """Why a ``queue=False`` submission does not run."""
    return (f"job {name} needs {size} {unit} at once but only {free} of the cluster's "
            f"{online} are free (queue=False, so it is not queued): free slots, add workers, "
            "or submit with queue=True")


def queue_head_reason(*, need: int, unit: str, free: int, online: int, restarting: int,
                      offline: int, releasing: Iterable[str]) -> str:
    """Why the head of a kind's queue waits: the slots it needs at once against the ones
    there are (``releasing``: jobs preempted for it, still releasing their slots)."""
    away = ", ".join(f"{n} {what}" for n, what in ((restarting, "restarting"),
                                                 (offline, "offline")) if n)
    away = f" ({away})" if away else ""
    if need > online:
        return (f"needs {need} {unit} at once; the cluster has {online}{away}: waiting for "
                "workers to join")
    why = f"needs {need} {unit} at once; {free} of {online} free{away}"
    names = list(releasing)
    if names:
        why += f"; preempted {', '.join(names)} releasing its slots"
    return why


def resize_rejected(*, name: str, resizable: bool, world_size: int, bounds: tuple[int, int],
                    size: int, total: int, unit: str, wait_for_workers: bool) -> str:
    """Why a resize request is refused ("" when it is not)."""
    lo, hi = bounds
    if not resizable:
        return (f"job {name} was submitted with a fixed size of {world_size} ranks: submit "
                "it with min_size= and/or max_size= to resize it")
    if not lo <= size <= hi:
        return (f"job {name} may run with {lo} to {hi} ranks (min_size={lo}, max_size={hi}), "
                f"not {size}")
    if size > total and not wait_for_workers:
        return (f"the cluster has {total} {unit}, fewer than the {size} asked for job {name}: "
                "add workers, or resize(..., wait_for_workers=True) to grow when they join")
    return ""


def restart_budget(max_restarts: int, window_s: float) -> str:
    """What ran out when a failed job is not restarted."""
    return (f"restart budget spent (max_restarts={max_restarts} within {window_s:.0f} s)"
            if max_restarts else "max_restarts=0")


def fault_list(faults: Iterable[Mapping[str, Any]]) -> str:
    """Every fault of a job, one clause each."""
    return "; ".join(f"{f['what']} on rank {f['rank']} ({f['host']}) at step {f['step']}"
                     for f in faults)


def gpu_shared_reason(gpu: str, address: str, slot: str) -> str:
    """Why a worker on a GPU another worker already uses is kept out."""
    return (f"it runs on GPU {gpu}, which worker {address} (slot {slot}) already uses: start "
            "one worker per GPU, each with its own CUDA_VISIBLE_DEVICES (dask cuda worker does)")


def labels_refused_reason(nvlink: str, leaf: str, problem: str) -> str:
    """Why a worker whose topology labels do not fit the cluster's is kept out."""
    return (f"its labels (NVLink domain {nvlink!r}, leaf {leaf!r}) do not fit the cluster's "
            f"topology: {problem}")


def slot_forgotten_reason(slot_forget_s: float) -> str:
    """Why a departed host's slot left the controller's book."""
    return (f"offline for more than {slot_forget_s:.0f} s with no job on it (slot_forget_s): "
            "forgotten; a worker that joins on its host later gets a slot again")


def slot_lost_reason(worker_return_s: float) -> str:
    """Why a slot whose worker was restarted is reported lost."""
    return (f"its worker did not come back within {worker_return_s:.0f} s of a restart; the "
            "cluster has one slot fewer until a worker joins on that host")


def describe_fault(gen: Generation, *, name: str, step: int, wall: float, now: float,
                   host_of: Callable[[str], str]) -> dict[str, Any]:
    """What ended ``gen`` (a job's generation at its ``step``), with one readable cause and
    the detection latency: the ``fault`` event, plus ``_detected_mono`` and ``_report`` (the
    long text, with the remote traceback) for the machine."""
    injected_when = None
    if gen.injected is not None:
        injected_when = float(gen.injected.get("when", 0)) or None
    hang = gen.watch.hang
    if hang is not None:
        culprits = hang.culprits if gen.watch.declared else ()
        rank = culprits[0] if culprits else next(
            (r for r, f in gen.failures.items() if not f.peer), None)
        what = "hang"
        error, cause = _hang_cause(hang, rank, bool(culprits))
        detected_wall, detected_mono = hang.detected_wall, hang.detected_mono
        if injected_when is None:
            injected_when = detected_wall - hang.silent_s
        report = f"job {name} hung at step {step}: {cause}"
    else:
        rank, primary = primary_failure(gen.failures)
        what = LOST if primary.lost_worker else "exception"
        error, step = primary.error, primary.step
        if primary.lost_worker:
            note = (f" (a {gen.injected['fault']['kind']} fault was injected)"
                    if gen.injected else "")
            cause = f"rank {rank}'s {error}{note}"
        else:
            cause = f"rank {rank} raised at step {step}: {error}"
        detected_wall = gen.failed_wall if gen.failed_wall is not None else wall
        detected_mono = gen.failed_at if gen.failed_at is not None else now
        if injected_when is None and not primary.peer:
            injected_when = primary.when  # the rank's own clock when it raised
        peer = " (a peer rank went away)" if primary.peer else ""
        report = (f"rank {rank} on {primary.host} failed at step {step}{peer}: {error}\n"
                  f"--- remote traceback (rank {rank}) ---\n{primary.traceback}")
    host = host_of(gen.slots[rank]) if rank is not None else None
    detect_s = detected_wall - injected_when if injected_when is not None else None
    fault: dict[str, Any] = dict(fault_event(
        detected_wall, what=what, cause=cause, rank=rank, host=host, step=step,
        error=error, generation=gen.number, detect_s=detect_s))
    fault["_detected_mono"] = detected_mono
    fault["_report"] = report
    return fault


def _hang_cause(hang: Hang, rank: int | None, told_apart: bool) -> tuple[str, str]:
    """(error, cause) of a hang: the bound it passed and the evidence."""
    if hang.phase:
        error = (f"rank {rank} made no progress in {hang.phase} for {hang.silent_s:.1f} s "
                 f"(bound {hang.limit_s:.1f} s)")
    else:
        error = f"no step progress for {hang.silent_s:.1f} s (limit {hang.limit_s:.1f} s)"
    who = "" if told_apart else "; no rank could be told apart: every rank's worker was restarted"
    return error, f"{error} = {hang.why}; {hang.evidence}{who}"


def checkpoint_rejected(name: str) -> str:
    """Why ``job.checkpoint()`` cannot work for a script job."""
    return (f"job {name} is a script: it keeps its own snapshots, and nbtrain cannot ask it "
            "for one (preempt() sends its children SIGTERM, which a script that handles it "
            "can use to snapshot)")


def resume_rejected(name: str, state: JobState) -> str:
    """Why a job in ``state`` cannot ``resume()``, and what to do instead."""
    return (f"job {name} is {state.value}: only a PREEMPTED job can resume(); to continue "
            "an ended job submit it again with resume='latest'")


def repeated_exception(faults: Sequence[Mapping[str, Any]]) -> str | None:
    """Why ``fail_fast`` ends the job: the newest fault is an exception with the same message,
    on the same rank at the same step, as the fault before it; else None."""
    if len(faults) < 2:
        return None
    last, before = faults[-1], faults[-2]
    same = all(last.get(k) == before.get(k) for k in ("what", "rank", "step", "error"))
    if not same or last.get("what") != "exception":
        return None
    return (f"the same exception twice at step {last['step']} on rank {last['rank']}: "
            f"{last['error']} (fail_fast: a bug in the training code fails at once; fix it "
            "and submit again, or submit(..., fail_fast=False) to retry it like any fault)")
