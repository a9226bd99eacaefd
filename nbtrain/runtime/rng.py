"""Capture and restore a rank's RNG states (python, numpy, torch CPU and CUDA).

A resumed run only continues exactly if dropout masks, augmentation and sampling draw the
same numbers they would have drawn, so every rank saves its own generator states with its
shard. The captured form holds only tensors, lists, ints, floats, strings and None, because
checkpoints are read back with ``torch.load(..., weights_only=True)``, which refuses numpy
objects and arbitrary classes.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

__all__ = ["RNG_FORMAT", "capture_rng_state", "restore_rng_state"]

RNG_FORMAT = 1


def capture_rng_state() -> dict[str, Any]:
    """This process's generator states, in a ``weights_only``-loadable form."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "format": RNG_FORMAT,
        "python": [int(version), torch.tensor(internal, dtype=torch.int64), gauss],
        "numpy": [
            str(name),
            torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            int(pos),
            int(has_gauss),
            float(cached),
        ],
        "torch": torch.get_rng_state(),
        "cuda": [],
    }
    if torch.cuda.is_available():
        state["cuda"] = [s.cpu() for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng_state(state: dict[str, Any]) -> list[str]:
    """Set the generators from ``capture_rng_state()``'s output; returns notes on what differed.

    CUDA states are restored for the devices present in both; a checkpoint from a GPU run
    loaded on a CPU-only machine restores the rest and says so in the notes.
    """
    if not isinstance(state, dict) or state.get("format") != RNG_FORMAT:
        found = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise ValueError(
            f"RNG state has format {found!r}, this nbtrain reads format {RNG_FORMAT}: "
            "it was not written by capture_rng_state() of this version"
        )
    notes: list[str] = []
    version, internal, gauss = state["python"]
    random.setstate((int(version), tuple(int(x) for x in internal.tolist()), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state(
        (str(name), keys.numpy().astype(np.uint32), int(pos), int(has_gauss), float(cached))
    )
    torch.set_rng_state(state["torch"])
    saved_cuda = list(state.get("cuda", []))
    if saved_cuda:
        if not torch.cuda.is_available():
            notes.append(
                f"checkpoint holds {len(saved_cuda)} CUDA RNG state(s) but CUDA is not "
                "available here; CUDA generators were not restored"
            )
        else:
            n = min(len(saved_cuda), torch.cuda.device_count())
            for i in range(n):
                torch.cuda.set_rng_state(saved_cuda[i], device=i)
            if n < len(saved_cuda):
                notes.append(
                    f"checkpoint holds {len(saved_cuda)} CUDA RNG states, this process sees "
                    f"{torch.cuda.device_count()} device(s); restored the first {n}"
                )
    return notes


def seed_rng(seed: int, step: int, rank: int) -> int:
    """Seed torch (CPU and CUDA), numpy and ``random`` for a rank that has no RNG state of its
    own in the checkpoint it resumes from (it did not exist at that world size): from (job
    seed, step, rank), so the same sequence of sizes gives the same run. Returns the seed."""
    import random

    import numpy as np

    derived = int(np.random.SeedSequence([seed, step, rank]).generate_state(1)[0])
    torch.manual_seed(derived)
    np.random.seed(derived)
    random.seed(derived)
    return derived
