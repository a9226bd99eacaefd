"""How much does a checkpoint cost the training loop? nbtrain vs torch.save vs DCP async_save.

Two ranks (torch.multiprocessing, gloo), each holding a model + Adam state of about 150 MB
(``--quick``; 200 MB without it), one intra-op thread each. In one run, per rank:

  (e) memcpy_s     one flat host copy of the state's bytes into a warm buffer, the physical
                   floor for (b), timed next to each snapshot (ratio: median of pairs)
  (a) sync_s       ``torch.save`` of the model and optimizer state dicts to a local file,
                   then fsync: a blocking checkpoint that is durable when it returns, the
                   guarantee nbtrain's commit gives. ``sync_nofsync_s`` is the same without
                   the fsync (data only in the page cache), reported next to it
  (b) blocking_s   nbtrain ``AsyncCheckpointer.save`` time the loop waits (steady state:
                   snapshot into reused buffers; waiting for a previous persist is reported
                   apart as ``wait_s`` and is zero when checkpoints are further apart than a
                   persist)
      persist_s    from nbtrain's ``save`` call (both ranks at once, after a barrier) until
                   the checkpoint is durable and, on the committing rank, committed, while
                   both ranks keep training: format 1 (each rank writes its full copy, the
                   bytes ``sync_s`` writes), so ``persist_vs_sync`` is persist while
                   training / ``sync_s``, both with the writer's fsync.
                   ``persist_breakdown_s`` says where the slowest rank's time went
                   (checksum, write, fsync, commit wait; "other" is serialization and
                   waiting for a CPU). The writer runs at ``writer_nice`` (10): on a busy
                   machine it gets the CPU training leaves
  (c) dcp_async_blocking_s  ``torch.distributed.checkpoint.async_save`` (default stager,
                   thread executor) until it returns, steady state
      dcp_persist_s  from the same ``async_save`` call until its upload future completes
                   (written, and ``.metadata`` committed), the same state, while the same
                   training loop runs. ``nbtrain_dcp_persist_s`` is nbtrain's persist in
                   DCP's layout (format 2, what jobs write: replicated tensors once, spread
                   over the ranks, the bytes DCP writes), measured like ``persist_s``;
                   ``persist_vs_dcp`` = ``nbtrain_dcp_persist_s`` / ``dcp_persist_s``: both
                   writers compete with training for the same cores
  (d) step time while a persist runs vs the steps around it, on rank 0 while rank 1 idles
      at a barrier (a writer core is free, as on a GPU node where the CPU mostly waits):
      with nbtrain's thread writer (``slowdown_during_persist``) and with the same shard
      written by a separate process (``process_slowdown_during_persist``, the no-GIL
      reference), windows alternating, median over repeats.
      ``slowdown_during_persist_ws2`` is the same figure with both ranks training and
      persisting at once on the same cores (includes CPU oversubscription on 2 cores).

On a machine with CUDA the JSON also holds ``gpu``: the same state on one GPU, snapshot into
pinned buffers vs the device-to-host memcpy floor and DCP ``async_save``
(``benchmarks/_checkpoint_gpu.py``); ``--no-gpu`` skips it.

Times are medians over repeats; the table shows the ratios the issue asks for. The last stdout
line is one JSON object. Run: ``python benchmarks/checkpoint.py --quick``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# The checkout this script lives in, not an installed nbtrain (the spawned ranks run this too).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

from nbtrain.runtime.async_ckpt import (
    DEFAULT_WRITER_NICE,
    AsyncCheckpointer,
    SaveResult,
)
from nbtrain.runtime.dcp_state import to_dcp_state
from nbtrain.runtime.storage import CheckpointStore

WORLD = 2


def build(width: int, depth: int, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    return model, opt


def state_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    n = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    for st in opt.state.values():
        n += sum(t.numel() * t.element_size() for t in st.values() if torch.is_tensor(t))
    return n


class Trainer:
    def __init__(self, width: int, depth: int, batch: int) -> None:
        self.model, self.opt = build(width, depth, seed=0)
        self.x = torch.randn(batch, width)

    def step(self) -> float:
        t = time.perf_counter()
        loss = self.model(self.x).square().mean()
        self.opt.zero_grad(set_to_none=False)
        loss.backward()
        self.opt.step()
        return time.perf_counter() - t

    def steps(self, n: int) -> list[float]:
        return [self.step() for _ in range(n)]

    def steps_until(self, done: Any, max_steps: int = 10_000) -> list[float]:
        out: list[float] = []
        while not done() and len(out) < max_steps:
            out.append(self.step())
        return out


def persisted_in(r: SaveResult) -> float:
    """From the save call until durable (and committed, on the committing rank)."""
    return r.wait_s + r.blocking_s + (r.persist_s or 0.0) + (r.commit_s or 0.0)


def breakdown(r: SaveResult) -> dict[str, float]:
    parts = r.times.as_dict()
    parts["other_s"] = max(0.0, persisted_in(r) - r.wait_s - r.blocking_s - sum(parts.values()))
    return parts


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def rank_main(rank: int, args: argparse.Namespace, root: str, port: int) -> None:
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    tr = Trainer(args.width, args.depth, args.batch)
    tr.steps(3)
    nbytes = state_bytes(tr.model, tr.opt)
    reps = args.reps
    res: dict[str, Any] = {"rank": rank, "state_bytes": nbytes}

    def state_dicts() -> dict[str, Any]:
        return {"model": tr.model.state_dict(), "optimizer": tr.opt.state_dict()}

    # (e) memcpy floor: one flat copy of the same number of bytes into a warm buffer, timed
    # right before each nbtrain snapshot in (b), so both see the same machine load.
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src).fill_(0)

    def memcpy() -> float:
        t = time.perf_counter()
        dst.copy_(src)
        return time.perf_counter() - t

    memcpy()

    # (a) synchronous torch.save.
    dist.barrier()
    sync, sync_nofsync = [], []
    for i in range(reps):
        path = f"{root}/sync-{rank}-{i}.pt"
        t = time.perf_counter()
        with open(path, "wb") as f:
            torch.save(state_dicts(), f)
            t_saved = time.perf_counter()
            f.flush()
            os.fsync(f.fileno())
        t_end = time.perf_counter()
        sync.append(t_end - t)
        sync_nofsync.append(t_saved - t)
        os.unlink(path)
    res["sync_s"] = median(sync)
    res["sync_nofsync_s"] = median(sync_nofsync)

    # (b) nbtrain, both ranks at once, committed by rank 0; (d, ws2) steps during persist.
    dist.barrier()
    store = CheckpointStore(f"{root}/nbtrain", keep=2)
    ck = AsyncCheckpointer(store, rank=rank, world_size=WORLD, attempt="bench")
    blocking, waits, persist, base, during, copies = [], [], [], [], [], []
    parts: list[dict[str, float]] = []
    step = 0
    for _i in range(reps + 1):
        base += tr.steps(args.base_steps)
        step += args.base_steps
        dist.barrier()  # both ranks save at once: the commit waits for a persist, not a step
        copies.append(memcpy())
        r = ck.save(step, {"model": tr.model, "optimizer": tr.opt}, {"step": step})
        blocking.append(r.blocking_s)
        waits.append(r.wait_s)
        during += tr.steps_until(lambda: not ck.in_flight)
        done = ck.wait()
        assert done is not None and done.error is None, done
        persist.append(persisted_in(done))
        parts.append(breakdown(done))
    ck.close()
    res["first_blocking_s"] = blocking[0]  # includes allocating the host buffers
    res["blocking_s"] = median(blocking[1:])
    res["memcpy_s"] = median(copies[1:])
    pairs = zip(blocking[1:], copies[1:], strict=True)
    res["blocking_vs_memcpy"] = median([b / c for b, c in pairs])
    res["wait_s"] = median(waits[1:])
    res["persist_s"] = median(persist[1:])
    res["persist_breakdown_s"] = {k: median([p[k] for p in parts[1:]]) for k in parts[0]}
    res["committed"] = store.committed() if rank == 0 else None
    res["ws2_base_step_s"] = mean(base)
    res["ws2_persist_step_s"] = mean(during)

    # (b') nbtrain in DCP's layout (what jobs write), the same state and training loop.
    dist.barrier()
    store = CheckpointStore(f"{root}/nbtrain-dcp", keep=2)
    ck = AsyncCheckpointer(store, rank=rank, world_size=WORLD, attempt="bench-dcp",
                           layout="dcp")
    persist, parts, nbytes_dcp = [], [], []
    tracked = {"model": tr.model, "optimizer": tr.opt}
    for _i in range(reps + 1):
        tr.steps(2)
        step += 2
        dist.barrier()
        r = ck.save(step, to_dcp_state(tracked), {"step": step})
        tr.steps_until(lambda: not ck.in_flight)
        done = ck.wait()
        assert done is not None and done.error is None, done
        persist.append(persisted_in(done))
        parts.append(breakdown(done))
        nbytes_dcp.append(r.bytes)
        dist.barrier()
    ck.close()
    res["nbtrain_dcp_persist_s"] = median(persist[1:])
    res["nbtrain_dcp_breakdown_s"] = {k: median([p[k] for p in parts[1:]]) for k in parts[0]}
    res["nbtrain_dcp_bytes"] = nbytes_dcp[-1]

    # (c) DCP async_save, default stager and thread executor.
    import torch.distributed.checkpoint as dcp

    dist.barrier()
    dcp_block, dcp_persist = [], []
    for i in range(reps + 1):
        tr.steps(2)
        finished: list[float] = []
        t = time.perf_counter()
        fut = dcp.async_save(state_dicts(), checkpoint_id=f"{root}/dcp-{i}")
        dcp_block.append(time.perf_counter() - t)
        upload: Any = getattr(fut, "upload_completion", fut)
        # Runs in the thread that completes the upload (or here, at once, if it is done).
        upload.add_done_callback(lambda _f, out=finished: out.append(time.perf_counter()))
        tr.steps_until(upload.done)
        upload.result()
        dcp_persist.append(finished[0] - t)
        dist.barrier()
    res["dcp_first_blocking_s"] = dcp_block[0]
    res["dcp_async_blocking_s"] = median(dcp_block[1:])
    res["dcp_persist_s"] = median(dcp_persist[1:])

    # (d) rank 0 alone trains (rank 1 waits at the barrier): thread writer vs forked process.
    dist.barrier()
    if rank == 0:
        res.update(gil_comparison(tr, root, args))
    dist.barrier()

    out: list[Any] = [None] * WORLD
    dist.all_gather_object(out, res)
    if rank == 0:
        with open(f"{root}/result.json", "w") as result_file:
            json.dump(out, result_file)
    dist.destroy_process_group()


def gil_comparison(tr: Trainer, root: str, args: argparse.Namespace) -> dict[str, Any]:
    """Step time while a shard persists in nbtrain's thread writer vs in a writer process.

    The process is the no-GIL reference: spawned up front (not forked, whose copy-on-write
    pages would tax every parameter update) and handed the snapshot once through shared
    memory. Windows alternate base / thread / base / process, so load from other programs
    hits both alike; each window's slowdown is against the mean of the base windows around it.
    """
    ctx = tmp.get_context("spawn")
    store = CheckpointStore(f"{root}/gil-thread", keep=1)
    ck = AsyncCheckpointer(store, rank=0, world_size=1, attempt="gil")
    state = {"model": tr.model, "optimizer": tr.opt}
    shared = _share(ck.snapshotter.snapshot({"state": state, "meta": {}}).state)
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_writer_process, args=(child, f"{root}/gil-proc"), daemon=True)
    proc.start()
    parent.send(shared)
    assert parent.recv() == "ready"
    thread_ratios, proc_ratios = [], []
    base_all, thread_all, n_thread = [], [], 0
    step = 0
    base = mean(tr.steps(args.base_steps))
    for _ in range(args.reps):
        step += 1
        ck.save(step, state)
        during = tr.steps_until(lambda: not ck.in_flight)
        ck.wait()
        after = mean(tr.steps(args.base_steps))
        thread_ratios.append(mean(during) / ((base + after) / 2) - 1)
        base_all.append(base)
        thread_all.append(mean(during))
        n_thread += len(during)
        step += 1
        parent.send(step)
        during = tr.steps_until(parent.poll)
        assert parent.recv() == step
        base = mean(tr.steps(args.base_steps))
        proc_ratios.append(mean(during) / ((after + base) / 2) - 1)
    parent.send(None)
    proc.join(60)
    ck.close()
    return {
        "thread_slowdown": median(thread_ratios),
        "thread_slowdowns": thread_ratios,
        "proc_slowdown": median(proc_ratios),
        "proc_slowdowns": proc_ratios,
        "thread_base_step_s": median(base_all),
        "thread_persist_step_s": median(thread_all),
        "thread_steps_during": n_thread,
    }


def _share(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.clone().share_memory_()
    if isinstance(obj, dict):
        return type(obj)((k, _share(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(_share(v) for v in obj)
    return obj


def _writer_process(conn: Any, url: str) -> None:
    torch.set_num_threads(1)
    if DEFAULT_WRITER_NICE:  # same priority as the thread writer: only the GIL differs
        os.nice(DEFAULT_WRITER_NICE)
    store = CheckpointStore(url, keep=1)
    payload = conn.recv()
    conn.send("ready")
    while (step := conn.recv()) is not None:
        store.write_shard(step, 0, 1, payload, attempt="gil")
        store.commit(step, 1, attempt="gil")
        store.prune()
        conn.send(step)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="about a minute on two cores")
    p.add_argument("--dir", default=None, help="local directory for the files (default: tmp)")
    p.add_argument("--no-gpu", action="store_true", help="skip the GPU figures")
    args = p.parse_args()
    # width 2048, depth 3: 12.6 M params -> 50 MB weights + 100 MB Adam moments.
    args.width, args.depth = (2048, 3) if args.quick else (2048, 4)
    args.batch = 16
    args.reps = 3 if args.quick else 5
    args.base_steps = 8 if args.quick else 20
    root = tempfile.mkdtemp(prefix="nbtrain-ckpt-bench-", dir=args.dir)
    t0 = time.perf_counter()
    try:
        tmp.spawn(rank_main, args=(args, root, free_port()), nprocs=WORLD, join=True)
        with open(f"{root}/result.json") as f:
            ranks = json.load(f)
        gpu = None
        if torch.cuda.is_available() and not args.no_gpu:
            sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
            from _checkpoint_gpu import device_figures

            gpu = device_figures(torch.device("cuda", 0), args.width, args.depth, args.reps,
                                 root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report(ranks, args, time.perf_counter() - t0, gpu)


def ms_parts(parts: dict[str, float]) -> str:
    return " ".join(f"{k.removesuffix('_s')} {v * 1e3:.0f}" for k, v in parts.items()) + " ms"


def report(ranks: list[dict[str, Any]], args: argparse.Namespace, wall: float,
           gpu: dict[str, Any] | None = None) -> None:
    def worst(key: str) -> float:
        return max(float(r[key]) for r in ranks)

    r0 = ranks[0]
    sync_s, blocking_s = worst("sync_s"), worst("blocking_s")
    dcp_s, memcpy_s = worst("dcp_async_blocking_s"), worst("memcpy_s")
    thread_slow, proc_slow = r0["thread_slowdown"], r0["proc_slowdown"]
    persist_s, dcp_persist_s = worst("persist_s"), worst("dcp_persist_s")
    nb_dcp_s = worst("nbtrain_dcp_persist_s")
    slowest = max(ranks, key=lambda r: float(r["persist_s"]))
    slowest_dcp = max(ranks, key=lambda r: float(r["nbtrain_dcp_persist_s"]))
    ws2_slow = max(r["ws2_persist_step_s"] / r["ws2_base_step_s"] - 1 for r in ranks)
    fig = {
        "state_mb": r0["state_bytes"] / 1e6,
        "world_size": WORLD,
        "sync_s": sync_s,
        "blocking_s": blocking_s,
        "first_blocking_s": worst("first_blocking_s"),
        "wait_s": worst("wait_s"),
        "persist_s": persist_s,
        "persist_vs_sync": persist_s / sync_s,
        "persist_breakdown_s": slowest["persist_breakdown_s"],
        "dcp_persist_s": dcp_persist_s,
        "nbtrain_dcp_persist_s": nb_dcp_s,
        "nbtrain_dcp_mb": max(float(r["nbtrain_dcp_bytes"]) for r in ranks) / 1e6,
        "persist_vs_dcp": nb_dcp_s / dcp_persist_s,
        "nbtrain_dcp_breakdown_s": slowest_dcp["nbtrain_dcp_breakdown_s"],
        "dcp_async_blocking_s": dcp_s,
        "dcp_first_blocking_s": worst("dcp_first_blocking_s"),
        "memcpy_s": memcpy_s,
        "blocking_ratio_vs_sync": blocking_s / sync_s,
        "sync_nofsync_s": worst("sync_nofsync_s"),
        "blocking_ratio_vs_sync_nofsync": blocking_s / worst("sync_nofsync_s"),
        "blocking_ratio_vs_dcp": blocking_s / dcp_s,
        "blocking_vs_memcpy": worst("blocking_vs_memcpy"),
        "memcpy_ratio_vs_sync": memcpy_s / sync_s,  # the best blocking_ratio_vs_sync possible
        "slowdown_during_persist": thread_slow,
        "process_slowdown_during_persist": proc_slow,
        "slowdown_during_persist_ws2": ws2_slow,
        "base_step_s": r0["thread_base_step_s"],
        "steps_during_persist": r0["thread_steps_during"],
        "committed_steps": r0["committed"],
        "writer_nice": DEFAULT_WRITER_NICE,
        "quick": bool(args.quick),
        "reps": args.reps,
        "cpus": os.cpu_count(),
        "loadavg_1m_at_end": os.getloadavg()[0],
        "torch": torch.__version__,
        "wall_s": wall,
        "gpu": gpu,
    }
    rows = [
        ("state (model + Adam), MB per rank", f"{fig['state_mb']:.1f}", ""),
        ("(a) torch.save + fsync, sync", f"{sync_s * 1e3:.1f} ms", "durable on return"),
        (
            "    torch.save without fsync",
            f"{fig['sync_nofsync_s'] * 1e3:.1f} ms",
            f"b/that {fig['blocking_ratio_vs_sync_nofsync']:.3f} (page cache only)",
        ),
        (
            "(b) nbtrain blocking (steady)",
            f"{blocking_s * 1e3:.1f} ms",
            f"{fig['blocking_ratio_vs_sync']:.3f} x sync (target <= 0.05)",
        ),
        ("    nbtrain first save (allocates)", f"{fig['first_blocking_s'] * 1e3:.1f} ms", ""),
        (
            "    nbtrain persist while training",
            f"{persist_s * 1e3:.1f} ms",
            f"{fig['persist_vs_sync']:.2f} x sync; " + ms_parts(fig["persist_breakdown_s"]),
        ),
        (
            "    nbtrain persist, DCP layout",
            f"{nb_dcp_s * 1e3:.1f} ms",
            f"{fig['persist_vs_dcp']:.2f} x DCP's (target <= 1); "
            + ms_parts(fig["nbtrain_dcp_breakdown_s"]),
        ),
        (
            "(c) DCP async_save blocking (steady)",
            f"{dcp_s * 1e3:.1f} ms",
            f"b/c {fig['blocking_ratio_vs_dcp']:.3f} (target <= 1.0)",
        ),
        ("    DCP async_save until uploaded", f"{dcp_persist_s * 1e3:.1f} ms",
         f"{fig['nbtrain_dcp_mb']:.1f} MB per rank"),
        (
            "(e) host memcpy of the state",
            f"{memcpy_s * 1e3:.1f} ms",
            f"b/e {fig['blocking_vs_memcpy']:.2f} (target <= 2); "
            f"e/a {fig['memcpy_ratio_vs_sync']:.3f}",
        ),
        ("(d) step slowdown, thread writer", f"{thread_slow * 100:+.1f} %", "target <= 5 %"),
        ("    step slowdown, process writer", f"{proc_slow * 100:+.1f} %", "no-GIL reference"),
        ("    step slowdown, both ranks busy", f"{ws2_slow * 100:+.1f} %", "2 ranks share cores"),
    ]
    cpus = os.cpu_count()
    print(f"checkpoint benchmark: world size {WORLD}, {cpus} CPUs, torch {torch.__version__}")
    for name, val, note in rows:
        print(f"  {name:<40} {val:>12}   {note}")
    if gpu is not None:
        from _checkpoint_gpu import print_rows

        print_rows(gpu)
    print(json.dumps(fig))


if __name__ == "__main__":
    main()
