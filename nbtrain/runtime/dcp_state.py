"""What a checkpoint holds, as ``torch.distributed.checkpoint`` state dicts, and back.

The tracked state (``ctx.track(...)`` or a Recipe's ``setup`` return value) holds live
objects. For a checkpoint in DCP's layout they become DCP state dicts, the form torch's
distributed checkpoint API defines and reshards:

- a module: ``get_model_state_dict`` (no DDP ``module.`` prefix; DTensor shards under FSDP
  and TP), loaded back with ``set_model_state_dict``;
- an optimizer: ``get_optimizer_state_dict`` against the tracked module that holds its
  parameters (state keyed by parameter name, so it follows the parameters to another
  sharding), loaded back with ``set_optimizer_state_dict``;
- any other object with ``state_dict()``/``load_state_dict()`` (LR scheduler, ...): its
  state dict;
- tensors, dicts, lists and plain values as they are (tensors are copied into in place).

Plain tensors are data-parallel replicas (saved once, see :mod:`nbtrain.runtime.dcp_write`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from nbtrain.runtime.snapshot import SnapshotError, find_in_state, load_state

__all__ = ["apply_dcp_state", "has_sharded_params", "to_dcp_state"]


def _modules(state: Any) -> list[torch.nn.Module]:
    return find_in_state(state, (torch.nn.Module,))


def _owner(opt: torch.optim.Optimizer, modules: list[torch.nn.Module],
           where: str) -> torch.nn.Module:
    wanted = {id(p) for g in opt.param_groups for p in g["params"]}
    for m in modules:
        if wanted <= {id(p) for p in m.parameters()}:
            return m
    raise SnapshotError(
        f"{where}: the optimizer's parameters are not all in one tracked module; checkpoints "
        "key optimizer state by parameter name, so track the module it trains as well, e.g. "
        "ctx.track(model=model, optimizer=opt)")


def to_dcp_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """The DCP state dict of the tracked ``state`` (tensors are the live ones, not copies)."""
    modules = _modules(state)

    def conv(obj: Any, where: str) -> Any:
        if isinstance(obj, torch.nn.Module):
            return get_model_state_dict(obj)
        if isinstance(obj, torch.optim.Optimizer):
            return get_optimizer_state_dict(_owner(obj, modules, where), obj)
        if isinstance(obj, torch.Tensor):
            return obj
        if isinstance(obj, Mapping):
            keys = [str(k) for k in obj]
            if len(set(keys)) != len(keys):
                raise SnapshotError(f"{where} has keys that are equal as strings ({keys}); "
                                    "checkpoint keys are names")
            return {str(k): conv(v, f"{where}[{k!r}]") for k, v in obj.items()}
        if isinstance(obj, (list, tuple)) and not isinstance(obj, torch.Size):
            return [conv(v, f"{where}[{i}]") for i, v in enumerate(obj)]
        state_dict = getattr(obj, "state_dict", None)
        if callable(state_dict):
            return state_dict()
        return obj

    return {str(k): conv(v, f"state[{k!r}]") for k, v in state.items()}


def apply_dcp_state(state: dict[str, Any], loaded: Mapping[str, Any]) -> None:
    """Put a loaded DCP state dict (``to_dcp_state``'s shape) back into the live objects."""
    modules = _modules(state)

    def put(target: Any, saved: Any, where: str) -> Any:
        if isinstance(target, torch.nn.Module):
            set_model_state_dict(target, saved)
            return target
        if isinstance(target, torch.optim.Optimizer):
            set_optimizer_state_dict(_owner(target, modules, where), target, saved)
            return target
        if isinstance(target, torch.Tensor):
            return load_state(target, saved)
        if isinstance(target, Mapping):
            restored = {k: put(v, saved[str(k)], f"{where}[{k!r}]") for k, v in target.items()}
            if isinstance(target, dict):
                target.update(restored)
                return target
            return restored
        if isinstance(target, (list, tuple)) and not isinstance(target, torch.Size):
            items = [put(t, s, f"{where}[{i}]")
                     for i, (t, s) in enumerate(zip(target, saved, strict=True))]
            if isinstance(target, list):
                target[:] = items
                return target
            return tuple(items)
        load = getattr(target, "load_state_dict", None)
        if callable(load):
            load(saved)
            return target
        return saved

    for k in list(state):
        state[k] = put(state[k], loaded[str(k)], f"state[{k!r}]")


def has_sharded_params(state: Any) -> bool:
    """Whether a tracked module holds DTensor parameters (FSDP or TP)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for m in _modules(state) for p in m.parameters())
