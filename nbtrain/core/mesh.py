"""A job's device mesh: the names and shape users ask for, and where each rank landed (pure).

``submit(..., mesh={"dp": 2, "tp": 2})`` names the parallel dimensions. ``tp`` ranks form one
tensor-parallel group; the gang scheduler's placement (:mod:`nbtrain.core.placement`) keeps
each such group inside one NVLink domain and numbers ranks with DP outermost and TP innermost,
so the ranks ``init_device_mesh(device, shape, mesh_dim_names=names)`` puts in one TP group
are the ones placed together. ``dp`` follows from the world size (give it to have it
checked); an elastic job changes ``dp``, never ``tp``. ``pp`` and ``cp`` are reserved.

:class:`MeshPlan` is what a rank is told about the mesh of its generation (``ctx.mesh_info``):
the shape, each rank's slot, host and NVLink domain, the groups along each dimension, and
whether each TP group sits inside one NVLink domain.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from nbtrain.core.placement import Layout

__all__ = ["MESH_DIMS", "MeshPlan", "RankPlace", "layout_of", "mesh_plan", "validate_mesh"]

#: The dimensions a job's mesh may name, outermost first.
MESH_DIMS: tuple[str, ...] = ("dp", "tp")
_RESERVED = ("pp", "cp")


def validate_mesh(mesh: Mapping[str, Any], world_size: int,
                  sizes: Sequence[int] = ()) -> dict[str, int]:
    """The mesh as ``{"dp": ..., "tp": ...}`` for ``world_size``; raises ``ValueError`` naming
    the fix. ``sizes``: other sizes the job may run at (elastic bounds), which must hold
    whole TP groups too."""
    if not isinstance(mesh, Mapping) or not mesh:
        raise ValueError(f"mesh must be a dict of dimension sizes such as {{'dp': 2, 'tp': 2}}, "
                         f"got {mesh!r}")
    for name, size in mesh.items():
        if name in _RESERVED:
            raise ValueError(f"mesh dimension {name!r} is reserved for later (pipeline and "
                             f"context parallelism are not built yet): use "
                             f"{' and '.join(MESH_DIMS)}")
        if name not in MESH_DIMS:
            raise ValueError(f"unknown mesh dimension {name!r}: name them {MESH_DIMS} "
                             "(data parallel outermost, tensor parallel inside an NVLink "
                             "domain)")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"mesh[{name!r}] must be a positive integer, got {size!r}")
    tp = int(mesh.get("tp", 1))
    if world_size % tp:
        raise ValueError(f"world_size={world_size} is not a multiple of mesh['tp']={tp}: use "
                         f"a world size of k*{tp}")
    dp = world_size // tp
    if "dp" in mesh and mesh["dp"] != dp:
        raise ValueError(f"mesh {dict(mesh)} has {mesh['dp'] * tp} ranks but world_size="
                         f"{world_size}: drop 'dp' (it follows from the world size) or make "
                         f"world_size={mesh['dp'] * tp}")
    odd = [s for s in sizes if s % tp]
    if odd:
        raise ValueError(f"elastic sizes {odd} are not multiples of mesh['tp']={tp}: an "
                         f"elastic job grows and shrinks in whole TP groups, so give "
                         f"min_size and max_size as multiples of {tp}")
    return {"dp": dp, "tp": tp}


def layout_of(mesh: Mapping[str, int] | None) -> Layout:
    """The placement layout of a job's mesh (no mesh: plain data parallel)."""
    return Layout(tp=int((mesh or {}).get("tp", 1)))


@dataclass(frozen=True)
class RankPlace:
    """Where one rank runs: its slot, host and NVLink domain (the host when none is declared
    or discovered)."""

    slot: str
    host: str
    nvlink: str


@dataclass(frozen=True)
class MeshPlan:
    """The mesh of one generation: ``shape`` along ``dim_names`` (row-major rank order, DP
    outermost), and where each rank runs (``places[rank]``)."""

    dim_names: tuple[str, ...]
    shape: tuple[int, ...]
    places: tuple[RankPlace, ...]

    def __post_init__(self) -> None:
        if len(self.dim_names) != len(self.shape):
            raise ValueError(f"mesh names {self.dim_names} and shape {self.shape} differ in "
                             "length")
        n = 1
        for s in self.shape:
            n *= s
        if n != len(self.places):
            raise ValueError(f"mesh shape {self.shape} holds {n} ranks, but {len(self.places)} "
                             "are placed")

    @property
    def world_size(self) -> int:
        return len(self.places)

    def size(self, dim: str) -> int:
        """The mesh's size along ``dim`` (1 for a dimension it does not have)."""
        return self.shape[self.dim_names.index(dim)] if dim in self.dim_names else 1

    def coords(self, rank: int) -> dict[str, int]:
        """``rank``'s coordinate along each dimension."""
        out: dict[str, int] = {}
        rest = rank
        for name, size in zip(reversed(self.dim_names), reversed(self.shape), strict=True):
            out[name] = rest % size
            rest //= size
        return {name: out[name] for name in self.dim_names}

    def groups(self, dim: str) -> list[list[int]]:
        """The groups of ranks that differ only along ``dim`` (each one a collective's
        group), in rank order."""
        if dim not in self.dim_names:
            return [[r] for r in range(self.world_size)]
        axis = self.dim_names.index(dim)
        stride = 1
        for s in self.shape[axis + 1:]:
            stride *= s
        size = self.shape[axis]
        seen: set[int] = set()
        out: list[list[int]] = []
        for r in range(self.world_size):
            if r in seen:
                continue
            base = r - ((r // stride) % size) * stride
            group = [base + i * stride for i in range(size)]
            seen.update(group)
            out.append(group)
        return out

    def tp_groups_in_nvlink(self) -> tuple[int, int]:
        """(TP groups inside one NVLink domain, TP groups), counting groups of 2+ ranks."""
        groups = [g for g in self.groups("tp") if len(g) > 1]
        inside = sum(1 for g in groups if len({self.places[r].nvlink for r in g}) == 1)
        return inside, len(groups)

    def to_dict(self) -> dict[str, Any]:
        """Plain values (for events, notebooks and JSON)."""
        inside, total = self.tp_groups_in_nvlink()
        return {
            "dims": dict(zip(self.dim_names, self.shape, strict=True)),
            "ranks": [{"rank": r, **self.coords(r), "slot": p.slot, "host": p.host,
                       "nvlink": p.nvlink} for r, p in enumerate(self.places)],
            "tp_groups": total, "tp_groups_in_nvlink": inside,
        }

    def describe(self) -> str:
        """The placement as people read it: each TP group (or rank) with its host and NVLink
        domain."""
        dims = " x ".join(f"{n}={s}" for n, s in zip(self.dim_names, self.shape, strict=True))
        lines = [f"mesh {dims} ({self.world_size} ranks; DP outermost, TP innermost)"]
        if self.size("tp") > 1:
            inside, total = self.tp_groups_in_nvlink()
            lines[0] += f"; {inside} of {total} TP groups inside one NVLink domain"
            for i, group in enumerate(self.groups("tp")):
                doms = sorted({self.places[r].nvlink for r in group})
                hosts = sorted({self.places[r].host for r in group})
                where = (f"NVLink domain {doms[0]}" if len(doms) == 1
                         else f"NVLink domains {', '.join(doms)} (crosses the network)")
                lines.append(f"  dp {i}: TP group ranks {group} on host "
                             f"{', '.join(hosts)}, {where}")
        else:
            for r, p in enumerate(self.places):
                lines.append(f"  rank {r}: host {p.host}, NVLink domain {p.nvlink}, slot "
                             f"{p.slot}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.describe()


def mesh_plan(mesh: Mapping[str, int] | None, places: Sequence[RankPlace]) -> MeshPlan:
    """The mesh of a generation placed on ``places`` (rank order). No ``mesh``: one "dp"
    dimension over every rank."""
    world = len(places)
    if not mesh:
        return MeshPlan(("dp",), (world,), tuple(places))
    dims = validate_mesh(mesh, world)
    names = tuple(n for n in MESH_DIMS if n in mesh or n == "dp")
    return MeshPlan(names, tuple(dims[n] for n in names), tuple(places))
