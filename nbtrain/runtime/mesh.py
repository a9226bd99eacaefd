"""The rank's ``DeviceMesh``, built from the generation's :class:`~nbtrain.core.mesh.MeshPlan`.

Built once per generation, right after the process group, on every rank in the same order
(a mesh of two or more dimensions creates a process group per group of each dimension, a
collective step), so user code can touch ``ctx.mesh`` from any rank at any time. Rank ``r``
sits at position ``r`` of the row-major ``shape``: the controller launched the ranks in
placement order, so a TP group (the innermost dimension) is the ranks placed together.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from nbtrain.core.mesh import MeshPlan, RankPlace, mesh_plan

__all__ = ["build_device_mesh", "default_plan"]


def default_plan(world_size: int, host: str) -> MeshPlan:
    """One "dp" dimension, for a launch that carries no plan (a rank started by hand)."""
    places = [RankPlace(slot=f"rank{r}", host=host, nvlink=host) for r in range(world_size)]
    return mesh_plan(None, places)


def build_device_mesh(plan: MeshPlan, device: torch.device) -> DeviceMesh:
    """The generation's ``DeviceMesh`` (``mesh_dim_names`` are the plan's)."""
    return init_device_mesh(device.type, plan.shape, mesh_dim_names=plan.dim_names)
