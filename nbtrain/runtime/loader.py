"""A sharded loader over one global, seeded sample order (see ``nbtrain.core.data``).

Every step consumes one *global* batch; rank r takes its contiguous slice. The position is the
global (epoch, cursor), so it survives restarts and world-size changes.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset
from torch.utils.data import default_collate as _default_collate

from nbtrain.core.data import DataPosition, advance, epoch_order, shard_of_batch


class ShardedLoader:
    """Yields this rank's share of consecutive global batches, forever (epochs wrap)."""

    def __init__(
        self,
        dataset: Dataset[Any],
        *,
        global_batch_size: int,
        rank: int,
        world_size: int,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = True,
        collate_fn: Any = None,
    ) -> None:
        n = len(dataset)  # type: ignore[arg-type]
        if global_batch_size < world_size:
            raise ValueError(
                f"global_batch_size={global_batch_size} is smaller than world_size="
                f"{world_size}: every rank needs at least one sample per step"
            )
        if global_batch_size > n:
            raise ValueError(
                f"global_batch_size={global_batch_size} exceeds the dataset's {n} samples"
            )
        self.dataset = dataset
        self.global_batch_size = global_batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.collate_fn = collate_fn or _default_collate
        self.num_samples = n
        self.position = DataPosition()
        self._order_epoch = -1
        self._order = np.arange(0)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if epoch != self._order_epoch:
            self._order = epoch_order(self.num_samples, self.seed, epoch, self.shuffle)
            self._order_epoch = epoch
        return self._order

    def next_indices(self) -> np.ndarray:
        """This rank's sample indices for the next step; advances the global position."""
        pos = self.position
        order = self._epoch_order(pos.epoch)
        batch = order[pos.cursor : pos.cursor + self.global_batch_size]
        self.position = advance(pos, self.global_batch_size, self.num_samples, self.drop_last)
        return shard_of_batch(batch, self.rank, self.world_size)

    def next_batch(self) -> Any:
        idx = self.next_indices()
        if isinstance(self.dataset, TensorDataset):
            # Index the tensors directly: one gather instead of per-sample calls.
            t = torch.from_numpy(idx)
            return tuple(x[t] for x in self.dataset.tensors)
        return self.collate_fn([self.dataset[int(i)] for i in idx])

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.position.epoch, "cursor": self.position.cursor}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = DataPosition(epoch=int(state["epoch"]), cursor=int(state["cursor"]))
