"""A sharded loader over one global, seeded sample order (see ``nbtrain.core.data``).

Every step consumes one *global* batch; rank r takes its contiguous slice. The position is the
global (epoch, cursor), so it survives restarts and world-size changes: after a resize the
rest of the epoch is split over the new ranks and every sample is used once.

``num_workers > 0`` loads batches in DataLoader worker processes that prefetch ahead; the
position saved in a checkpoint is still that of the batches the step loop consumed, not of
the prefetched ones. Dask worker processes are daemonic by default and a daemonic process may
not start children: the clusters nbtrain starts set ``distributed.worker.daemon: False``; on
your own cluster set it too (``DASK_DISTRIBUTED__WORKER__DAEMON=False`` for the workers).
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import pickle
import threading
import time
from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset
from torch.utils.data import default_collate as _default_collate

from nbtrain.core.data import DataPosition, advance, epoch_order, shard_of_batch

__all__ = ["PositionedLoader", "ShardedLoader", "batch_share"]


class PositionedLoader(Protocol):
    """A loader whose global data position travels with checkpoints."""

    last_share: float | None
    last_sizes: tuple[int, int] | None

    def next_batch(self) -> Any: ...
    def close(self) -> None: ...
    def state_dict(self) -> dict[str, int]: ...
    def load_state_dict(self, state: dict[str, int]) -> None: ...


def batch_share(mine: int, batch: int, world_size: int) -> float | None:
    """This rank's share of a global batch when it did not split evenly over the ranks (the
    gradient all-reduce weighs each rank by it), None when it did (every rank weighs
    1/world_size, bit for bit as DDP)."""
    return None if mine * world_size == batch else mine / batch


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
        num_workers: int = 0,
        prefetch_factor: int = 2,
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
        if not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"num_workers must be an integer >= 0, got {num_workers!r}")
        self.dataset = dataset
        self.global_batch_size = global_batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.collate_fn = collate_fn or _default_collate
        self.num_workers = num_workers
        self.prefetch_factor = prefetch_factor
        self.num_samples = n
        self.position = DataPosition()
        #: This rank's share of the last global batch, see :func:`batch_share`.
        self.last_share: float | None = None
        #: (this rank's samples, the global batch's) of the last batch.
        self.last_sizes: tuple[int, int] | None = None
        self._orders: dict[int, np.ndarray] = {}
        self._prefetch: Iterator[Any] | None = None

    def _epoch_order(self, epoch: int) -> np.ndarray:
        order = self._orders.get(epoch)
        if order is None:
            order = epoch_order(self.num_samples, self.seed, epoch, self.shuffle)
            # The step loop and the prefetching sampler may stand in two epochs.
            self._orders = {e: o for e, o in self._orders.items() if e >= epoch - 1}
            self._orders[epoch] = order
        return order

    def _at(self, pos: DataPosition) -> tuple[np.ndarray, int, DataPosition]:
        """(this rank's indices, the global batch's size, the next position) at ``pos``."""
        batch = self._epoch_order(pos.epoch)[pos.cursor : pos.cursor + self.global_batch_size]
        nxt = advance(pos, self.global_batch_size, self.num_samples, self.drop_last)
        return shard_of_batch(batch, self.rank, self.world_size), len(batch), nxt

    def next_indices(self) -> np.ndarray:
        """This rank's sample indices for the next step; advances the global position."""
        mine, size, self.position = self._at(self.position)
        self.last_share = batch_share(len(mine), size, self.world_size)
        self.last_sizes = (len(mine), size)
        return mine

    def next_batch(self) -> Any:
        if self.num_workers:
            return self._next_prefetched()
        idx = self.next_indices()
        if isinstance(self.dataset, TensorDataset):
            # Index the tensors directly: one gather instead of per-sample calls.
            t = torch.from_numpy(idx)
            return tuple(x[t] for x in self.dataset.tensors)
        return self.collate_fn([self.dataset[int(i)] for i in idx])

    def _next_prefetched(self) -> Any:
        if self._prefetch is None:
            if multiprocessing.current_process().daemon:
                raise RuntimeError(
                    "num_workers > 0 needs worker processes that may start children, and this "
                    "Dask worker is daemonic: start the cluster's workers with "
                    "DASK_DISTRIBUTED__WORKER__DAEMON=False (dask config "
                    "distributed.worker.daemon: False), or use num_workers=0")
            loader: DataLoader[Any] = DataLoader(
                _ByValue(self.dataset),  # type: ignore[arg-type]
                batch_sampler=_Positions(self, self.position),
                num_workers=self.num_workers,
                collate_fn=_ByValue(self.collate_fn),
                prefetch_factor=self.prefetch_factor,
                multiprocessing_context=_worker_context(),
                worker_init_fn=functools.partial(follow_rank, *_this_process()))
            try:
                self._prefetch = iter(loader)
            except (TypeError, AttributeError, pickle.PicklingError) as exc:
                raise TypeError(
                    f"num_workers={self.num_workers}: the dataset "
                    f"({type(self.dataset).__name__}) cannot be sent to DataLoader worker "
                    f"processes ({type(exc).__name__}: {exc}); open files or connections "
                    "lazily in __getitem__ (not in __init__), or use num_workers=0") from exc
        batch = next(self._prefetch)
        self.next_indices()  # the consumed position, for checkpoints
        return batch

    def close(self) -> None:
        """Stop the prefetching worker processes (if any) now. The rank task calls it when
        its generation ends: left to the garbage collector (the loader and its iterator hold
        each other), the workers were joined at some later moment inside whatever ran then,
        a later generation's step on this Dask worker, which stalled and looked like a hang."""
        it, self._prefetch = self._prefetch, None
        shutdown = getattr(it, "_shutdown_workers", None)  # what the iterator's __del__ calls
        if callable(shutdown):
            shutdown()

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.position.epoch, "cursor": self.position.cursor}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = DataPosition(epoch=int(state["epoch"]), cursor=int(state["cursor"]))
        self.close()  # prefetched batches belong to the old position


class _Positions:
    """Batch sampler for the prefetching DataLoader: this rank's index lists from ``start``
    on, forever (read in the rank's process; the workers only load the samples)."""

    def __init__(self, loader: ShardedLoader, start: DataPosition) -> None:
        self.loader = loader
        self.start = start

    def __iter__(self) -> Iterator[list[int]]:
        pos = self.start
        while True:
            mine, _, pos = self.loader._at(pos)
            yield mine.tolist()


def _worker_context() -> Any:
    """Where DataLoader workers come from: a fork server where there is one. Forking the rank's
    own process is unsafe: a Dask worker runs many threads, and a child forked while one of
    them held a lock (of multiprocessing's fd sharing, say) can die or hang (seen here as
    "DataLoader worker exited unexpectedly" and a rank stuck in ``rebuild_storage_fd`` on a
    busy machine). The server is a fresh process that imports torch once; children fork from
    it at once, and the dataset travels by value (cloudpickle), as Dask sends the recipe."""
    if "forkserver" in multiprocessing.get_all_start_methods():
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["torch"])
        return context
    return multiprocessing.get_context("spawn")


#: How often a DataLoader worker checks that the rank that started it still runs (seconds).
RANK_WATCH_S = 2.0


def _this_process() -> tuple[int, float]:
    """This process's pid and start time (a pid alone may be reused)."""
    import psutil

    return os.getpid(), psutil.Process().create_time()


def follow_rank(pid: int, created: float, worker_id: int) -> None:
    """``worker_init_fn`` of nbtrain's DataLoader workers: end the worker once the rank's
    process (``pid``, started at ``created``) is gone.

    Without it a rank that died (a kill, an OOM, its worker's nanny killed) left its loader
    workers and their fork server running for good: torch's own watchdog in a worker watches
    the worker's parent, which is the fork server, and every client of a fork server (its
    children too) holds the pipe whose end tells the server to exit."""
    def watch() -> None:
        import psutil

        while True:
            time.sleep(RANK_WATCH_S)
            try:
                alive = psutil.Process(pid).create_time() == created
            except psutil.NoSuchProcess:  # gone (a zombie counts until it is reaped)
                alive = False
            except psutil.Error:  # cannot tell (access denied): keep going
                alive = True
            if not alive:
                os._exit(0)

    threading.Thread(target=watch, name="nbtrain-follow-rank", daemon=True).start()


class _ByValue:
    """Wraps a dataset or collate function so spawned DataLoader workers get it by value
    (cloudpickle), as Dask sends the recipe."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __getstate__(self) -> bytes:
        import cloudpickle

        return cloudpickle.dumps(self.obj)

    def __setstate__(self, state: bytes) -> None:
        import cloudpickle

        self.obj = cloudpickle.loads(state)

    def __len__(self) -> int:
        return len(self.obj)

    def __getitem__(self, i: Any) -> Any:
        return self.obj[i]

    def __call__(self, *args: Any) -> Any:
        return self.obj(*args)
