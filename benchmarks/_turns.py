"""Turn-taking: the members of a rate comparison run at once and train in turns.

Two runs made one after the other on a shared 2-core machine differ by the systems and by
the machine's drift in between, and that drift (10-20% within a minute here) is larger than
the difference a benchmark is after. Here all members start together and take turns of
``turn_s`` seconds on one wall-clock schedule from ``t0``: member ``m`` of ``n`` trains in
turns ``m, m + n, m + 2n, ...`` and sleeps in the others. The turns of a cycle are seconds
apart, so the machine's drift cancels in their ratio, and many short cycles make a
median that a few seconds of foreign load cannot move.

Every rank calls :meth:`Turns.after_step` at each step end. The ranks of a member agree,
through one all-reduce of a flag per step (paid by every member alike), whether its turn is
over; then they sleep together until its next turn, or stop after its last one.
:meth:`Turns.rates` reads a member's steady rate in each of its turns from its step end
times, leaving out the first ``skip_s`` of each turn (the hand-over: the other member's last
step, cold caches).
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
import statistics
import time
from collections.abc import Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class Turns:
    t0: float  # wall-clock start of turn 0
    turn_s: float
    members: int
    turns: int  # per member
    me: int = 0

    def member(self, me: int) -> Turns:
        return dataclasses.replace(self, me=me)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Turns:
        return cls(**json.loads(text))

    @property
    def end(self) -> float:
        return self.t0 + self.members * self.turns * self.turn_s

    def start(self, k: int) -> float:
        return self.t0 + k * self.turn_s

    def mine(self, t: float) -> bool:
        """Whether wall-clock time ``t`` lies in one of this member's turns."""
        if t < self.t0 or t >= self.end:
            return False
        return int((t - self.t0) // self.turn_s) % self.members == self.me

    def next_start(self, t: float) -> float | None:
        """The start of this member's first turn that begins after ``t`` (None: no more)."""
        k = 0 if t < self.t0 else int((t - self.t0) // self.turn_s) + 1
        k += (self.me - k) % self.members
        return self.start(k) if k < self.members * self.turns else None

    def after_step(self) -> bool:
        """At a step end on every rank: True to train on (after sleeping until this member's
        next turn if its turn is over), False once its last turn is over."""
        import torch
        import torch.distributed as dist

        flag = torch.tensor([0 if self.mine(time.time()) else 1])
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if not int(flag.item()):
            return True
        start = self.next_start(time.time())
        if start is None:
            return False
        time.sleep(max(0.0, start - time.time()))
        return True

    def windows(self, times: Sequence[float], skip_s: float) -> dict[int, list[float]]:
        """The step ends in each of this member's turns, by cycle: those in ``[start +
        skip_s, end)`` of the turn; turns with fewer than 3, or all at one time, are left
        out."""
        out: dict[int, list[float]] = {}
        for cycle in range(self.turns):
            k = cycle * self.members + self.me
            lo, hi = self.start(k) + skip_s, self.start(k + 1)
            inside = [t for t in times if lo <= t < hi]
            if len(inside) >= 3 and inside[-1] > inside[0]:
                out[cycle] = inside
        return out

    def per_step(self, samples: Sequence[Sequence[float]], skip_s: float
                 ) -> dict[int, list[float]]:
        """This member's means per step in each of its turns (:meth:`windows` of the
        samples' times), from :func:`thread_sample` rows taken at each step end: wall ms, CPU
        ms of the training thread, its voluntary and its involuntary context switches."""
        times = [s[0] for s in samples]
        out: dict[int, list[float]] = {}
        for cycle, ends in self.windows(times, skip_s).items():
            i0, i1 = bisect.bisect_left(times, ends[0]), bisect.bisect_left(times, ends[-1])
            first, last, n = samples[i0], samples[i1], i1 - i0
            out[cycle] = [(last[0] - first[0]) / n * 1000, (last[1] - first[1]) / n * 1000,
                          (last[2] - first[2]) / n, (last[3] - first[3]) / n]
        return out

    def rates(self, times: Sequence[float], skip_s: float) -> dict[int, float]:
        """This member's steady rate (steps/s) in each of its turns (:meth:`windows`)."""
        return {cycle: (len(ends) - 1) / (ends[-1] - ends[0])
                for cycle, ends in self.windows(times, skip_s).items()}


def thread_sample() -> list[float]:
    """The calling thread now: wall clock, CPU seconds, and its voluntary and involuntary
    context switches so far (Linux's ``/proc/thread-self/status``; 0 elsewhere)."""
    switches = {"voluntary_ctxt_switches:": 0.0, "nonvoluntary_ctxt_switches:": 0.0}
    try:
        with open("/proc/thread-self/status") as f:
            for line in f:
                name, _, value = line.partition("\t")
                if name in switches:
                    switches[name] = float(value)
    except OSError:
        pass
    return [time.time(), time.thread_time(), *switches.values()]


def rank_pids() -> list[int]:
    """Collective: every rank's process id, in rank order (on every rank)."""
    import os

    import torch.distributed as dist

    pids: list[int] = [0] * dist.get_world_size()
    dist.all_gather_object(pids, os.getpid())
    return pids


def hf_probe_callback(samples: list[list[float]]) -> Any:
    """A ``transformers`` callback that appends a :func:`thread_sample` at each step end
    (add it before :func:`hf_turn_callback`, which sleeps through the other's turns)."""
    from transformers import TrainerCallback

    class Probe(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            samples.append(thread_sample())

    return Probe()


def hf_turn_callback(turns: Turns) -> Any:
    """A ``transformers`` callback that takes ``turns`` at each step end."""
    from transformers import TrainerCallback

    class TakeTurns(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if not turns.after_step():
                control.should_training_stop = True

    return TakeTurns()


def median_interval(values: Sequence[float], level: float = 0.95
                    ) -> tuple[float, float] | None:
    """A distribution-free confidence interval for the median the values were drawn around:
    the order statistics ``l`` and ``n - l + 1`` (1-based) with the largest ``l`` whose
    binomial tail ``P(Bin(n, 1/2) <= l - 1)`` stays within ``(1 - level) / 2``; at least
    ``level`` of such intervals hold the median. None: too few values (fewer than 6 at 95%)."""
    n = len(values)
    alpha = (1.0 - level) / 2.0
    below, lo = 0.0, 0  # below = P(Bin(n, 1/2) <= lo - 1)
    while lo < n:
        tail = below + math.comb(n, lo) / 2.0 ** n
        if tail > alpha:
            break
        below, lo = tail, lo + 1
    if lo == 0:
        return None
    ordered = sorted(values)
    return ordered[lo - 1], ordered[n - lo]


def pair_figures(name: str, ours: dict[int, float], peer: dict[int, float], *,
                 ready: float, turns: Turns) -> dict[str, Any]:
    """The ratio figures of two members' turn rates (``ours`` member 0, ``peer`` member 1):
    cycles where both have a rate, after the first (warm-up) cycle and after both members
    had made their first step (``ready``: a member still starting would load the other's
    turns). ``{name}_ratio`` is the median of the cycles' ratios (each cycle's two turns are
    seconds apart), ``{name}_pooled_ratio`` the ratio of the members' mean rates over those
    cycles, with the cycles' interquartile range and count. ``{name}_ratio_ci95``: a 95%
    interval for the median ratio (:func:`median_interval`); a target is met when its low
    end is, and missed when its high end is below it (else the run cannot tell)."""
    cycles = [c for c in sorted(set(ours) & set(peer))
              if c >= 1 and turns.start(c * turns.members) >= ready]
    pairs = [ours[c] / peer[c] for c in cycles]
    iqr = None
    if len(pairs) >= 2:
        q1, _, q3 = statistics.quantiles(pairs, n=4)
        iqr = round(q3 - q1, 4)
    mean_ours = statistics.fmean(ours[c] for c in cycles) if cycles else math.nan
    mean_peer = statistics.fmean(peer[c] for c in cycles) if cycles else math.nan
    interval = median_interval(pairs)
    return {f"{name}_ratio": round(statistics.median(pairs), 4) if pairs else None,
            f"{name}_ratio_ci95": None if interval is None else [round(x, 4) for x in interval],
            f"{name}_pooled_ratio": round(mean_ours / mean_peer, 4) if cycles else None,
            f"{name}_pair_iqr": iqr, f"{name}_cycles": len(cycles),
            f"{name}_ours_steps_per_s": round(mean_ours, 2) if cycles else None,
            f"{name}_peer_steps_per_s": round(mean_peer, 2) if cycles else None}
