"""The peer for benchmarks/overhead.py: the same training as a plain torchrun DDP script.

Launched as ``torchrun --nproc-per-node 2 benchmarks/_torchrun_peer.py --steps N --out F``;
rank 0 writes the wall-clock end time of every step to F (JSON). With ``--turns JSON``
(``benchmarks/_turns.py``) it trains in its turns only, and stops after its last one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _turns import Turns
from torch.nn.parallel import DistributedDataParallel

from nbtrain.examples import DigitsMLP, digits
from nbtrain.runtime.loader import ShardedLoader


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--turns", default=None, help="a Turns as JSON (benchmarks/_turns.py)")
    args = parser.parse_args()
    turns = Turns.from_json(args.turns) if args.turns else None
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    recipe = DigitsMLP(hidden=args.hidden, layers=args.layers, batch_size=args.batch)
    model = DistributedDataParallel(recipe.build_model())
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr)
    loader = ShardedLoader(digits("train"), global_batch_size=args.batch, rank=rank,
                           world_size=world)
    times = []
    for _ in range(args.steps):
        x, y = loader.next_batch()
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        loss.item()
        times.append(time.time())
        if turns is not None and not turns.after_step():
            break
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(times, f)
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
