"""Checkpoints inside the rank loop: what goes in, when, and restoring from one.

A shard holds the recipe's state (``setup``'s return value, each object's ``state_dict()``)
plus this rank's RNG states, the global data position and the step. The policy decides *when*;
``every_steps`` is deterministic across ranks, while time-based and auto decisions are agreed
at the control agreement (a MAX over ranks), so every rank checkpoints the same step.

Checkpoints are written in DCP's layout (format 2, :mod:`nbtrain.runtime.dcp_write`): the
tracked state as DCP state dicts (:mod:`nbtrain.runtime.dcp_state`), replicated tensors once,
sharded ones (FSDP, TP) by their owners; each rank's own file holds its RNG states, the data
position and the step.

Restore: each rank loads the newest committed checkpoint it can verify at or before the step
the engine names; the ranks then agree (MIN/MAX all-reduce) on one step, falling back together
if one of them could not load the newest, so no rank resumes from a different step.

At another world size or mesh shape (an elastic resize, a recovery on fewer slots, a resume
with another mesh) DCP's load planner reads, for each tensor this rank holds now, the parts
of the saved chunks that overlap it (resharding); rank r reads the own file of rank
``r % old world size`` for the data position, which the loader re-partitions over the new
ranks. RNG: a rank that existed when the checkpoint was taken restores its own RNG states; a
new rank seeds torch, numpy and ``random`` from (job seed, step, rank), so a run is
reproducible for a given sequence of sizes. Checkpoints of format 1 (a full copy per rank)
still restore into DDP jobs, reading shard ``r % old world size``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from nbtrain.core.checkpoint_policy import CheckpointPolicy
from nbtrain.runtime.async_ckpt import AsyncCheckpointer, SaveResult
from nbtrain.runtime.dcp_read import load_into
from nbtrain.runtime.dcp_state import apply_dcp_state, has_sharded_params, to_dcp_state
from nbtrain.runtime.launch import CheckpointPlan
from nbtrain.runtime.loader import PositionedLoader
from nbtrain.runtime.rng import capture_rng_state, restore_rng_state, seed_rng
from nbtrain.runtime.snapshot import SnapshotError, load_state
from nbtrain.runtime.storage import CheckpointError, CheckpointStore, Manifest

__all__ = ["CheckpointPlan", "RankCheckpointing"]


class RankCheckpointing:
    def __init__(self, plan: CheckpointPlan, *, rank: int, world_size: int, generation: int,
                 job: dict[str, Any], on_event: Callable[[str, dict[str, Any]], None],
                 seed: int = 0,
                 state: dict[str, Any] | None = None,
                 loader: PositionedLoader | None = None,
                 mesh_dims: dict[str, tuple[int, int]] | None = None) -> None:
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
            layout="dcp", mesh_dims=mesh_dims,
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
            loaded = self._load_newest(source, at, skipped)
            step = loaded[0] if loaded is not None else 0
            agreed = torch.tensor([step, -step], dtype=torch.int64)
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
            hi, lo = int(agreed[0]), -int(agreed[1])
            if hi == lo:
                break
            at = lo  # someone could not load the newest: everyone falls back to its step
            if lo == 0:
                loaded, step = None, 0
                break
        if loaded is None or step == 0:
            return 0, skipped
        _, meta, shard_rank = loaded
        if self.loader is not None and "data" in meta:
            self.loader.load_state_dict(meta["data"])
        if "rng" in meta and shard_rank == self.rank:
            restore_rng_state(meta["rng"])
        else:
            seed_rng(self.seed, step, self.rank)
        self.policy = CheckpointPolicy(self.plan.policy, now=time.monotonic(), step=step)
        self.last_saved_step = step
        return step, skipped

    def _load_newest(self, store: CheckpointStore, at: int | None,
                     skipped: list[tuple[int, str]]) -> tuple[int, dict[str, Any], int] | None:
        """Load the newest intact committed checkpoint at or before ``at`` into the tracked
        state: (step, this rank's meta, the rank whose own file it read). Corrupt, partial
        and unreadable checkpoints are skipped (and listed); None when there is none."""
        reasons: list[str] = []
        for step in store.committed():
            if at is not None and step > at:
                continue
            try:
                manifest = store.read_manifest(step)
                shard = self.rank % manifest.world_size
                if manifest.sharded:
                    meta = self._load_sharded(store, manifest, shard)
                else:
                    meta = self._load_full_copy(store, manifest, shard)
            except CheckpointError as e:
                if (step, str(e)) not in skipped:
                    skipped.append((step, str(e)))
                reasons.append(str(e))
                continue
            return step, meta, shard
        if reasons:
            raise CheckpointError(store.url, "no loadable checkpoint: " + "; ".join(reasons))
        return None

    def _load_sharded(self, store: CheckpointStore, manifest: Manifest,
                      shard: int) -> dict[str, Any]:
        payload = store.load_shard(manifest.step, shard, manifest=manifest)
        reader = store.dcp_reader(manifest)
        target = to_dcp_state(self.state)
        try:
            load_into(target, reader)
        except (CheckpointError, SnapshotError):
            raise
        except (RuntimeError, ValueError, KeyError) as e:
            raise SnapshotError(
                f"the checkpoint at step {manifest.step} ({store.step_url(manifest.step)}) "
                f"does not fit the tracked state: {e}; restore it with the model and "
                "optimizer that wrote it (the same names and shapes)") from e
        apply_dcp_state(self.state, target)
        return dict(payload.get("meta") or {})

    def _load_full_copy(self, store: CheckpointStore, manifest: Manifest,
                        shard: int) -> dict[str, Any]:
        if has_sharded_params(self.state):
            raise CheckpointError(
                manifest.path,
                "written in nbtrain's checkpoint format 1 (a full copy of a DDP job's state "
                "per rank, before sharded checkpoints), which restores into DDP models only: "
                "resume it with strategy='ddp', let the job checkpoint once (format 2), then "
                "resume that checkpoint with FSDP or TP")
        payload = store.load_shard(manifest.step, shard, manifest=manifest)
        load_state(self.state, payload["state"])
        return dict(payload.get("meta") or {})

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
        # Only the live tensors' references: the writer copies what this rank writes.
        result = self.writer.save(step, to_dcp_state(self.state), meta,
                                  manifest_metadata={"step": step})
        self.policy.record(step, time.monotonic(), cost_s=result.stall_s)
        self.last_saved_step = step
        return result

    def finish(self, timeout: float | None = None) -> SaveResult | None:
        """Wait for the checkpoint in flight (persisted, and committed on the committer)."""
        return self.writer.close(timeout)

    def abandon(self) -> None:
        self.writer.close(timeout=5.0, cancel=True)
