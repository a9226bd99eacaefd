"""Move a batch to the rank's device, keeping its type: tensors inside lists, tuples,
namedtuples, dicts, other mappings (an HF ``BatchEncoding``), and dataclasses, to any depth.
Anything else (strings, numbers, ``None``) passes through unchanged."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping, MutableMapping
from typing import Any

import torch

__all__ = ["to_device"]


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor in it on ``device`` (a no-op for CPU tensors on CPU)."""
    if isinstance(batch, torch.Tensor):
        return batch if batch.device == device else batch.to(device, non_blocking=True)
    if isinstance(batch, (str, bytes)):
        return batch
    if isinstance(batch, Mapping):
        moved = {k: to_device(v, device) for k, v in batch.items()}
        if isinstance(batch, MutableMapping):
            clone = copy.copy(batch)  # keeps the mapping's type and its other attributes
            clone.update(moved)
            return clone
        try:
            return type(batch)(moved)  # type: ignore[call-arg]
        except TypeError:
            return moved
    if isinstance(batch, tuple) and hasattr(type(batch), "_fields"):  # a namedtuple
        return type(batch)(*(to_device(v, device) for v in batch))
    if isinstance(batch, (list, tuple)):
        items = [to_device(v, device) for v in batch]
        try:
            return type(batch)(items)
        except TypeError:
            return items if isinstance(batch, list) else tuple(items)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        record = copy.copy(batch)
        for f in dataclasses.fields(batch):
            # object.__setattr__: a frozen dataclass's fields too
            object.__setattr__(record, f.name, to_device(getattr(batch, f.name), device))
        return record
    return batch
