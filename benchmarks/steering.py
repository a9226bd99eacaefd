"""Live knobs: how fast a change reaches every rank, whether they agree, what it costs, and
whether a replay reproduces the steered run.

The job: a float64 MLP regression (hidden 256, global batch 256) as a training function on 2
ranks of an embedded cluster (gloo), ``--steps`` steps. Rounds alternate two variants in the
same run (order swapped round by round, figures are medians over rounds):

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
- ``overhead_ratio``: steps/s of steered over plain, each from rank 0's step rows after its
  first ``--warmup`` steps (wall clock between rows, so the agreement, the broadcast of a
  change and its application all count).

Usage: ``python benchmarks/steering.py [--quick] [--rounds N] [--steps N] [--every N]``.
The last stdout line is one JSON object with those figures and the per-round details.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.data import TensorDataset  # noqa: E402

import nbtrain  # noqa: E402

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
        loss = F.mse_loss(model(x), y)
        aux = ctx.knob("aux_weight") if steered else 0.0
        if aux:
            loss = loss + aux * 1e-4 * sum((p * p).sum() for p in model.parameters())
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
        time.sleep(0.005)


def _steps_per_s(job: nbtrain.JobHandle, warmup: int) -> float:
    m = job.metrics
    r0 = m[(m["rank"] == 0) & (m["step"] > warmup)].sort_values("step")
    span = float(r0["time"].iloc[-1] - r0["time"].iloc[0])
    return (len(r0) - 1) / span


def _steer(job: nbtrain.JobHandle, steps: int, every: int) -> list[dict[str, Any]]:
    """Change the LR (and every other time aux_weight) every ``every`` steps while it runs."""
    out: list[dict[str, Any]] = []
    _wait(lambda: bool(job.knobs.declared), 120, "the job's knobs")
    mark, i = every, 0
    while mark < steps - every // 2 and not job.done:
        _wait(lambda m=mark: job.step >= m or job.done, 120, f"step {mark}")
        if job.done:
            break
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


def _same_step(job: nbtrain.JobHandle, changes: list[dict[str, Any]]) -> bool:
    m = job.metrics.dropna(subset=["lr"])
    wide = m.pivot_table(index="step", columns="rank", values=["lr", "aux"], aggfunc="last")
    if wide.isna().any().any():
        return False
    same = bool((wide["lr"][0] == wide["lr"][1]).all()
                and (wide["aux"][0] == wide["aux"][1]).all())
    for c in changes:  # each change is in force from the step after its own, on every rank
        s = int(c["step"])
        if s + 1 in wide.index and wide["lr"][0][s + 1] != c["values"]["lr"]:
            same = False
    return same


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 rounds of 400 steps")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--every", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=20)
    args = ap.parse_args()
    rounds = args.rounds or (2 if args.quick else 4)
    steps = args.steps or (400 if args.quick else 1000)
    tmp = Path(tempfile.mkdtemp(prefix="nbtrain-steering-"))
    ratios, latencies, agree, details = [], [], True, []
    last: nbtrain.JobHandle | None = None
    last_out = tmp
    settings = nbtrain.Settings.load(checkpoint_root=str(tmp / "ckpt"))
    with nbtrain.connect(n_workers=WORLD, gpus=False, settings=settings) as cl:
        for r in range(rounds):
            rates: dict[str, float] = {}
            for variant in (("plain", "steered") if r % 2 == 0 else ("steered", "plain")):
                _wait(lambda: len(cl.free_slots) == WORLD, 120, "free slots")
                steered = variant == "steered"
                out = tmp / f"r{r}-{variant}"
                out.mkdir()
                job = cl.submit(train, world_size=WORLD, steps=steps, checkpoint=None,
                                config={"steered": steered, "out": str(out)},
                                name=f"steering-{variant}-{r}")
                changes = _steer(job, steps, args.every) if steered else []
                state = job.wait(600)
                if state is not nbtrain.JobState.SUCCEEDED:
                    raise RuntimeError(f"{job.name} ended {state.value}: {job.reason}")
                rates[variant] = _steps_per_s(job, args.warmup)
                if steered:
                    lat = _applied_at(job, changes)
                    latencies += lat
                    agree = agree and _same_step(job, changes) and len(lat) == len(changes)
                    last = job
                    last_out = out
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
        "rounds": details, "steps": steps, "every": args.every, "world_size": WORLD,
    }
    print(f"set -> applied on every rank: median {figures['set_to_applied_s']} s over "
          f"{len(latencies)} changes; same step on all ranks: {agree}; replay max |diff| "
          f"{diff:g}; steered/plain steps/s {figures['overhead_ratio']}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
