"""GPU figures for ``benchmarks/checkpoint.py`` (run when CUDA is available).

One process, one GPU, a model + Adam state of the same size as the CPU part. Per checkpoint,
medians over repeats:

  memcpy_s          one flat device-to-host copy of the state's bytes into a warm pinned
                    buffer, synchronized: the floor for any snapshot of the state
  sync_snapshot_s   ``HostSnapshotter.snapshot(wait=True)``: what the loop would wait for if
                    the snapshot blocked until the copies were done
  blocking_s        ``AsyncCheckpointer.save``: what the loop waits for (the copies are queued
                    on a side stream and the writer waits for them)
  copied_s          from the start of ``save`` until the copies are done (the loop's stream
                    is synchronized, which waits for them)
  dcp_async_blocking_s  ``torch.distributed.checkpoint.async_save`` (default stager) until it
                    returns

``device_figures(torch.device("cpu"), ...)`` runs the same code on the CPU (no pinned
buffers, no streams), which is how it is checked on machines without a GPU.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from nbtrain.runtime.async_ckpt import AsyncCheckpointer
from nbtrain.runtime.snapshot import HostSnapshotter
from nbtrain.runtime.storage import CheckpointStore


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_figures(device: torch.device, width: int, depth: int, reps: int,
                   root: str) -> dict[str, Any]:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    x = torch.randn(64, width, device=device)

    def step() -> float:
        t = time.perf_counter()
        loss = model(x).square().mean()
        opt.zero_grad(set_to_none=False)
        loss.backward()
        opt.step()
        _sync(device)
        return time.perf_counter() - t

    for _ in range(3):
        step()
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    nbytes += sum(t.numel() * t.element_size() for st in opt.state.values()
                  for t in st.values() if torch.is_tensor(t))
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")

    def memcpy() -> float:
        _sync(device)
        t = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        _sync(device)
        return time.perf_counter() - t

    state = {"model": model, "optimizer": opt}
    memcpy()
    snapshotter = HostSnapshotter()
    snapshotter.snapshot(state)  # allocates the pinned buffers
    copies, sync_snap, blocking, copied, steps = [], [], [], [], []
    for _ in range(reps):
        copies.append(memcpy())
        _sync(device)
        t = time.perf_counter()
        snapshotter.snapshot(state, wait=True)
        sync_snap.append(time.perf_counter() - t)
    store = CheckpointStore(f"{root}/gpu-nbtrain", keep=2)
    ck = AsyncCheckpointer(store, rank=0, world_size=1, attempt="bench-gpu")
    for i in range(reps + 1):
        steps.append(step())
        _sync(device)
        t = time.perf_counter()
        r = ck.save(i + 1, state, {"step": i + 1})
        t_saved = time.perf_counter()
        _sync(device)  # the loop's stream waits for the side stream's copies
        t_copied = time.perf_counter()
        if i:  # the first save allocates its buffers
            blocking.append(t_saved - t)
            copied.append(t_copied - t)
        done = ck.wait()
        assert done is not None and done.error is None, done
        assert r.bytes > 0
    ck.close()

    import torch.distributed.checkpoint as dcp

    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    dcp_block = []
    try:
        for i in range(reps + 1):
            step()
            t = time.perf_counter()
            fut = dcp.async_save({"model": model.state_dict(), "optimizer": opt.state_dict()},
                                 checkpoint_id=f"{root}/gpu-dcp-{i}")
            dcp_block.append(time.perf_counter() - t)
            upload: Any = getattr(fut, "upload_completion", fut)
            upload.result()
    finally:
        if own_group:
            dist.destroy_process_group()
    med = statistics.median
    fig: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "state_mb": nbytes / 1e6,
        "memcpy_s": med(copies),
        "sync_snapshot_s": med(sync_snap),
        "blocking_s": med(blocking),
        "copied_s": med(copied),
        "dcp_async_blocking_s": med(dcp_block[1:]),
        "step_s": med(steps),
    }
    fig["sync_snapshot_vs_memcpy"] = fig["sync_snapshot_s"] / fig["memcpy_s"]
    fig["copied_vs_memcpy"] = fig["copied_s"] / fig["memcpy_s"]
    fig["blocking_vs_memcpy"] = fig["blocking_s"] / fig["memcpy_s"]
    fig["blocking_vs_dcp"] = fig["blocking_s"] / fig["dcp_async_blocking_s"]
    return fig


def print_rows(fig: dict[str, Any]) -> None:
    rows = [
        (f"GPU: {fig['device']}, state MB", f"{fig['state_mb']:.1f}", ""),
        ("  D2H memcpy into pinned memory", f"{fig['memcpy_s'] * 1e3:.2f} ms", "the floor"),
        ("  snapshot, waiting for the copies", f"{fig['sync_snapshot_s'] * 1e3:.2f} ms",
         f"{fig['sync_snapshot_vs_memcpy']:.2f} x memcpy"),
        ("  nbtrain save: loop blocked", f"{fig['blocking_s'] * 1e3:.2f} ms",
         f"{fig['blocking_vs_memcpy']:.2f} x memcpy, {fig['blocking_vs_dcp']:.3f} x DCP"),
        ("  nbtrain save: copies done", f"{fig['copied_s'] * 1e3:.2f} ms",
         f"{fig['copied_vs_memcpy']:.2f} x memcpy"),
        ("  DCP async_save blocking", f"{fig['dcp_async_blocking_s'] * 1e3:.2f} ms", ""),
    ]
    for name, val, note in rows:
        print(f"  {name:<40} {val:>12}   {note}")
