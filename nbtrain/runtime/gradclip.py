"""Gradient clipping by the global norm, also for sharded parameters (FSDP2, TP).

``torch.nn.utils.clip_grad_norm_`` stacks the per-tensor norms, which DTensor refuses when
the gradients live on different device meshes: under ``tp+fsdp`` the layers of the TP plan
hold DTensors on the 2-D ``(dp, tp)`` mesh and every other layer on the 1-D ``dp`` mesh
(measured on torch 2.13: "All operands in aten.stack.default must have the same mesh").
Here the norm is taken per mesh (DTensor reduces each group's partial norms over its own
mesh, counting a replicated shard once), the groups' norms are combined into the one
global norm, the same on every rank, and each gradient's local shard is scaled by the same
factor. Plain tensors (DDP, whose gradients are already all-reduced) form a group of their
own. Collective under sharding: every rank must call it with the same parameters, which
the optimizer step pre-hook does.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor

__all__ = ["clip_grad_norm"]


def clip_grad_norm(params: Iterable[torch.Tensor], max_norm: float,
                   norm_type: float = 2.0) -> torch.Tensor:
    """Scale the gradients of ``params`` in place so their global ``norm_type`` norm is
    at most ``max_norm``; returns that total norm (a plain tensor, before clipping)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    groups: dict[object, list[torch.Tensor]] = {}  # one per mesh, in first-seen order
    for g in grads:
        key = g.device_mesh if isinstance(g, DTensor) else None
        groups.setdefault(key, []).append(g)
    norms = []
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm(group, norm_type)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        norms.append(norm.to(torch.float64))
    stacked = torch.stack([n.to(norms[0].device) for n in norms])
    total = (stacked.max() if norm_type == float("inf")
             else stacked.pow(norm_type).sum().pow(1.0 / norm_type))
    # As torch does: no device sync for the decision, a factor of 1 when under the limit.
    coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for g in grads:
            local = g.to_local() if isinstance(g, DTensor) else g
            local.mul_(coef.to(local.device, local.dtype))
    return total
