"""The peer for benchmarks/frameworks.py: the same HF ``Trainer`` as
``nbtrain.framework_examples.build_trainer``, run as a plain torchrun script.

Launched as ``torchrun --nproc-per-node 2 benchmarks/_hf_torchrun_peer.py --steps N --out F
--work DIR --n-embd E [--turns JSON] [--probe]``; rank 0 writes the wall-clock end time of every
step to F (JSON), or with ``--probe`` ``{"samples": [...], "pids": [...]}``: a
``_turns.thread_sample`` row at each step end and both ranks' process ids
(``benchmarks/turn_anatomy.py``).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
from _turns import Turns, hf_probe_callback, hf_turn_callback, rank_pids

from nbtrain.framework_examples import build_trainer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--work", required=True)
    parser.add_argument("--n-embd", type=int, default=32)
    parser.add_argument("--turns", default=None, help="a Turns as JSON (benchmarks/_turns.py)")
    parser.add_argument("--probe", action="store_true",
                        help="write per-step thread samples and the ranks' pids")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))
    trainer, times = build_trainer({"work_dir": args.work, "n_embd": args.n_embd},
                                   max_steps=args.steps)
    samples: list[list[float]] = []
    if args.probe:
        trainer.add_callback(hf_probe_callback(samples))
    if args.turns:
        trainer.add_callback(hf_turn_callback(Turns.from_json(args.turns)))
    trainer.train()
    result = {"samples": samples, "pids": rank_pids()} if args.probe else times
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
