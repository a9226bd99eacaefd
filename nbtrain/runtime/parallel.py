"""``ctx.prepare``: wrap a model for the job's mesh — DDP, FSDP2, or TP + FSDP2 — with
optional bf16 mixed precision and ``torch.compile``.

Strategies:

- ``"ddp"``: ``DistributedDataParallel`` over every rank (the mesh must have ``tp == 1``).
- ``"fsdp"``: FSDP2 (``torch.distributed.fsdp.fully_shard``) over every rank: parameters,
  gradients and optimizer state are sharded; each *unit* gathers its parameters for its
  forward and backward and frees them after.
- ``"tp+fsdp"``: tensor parallelism (``parallelize_module`` with ``tp_plan``) on the mesh's
  ``tp`` dimension (ranks placed inside one NVLink domain), then FSDP2 on ``dp``.

**FSDP wrap rule** (:func:`fsdp_units`): the units are the blocks of the model's outermost
``nn.ModuleList`` or ``nn.Sequential`` (searched breadth-first from the model itself) that
hold parameters — a transformer's layers, the layers of a ``Sequential`` MLP; with no such
container, the model's direct children that hold parameters. Each unit is sharded on its
own, then the model as a whole (embeddings, heads and anything else left). Peak memory is
about one unit's full parameters on top of the shards. Pass ``fsdp_units=`` (module
classes, or a predicate ``(name, module) -> bool``) to choose other units.

**Precision** ``"bf16-mixed"``: parameters, gradients' reduction and optimizer state stay in
the model's dtype; the compute runs in bfloat16 — FSDP casts the gathered parameters
(``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``), DDP runs the forward
under ``torch.autocast``. Outputs come back as float32, so the loss is computed in float32.

**compile**: ``torch.compile`` each FSDP unit's forward (or the whole model's under DDP)
before wrapping, in place, so parameter names, state dicts and checkpoints do not change.
Not through ``Module.compile()``: on torch 2.13 it captures nothing (Dynamo skips the
``Module._call_impl`` frame it compiles, as a file in its skip list — ``TORCH_LOGS=+dynamo``
says "skipping: _call_impl"), so the model silently runs eager; compiling the bound
``forward`` is traced.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

from nbtrain.core.mesh import MeshPlan
from nbtrain.runtime.timing import PhaseTimer

__all__ = ["PRECISIONS", "STRATEGIES", "Prepared", "fsdp_units", "prepare_model"]

STRATEGIES = ("ddp", "fsdp", "tp+fsdp")
PRECISIONS = ("fp32", "bf16-mixed")
UnitRule = type | tuple[type, ...] | Callable[[str, nn.Module], bool] | None


@dataclass(frozen=True)
class Prepared:
    """How a model was prepared (for the ``memory`` event and the dashboard)."""

    strategy: str
    precision: str
    compiled: bool
    units: int  # FSDP units (0 under DDP)


def _has_params(m: nn.Module) -> bool:
    return any(True for _ in m.parameters())


def fsdp_units(model: nn.Module, rule: UnitRule = None) -> list[nn.Module]:
    """The modules FSDP shards one by one, in order (see the module docstring)."""
    if rule is not None:
        match: Callable[[str, nn.Module], bool]
        if isinstance(rule, (type, tuple)):
            classes = rule
            match = lambda _name, m: isinstance(m, classes)  # noqa: E731
        else:
            match = rule
        picked: list[tuple[str, nn.Module]] = []
        for name, m in model.named_modules():
            if not name or any(name.startswith(p + ".") for p, _ in picked):
                continue
            if match(name, m) and _has_params(m):
                picked.append((name, m))
        return [m for _, m in picked]
    queue: list[nn.Module] = [model]
    while queue:
        m = queue.pop(0)
        if isinstance(m, (nn.ModuleList, nn.Sequential)):
            return [c for c in m.children() if _has_params(c)]
        queue.extend(m.children())
    return [c for c in model.children() if _has_params(c)]


def _tp_styles(plan: Mapping[str, Any]) -> dict[str, Any]:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
    )

    names: dict[str, Callable[[], Any]] = {"colwise": ColwiseParallel,
                                           "rowwise": RowwiseParallel,
                                           "sequence": SequenceParallel}
    out: dict[str, Any] = {}
    for key, style in plan.items():
        if isinstance(style, str):
            if style not in names:
                raise ValueError(f"tp_plan[{key!r}] = {style!r}: use 'colwise', 'rowwise', "
                                 "'sequence' or a torch.distributed.tensor.parallel style")
            style = names[style]()
        out[key] = style
    return out


def _to_float32(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return out.float() if out.is_floating_point() else out
    if isinstance(out, (list, tuple)):
        return type(out)(_to_float32(o) for o in out)
    if isinstance(out, dict):
        return {k: _to_float32(v) for k, v in out.items()}
    return out


def _autocast_forward(model: nn.Module, device: torch.device) -> None:
    """Run ``model``'s forward under bf16 autocast, returning float32 outputs."""
    forward = model.forward

    @functools.wraps(forward)
    def mixed(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
            out = forward(*args, **kwargs)
        return _to_float32(out)

    model.forward = mixed


def _compile(module: nn.Module) -> None:
    """Compile ``module``'s forward in place (see the module docstring for why not
    ``Module.compile()``)."""
    module.forward = torch.compile(module.forward)


def prepare_model(model: nn.Module, *, mesh: DeviceMesh, plan: MeshPlan,
                  device: torch.device, timer: PhaseTimer, strategy: str = "ddp",
                  precision: str = "fp32", compile: bool = False,
                  tp_plan: Mapping[str, Any] | None = None, fsdp_units_rule: UnitRule = None,
                  ddp_kwargs: Mapping[str, Any] | None = None
                  ) -> tuple[nn.Module, Prepared]:
    """The wrapped model and how it was prepared; raises ``ValueError`` naming the fix."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r}: use one of {', '.join(STRATEGIES)}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: use one of {', '.join(PRECISIONS)}")
    tp = plan.size("tp")
    if strategy == "tp+fsdp":
        if not tp_plan:
            raise ValueError("strategy='tp+fsdp' needs tp_plan={module name: style}, e.g. "
                             "{'0': 'colwise', '2': 'rowwise'} for Sequential(Linear, ReLU, "
                             "Linear)")
    elif tp > 1:
        raise ValueError(f"this job's mesh has tp={tp}: strategy {strategy!r} would run "
                         "every TP rank as a data-parallel replica; use strategy='tp+fsdp' "
                         "with a tp_plan, or submit without tp")
    elif tp_plan:
        raise ValueError(f"tp_plan is for strategy='tp+fsdp' (got strategy={strategy!r})")
    if ddp_kwargs and strategy != "ddp":
        raise ValueError(f"{sorted(ddp_kwargs)} are DistributedDataParallel arguments; "
                         f"strategy={strategy!r} does not use DDP")
    model = model.to(device)
    if strategy == "ddp":
        if precision == "bf16-mixed":
            _autocast_forward(model, device)
        if compile:
            _compile(model)
        device_ids = [device.index] if device.type == "cuda" else None
        ddp = DistributedDataParallel(model, device_ids=device_ids, **dict(ddp_kwargs or {}))
        timer.attach_ddp(ddp)
        return ddp, Prepared(strategy, precision, compile, 0)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dp_mesh = mesh["dp"] if "dp" in (mesh.mesh_dim_names or ()) else mesh
    if strategy == "tp+fsdp":
        from torch.distributed.tensor.parallel import parallelize_module

        assert tp_plan is not None
        parallelize_module(model, mesh["tp"], _tp_styles(tp_plan))
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                   output_dtype=torch.float32)
              if precision == "bf16-mixed" else MixedPrecisionPolicy())
    units = fsdp_units(model, fsdp_units_rule)
    for unit in units:
        if compile:
            _compile(unit)
        fully_shard(unit, mesh=dp_mesh, mp_policy=policy)
        timer.attach_fsdp(unit)
    if compile and not units:
        _compile(model)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy)
    timer.attach_fsdp(model)
    return model, Prepared(strategy, precision, compile, len(units))
