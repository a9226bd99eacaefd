"""Checkpoints inside the rank loop: what goes in, when, and restoring from one.

A shard holds the recipe's state (``setup``'s return value, each object's ``state_dict()``)
plus this rank's RNG states, the global data position and the step. The policy decides *when*;
``every_steps`` is deterministic across ranks, while time-based and auto decisions are agreed
at the control agreement (a MAX over ranks), so every rank checkpoints the same step.

Restore: each rank loads the newest committed checkpoint it can verify at or before the step
the engine names; the ranks then agree (MIN/MAX all-reduce) on one step, falling back together
if one of them could not load the newest, so no rank resumes from a different step.

At another world size (an elastic resize, a recovery on fewer slots) the data-parallel state
is the same in every shard, so rank r reads shard ``r % old world size``; the global data
position is re-partitioned over the new ranks by the loader. RNG: a rank that existed when the
checkpoint was taken restores its own RNG states; a new rank seeds torch, numpy and ``random``
from (job seed, step, rank), so a run is reproducible for a given sequence of sizes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from nbtrain.core.checkpoint_policy import CheckpointPolicy
from nbtrain.runtime.async_ckpt import AsyncCheckpointer, SaveResult
from nbtrain.runtime.launch import CheckpointPlan
from nbtrain.runtime.loader import PositionedLoader
from nbtrain.runtime.rng import capture_rng_state, restore_rng_state, seed_rng
from nbtrain.runtime.snapshot import load_state
from nbtrain.runtime.storage import CheckpointStore

__all__ = ["CheckpointPlan", "RankCheckpointing"]


class RankCheckpointing:
    def __init__(self, plan: CheckpointPlan, *, rank: int, world_size: int, generation: int,
                 job: dict[str, Any], on_event: Callable[[str, dict[str, Any]], None],
                 seed: int = 0,
                 state: dict[str, Any] | None = None,
                 loader: PositionedLoader | None = None) -> None:
        self.plan = plan
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.state: dict[str, Any] = state if state is not None else {}
        self.loader = loader
        self.store = CheckpointStore(plan.url, keep=plan.keep)
        self.policy = CheckpointPolicy(plan.policy, now=time.monotonic())
        self.writer = AsyncCheckpointer(
            self.store, rank=rank, world_size=world_size, attempt=f"g{generation}",
            job=job, on_event=on_event, commit_timeout_s=plan.commit_timeout_s,
        )
        self.last_saved_step = -1

    def bind(self, state: dict[str, Any], loader: PositionedLoader | None) -> None:
        """What checkpoints hold, known when the training loop starts."""
        self.state = state
        self.loader = loader

    # -- restore ----------------------------------------------------------------------------
    def restore(self) -> tuple[int, list[tuple[int, str]]]:
        """Load the agreed newest committed checkpoint; returns (step, skipped) — step 0 when
        starting fresh."""
        chosen = self._restore_source()
        if chosen is None:
            return 0, []
        source, at = chosen
        skipped: list[tuple[int, str]] = []
        while True:
            result = source.restore_latest(self.rank, world_size=self.world_size,
                                           verify_all=False, at_or_before=at)
            if result is not None:
                skipped.extend(result.skipped)
            step = result.step if result is not None else 0
            agreed = torch.tensor([step, -step], dtype=torch.int64)
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
            hi, lo = int(agreed[0]), -int(agreed[1])
            if hi == lo:
                break
            at = lo  # someone could not load the newest: everyone falls back to its step
            if lo == 0:
                result, step = None, 0
                break
        if result is None or step == 0:
            return 0, skipped
        payload = result.payload
        load_state(self.state, payload["state"])
        meta = payload["meta"]
        if self.loader is not None and "data" in meta:
            self.loader.load_state_dict(meta["data"])
        assert result is not None
        if "rng" in meta and result.shard_rank == self.rank:
            restore_rng_state(meta["rng"])
        else:
            seed_rng(self.seed, step, self.rank)
        self.policy = CheckpointPolicy(self.plan.policy, now=time.monotonic(), step=step)
        self.last_saved_step = step
        return step, skipped

    def _restore_source(self) -> tuple[CheckpointStore, int | None] | None:
        """The first of the plan's sources that holds a committed checkpoint (the job's own
        directory once it has one, else the ``resume=`` source). Every rank reads the same
        shared storage after the previous generation ended, so every rank picks the same."""
        for url, at in self.plan.restore_from:
            store = CheckpointStore(url, keep=self.plan.keep)
            committed = [s for s in store.committed() if at is None or s <= at]
            if committed:
                return store, at
        return None

    # -- save -------------------------------------------------------------------------------
    def deterministic_due(self, step: int) -> bool:
        n = self.plan.policy.every_steps
        return n is not None and step % n == 0

    def locally_due(self, step: int) -> bool:
        """Time-based / auto decisions: contributed to the agreement, not acted on alone."""
        return self.policy.due(step, time.monotonic())

    def save(self, step: int) -> SaveResult | None:
        if step == self.last_saved_step:
            return None
        meta: dict[str, Any] = {"rng": capture_rng_state(), "step": step}
        if self.loader is not None:
            meta["data"] = self.loader.state_dict()
        # The snapshotter calls each object's state_dict() itself.
        result = self.writer.save(step, self.state, meta,
                                  manifest_metadata={"step": step})
        self.policy.record(step, time.monotonic(), cost_s=result.stall_s)
        self.last_saved_step = step
        return result

    def finish(self, timeout: float | None = None) -> SaveResult | None:
        """Wait for the checkpoint in flight (persisted, and committed on the committer)."""
        return self.writer.close(timeout)

    def abandon(self) -> None:
        self.writer.close(timeout=5.0, cancel=True)
