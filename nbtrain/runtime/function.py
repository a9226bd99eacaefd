"""A training function as the unit of work: ``train(ctx, config)``, the user's own loop.

``cluster.submit(train, world_size=4, config={"lr": 1e-3})`` pickles a :class:`TrainFunction`
(the function and its config) where a ``Recipe`` would go; every rank calls it with its
:class:`~nbtrain.runtime.context.RankContext`. The value rank 0's call returns is the job's
result (``job.result()``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["TrainFunction"]


@dataclass(frozen=True)
class TrainFunction:
    fn: Callable[..., Any]
    config: Mapping[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return str(getattr(self.fn, "__name__", "train"))
