"""The peer for benchmarks/recovery.py: a plain torchrun DDP script with checkpoint-resume.

Launched as ``torchrun --standalone --nproc-per-node 2 --max-restarts 1
benchmarks/_torchrun_recovery_peer.py --dir D --store-port P ...``. It trains the same model on
the same data as nbtrain's ``DigitsMLP`` and saves a checkpoint every ``--ckpt-every`` steps the
way a plain script does: rank 0 ``torch.save``s model, optimizer and data position, fsyncs, and
renames the file into place (so a kill mid-save leaves the previous checkpoint). In the first
attempt (``TORCHELASTIC_RESTART_COUNT == 0``) rank 1 SIGKILLs itself at the start of step
``--kill-step``, after writing the wall time of the kill to ``D/kill.json``; torchrun then tears
the group down and starts both workers again, which resume from the checkpoint.

Each attempt builds a FRESH TCPStore on port ``P + TORCHELASTIC_RESTART_COUNT``: with gloo on
torch 2.13 a restart that reuses the elastic agent's store fails to re-rendezvous, so this is
what makes the baseline work at all (and keeps the comparison fair).

Rank 0 writes ``D/attempt-<n>.json`` after its first completed step of each attempt (and again
at the end): the wall times of process start (before importing torch), imports done, process
group up, model/optimizer/data built, checkpoint loaded, DDP wrapped, first step done, and the
step it resumed from.
"""

from __future__ import annotations

import time

T_START = time.time()  # before the heavy imports: a restart pays for them again

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import sklearn.datasets  # noqa: E402, F401  (digits() imports it lazily: count it as import)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

from nbtrain.examples import DigitsMLP, digits  # noqa: E402
from nbtrain.runtime.loader import ShardedLoader  # noqa: E402

T_IMPORTED = time.time()


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def _save(path: Path, step: int, model: torch.nn.Module, opt: torch.optim.Optimizer,
          loader: ShardedLoader) -> None:
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        torch.save({"step": step, "model": model.state_dict(), "optimizer": opt.state_dict(),
                    "data": loader.state_dict()}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--store-port", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--kill-step", type=int, required=True)
    parser.add_argument("--ckpt-every", type=int, required=True)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=128)
    args = parser.parse_args()
    out = Path(args.dir)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    store = dist.TCPStore(host, args.store_port + restart, world, is_master=rank == 0,
                          timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    t_pg = time.time()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    recipe = DigitsMLP(hidden=args.hidden, layers=args.layers, batch_size=args.batch)
    module = recipe.build_model()
    opt = torch.optim.AdamW(module.parameters(), lr=recipe.lr)
    loader = ShardedLoader(digits("train"), global_batch_size=args.batch, rank=rank,
                           world_size=world)
    t_built = time.time()
    ckpt = out / "checkpoint.pt"
    step = 0
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=True)
        module.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        loader.load_state_dict(state["data"])
        step = int(state["step"])
    start_step = step
    t_loaded = time.time()
    model = DistributedDataParallel(module)  # broadcasts rank 0's parameters: waits for peers
    t_restored = time.time()
    record: dict[str, Any] = {
        "attempt": restart, "start": T_START, "imported": T_IMPORTED, "process_group": t_pg,
        "built": t_built, "loaded": t_loaded, "restored": t_restored, "start_step": start_step,
    }
    while step < args.steps:
        if restart == 0 and rank == 1 and step + 1 == args.kill_step:
            _write_json(out / "kill.json", {"when": time.time(), "step": step})
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = loader.next_batch()
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        loss.item()
        step += 1
        if rank == 0 and step == start_step + 1:
            record["first_step"] = time.time()
            _write_json(out / f"attempt-{restart}.json", record)
        if rank == 0 and step % args.ckpt_every == 0:
            _save(ckpt, step, module, opt, loader)
    if rank == 0:
        record.update(end=time.time(), steps_done=step)
        _write_json(out / f"attempt-{restart}.json", record)
    dist.destroy_process_group()
    # torch 2.13 with gloo: freeing the DDP model when main() returns can deadlock (the
    # process group's destructor joins its work thread holding the GIL, while that thread
    # needs the GIL to free a finished work item; about one run in five hung here). The
    # results are written and the group is down: leave without running destructors.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
