"""Checkpoints inside the rank loop: what goes in, when, and restoring from one.

A shard holds the recipe's state (``setup``'s return value, each object's ``state_dict()``)
plus this rank's RNG states, the global data position and the step. The policy decides *when*;
``every_steps`` is deterministic across ranks, while time-based and auto decisions are agreed
at the control agreement (a MAX over ranks), so every rank checkpoints the same step.

Checkpoints are written in DCP's layout (format 2, :mod:`nbtrain.runtime.dcp_write`): the
tracked state as DCP state dicts (:mod:`nbtrain.runtime.dcp_state`), replicated tensors once,
sharded ones (FSDP, TP) by their owners; each rank's own file holds its RNG states, the data
position and the step.

Restore: the ranks exchange what each sees in each restore source and choose one source and
the steps all of them see (:mod:`nbtrain.core.restore_choice`); they load the newest of those,
and fall back together (a MAX all-reduce of how each load went) when one of them could not,
so no rank resumes from a different step or source, and every rank makes the same calls.

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

import logging
import socket
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from nbtrain.core.checkpoint_policy import CheckpointPolicy
from nbtrain.core.restore_choice import (
    STEPS_SHOWN,
    ProbeReport,
    RankView,
    RestoreError,
    choose_restore,
    storage_problem,
)
from nbtrain.runtime.async_ckpt import AsyncCheckpointer, SaveResult
from nbtrain.runtime.dcp_read import load_into
from nbtrain.runtime.dcp_state import apply_dcp_state, has_sharded_params, to_dcp_state
from nbtrain.runtime.launch import CheckpointPlan
from nbtrain.runtime.loader import PositionedLoader
from nbtrain.runtime.rng import capture_rng_state, restore_rng_state, seed_rng
from nbtrain.runtime.snapshot import SnapshotError, load_state
from nbtrain.runtime.storage import CheckpointError, CheckpointStore, Manifest

__all__ = ["CheckpointPlan", "RankCheckpointing"]

logger = logging.getLogger(__name__)

#: How one rank's load of a candidate step went (the ranks take the worst, by MAX).
LOAD_OK, LOAD_SKIP, LOAD_MISFIT = 0, 1, 2


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
        self.attempt = f"g{generation}"  # this generation's saves and storage probes
        self.writer = AsyncCheckpointer(
            self.store, rank=rank, world_size=world_size, attempt=self.attempt,
            job=job, on_event=on_event, commit_timeout_s=plan.commit_timeout_s,
            layout="dcp", mesh_dims=mesh_dims,
        )
        self.last_saved_step = -1
        #: Extra plain data for this rank's own file (the knobs in force and their history).
        self.meta_hook: Callable[[], dict[str, Any]] | None = None
        #: This rank's meta of the checkpoint it restored (empty: a fresh start).
        self.restored_meta: dict[str, Any] = {}
        #: The checkpoint restored is the job's own (not a ``resume=`` source).
        self.restored_own = False

    def bind(self, state: dict[str, Any], loader: PositionedLoader | None) -> None:
        """What checkpoints hold, known when the training loop starts."""
        self.state = state
        self.loader = loader

    # -- restore ----------------------------------------------------------------------------
    def restore(self) -> tuple[int, list[tuple[int, str]]]:
        """Load the checkpoint every rank agrees on; returns (step, skipped) - step 0 when
        starting fresh. Collective: every rank takes part in the same calls whatever it found
        (``nbtrain.core.restore_choice``), so no rank hangs and none keeps a state the others
        do not have. Raises CheckpointError (every rank together) when no checkpoint every
        rank can load exists, or when the ranks do not see the same storage."""
        sources = list(self.plan.restore_from)
        host = socket.gethostname()
        write_error = self.store.write_probe(self.attempt, self.rank)
        mine = RankView(self.rank, host, tuple(self._committed(url, at) for url, at in sources))
        views: list[Any] = [None] * self.world_size
        dist.all_gather_object(views, mine)  # also the barrier: every probe is written now
        self._check_storage(host, write_error)
        try:
            choice = choose_restore(sources, views)  # the same on every rank
        except RestoreError as exc:
            raise CheckpointError(sources[0][0], str(exc)) from None
        if choice is None:
            return 0, []
        url = sources[choice.source][0]
        self.restored_own = choice.source == 0
        store = CheckpointStore(url, keep=self.plan.keep)
        skipped: list[tuple[int, str]] = []
        for step in choice.steps:
            outcome, loaded, why = LOAD_OK, None, ""
            try:
                loaded = self._load(store, step)
            except SnapshotError as exc:  # does not fit the tracked state: older ones neither
                outcome, why = LOAD_MISFIT, str(exc)
            except Exception as exc:  # corrupt, partial or unreadable: try an older one
                outcome, why = LOAD_SKIP, str(exc) if isinstance(exc, CheckpointError) else (
                    f"{store.step_url(step)}: {type(exc).__name__}: {exc}")
            # (every rank reaches this all-reduce, whatever its load did)
            worst = torch.tensor([outcome], dtype=torch.int64, device=_collective_device())
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
            if int(worst) == LOAD_OK:
                assert loaded is not None
                self._resume_at(step, *loaded)
                return step, skipped
            if outcome == LOAD_MISFIT:
                raise SnapshotError(why)
            if int(worst) == LOAD_MISFIT:
                raise CheckpointError(store.step_url(step), "another rank could not load this "
                                      "checkpoint into its tracked state (its error says why)")
            skipped.append((step, why or "another rank could not load it"))
        raise CheckpointError(url, "no checkpoint every rank could load: " + "; ".join(
            f"step {s}: {why}" for s, why in skipped))

    def _check_storage(self, host: str, write_error: str) -> None:
        """Every rank sees every rank's probe file in the job's directory, or every rank
        raises, naming who saw what (commits would otherwise wait out their timeout)."""
        try:
            unseen = () if write_error else tuple(self.store.unseen_probes(
                self.attempt, range(self.world_size)))
        except Exception as exc:  # reported with the others', after the gather
            write_error, unseen = f"cannot list it: {type(exc).__name__}: {exc}", ()
        if self.rank == 0:
            self._cleanup_at_start()  # while every rank waits in the gather below
        reports: list[Any] = [None] * self.world_size
        dist.all_gather_object(reports, ProbeReport(self.rank, host, write_error, unseen))
        self.store.remove_probe(self.attempt, self.rank)
        problem = storage_problem(self.plan.url, reports)
        if problem:
            raise CheckpointError(self.plan.url, problem)

    def _cleanup_at_start(self) -> None:
        """Remove the job's saves that never committed (and stale probe files): no rank of
        this generation is saving yet, and one of an ended generation cannot commit."""
        try:
            removed = self.store.cleanup_incomplete(start_of=self.attempt)
        except Exception as exc:  # housekeeping: never fails a start
            logger.warning("nbtrain rank %d: cleaning up %s failed: %s: %s", self.rank,
                           self.plan.url, type(exc).__name__, exc)
            return
        if removed:
            logger.info("nbtrain rank %d: removed %d uncommitted checkpoint paths under %s",
                        self.rank, len(removed), self.plan.url)

    def _committed(self, url: str, at: int | None) -> tuple[int, ...]:
        """This rank's view of one source: its committed steps at or before ``at``."""
        try:
            steps = CheckpointStore(url, keep=self.plan.keep).committed()
        except Exception:  # unreadable here: this rank sees nothing there (named if it matters)
            return ()
        return tuple(s for s in steps if at is None or s <= at)[:STEPS_SHOWN]

    def _load(self, store: CheckpointStore, step: int) -> tuple[dict[str, Any], int]:
        """Load one committed checkpoint into the tracked state: this rank's meta and the
        rank whose own file it read."""
        manifest = store.read_manifest(step)
        shard = self.rank % manifest.world_size
        if manifest.sharded:
            return self._load_sharded(store, manifest, shard), shard
        return self._load_full_copy(store, manifest, shard), shard

    def _resume_at(self, step: int, meta: dict[str, Any], shard_rank: int) -> None:
        """The data position, RNG and policy of a loaded checkpoint."""
        self.restored_meta = dict(meta)
        if self.loader is not None and "data" in meta:
            self.loader.load_state_dict(meta["data"])
        if "rng" in meta and shard_rank == self.rank:
            restore_rng_state(meta["rng"])
        else:
            seed_rng(self.seed, step, self.rank)
        every = self.every_steps  # the knob's, when one set it: kept
        self.policy = CheckpointPolicy(self.plan.policy, now=time.monotonic(), step=step)
        self.policy.set_every_steps(every)
        self.last_saved_step = step

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

    # -- save -------------------------------------------------------------------------------
    @property
    def every_steps(self) -> int | None:
        """The step interval in force: the plan's, until the ``checkpoint_every`` knob
        changes it (:meth:`set_every_steps`)."""
        return self.policy.every_steps

    def set_every_steps(self, value: float) -> None:
        """The ``checkpoint_every`` knob (0: none by steps). Every rank applies it at the
        same step boundary (after this boundary's own decision), so the deterministic
        checkpoints stay the same steps on every rank."""
        self.policy.set_every_steps(int(value))

    def deterministic_due(self, step: int) -> bool:
        n = self.every_steps
        return n is not None and step % n == 0

    def locally_due(self, step: int) -> bool:
        """Time-based / auto decisions: contributed to the agreement, not acted on alone
        (the step interval's multiples are :meth:`deterministic_due`'s)."""
        return self.policy.time_due(step, time.monotonic())

    def save(self, step: int) -> SaveResult | None:
        if step == self.last_saved_step:
            return None
        meta: dict[str, Any] = {"rng": capture_rng_state(), "step": step}
        if self.loader is not None:
            meta["data"] = self.loader.state_dict()
        if self.meta_hook is not None:
            meta.update(self.meta_hook())
        # Only the live tensors' references: the writer copies what this rank writes.
        result = self.writer.save(step, to_dcp_state(self.state), meta,
                                  manifest_metadata={"step": step})
        self.policy.record(step, time.monotonic(), cost_s=result.stall_s)
        self.last_saved_step = step
        return result

    def finish(self, timeout: float | None = None) -> SaveResult | None:
        """Wait for the checkpoint in flight (persisted, and committed on the committer). One
        that takes longer than ``timeout`` is abandoned (fenced: it can no longer commit) and
        reported as an uncommitted result, never raised."""
        try:
            self.writer.wait(timeout)
        except TimeoutError:
            note = self.writer.abandon(timeout=1.0)
            step = self.last_saved_step
            error = (f"the checkpoint at step {step} did not persist and commit within "
                     f"{timeout:g} s")
            return SaveResult(step=step, bytes=0, blocking_s=0.0, wait_s=0.0, error=error,
                              phase="timeout" if not note else f"timeout ({note})")
        return self.writer.close(timeout)

    def abandon(self) -> None:
        """After a failure: never raises, so the rank's own failure reaches the controller
        and the rest of its cleanup runs (``AsyncCheckpointer.abandon``)."""
        note = self.writer.abandon(timeout=5.0)
        if note:
            logger.warning("nbtrain rank %d: %s", self.rank, note)


def _collective_device() -> torch.device:
    """Where a small agreement tensor must live for the default process group (NCCL takes
    CUDA tensors only)."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
