"""Which samples the training consumed: record each step's sample ids on every rank, then
check every epoch used each sample exactly once across restarts and resizes.

In a training function (``idx`` are the batch's sample indices, e.g. from a dataset that
returns them; :class:`Indexed` wraps any map-style dataset to do so)::

    ids = SampleLog(config["ids_dir"])
    for x, y, idx in ctx.batches(Indexed(data), global_batch_size=64):
        ids.record(ctx, idx)
        ...

and afterwards, in the notebook: ``account(ids_dir, steps, n=len(data), global_batch_size=64)``.
A step may run more than once (a restart re-runs the steps after its checkpoint): the run
that counts is the one of the last generation that ran it, which is the one the final model
went through.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset

from nbtrain.core.data import epoch_order

__all__ = ["Accounting", "Indexed", "SampleLog", "account", "committed_ids"]


class Indexed(Dataset[tuple[Any, ...]]):
    """A map-style dataset whose samples also carry their index: ``(*sample, index)``."""

    def __init__(self, data: Any) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[Any, ...]:
        sample = self.data[i]
        return (*sample, i) if isinstance(sample, tuple) else (sample, i)


class SampleLog:
    """Appends one JSON line per step to ``<dir>/ids-g<generation>-r<rank>.jsonl``: the step
    this rank runs, its world size and the sample ids it got."""

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)

    def record(self, ctx: Any, ids: Iterable[Any]) -> None:
        path = self.dir / f"ids-g{ctx.generation}-r{ctx.rank}.jsonl"
        line = json.dumps({"step": ctx.step + 1, "world_size": ctx.world_size,
                           "ids": [int(i) for i in ids]})
        with open(path, "a") as f:
            f.write(line + "\n")


def _records(directory: str | Path) -> Iterable[tuple[int, int, dict[str, Any]]]:
    for path in sorted(Path(directory).glob("ids-g*-r*.jsonl")):
        gen = int(path.name.split("-")[1][1:])
        rank = int(path.name.split("-r")[1].split(".")[0])
        for line in path.read_text().splitlines():
            if line.strip():
                yield gen, rank, json.loads(line)


def committed_ids(directory: str | Path, final_step: int) -> dict[int, list[int]]:
    """Sample ids of steps 1..final_step as the run that made the final model consumed them:
    each step from the last generation that ran it, all its ranks together."""
    runs: dict[int, dict[int, list[int]]] = {}  # step -> generation -> ids
    for gen, _, rec in _records(directory):
        runs.setdefault(int(rec["step"]), {}).setdefault(gen, []).extend(rec["ids"])
    return {s: runs[s][max(runs[s])] for s in range(1, final_step + 1) if s in runs}


@dataclass(frozen=True)
class Accounting:
    """Per epoch: samples consumed twice (``duplicates``) and samples of its global batches
    no committed step consumed (``missing``); ``sizes``: generation -> world size."""

    steps: int
    epochs: int
    duplicates: int
    missing: int
    sizes: dict[int, int]

    @property
    def exactly_once(self) -> bool:
        return self.duplicates == 0 and self.missing == 0

    def __str__(self) -> str:
        sizes = " -> ".join(str(n) for _, n in sorted(self.sizes.items()))
        verdict = "every sample exactly once" if self.exactly_once else (
            f"{self.duplicates} duplicates, {self.missing} missing")
        return (f"{self.steps} steps over {self.epochs} epoch(s), world sizes {sizes}: "
                f"{verdict}")


def account(directory: str | Path, final_step: int, *, n: int, global_batch_size: int,
            seed: int = 0, shuffle: bool = True) -> Accounting:
    """Check the recorded ids against nbtrain's global order (``seed``/``shuffle`` as the
    job's): an id consumed twice in an epoch is a duplicate; an id of the epoch's global
    batches that no committed step consumed is missing."""
    ids_by_step = committed_ids(directory, final_step)
    per_epoch = n // global_batch_size
    seen: dict[int, list[int]] = {}
    expected: dict[int, set[int]] = {}
    for step in range(1, final_step + 1):
        epoch, cursor = divmod(step - 1, per_epoch)
        order = epoch_order(n, seed, epoch, shuffle)
        expected.setdefault(epoch, set()).update(
            int(i) for i in order[cursor * global_batch_size:(cursor + 1) * global_batch_size])
        seen.setdefault(epoch, []).extend(ids_by_step.get(step, []))
    sizes: dict[int, int] = {}
    for gen, rank, _ in _records(directory):
        sizes[gen] = max(sizes.get(gen, 0), rank + 1)
    return Accounting(
        steps=final_step, epochs=len(expected),
        duplicates=sum(len(ids) - len(set(ids)) for ids in seen.values()),
        missing=sum(len(expected[e] - set(seen[e])) for e in expected),
        sizes=dict(sorted(sizes.items())))
