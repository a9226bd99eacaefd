"""Exactly-once batches from an iterable dataset (a stream without ``len`` or indexing).

Contract: iterating the dataset gives the same samples in the same order each time for a
given epoch; if it has ``set_epoch(epoch)`` it is called before each pass, so the order may
change per epoch (a seeded shuffle buffer, say) as long as the same epoch gives the same order.
Every rank reads the whole stream and keeps its contiguous slice of each global batch, so the
position is one global (epoch, samples consumed) like a map-style dataset's, and any world
size can continue from it: a restarted or resized rank fast-forwards by reading and dropping
the consumed samples. The price is that each rank reads every sample: for data that is
expensive to read, use a map-style dataset (``__len__`` and ``__getitem__``).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import Any

from torch.utils.data import default_collate as _default_collate

from nbtrain.core.data import DataPosition
from nbtrain.runtime.loader import batch_share

__all__ = ["StreamLoader"]


class StreamLoader:
    """This rank's slice of consecutive global batches of an iterable dataset, epoch after
    epoch. ``drop_last``: a short final batch of an epoch is skipped."""

    def __init__(self, dataset: Iterable[Any], *, global_batch_size: int, rank: int,
                 world_size: int, drop_last: bool = True, collate_fn: Any = None) -> None:
        if global_batch_size < world_size:
            raise ValueError(
                f"global_batch_size={global_batch_size} is smaller than world_size="
                f"{world_size}: every rank needs at least one sample per step")
        self.dataset = dataset
        self.global_batch_size = global_batch_size
        self.rank = rank
        self.world_size = world_size
        self.drop_last = drop_last
        self.collate_fn = collate_fn or _default_collate
        self.position = DataPosition()
        self.last_share: float | None = None
        #: (this rank's samples, the global batch's) of the last batch.
        self.last_sizes: tuple[int, int] | None = None
        self._it: Iterator[Any] | None = None

    def _open(self) -> Iterator[Any]:
        set_epoch = getattr(self.dataset, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(self.position.epoch)
        it = iter(self.dataset)
        skipped = sum(1 for _ in itertools.islice(it, self.position.cursor))
        if skipped < self.position.cursor:
            raise ValueError(
                f"the dataset gave {skipped} samples in epoch {self.position.epoch}, fewer "
                f"than the {self.position.cursor} the checkpoint says were consumed: it must "
                "give the same samples each time it is iterated (see nbtrain.runtime.stream)")
        return it

    def next_batch(self) -> Any:
        for _ in range(2):  # at most one epoch boundary per batch
            if self._it is None:
                self._it = self._open()
            batch = list(itertools.islice(self._it, self.global_batch_size))
            full = len(batch) == self.global_batch_size
            if batch and (full or not self.drop_last) and len(batch) >= self.world_size:
                pos = self.position
                self.position = (DataPosition(pos.epoch, pos.cursor + len(batch)) if full
                                 else DataPosition(pos.epoch + 1, 0))
                if not full:
                    self._it = None
                n = len(batch)
                lo, hi = n * self.rank // self.world_size, n * (self.rank + 1) // self.world_size
                self.last_share = batch_share(hi - lo, n, self.world_size)
                self.last_sizes = (hi - lo, n)
                return self.collate_fn(batch[lo:hi])
            if self.position.cursor == 0 and not batch:
                raise ValueError("the dataset is empty: an iterable dataset must give samples")
            self.position = DataPosition(self.position.epoch + 1, 0)  # the epoch is used up
            self._it = None
        raise ValueError(
            f"the dataset gives fewer than global_batch_size={self.global_batch_size} samples "
            "per epoch (drop_last=True drops them all)")

    def close(self) -> None:
        """Close the dataset's iterator (a generator's ``finally`` runs now)."""
        it, self._it = self._it, None
        close = getattr(it, "close", None)
        if callable(close):
            close()

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.position.epoch, "cursor": self.position.cursor}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = DataPosition(epoch=int(state["epoch"]), cursor=int(state["cursor"]))
        self._it = None
