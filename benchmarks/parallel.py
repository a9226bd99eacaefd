"""Beyond DDP: does FSDP shard the state, do TP groups land in NVLink, do sharded checkpoints
reshard, and what does a sharded checkpoint cost the loop next to DCP's ``async_save``?

One standalone cluster (``dask scheduler``/``dask worker``) of four CPU slots declared as two
hosts of two GPUs joined by NVLink (``NBTRAIN_WORKER_HOST``/``NBTRAIN_WORKER_NVLINK``), gloo.
Every figure compares nbtrain with a peer in the same run:

- ``fsdp_state_bytes_ratio``: per-rank parameter + optimizer-state bytes (the ``memory``
  event, ``job.memory``) of an FSDP job over a DDP job of the same model (an MLP, Adam),
  world size 2, the worst rank of each. Target <= 0.6 (ideal 1/2 at world size 2).
- ``fsdp_steps_ratio``: FSDP's steps/s over DDP's on the same model and global batches
  (the slowest rank's median step time after warm-up; DDP and FSDP jobs alternate, median of
  the rounds' ratios; no target: on CPU/gloo FSDP's all-gathers are not hidden behind
  compute as they are on GPUs).
- ``tp_in_nvlink``: the fraction of a ``mesh={"dp": 2, "tp": 2}`` job's TP groups that run
  inside one declared NVLink domain, from each rank's ``ctx.mesh_info`` (target 1.0).
- ``reshard_ok``: float64, an FSDP job checkpointed at world size 2 and resumed by FSDP at
  world size 4, and a TP + FSDP job (2 x 2) resumed by FSDP at world size 2, end with the
  parameters of an uninterrupted FSDP run (max abs difference <= 1e-9).
- ``ckpt_blocking_vs_dcp``: inside the FSDP job, on its live sharded state, the time the loop
  waits for nbtrain's checkpoint (``AsyncCheckpointer`` in the DCP layout, as the job's own
  checkpoints: ``to_dcp_state`` + host snapshot) over the time
  ``torch.distributed.checkpoint.async_save`` (default stager, thread executor) blocks on the
  same state dicts; saves alternate, each persisted before the next, steady state (the first
  of each allocates), median, the worst rank. Target <= 1.

Usage: ``python benchmarks/parallel.py [--quick]``. The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import nbtrain
from nbtrain.engine.standalone import standalone_cluster

TP_PLAN = {"0": "colwise", "2": "rowwise"}


def mlp(width: int, depth: int) -> torch.nn.Sequential:
    """``depth`` pairs of Linear + ReLU, then a Linear head (TP_PLAN splits the first pair)."""
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(width, width))
    return torch.nn.Sequential(*layers)


def train(ctx: nbtrain.RankContext, config: dict[str, Any]) -> dict[str, Any]:
    """Runs in each rank: Adam on a synthetic regression; optionally writes the full
    parameters (``params_out``) and compares checkpoint blocking (``ckpt_reps``)."""
    dtype = getattr(torch, config["dtype"])
    width = config["width"]
    model = ctx.prepare(mlp(width, config["depth"]).to(dtype), strategy=config["strategy"],
                        tp_plan=config.get("tp_plan"))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ctx.track(model=model, optimizer=opt)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1024, width, generator=gen, dtype=dtype)
    data = torch.utils.data.TensorDataset(x, torch.tanh(x.flip(1)))
    for xb, yb in ctx.batches(data, global_batch_size=config["batch"]):
        loss = F.mse_loss(model(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
        ctx.report(loss=loss.item())
    out: dict[str, Any] = {"mesh": ctx.mesh_info.to_dict() if ctx.mesh_info else None}
    if config.get("params_out"):
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        if ctx.rank == 0:
            torch.save(full, config["params_out"])
    if config.get("ckpt_reps"):
        out.update(compare_checkpoints(ctx, {"model": model, "optimizer": opt}, config))
    return out


def compare_checkpoints(ctx: nbtrain.RankContext, state: dict[str, Any],
                        config: dict[str, Any]) -> dict[str, Any]:
    """nbtrain's blocking checkpoint time vs DCP ``async_save``'s, on this rank's state."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from nbtrain.runtime.async_ckpt import AsyncCheckpointer
    from nbtrain.runtime.dcp_state import to_dcp_state
    from nbtrain.runtime.storage import CheckpointStore

    root = Path(config["ckpt_dir"])
    plan = ctx.mesh_info
    assert plan is not None
    dims = {name: (c, plan.size(name)) for name, c in plan.coords(ctx.rank).items()}
    writer = AsyncCheckpointer(CheckpointStore(str(root / "nbtrain"), keep=2), rank=ctx.rank,
                               world_size=ctx.world_size, attempt="bench", layout="dcp",
                               mesh_dims=dims)
    ours: list[float] = []
    theirs: list[float] = []
    nbytes = 0
    for i in range(config["ckpt_reps"] + 1):
        dist.barrier()
        t = time.perf_counter()
        saved = writer.save(i + 1, to_dcp_state(state), {"step": i + 1})
        ours.append(time.perf_counter() - t)
        nbytes = saved.bytes
        done = writer.wait()
        assert done is not None and done.error is None, done
        dist.barrier()
        t = time.perf_counter()
        fut = dcp.async_save(to_dcp_state(state), checkpoint_id=str(root / f"dcp-{i}"))
        theirs.append(time.perf_counter() - t)
        upload: Any = getattr(fut, "upload_completion", fut)
        upload.result()
    writer.close()
    mine = {"nbtrain_blocking_s": statistics.median(ours[1:]),
            "dcp_async_blocking_s": statistics.median(theirs[1:]),
            "nbtrain_first_blocking_s": ours[0], "dcp_first_blocking_s": theirs[0],
            "checkpoint_bytes": nbytes}
    every: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(every, mine)
    return {k: max(r[k] for r in every) for k in mine}  # the worst rank of each


def _wait(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.05)


def run(cluster: nbtrain.Cluster, name: str, *, world_size: int, steps: int,
        config: dict[str, Any], **kwargs: Any) -> nbtrain.JobHandle:
    job = cluster.submit(train, world_size=world_size, steps=steps, name=name, config=config,
                         **kwargs)
    if job.wait(600) is not nbtrain.JobState.SUCCEEDED:
        raise RuntimeError(f"{name}: {job.status.value}: {job.error or job.reason}")
    return job


def median_step_s(job: nbtrain.JobHandle, skip: int) -> float:
    """The median over steps after the first ``skip`` of the slowest rank's step time."""
    rows = job.metrics
    rows = rows[rows["step"] > skip]
    return float(rows.groupby("step")["step_s"].max().median())


def state_bytes(job: nbtrain.JobHandle) -> int:
    """The worst rank's parameter + optimizer-state bytes."""
    return max(int(m["params_bytes"]) + int(m["optimizer_bytes"]) for m in job.memory.values())


def max_diff(a: Path, b: Path) -> float:
    pa, pb = torch.load(a), torch.load(b)
    assert set(pa) == set(pb), (sorted(pa), sorted(pb))
    return max(float((pa[k] - pb[k]).abs().max()) for k in pa)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="about a minute on two cores")
    args = parser.parse_args()
    width, depth = (1024, 3) if args.quick else (1536, 4)
    steps = 20 if args.quick else 50
    reps = 3 if args.quick else 5
    rounds = 2 if args.quick else 4
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="nbtrain-parallel-bench-") as tmp:
        root = Path(tmp)
        env = {"NBTRAIN_CHECKPOINT_ROOT": str(root / "ckpt")}
        with standalone_cluster(0, logs=root / "logs", scheduler_env=env) as sc:
            for host in ("a", "b"):
                sc.add_workers(2, env={"NBTRAIN_WORKER_HOST": f"node-{host}",
                                       "NBTRAIN_WORKER_NVLINK": f"nvl-{host}"}, name=host)
            settings = nbtrain.Settings.load(token_file=str(root / "tokens.json"),
                                             checkpoint_root=str(root / "ckpt"))
            with nbtrain.connect(sc.address, settings=settings) as c:
                _wait(lambda: len(c.free_slots) == 4, 180, "four slots")
                figures = measure(c, root, width=width, depth=depth, steps=steps, reps=reps,
                                  rounds=rounds)
    figures["quick"] = bool(args.quick)
    figures["cpus"] = os.cpu_count()
    figures["torch"] = torch.__version__
    figures["wall_s"] = round(time.monotonic() - t0, 1)
    print(json.dumps(figures))


def measure(c: nbtrain.Cluster, root: Path, *, width: int, depth: int, steps: int,
            reps: int, rounds: int) -> dict[str, Any]:
    big = {"width": width, "depth": depth, "dtype": "float32", "batch": 64}
    (root / "dcp").mkdir()
    # DDP and FSDP jobs alternate, so both see the same machine load (other processes on two
    # cores move absolute step times a lot); the ratio is the median of the rounds'.
    skip = max(3, steps // 4)
    ddp_steps: list[float] = []
    fsdp_steps: list[float] = []
    ddp = fsdp = first_fsdp = None
    for i in range(rounds):
        ddp = run(c, f"ddp-{i}", world_size=2, steps=steps, checkpoint=None,
                  config={**big, "strategy": "ddp"})
        fsdp = run(c, f"fsdp-{i}", world_size=2, steps=steps, checkpoint=None,
                   config={**big, "strategy": "fsdp", "ckpt_reps": reps if i == 0 else 0,
                           "ckpt_dir": str(root / "dcp")})
        first_fsdp = first_fsdp or fsdp
        ddp_steps.append(median_step_s(ddp, skip))
        fsdp_steps.append(median_step_s(fsdp, skip))
    assert ddp is not None and fsdp is not None and first_fsdp is not None
    steps_ratio = statistics.median(d / f for d, f in zip(ddp_steps, fsdp_steps, strict=True))
    ddp_step, fsdp_step = statistics.median(ddp_steps), statistics.median(fsdp_steps)
    ddp_bytes, fsdp_bytes = state_bytes(ddp), state_bytes(fsdp)
    ck = first_fsdp.result()
    print(f"state per rank (params + Adam): DDP {ddp_bytes / 1e6:.1f} MB, FSDP "
          f"{fsdp_bytes / 1e6:.1f} MB; step DDP {ddp_step * 1e3:.1f} ms, FSDP "
          f"{fsdp_step * 1e3:.1f} ms", flush=True)
    print(f"checkpoint of an FSDP rank's state ({ck['checkpoint_bytes'] / 1e6:.1f} MB): nbtrain "
          f"blocks {ck['nbtrain_blocking_s'] * 1e3:.1f} ms, DCP async_save "
          f"{ck['dcp_async_blocking_s'] * 1e3:.1f} ms (first saves "
          f"{ck['nbtrain_first_blocking_s'] * 1e3:.1f} / {ck['dcp_first_blocking_s'] * 1e3:.1f}"
          " ms)", flush=True)

    # Placement and resharding: a small float64 model, exact comparisons.
    small = {"width": 32, "depth": 2, "dtype": "float64", "batch": 32}
    n = 8
    ref = root / "ref.pt"
    run(c, "fsdp-ref", world_size=2, steps=2 * n, checkpoint=None,
        config={**small, "strategy": "fsdp", "params_out": str(ref)})
    first = run(c, "fsdp-2", world_size=2, steps=n, checkpoint=None,
                config={**small, "strategy": "fsdp"})
    at4 = root / "at4.pt"
    run(c, "fsdp-4", world_size=4, steps=2 * n, resume=first.checkpoints[0]["url"],
        config={**small, "strategy": "fsdp", "params_out": str(at4)})
    tp = run(c, "tp-2x2", world_size=4, steps=n, checkpoint=None, mesh={"dp": 2, "tp": 2},
             config={**small, "strategy": "tp+fsdp", "tp_plan": TP_PLAN})
    from_tp = root / "from_tp.pt"
    run(c, "fsdp-from-tp", world_size=2, steps=2 * n, resume=tp.checkpoints[0]["url"],
        config={**small, "strategy": "fsdp", "params_out": str(from_tp)})
    mesh = tp.result()["mesh"]
    inside, groups = mesh["tp_groups_in_nvlink"], mesh["tp_groups"]
    diffs = {"fsdp_2_to_4": max_diff(ref, at4), "tp_2x2_to_fsdp_2": max_diff(ref, from_tp)}
    print(f"TP groups inside an NVLink domain: {inside} of {groups}; resumed at another size "
          f"or shape, max |param - uninterrupted|: {diffs}", flush=True)

    fig: dict[str, Any] = {
        "fsdp_state_bytes_ratio": round(fsdp_bytes / ddp_bytes, 4),
        "fsdp_steps_ratio": round(steps_ratio, 4),
        "tp_in_nvlink": inside / groups if groups else float("nan"),
        "reshard_ok": all(d <= 1e-9 for d in diffs.values()),
        "ckpt_blocking_vs_dcp": round(ck["nbtrain_blocking_s"] / ck["dcp_async_blocking_s"], 4),
        "ddp_state_bytes": ddp_bytes, "fsdp_state_bytes": fsdp_bytes,
        "ddp_step_s": round(ddp_step, 5), "fsdp_step_s": round(fsdp_step, 5),
        "steps_ratio_rounds": [round(d / f, 4) for d, f in zip(ddp_steps, fsdp_steps,
                                                                strict=True)],
        "nbtrain_ckpt_blocking_s": round(ck["nbtrain_blocking_s"], 5),
        "dcp_async_blocking_s": round(ck["dcp_async_blocking_s"], 5),
        "ckpt_mb_per_rank": round(ck["checkpoint_bytes"] / 1e6, 2),
        "reshard_max_diff": diffs,
        "tp_mesh": mesh["dims"],
        "model": {"width": width, "depth": depth, "params": sum(
            p.numel() for p in mlp(width, depth).parameters())},
        "steps": steps, "reps": reps, "rounds": rounds,
    }
    fig["targets_met"] = {"fsdp_state_bytes_ratio<=0.6": fig["fsdp_state_bytes_ratio"] <= 0.6,
                          "tp_in_nvlink==1": fig["tp_in_nvlink"] == 1.0,
                          "reshard_ok": fig["reshard_ok"],
                          "ckpt_blocking_vs_dcp<=1": fig["ckpt_blocking_vs_dcp"] <= 1.0}
    rows = [("state per rank, DDP", f"{ddp_bytes / 1e6:.1f} MB", ""),
            ("state per rank, FSDP", f"{fsdp_bytes / 1e6:.1f} MB",
             f"{fig['fsdp_state_bytes_ratio']:.3f} x DDP (target <= 0.6)"),
            ("steps/s, FSDP over DDP", f"{fig['fsdp_steps_ratio']:.3f}", "CPU, gloo"),
            ("TP groups inside NVLink", f"{inside}/{groups}", "target all"),
            ("resume at another size/shape", "equal" if fig["reshard_ok"] else "DIFFERENT",
             f"max diff {max(diffs.values()):.1e}"),
            ("checkpoint blocking, nbtrain", f"{ck['nbtrain_blocking_s'] * 1e3:.1f} ms",
             f"{fig['ckpt_blocking_vs_dcp']:.3f} x DCP async_save (target <= 1)"),
            ("checkpoint blocking, DCP", f"{ck['dcp_async_blocking_s'] * 1e3:.1f} ms", "")]
    print(f"parallel benchmark: {c!r}")
    for name, val, note in rows:
        print(f"  {name:<32} {val:>12}   {note}")
    return fig


if __name__ == "__main__":
    main()
