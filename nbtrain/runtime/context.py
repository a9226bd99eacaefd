"""``RankContext``: what a recipe sees of its rank."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset

from nbtrain.runtime.loader import ShardedLoader
from nbtrain.runtime.timing import PhaseTimer


@dataclass
class RankContext:
    """Rank, world size, device and generation of this rank, plus helpers for plain torch."""

    job_id: str
    rank: int
    world_size: int
    generation: int
    device: torch.device
    seed: int
    host: str
    step: int = 0
    timer: PhaseTimer = field(default_factory=PhaseTimer)
    _loader: ShardedLoader | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def prepare(self, model: torch.nn.Module, **ddp_kwargs: Any) -> torch.nn.Module:
        """Move ``model`` to this rank's device and wrap it in DistributedDataParallel.

        DDP broadcasts rank 0's parameters at construction, so every rank starts equal.
        """
        model = model.to(self.device)
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        ddp = DistributedDataParallel(model, device_ids=device_ids, **ddp_kwargs)
        self.timer.attach_ddp(ddp)
        return ddp

    def loader(
        self,
        dataset: Dataset[Any],
        *,
        global_batch_size: int,
        shuffle: bool = True,
        drop_last: bool = True,
        collate_fn: Any = None,
    ) -> ShardedLoader:
        """A loader giving this rank its slice of each global batch (seeded, restart-safe)."""
        self._loader = ShardedLoader(
            dataset,
            global_batch_size=global_batch_size,
            rank=self.rank,
            world_size=self.world_size,
            seed=self.seed,
            shuffle=shuffle,
            drop_last=drop_last,
            collate_fn=collate_fn,
        )
        return self._loader

    def next_batch(self) -> Any:
        if self._loader is None:
            raise RuntimeError(
                "no loader: call ctx.loader(dataset, global_batch_size=...) in setup(), "
                "or override Recipe.next_batch(ctx)"
            )
        batch = self._loader.next_batch()
        return _to_device(batch, self.device)


def _to_device(batch: Any, device: torch.device) -> Any:
    if device.type == "cpu":
        return batch
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: _to_device(v, device) for k, v in batch.items()}
    return batch
