"""The peer for benchmarks/elastic.py: a plain DDP loop under two TorchElastic agents.

Launched by each of two agents as ``torchrun --nnodes 1:2 --nproc-per-node 1 --rdzv-backend
c10d --rdzv-endpoint 127.0.0.1:R --max-restarts 3 _torchrun_elastic_peer.py --dir D
--store-port P``. The benchmark SIGKILLs one agent with its worker; the survivor's agent sees
its worker fail (its gloo peer is gone), tears the group down and re-rendezvouses with the
nodes that are left, then starts its worker again at the smaller world size. The survivor
notices only when its collective times out (gloo has no abort): ``--pg-timeout`` seconds, the
process group's timeout (torch's default is 30 minutes).

Rank 0 writes ``D/attempt-<restart>.json`` after the first completed step of each attempt:
the world size, the process start (before importing torch) and the wall time of that step.
Each attempt builds a fresh TCPStore on port ``P + TORCHELASTIC_RESTART_COUNT`` (with gloo on
torch 2.13 a restart that reuses the agent's store fails to re-rendezvous; see
``_torchrun_recovery_peer.py``).
"""

from __future__ import annotations

import time

T_START = time.time()  # before the heavy imports: a restart pays for them again

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

from nbtrain.examples import DigitsMLP, digits  # noqa: E402
from nbtrain.runtime.loader import ShardedLoader  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--store-port", type=int, required=True)
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--step-sleep", type=float, default=0.02)
    parser.add_argument("--pg-timeout", type=float, default=30.0)
    args = parser.parse_args()
    out = Path(args.dir)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore("127.0.0.1", args.store_port + restart, world, is_master=rank == 0,
                          timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.pg_timeout))
    recipe = DigitsMLP()
    model = DistributedDataParallel(recipe.build_model())
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr)
    loader = ShardedLoader(digits("train"), global_batch_size=recipe.batch_size, rank=rank,
                           world_size=world)
    for step in range(1, args.steps + 1):
        x, y = loader.next_batch()
        time.sleep(args.step_sleep)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step == 1 and rank == 0:
            path = out / f"attempt-{restart}.json"
            path.with_suffix(".tmp").write_text(json.dumps(
                {"world": world, "start": T_START, "first_step": time.time()}))
            os.replace(path.with_suffix(".tmp"), path)


if __name__ == "__main__":
    main()
