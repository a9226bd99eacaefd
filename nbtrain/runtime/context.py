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
from torch.utils.data import Dataset

from nbtrain.core.mesh import MeshPlan
from nbtrain.runtime.batch import to_device
from nbtrain.runtime.knobs import RankKnobs
from nbtrain.runtime.loader import PositionedLoader, ShardedLoader
from nbtrain.runtime.lr_rules import LRScaling
from nbtrain.runtime.parallel import Prepared, UnitRule, prepare_model
from nbtrain.runtime.stepper import Stepper
from nbtrain.runtime.stream import StreamLoader
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
    #: The size the job was submitted with (the reference of :meth:`scale_lr`).
    base_world_size: int = 0
    timer: PhaseTimer = field(default_factory=PhaseTimer)
    #: The generation's mesh: its shape and where each rank runs (``print(ctx.mesh_info)``).
    mesh_info: MeshPlan | None = None
    #: Live knobs: ``ctx.knobs.declare("aux_weight", 0.1, min=0, max=1)``; the job's owner
    #: changes them with ``job.set(aux_weight=0.2)`` (see :mod:`nbtrain.runtime.knobs`).
    knobs: RankKnobs = field(default_factory=RankKnobs)
    _mesh: Any = None  # the DeviceMesh, built by the rank task after the process group
    _prepared: list[Prepared] = field(default_factory=list)
    _loader: PositionedLoader | None = None
    _lr: LRScaling | None = None
    _state: dict[str, Any] = field(default_factory=dict)  # what checkpoints hold
    _reported: dict[str, float] = field(default_factory=dict)  # this step's metrics
    _driver: LoopDriver | None = None
    _looping: bool = False

    def knob(self, name: str) -> float:
        """The value of a declared knob in force for this step (the same on every rank)."""
        return self.knobs[name]

    @property
    def total_steps(self) -> int | None:
        """The job's ``steps`` (``submit(..., steps=N)``); None: the training function's
        own loop decides when it ends."""
        return self._driver.stepper.steps if self._driver is not None else None

    @property
    def outcome(self) -> str | None:
        """Why the training loop ended ("completed", "stopped", "preempted", ...); None while
        it runs."""
        return self._driver.stepper.outcome if self._driver is not None else None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def mesh(self) -> Any:
        """The job's ``torch.distributed.device_mesh.DeviceMesh`` (``ctx.mesh["tp"]``,
        ``ctx.mesh["dp"]``): rank order follows the placement, so a TP group is the ranks
        placed inside one NVLink domain. One "dp" dimension when submitted without ``mesh``."""
        if self._mesh is None:
            raise RuntimeError("ctx.mesh exists inside a job's rank, after its process group "
                               "started (in setup() or the training function)")
        return self._mesh

    def _coord(self, dim: str) -> tuple[int, int]:
        plan = self.mesh_info
        if plan is None:
            return (self.rank, self.world_size) if dim == "dp" else (0, 1)
        return plan.coords(self.rank).get(dim, 0), plan.size(dim)

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel index: the ranks of one TP group share it (and their
        batches)."""
        return self._coord("dp")[0]

    @property
    def dp_size(self) -> int:
        """The number of data-parallel replicas: ``world_size // tp``."""
        return self._coord("dp")[1]

    @property
    def tp_rank(self) -> int:
        """This rank's index inside its TP group (0 without TP)."""
        return self._coord("tp")[0]

    def prepare(self, model: torch.nn.Module, *, strategy: str = "ddp",
                precision: str = "fp32", compile: bool = False,
                tp_plan: dict[str, Any] | None = None, fsdp_units: UnitRule = None,
                **ddp_kwargs: Any) -> torch.nn.Module:
        """Move ``model`` to this rank's device and wrap it for the job's mesh.

        - ``strategy="ddp"`` (default): DistributedDataParallel, which broadcasts rank 0's
          parameters, so every rank starts equal. Extra keyword arguments go to DDP.
        - ``"fsdp"``: FSDP2 ``fully_shard``: parameters, gradients and optimizer state
          sharded over the ranks, one unit per block (``fsdp_units``; the rule is in
          :mod:`nbtrain.runtime.parallel`). Build the model with the same seed on every rank
          (FSDP shards each rank's own copy; it does not broadcast).
        - ``"tp+fsdp"``: tensor parallelism on the mesh's ``tp`` dimension with ``tp_plan``
          (``{"layers.0.ff1": "colwise", "layers.0.ff2": "rowwise"}``, or
          ``torch.distributed.tensor.parallel`` styles), then FSDP2 on ``dp``.
        - ``precision="bf16-mixed"``: bfloat16 compute, parameters and gradient reduction
          in the model's dtype, float32 outputs.
        - ``compile=True``: ``torch.compile`` (per FSDP unit, or the whole model under DDP).

        Create the optimizer from the returned model's parameters, after ``prepare``.
        """
        if self._mesh is None:
            raise RuntimeError("ctx.prepare(...) runs inside a job's rank (setup() or the "
                               "training function)")
        assert self.mesh_info is not None
        prepared, how = prepare_model(
            model, mesh=self._mesh, plan=self.mesh_info, device=self.device, timer=self.timer,
            strategy=strategy, precision=precision, compile=compile, tp_plan=tp_plan,
            fsdp_units_rule=fsdp_units, ddp_kwargs=ddp_kwargs)
        self._prepared.append(how)
        return prepared

    def loader(
        self,
        dataset: Dataset[Any],
        *,
        global_batch_size: int,
        shuffle: bool = True,
        drop_last: bool = True,
        collate_fn: Any = None,
        num_workers: int = 0,
    ) -> ShardedLoader:
        """A loader giving this rank its slice of each global batch (seeded, restart-safe,
        the same batches at every world size). ``num_workers``: DataLoader worker processes
        that load and prefetch the samples."""
        loader = ShardedLoader(
            dataset,
            global_batch_size=global_batch_size,
            rank=self.dp_rank,
            world_size=self.dp_size,
            seed=self.seed,
            shuffle=shuffle,
            drop_last=drop_last,
            collate_fn=collate_fn,
            num_workers=num_workers,
        )
        self.close_data()
        self._loader = loader
        return loader

    def close_data(self) -> None:
        """Stop this rank's loader (its DataLoader worker processes) now; the rank task calls
        it when the generation ends, however it ends."""
        loader, self._loader = self._loader, None
        if loader is not None:
            loader.close()

    def scale_lr(self, optimizer: torch.optim.Optimizer, rule: str = "linear", *,
                 base_world_size: int | None = None, scheduler: Any = None) -> float:
        """Scale the learning rate with the world size, for a job whose per-rank batch is
        fixed (``ctx.batches(..., batch_size=...)``, so the global batch grows with the
        ranks): ``"linear"`` multiplies it by ``world_size / base_world_size``, ``"sqrt"``
        by the square root of that. ``base_world_size``: the size the LR was tuned for
        (default: the size the job was submitted with). Applied again after every restore
        and resize (relative to what is applied, so an LR scheduler's decay is kept; pass
        the ``scheduler`` so its base LRs follow). Returns the factor; the job's ``data``
        event names it."""
        self._lr = LRScaling(optimizer, rule, base_world_size or self.base_world_size
                             or self.world_size, scheduler=scheduler)
        return self._lr.apply(self.world_size)

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
                global_batch_size: int | None = None, batch_size: int | None = None,
                shuffle: bool = True, drop_last: bool = True, collate_fn: Any = None,
                num_workers: int = 0) -> Iterator[Any]:
        """The training loop: one step per iteration, each with this rank's batch.

        With ``global_batch_size`` (or ``batch_size``, per rank: the global batch is then
        ``batch_size * dp_size`` and changes with a resize; see :meth:`scale_lr`) nbtrain
        shards each global batch over the ranks, and the global data position is part of
        every checkpoint: every sample of an epoch is used exactly once across restarts and
        resizes, at any world size.

        - ``data`` a map-style dataset (``__len__``, ``__getitem__``): one seeded order per
          epoch (``shuffle``); ``num_workers``: DataLoader worker processes prefetch it.
        - ``data`` an iterable dataset: every rank reads the stream and keeps its slice
          (contract in :mod:`nbtrain.runtime.stream`: the same samples each time it is
          iterated, per ``set_epoch``).
        - Without a batch size, ``data`` (your own ``DataLoader``) is used as it is: each rank
          takes its own batches and the position is not restored (a resumed job starts it
          from its beginning).

        With a ``tp`` mesh dimension the batch is split over the data-parallel replicas
        (``dp_size``): the ranks of one TP group get the same batch.

        A global batch that does not divide by the world size is split as evenly as it goes
        (sizes differ by one) and the gradient all-reduce weighs each rank by its share, so
        the step equals one over the whole global batch.

        The loop ends after the job's ``steps``; a stop, preemption, resize or halt ends it
        at a step boundary and skips the rest of the training function.
        """
        if batch_size is not None:
            if global_batch_size is not None:
                raise TypeError("ctx.batches(...): give global_batch_size (kept at every world "
                                "size) or batch_size (per rank), not both")
            global_batch_size = batch_size * self.dp_size
        if global_batch_size is None:
            if isinstance(data, Dataset) or (hasattr(data, "__getitem__")
                                             and hasattr(data, "__len__")):
                raise TypeError("ctx.batches(dataset, global_batch_size=...): the global batch "
                                "size is needed to shard a dataset over the ranks")
            it = iter(data)
            return self._loop(lambda: to_device(next(it), self.device))
        if hasattr(data, "__getitem__") and hasattr(data, "__len__"):
            self.loader(data, global_batch_size=global_batch_size,  # type: ignore[arg-type]
                        shuffle=shuffle, drop_last=drop_last, collate_fn=collate_fn,
                        num_workers=num_workers)
        else:
            if num_workers:
                raise ValueError("num_workers is for map-style datasets; an iterable dataset "
                                 "is read by every rank (see nbtrain.runtime.stream)")
            self.close_data()
            self._loader = StreamLoader(data,  # type: ignore[arg-type]
                                        global_batch_size=global_batch_size,
                                        rank=self.dp_rank, world_size=self.dp_size,
                                        drop_last=drop_last, collate_fn=collate_fn)
        return self._loop(self.next_batch)

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

    def restored(self) -> dict[str, Any]:
        """Called once the checkpoint is restored: applies the LR rule at this world size and
        returns where the data stands and how batch and LR are set (the ``data`` event)."""
        info: dict[str, Any] = {"world_size": self.world_size, "step": self.step}
        loader = self._loader
        if loader is not None:
            info.update(loader.state_dict())
            info["global_batch_size"] = getattr(loader, "global_batch_size", None)
        if self._lr is not None:
            info.update(lr_rule=self._lr.rule, lr_factor=self._lr.apply(self.world_size),
                        lr_base_world_size=self._lr.base_world_size)
        return info

    def next_batch(self) -> Any:
        if self._loader is None:
            raise RuntimeError(
                "no loader: call ctx.loader(dataset, global_batch_size=...) in setup(), "
                "or override Recipe.next_batch(ctx)"
            )
        batch = self._loader.next_batch()
        self.timer.grad_weight = self._loader.last_share
        self.timer.batch_sizes = self._loader.last_sizes
        return to_device(batch, self.device)

