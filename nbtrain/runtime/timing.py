"""Per-step phase timing on one rank: data wait, compute, communication wait, optimizer.

DDP overlaps the gradient all-reduce with backward, so "communication" here is the time this
rank sat *waiting* for all-reduces after its own backward compute was done: from the last
bucket's hook call to the completion of the last all-reduce. A rank with slow compute waits
little; its peers wait for it. ``compute = step - data - comm - optimizer``.

On gloo and NCCL alike the hook sees completion through the all-reduce future; on NCCL the
future completes when the kernel is enqueued-and-done on the stream, which is what we want.

Under FSDP (``strategy="fsdp"`` or ``"tp+fsdp"``) "communication" is the time this rank spent
in FSDP's parameter all-gathers (before each unit's forward and, resharded, its backward) and
gradient reduce-scatters (after each unit's backward), measured by custom FSDP comms that
time the calls (``FSDPModule.set_custom_all_gather``/``set_custom_reduce_scatter``). On CPU
(gloo) FSDP issues these collectives synchronously on the training thread, so this is their
whole time, transfer included, plus the wait for slower peers: a rank with slow compute again
shows higher ``compute``, its peers higher ``comm``. On CUDA they only enqueue work on FSDP's
communication streams, so most of the wait would show in compute. Tensor-parallel collectives
(inside forward and backward, issued by DTensor) count as compute.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter


class PhaseTimer:
    """Collects the comm-wait and optimizer time of the current step.

    ``grad_weight``: this rank's share of the step's global batch, set by the loader each
    step. The all-reduce sums gradients weighted by it, so the result is the gradient of the
    global batch's mean loss also when the batch does not split evenly over the ranks (an
    elastic job at a world size that does not divide it); None (a loader nbtrain does not
    shard) weighs every rank 1/world_size, as DDP does.
    """

    def __init__(self) -> None:
        self.grad_weight: float | None = None
        #: (this rank's samples, the global batch's) of the step, set by nbtrain's loaders
        #: (None: another loader).
        self.batch_sizes: tuple[int, int] | None = None
        #: Also measure the squared norms of this rank's local gradient and of the reduced
        #: one (for the gradient noise scale, ``core.gradnoise``; rank 0 of a goodput-sized
        #: job). They stay tensors on the gradients' device: nothing here waits for them.
        self.grad_norms = False
        self._local_sq: list[torch.Tensor] = []
        self._global_sq: list[torch.Tensor] = []
        self.reset()

    def take_grad_norms(self) -> torch.Tensor | None:
        """The squared norms of the local and the reduced gradient of the step just done,
        summed over its buckets (a float64 tensor of two on the gradients' device; reading it
        waits for the step's work), then cleared. None: none measured, or a step whose
        reductions did not all complete."""
        local, reduced = self._local_sq, self._global_sq
        self._local_sq, self._global_sq = [], []
        if not local or len(local) != len(reduced):
            return None
        return torch.stack([torch.stack(local).sum(), torch.stack(reduced).sum()])

    def reset(self) -> None:
        self._last_hook = 0.0
        self._last_done = 0.0
        self._opt_start = 0.0
        self.opt_s = 0.0
        self.fsdp_comm_s = 0.0

    @property
    def comm_s(self) -> float:
        ddp = max(0.0, self._last_done - self._last_hook) if self._last_hook else 0.0
        return ddp + self.fsdp_comm_s

    # -- FSDP comms ------------------------------------------------------------------------
    def attach_fsdp(self, module: Any) -> None:
        """Time the all-gathers and reduce-scatters of one FSDP module (a unit or the root)."""
        module.set_custom_all_gather(TimedAllGather(self))
        module.set_custom_reduce_scatter(TimedReduceScatter(self))

    # -- DDP comm hook -------------------------------------------------------------------
    def attach_ddp(self, ddp: torch.nn.parallel.DistributedDataParallel) -> None:
        ddp.register_comm_hook(state=self, hook=_timed_allreduce_hook)

    # -- optimizer hooks -----------------------------------------------------------------
    def attach_optimizer(self, opt: torch.optim.Optimizer) -> None:
        opt.register_step_pre_hook(self._opt_pre)
        opt.register_step_post_hook(self._opt_post)

    def _opt_pre(self, *_: Any) -> None:
        self._opt_start = time.perf_counter()

    def _opt_post(self, *_: Any) -> None:
        self.opt_s += time.perf_counter() - self._opt_start


def _timed_allreduce_hook(timer, bucket):  # type: ignore[no-untyped-def]
    """DDP's all-reduce (a mean weighted by each rank's share of the global batch),
    timestamped at call and completion.

    Unannotated on purpose: DDP compares the annotations with the real classes, and this
    module's postponed (string) annotations would fail that check.
    """
    timer._last_hook = time.perf_counter()
    group = dist.group.WORLD
    weight = timer.grad_weight
    norms = timer.grad_norms
    if norms:  # this rank's own gradient, before the reduction
        timer._local_sq.append(_sq_norm(bucket.buffer()))
    buf = (bucket.buffer().mul_(weight) if weight is not None
           else bucket.buffer().div_(dist.get_world_size(group)))
    fut = dist.all_reduce(buf, group=group, async_op=True).get_future()

    def _done(f: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        timer._last_done = time.perf_counter()
        reduced = f.value()[0]
        if norms:
            timer._global_sq.append(_sq_norm(reduced))
        return reduced

    return fut.then(_done)


def _sq_norm(t: torch.Tensor) -> torch.Tensor:
    """A tensor's squared norm, computed in float64 (a bf16 or float32 bucket's too)."""
    return torch.linalg.vector_norm(t.detach(), dtype=torch.float64).square()


class _Alloc:
    """FSDP's default buffer allocation (a plain ``torch.empty``)."""

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class TimedAllGather(_Alloc, AllGather):
    """FSDP's parameter all-gather, timed into ``timer.fsdp_comm_s``."""

    def __init__(self, timer: PhaseTimer) -> None:
        self.timer = timer

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, async_op: bool = False) -> Any:
        t0 = time.perf_counter()
        work = dist.all_gather_single(output_tensor, input_tensor, group=group,
                                      async_op=async_op)
        self.timer.fsdp_comm_s += time.perf_counter() - t0
        return work


class TimedReduceScatter(_Alloc, ReduceScatter):
    """FSDP's gradient reduce-scatter, timed into ``timer.fsdp_comm_s``, weighing each rank's
    gradient by its share of an unevenly split global batch (as the DDP hook does): FSDP
    divides the sum by the data-parallel size, so the input is scaled by share x size."""

    def __init__(self, timer: PhaseTimer) -> None:
        self.timer = timer

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op: Any, async_op: bool = False) -> Any:
        weight = self.timer.grad_weight
        if weight is not None:
            input_tensor.mul_(weight * group.size())
        t0 = time.perf_counter()
        work = dist.reduce_scatter_single(output_tensor, input_tensor, op=op, group=group,
                                          async_op=async_op)
        self.timer.fsdp_comm_s += time.perf_counter() - t0
        return work
