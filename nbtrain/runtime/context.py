"""``RankContext``: what a recipe or a training function sees of its rank.

A training function marks its step boundaries by iterating ``ctx.batches(...)`` (or
``ctx.steps()``): each iteration is one step, timed, checkpointed and steerable exactly like a
``Recipe``'s. ``ctx.track(model=..., optimizer=...)`` names what checkpoints hold (restored
into it when the loop starts), ``ctx.report(loss=...)`` sends the step's metrics.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset

from nbtrain.runtime.loader import ShardedLoader
from nbtrain.runtime.stepper import Stepper
from nbtrain.runtime.timing import PhaseTimer

__all__ = ["LoopDriver", "LoopEnded", "RankContext"]


class LoopEnded(BaseException):
    """Raised out of a training function's loop when a stop, preemption or halt ends it:
    the rest of the function does not run (a ``BaseException``, so ``except Exception`` in
    user code does not swallow it)."""

    def __init__(self, outcome: str) -> None:
        super().__init__(outcome)
        self.outcome = outcome


class LoopDriver(Protocol):
    """What the rank task gives the context to run a loop: the step boundary, and the start
    of the loop (restore the newest checkpoint, announce the rank)."""

    stepper: Stepper

    def start_loop(self) -> int: ...


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
    _state: dict[str, Any] = field(default_factory=dict)  # what checkpoints hold
    _reported: dict[str, float] = field(default_factory=dict)  # this step's metrics
    _driver: LoopDriver | None = None
    _looping: bool = False

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

    # -- a training function's side ----------------------------------------------------------
    def track(self, **objects: Any) -> None:
        """Name what checkpoints hold: objects with ``state_dict()``/``load_state_dict()``
        (the prepared model, optimizer, LR scheduler, ...). Call before the training loop
        starts: when it starts, a resumed or recovered job loads its checkpoint into them
        (and restores the data position and the RNG), so the loop continues exactly."""
        if self._looping:
            raise RuntimeError(
                "ctx.track(...) after the training loop started: call it before iterating "
                "ctx.batches(...) / ctx.steps(), so the checkpoint is restored into it")
        for name, obj in objects.items():
            if not (callable(getattr(obj, "state_dict", None))
                    and callable(getattr(obj, "load_state_dict", None))):
                raise TypeError(
                    f"ctx.track({name}=...) needs an object with state_dict() and "
                    f"load_state_dict() (a module, optimizer, scheduler), got "
                    f"{type(obj).__name__}")
            if isinstance(obj, torch.optim.Optimizer):
                self.timer.attach_optimizer(obj)
            self._state[name] = obj

    def report(self, **metrics: float) -> None:
        """Metrics of the current step (``loss=...``): the dashboard plots them, trackers
        receive them, and a NaN or infinite value raises an alert."""
        self._reported.update(metrics)

    def batches(self, data: Dataset[Any] | Iterable[Any], *,
                global_batch_size: int | None = None, shuffle: bool = True,
                drop_last: bool = True, collate_fn: Any = None) -> Iterator[Any]:
        """The training loop: one step per iteration, each with this rank's batch.

        ``data`` a map-style dataset: nbtrain shards each global batch of
        ``global_batch_size`` over the ranks from one seeded order, and the data position is
        part of every checkpoint (exactly-once across restarts). Any other iterable (your own
        ``DataLoader``) is used as it is: each rank takes its own batches, and its position is
        not restored (a resumed job starts it from its beginning).

        The loop ends after the job's ``steps``; a stop, preemption or halt ends it at a step
        boundary and skips the rest of the training function.
        """
        if isinstance(data, Dataset) or (hasattr(data, "__getitem__")
                                         and hasattr(data, "__len__")):
            if global_batch_size is None:
                raise TypeError("ctx.batches(dataset, global_batch_size=...): the global batch "
                                "size is needed to shard a dataset over the ranks")
            loader = self.loader(data, global_batch_size=global_batch_size,  # type: ignore[arg-type]
                                 shuffle=shuffle, drop_last=drop_last, collate_fn=collate_fn)
            return self._loop(lambda: _to_device(loader.next_batch(), self.device))
        it = iter(data)
        return self._loop(lambda: _to_device(next(it), self.device))

    def steps(self) -> Iterator[int]:
        """The training loop without data from nbtrain: yields the step number (1, 2, ...);
        fetch your batch inside the loop (its time counts as compute)."""
        return self._loop(lambda: self.step + 1)

    def _loop(self, fetch: Callable[[], Any]) -> Iterator[Any]:
        driver = self._driver
        if driver is None:
            raise RuntimeError("ctx.batches() / ctx.steps() run inside a job's training "
                               "function (cluster.submit(train, ...)), not in a Recipe")
        if self._looping:
            raise RuntimeError("one training loop per rank and generation: ctx.batches() / "
                               "ctx.steps() was already started")
        self._looping = True
        self.step = driver.start_loop()
        stepper = driver.stepper
        while stepper.begin():
            try:
                batch = fetch()
            except StopIteration:  # the user's iterable ran out: the training is done
                stepper.in_step = False
                stepper.outcome = "completed"
                return
            stepper.batch_ready()
            self._reported = {}
            yield batch
            ending = stepper.end(self._reported)
            self.step = stepper.step
            if ending:
                raise LoopEnded(stepper.outcome or "stopped")

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
