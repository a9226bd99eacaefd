"""How much training state this rank holds: parameter, gradient and optimizer-state bytes.

Counted over the tracked modules and optimizers (``ctx.track`` / a Recipe's state), local
shards only: under FSDP a rank holds ``1/dp`` of each sharded tensor, so the figures show the
sharding at work; under DDP every rank holds all of it. Sent once per generation, after its
first step (optimizers create their state lazily, in their first step), as the ``memory``
event that the dashboard shows per rank.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from nbtrain.runtime.snapshot import find_in_state

__all__ = ["state_memory"]


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _nbytes(tensors: Iterable[Any]) -> int:
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        local = _local(t)
        key = local.data_ptr() if local.numel() else id(local)
        if key in seen:
            continue
        seen.add(key)
        total += local.numel() * local.element_size()
    return total


def _optimizer_tensors(opt: torch.optim.Optimizer) -> Iterable[Any]:
    for per_param in opt.state.values():
        yield from per_param.values()


def state_memory(state: Mapping[str, Any]) -> dict[str, int]:
    """``params_bytes``, ``grads_bytes`` and ``optimizer_bytes`` of this rank's tracked state
    (local shards; tied or shared tensors counted once)."""
    objects = find_in_state(state, (torch.nn.Module, torch.optim.Optimizer))
    modules = [o for o in objects if isinstance(o, torch.nn.Module)]
    optimizers = [o for o in objects if isinstance(o, torch.optim.Optimizer)]
    params = [p for m in modules for p in m.parameters()]
    return {
        "params_bytes": _nbytes(params),
        "grads_bytes": _nbytes(p.grad for p in params if p.grad is not None),
        "optimizer_bytes": _nbytes(t for o in optimizers for t in _optimizer_tensors(o)),
    }
