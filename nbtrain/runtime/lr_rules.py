"""Learning-rate scaling with the world size, for jobs whose per-rank batch is fixed.

When the global batch grows with the number of ranks, the LR usually has to follow: linearly
(Goyal et al., 2017: "Accurate, Large Minibatch SGD") or by the square root (common for
adaptive optimizers). The factor is applied relative to the one already applied, so after a
restore (whose optimizer state carries the old size's LR) or a resize it lands on the same
LR a fresh run at that size would have, keeping any decay an LR scheduler applied.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["RULES", "LRScaling", "lr_factor"]

RULES = ("linear", "sqrt")
_KEY = "nbtrain_lr_factor"  # the factor applied, stored in each param group (checkpointed)


def lr_factor(rule: str, world_size: int, base_world_size: int) -> float:
    """``world_size / base_world_size`` (linear) or its square root (sqrt)."""
    if rule not in RULES:
        raise ValueError(f"LR scaling rule must be one of {', '.join(RULES)}, got {rule!r}")
    ratio = world_size / base_world_size
    return ratio if rule == "linear" else math.sqrt(ratio)


class LRScaling:
    """Keeps an optimizer's LR (and an LR scheduler's base LRs) scaled for the world size."""

    def __init__(self, optimizer: torch.optim.Optimizer, rule: str, base_world_size: int, *,
                 scheduler: Any = None) -> None:
        lr_factor(rule, 1, 1)  # validates the rule
        if base_world_size < 1:
            raise ValueError(f"base_world_size must be >= 1, got {base_world_size}")
        self.optimizer = optimizer
        self.rule = rule
        self.base_world_size = base_world_size
        self.scheduler = scheduler

    def apply(self, world_size: int) -> float:
        """Scale to ``world_size``; returns the factor (relative to the base size)."""
        factor = lr_factor(self.rule, world_size, self.base_world_size)
        bases = getattr(self.scheduler, "base_lrs", None)
        for i, group in enumerate(self.optimizer.param_groups):
            change = factor / float(group.get(_KEY, 1.0))
            group["lr"] = group["lr"] * change
            if "initial_lr" in group:
                group["initial_lr"] = group["initial_lr"] * change
            if isinstance(bases, list) and i < len(bases):
                bases[i] = bases[i] * change
            group[_KEY] = factor
        return factor
