"""Global sample order and per-rank shards (pure, numpy only).

The order is a function of (seed, epoch) alone and the position is one global cursor
(samples consumed in the current epoch), so a restart with any world size can re-partition
the rest of the epoch and every sample is used exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt


@dataclass(frozen=True)
class DataPosition:
    """Where the global sample stream stands: epoch and samples consumed in it."""

    epoch: int = 0
    cursor: int = 0


def epoch_order(num_samples: int, seed: int, epoch: int, shuffle: bool) -> npt.NDArray[np.int64]:
    """The global sample order of one epoch, identical on every rank."""
    if not shuffle:
        return np.arange(num_samples, dtype=np.int64)
    rng = np.random.default_rng([seed, epoch])
    return rng.permutation(num_samples).astype(np.int64)


def shard_of_batch(
    global_batch: npt.NDArray[np.int64], rank: int, world_size: int
) -> npt.NDArray[np.int64]:
    """This rank's contiguous slice of one global batch (sizes differ by at most one)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    n = len(global_batch)
    lo = (n * rank) // world_size
    hi = (n * (rank + 1)) // world_size
    return global_batch[lo:hi]


def advance(pos: DataPosition, batch_size: int, num_samples: int, drop_last: bool) -> DataPosition:
    """The position after one global batch; wraps to the next epoch when this one is used up."""
    remaining = num_samples - pos.cursor
    take = min(batch_size, remaining)
    cursor = pos.cursor + take
    left = num_samples - cursor
    if left == 0 or (drop_last and left < batch_size):
        return DataPosition(epoch=pos.epoch + 1, cursor=0)
    return DataPosition(epoch=pos.epoch, cursor=cursor)


def global_batch(
    pos: DataPosition, batch_size: int, num_samples: int, seed: int, shuffle: bool
) -> npt.NDArray[np.int64]:
    """Sample indices of the global batch that starts at ``pos``."""
    order = epoch_order(num_samples, seed, pos.epoch, shuffle)
    return order[pos.cursor : pos.cursor + batch_size]
