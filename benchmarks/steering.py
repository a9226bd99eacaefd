"""Live knobs: how fast a change reaches every rank, whether they agree, what it costs, and
whether a replay reproduces the steered run.

The job: a float64 MLP regression (hidden 256, global batch 256) as a training function on 2
ranks of an embedded cluster (gloo), ``--steps`` steps. Each round runs two such jobs side by
side on the cluster's 4 slots, so whatever else this shared machine runs slows both alike
(submission order swapped round by round; figures are medians over rounds):

- **plain**: the function declares no knob and nothing is changed (the built-ins of its
  optimizer are declared by nbtrain anyway and stay untouched);
- **steered**: it declares ``aux_weight`` and reads it every step, and the client changes the
  LR (and every other time ``aux_weight``, as a 20-step ramp) every ``--every`` steps with
  ``job.set``, while it trains.

Figures:

- ``set_to_applied_s``: from the ``job.set`` call to the moment every rank has finished the
  step at whose end it applied the change (the newest rank's step row at that step; the
  same wall clock on this one machine): median over every change of every steered round.
- ``same_step_all_ranks``: every rank trained every step of every steered round with the same
  LR and ``aux_weight`` (each rank reports the values it used), and each change took effect
  on both ranks at the step after the one it was applied at.
- ``replay_max_abs_diff``: the largest difference between the parameters of the last steered
  round and its ``submit(..., replay=job)`` (the same changes at the same steps).
- ``overhead_ratio``: steps/s of steered over plain of the same round (median over rounds;
  the two run at the same time), each from rank 0's
  step rows after its first ``--warmup`` steps: the wall clock between consecutive rows, so
  the agreement, the broadcast of a change and its application all count; intervals longer
  than 3 median steps are left out (other processes taking this shared machine's 2 cores;
  a change costs far less than that, see ``change_step_extra_ms``).
- ``change_step_extra_ms``: how much longer than the median step the step that applied a
  change took (median over changes): the cost of one live change.

Usage: ``python benchmarks/steering.py [--quick] [--rounds N] [--steps N] [--every N]``.
The last stdout line is one JSON object with those figures and the per-round details.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, cast

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.data import TensorDataset  # noqa: E402

import nbtrain  # noqa: E402
from nbtrain.core.knobs import values_at  # noqa: E402

WORLD = 2


def _data(n: int = 4096, d: int = 32) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    y = torch.sin(x @ torch.randn(d, 1, generator=g, dtype=torch.float64))
    return TensorDataset(x, y)


def train(ctx: nbtrain.RankContext, config: dict[str, Any]) -> None:
    steered = bool(config["steered"])
    if steered:
        ctx.knobs.declare("aux_weight", 0.0, min=0.0, max=1.0)
    torch.manual_seed(0)
    model = ctx.prepare(torch.nn.Sequential(
        torch.nn.Linear(32, 256), torch.nn.Tanh(), torch.nn.Linear(256, 256), torch.nn.Tanh(),
        torch.nn.Linear(256, 1)).double())
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    ctx.track(model=model, optimizer=opt)
    for x, y in ctx.batches(_data(), global_batch_size=256):
        aux = ctx.knob("aux_weight") if steered else 0.0
        # The same work in both variants: only the knob machinery differs.
        penalty = sum((p * p).sum() for p in model.parameters())
        loss = F.mse_loss(model(x), y) + aux * 1e-4 * penalty
        opt.zero_grad()
        loss.backward()
        opt.step()
        ctx.report(loss=loss.item(), lr=opt.param_groups[0]["lr"], aux=aux)
    if config.get("out"):
        torch.save(getattr(model, "module", model).state_dict(),
                   Path(config["out"]) / f"rank{ctx.rank}.pt")


def _wait(cond: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.01)


def _intervals(job: nbtrain.JobHandle, warmup: int) -> tuple[list[int], list[float]]:
    """Rank 0's steps after ``warmup`` and the wall time from each one's row to the next."""
    m = job.metrics
    r0 = m[(m["rank"] == 0) & (m["step"] > warmup)].sort_values("step")
    times = r0["time"].tolist()
    return r0["step"].tolist()[1:], [b - a for a, b in itertools.pairwise(times)]


def _steps_per_s(job: nbtrain.JobHandle, warmup: int) -> float:
    """Steps per second from rank 0's rows, leaving out stalls longer than 3 median steps:
    on a shared 2-core machine those are other processes taking the cores (a knob change
    costs a fraction of one step, so its steps stay in)."""
    _, dts = _intervals(job, warmup)
    limit = 3 * statistics.median(dts)
    kept = [dt for dt in dts if dt <= limit]
    return len(kept) / sum(kept)


def _change_cost_ms(job: nbtrain.JobHandle, changes: list[dict[str, Any]],
                    warmup: int) -> list[float]:
    """Per change: how much longer than the median step the step that applied it took."""
    steps, dts = _intervals(job, warmup)
    typical = statistics.median(dts)
    at = dict(zip(steps, dts, strict=True))
    return [1e3 * (at[c["step"]] - typical) for c in changes if c["step"] in at]


def _steer(job: nbtrain.JobHandle, steps: int, every: int, change: bool
           ) -> list[dict[str, Any]]:
    """Change the LR (and every other time aux_weight) every ``every`` steps while it runs.
    ``change=False`` watches the same way and changes nothing."""
    out: list[dict[str, Any]] = []
    _wait(lambda: job.step >= 1, 120, "the first step")
    mark, i = every, 0
    # The last change is asked a whole interval before the end: on a loaded machine the
    # job could otherwise end before its ranks agree on it (job.set then raises).
    while mark < steps - every and not job.done:
        _wait(lambda m=mark: job.step >= m or job.done, 120, f"step {mark}")
        if job.done:
            break
        if not change:
            mark += every
            continue
        i += 1
        values: dict[str, Any] = {"lr": 0.02 * (0.9 ** i)}
        if i % 2 == 0:
            values["aux_weight"] = min(1.0, 0.1 * i)
        t0 = time.time()
        step = job.set(**values, ramp=20 if i % 2 == 0 else 0)
        out.append({"asked": t0, "step": step, "values": values})
        mark += every
    return out


def _applied_at(job: nbtrain.JobHandle, changes: list[dict[str, Any]]) -> list[float]:
    """Per change: from the call to the newest rank's row of the step it was applied at."""
    m = job.metrics
    out = []
    for c in changes:
        rows = m[m["step"] == c["step"]]
        if len(rows["rank"].unique()) == WORLD:
            out.append(float(rows["time"].max()) - c["asked"])
    return out


def _same_step(job: nbtrain.JobHandle) -> bool:
    """Every rank trained every step with the same values, the ones the job's history gives
    for that step (``core.knobs.values_at``): each change in force from the step after its
    own, on every rank."""
    state = job.knobs
    defaults = {n: s.default for n, s in state.declared.items()}
    m = job.metrics.dropna(subset=["lr"])
    wide = m.pivot_table(index="step", columns="rank", values=["lr", "aux"], aggfunc="last")
    if wide.isna().any().any() or len(m["rank"].unique()) != WORLD:
        return False
    for step, row in wide.iterrows():
        want = values_at(defaults, state.history, int(cast(int, step)) - 1)
        for rank in range(WORLD):
            if row[("lr", rank)] != want["lr"] or row[("aux", rank)] != want["aux_weight"]:
                return False
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="6 rounds of 300 steps")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--every", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=20)
    args = ap.parse_args()
    rounds = args.rounds or (6 if args.quick else 10)
    steps = args.steps or (300 if args.quick else 1000)
    tmp = Path(tempfile.mkdtemp(prefix="nbtrain-steering-"))
    ratios, latencies, agree, details = [], [], True, []
    costs: list[float] = []
    last: nbtrain.JobHandle | None = None
    last_out = tmp
    settings = nbtrain.Settings.load(checkpoint_root=str(tmp / "ckpt"))
    with nbtrain.connect(n_workers=2 * WORLD, gpus=False, settings=settings) as cl:
        for r in range(rounds):
            _wait(lambda: len(cl.free_slots) == 2 * WORLD, 120, "free slots")
            jobs: dict[str, nbtrain.JobHandle] = {}
            outs: dict[str, Path] = {}
            for variant in (("plain", "steered") if r % 2 == 0 else ("steered", "plain")):
                outs[variant] = tmp / f"r{r}-{variant}"
                outs[variant].mkdir()
                jobs[variant] = cl.submit(
                    train, world_size=WORLD, steps=steps, checkpoint=None,
                    config={"steered": variant == "steered", "out": str(outs[variant])},
                    name=f"steering-{variant}-{r}")
            job = jobs["steered"]
            changes = _steer(job, steps, args.every, change=True)
            for j in jobs.values():
                state = j.wait(600)
                if state is not nbtrain.JobState.SUCCEEDED:
                    raise RuntimeError(f"{j.name} ended {state.value}: {j.reason}")
            rates = {v: _steps_per_s(j, args.warmup) for v, j in jobs.items()}
            costs += _change_cost_ms(job, changes, args.warmup)
            lat = _applied_at(job, changes)
            latencies += lat
            agree = agree and _same_step(job) and len(lat) == len(changes)
            last, last_out = job, outs["steered"]
            ratios.append(rates["steered"] / rates["plain"])
            details.append({"round": r, **{f"{k}_steps_per_s": round(v, 1)
                                           for k, v in rates.items()}})
            print(f"round {r}: plain {rates['plain']:.1f} steps/s, steered "
                  f"{rates['steered']:.1f} steps/s, ratio {ratios[-1]:.3f}", flush=True)
        assert last is not None
        out = tmp / "replay"
        out.mkdir()
        again = cl.submit(train, world_size=WORLD, steps=steps, checkpoint=None,
                          config={"steered": True, "out": str(out)}, name="steering-replay",
                          replay=last)
        if again.wait(600) is not nbtrain.JobState.SUCCEEDED:
            raise RuntimeError(f"the replay ended {again.status.value}: {again.reason}")
        diff = 0.0
        for rank in range(WORLD):
            a = torch.load(last_out / f"rank{rank}.pt")
            b = torch.load(out / f"rank{rank}.pt")
            diff = max(diff, max(float((a[k] - b[k]).abs().max()) for k in a))
    figures = {
        "set_to_applied_s": round(statistics.median(latencies), 4) if latencies else None,
        "set_to_applied_max_s": round(max(latencies), 4) if latencies else None,
        "changes": len(latencies),
        "same_step_all_ranks": agree,
        "replay_max_abs_diff": diff,
        "overhead_ratio": round(statistics.median(ratios), 4),
        "change_step_extra_ms": round(statistics.median(costs), 3) if costs else None,
        "rounds": details, "steps": steps, "every": args.every, "world_size": WORLD,
    }
    print(f"set -> applied on every rank: median {figures['set_to_applied_s']} s over "
          f"{len(latencies)} changes; same step on all ranks: {agree}; replay max |diff| "
          f"{diff:g}; steered/plain steps/s {figures['overhead_ratio']}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
