"""Data across world sizes (pure, in-process): the global position re-partitioned over a new
number of ranks, iterable datasets under their contract, DataLoader worker processes, uneven
splits, the seeding rule for new ranks and the LR scaling rules."""

from __future__ import annotations

import math
import multiprocessing
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import IterableDataset, TensorDataset

from nbtrain.core.data import epoch_order
from nbtrain.runtime.loader import ShardedLoader, batch_share
from nbtrain.runtime.lr_rules import LRScaling, lr_factor
from nbtrain.runtime.rng import seed_rng
from nbtrain.runtime.stream import StreamLoader

N, B = 60, 12  # five global batches an epoch


def ids_dataset(n: int = N) -> TensorDataset:
    return TensorDataset(torch.arange(n))


def run_sizes(make: Any, plan: list[tuple[int, int]]) -> list[list[int]]:
    """Each global batch's ids, running ``steps`` steps at ``world_size`` for each
    (world_size, steps) of ``plan``, handing the position over between sizes."""
    state: dict[str, int] | None = None
    batches: list[list[int]] = []
    for world_size, steps in plan:
        loaders = [make(rank, world_size) for rank in range(world_size)]
        for loader in loaders:
            if state is not None:
                loader.load_state_dict(state)
        for _ in range(steps):
            step: list[int] = []
            for loader in loaders:
                (ids,) = loader.next_batch() if isinstance(loader, ShardedLoader) else (
                    loader.next_batch(),)
                step += [int(i) for i in ids]
            batches.append(step)
        states = [loader.state_dict() for loader in loaders]
        assert all(s == states[0] for s in states), states  # every rank agrees
        state = states[0]
    return batches


def assert_each_epoch_once(batches: list[list[int]], n: int, per_epoch: int) -> None:
    for start in range(0, len(batches) - per_epoch + 1, per_epoch):
        ids = [i for b in batches[start:start + per_epoch] for i in b]
        assert sorted(ids) == list(range(n)), (start, ids)


def test_map_style_position_is_repartitioned_at_any_size() -> None:
    def make(rank: int, world_size: int) -> ShardedLoader:
        return ShardedLoader(ids_dataset(), global_batch_size=B, rank=rank,
                             world_size=world_size, seed=3)

    plan = [(3, 2), (1, 4), (5, 3), (2, 6)]  # sizes change mid-epoch and across epochs
    batches = run_sizes(make, plan)
    fixed = run_sizes(make, [(1, sum(s for _, s in plan))])
    assert batches == fixed  # the same global batches whatever the sizes
    assert_each_epoch_once(batches, N, N // B)
    assert [sorted(b) for b in batches[:5]] == [
        sorted(int(i) for i in epoch_order(N, 3, 0, True)[k * B:(k + 1) * B]) for k in range(5)]


def test_uneven_split_shares() -> None:
    loaders = [ShardedLoader(ids_dataset(), global_batch_size=B, rank=r, world_size=5)
               for r in range(5)]
    sizes = [len(loader.next_indices()) for loader in loaders]
    assert sizes == [2, 2, 3, 2, 3] and sum(sizes) == B
    shares = [loader.last_share for loader in loaders]
    assert shares == [2 / 12, 2 / 12, 3 / 12, 2 / 12, 3 / 12]
    assert math.isclose(sum(s for s in shares if s is not None), 1.0)
    assert batch_share(6, 12, 2) is None  # even: DDP's own 1/world_size


class Stream(IterableDataset):  # type: ignore[type-arg]
    """A generator-backed stream whose order depends on the epoch (its contract)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.epoch = 0
        self.passes = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        self.passes += 1
        g = torch.Generator().manual_seed(self.epoch)
        yield from (int(i) for i in torch.randperm(self.n, generator=g))


def test_iterable_dataset_position_survives_any_size() -> None:
    n = 65  # 5 full batches of 12 and 5 samples dropped at the end of each epoch

    def make(rank: int, world_size: int) -> StreamLoader:
        return StreamLoader(Stream(n), global_batch_size=B, rank=rank, world_size=world_size)

    plan = [(2, 3), (3, 4), (1, 5)]
    batches = run_sizes(make, plan)
    assert batches == run_sizes(make, [(1, 12)])
    for epoch in range(2):
        ids = [i for b in batches[epoch * 5:(epoch + 1) * 5] for i in b]
        order = [int(i) for i in torch.randperm(n, generator=torch.Generator().manual_seed(
            epoch))]
        assert ids == order[:60]  # every sample of the epoch once, in the stream's order


def test_iterable_dataset_that_changes_is_refused_with_the_contract() -> None:
    class Shrinking(Stream):
        def __iter__(self) -> Iterator[int]:
            yield from range(self.n - 20 * self.passes)
            self.passes += 1

    loader = StreamLoader(Shrinking(60), global_batch_size=B, rank=0, world_size=1)
    loader.load_state_dict({"epoch": 0, "cursor": 48})
    loader.dataset.passes = 1  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="fewer than the 48 the checkpoint says"):
        loader.next_batch()


def test_dataloader_workers_give_the_same_batches_and_the_consumed_position() -> None:
    def make(workers: int) -> ShardedLoader:
        return ShardedLoader(ids_dataset(), global_batch_size=B, rank=1, world_size=2,
                             num_workers=workers)

    plain, prefetched = make(0), make(2)
    for _ in range(7):
        assert torch.equal(plain.next_batch()[0], prefetched.next_batch()[0])
        assert prefetched.state_dict() == plain.state_dict()  # not the prefetched one
    state = prefetched.state_dict()
    again = make(2)
    again.load_state_dict(state)
    assert torch.equal(again.next_batch()[0], plain.next_batch()[0])
    prefetched.close()
    again.close()


def test_dataloader_workers_in_a_daemonic_process_say_how_to_fix_it() -> None:
    loader = ShardedLoader(ids_dataset(), global_batch_size=B, rank=0, world_size=1,
                           num_workers=1)
    me = multiprocessing.current_process()
    was = me.daemon
    me._config["daemon"] = True  # type: ignore[attr-defined]  # as in a Dask worker
    try:
        with pytest.raises(RuntimeError, match="DASK_DISTRIBUTED__WORKER__DAEMON=False"):
            loader.next_batch()
    finally:
        me._config["daemon"] = was  # type: ignore[attr-defined]


def test_new_ranks_are_seeded_from_seed_step_and_rank() -> None:
    seed_rng(7, 40, 2)
    a = torch.rand(3)
    seed_rng(7, 40, 2)
    assert torch.equal(torch.rand(3), a)
    seed_rng(7, 40, 3)
    assert not torch.equal(torch.rand(3), a)


def test_lr_rules_scale_relative_to_what_is_applied() -> None:
    assert lr_factor("linear", 4, 2) == 2.0 and lr_factor("sqrt", 8, 2) == 2.0
    with pytest.raises(ValueError, match="one of linear, sqrt"):
        lr_factor("cubic", 2, 1)
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    rule = LRScaling(opt, "linear", 2, scheduler=sched)
    assert rule.apply(4) == 2.0 and math.isclose(opt.param_groups[0]["lr"], 0.2)
    opt.step()
    sched.step()  # decays to 0.1
    saved = opt.state_dict()  # written at 4 ranks
    # Restored at 1 rank: the decayed LR, scaled for 1 rank instead of 4.
    fresh = torch.optim.SGD([param], lr=0.1)
    fresh.load_state_dict(saved)
    rule = LRScaling(fresh, "linear", 2)
    assert rule.apply(1) == 0.5
    assert math.isclose(fresh.param_groups[0]["lr"], 0.1 / 2.0 * 0.5)


class _WithALock(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """A dataset that opened something in ``__init__`` that cannot travel to a process."""

    def __init__(self) -> None:
        self.handle = threading.Lock()

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i])


def test_a_dataset_that_cannot_reach_the_workers_says_what_to_do() -> None:
    loader = ShardedLoader(_WithALock(), global_batch_size=B, rank=0, world_size=1,
                           num_workers=1)
    with pytest.raises(TypeError, match=r"num_workers=1: the dataset \(_WithALock\) cannot be "
                                        r"sent to DataLoader worker processes .*lazily in "
                                        r"__getitem__"):
        loader.next_batch()


def test_close_stops_the_dataloader_workers_at_once() -> None:
    """The rank task closes its loader when a generation ends: the worker processes end then,
    even while something else (here ``held``, in a rank a failure's traceback) still holds
    the iterator, instead of being joined by the garbage collector inside a later step."""
    loader = ShardedLoader(ids_dataset(), global_batch_size=B, rank=0, world_size=1,
                           num_workers=2)
    loader.next_batch()
    held = loader._prefetch
    workers = list(held._workers)  # type: ignore[union-attr]
    assert len(workers) == 2 and all(w.is_alive() for w in workers)
    loader.close()
    assert loader._prefetch is None
    assert not any(w.is_alive() for w in workers), [w.exitcode for w in workers]
    del held


def test_close_closes_an_iterable_datasets_generator() -> None:
    closed: list[bool] = []

    class Stream(IterableDataset):  # type: ignore[type-arg]
        def __iter__(self) -> Iterator[torch.Tensor]:
            try:
                yield from (torch.tensor([i]) for i in range(100))
            finally:
                closed.append(True)

    loader = StreamLoader(Stream(), global_batch_size=4, rank=0, world_size=1)
    loader.next_batch()
    loader.close()
    assert closed == [True]
