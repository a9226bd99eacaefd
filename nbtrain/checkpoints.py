"""The trained model back in the notebook: read a job's checkpoints as plain state dicts.

>>> ckpt = nbtrain.load_checkpoint(job)                # or a checkpoint directory / step URL
>>> model.load_state_dict(ckpt.state["model"])         # no DDP "module." prefix
>>> ckpt.step, ckpt.metadata["job"]["name"]
>>> nbtrain.export_checkpoint(job, "model.pt")         # one plain torch.save file

A checkpoint holds what the job tracked (``ctx.track(model=..., optimizer=...)`` or what a
Recipe's ``setup`` returned) plus nbtrain's own meta (data position, RNG, step). Sharded
state (FSDP, TP) is put back together into full tensors: ``state["model"]`` loads into the
plain, unwrapped model. The optimizer's state is keyed by parameter name (DCP's form, which
is what lets it reshard); load it into a plain optimizer with
``torch.distributed.checkpoint.state_dict.set_optimizer_state_dict(model, opt,
ckpt.state["optimizer"])``. Checksums are verified and files load with
``weights_only=True``, as when a job restores. Checkpoints of format 1 (before sharded
checkpoints) read rank 0's full copy, with the optimizer state as ``optimizer.state_dict()``
gives it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nbtrain.runtime.dcp_read import load_full
from nbtrain.runtime.storage import CheckpointError, CheckpointStore, split_checkpoint_url

__all__ = ["Checkpoint", "export_checkpoint", "load_checkpoint"]

_DDP_PREFIX = "module."


@dataclass(frozen=True)
class Checkpoint:
    """One committed checkpoint, read back."""

    step: int
    state: dict[str, Any]  # tracked name -> its state dict (model weights without "module.")
    meta: dict[str, Any]  # nbtrain's: data position, RNG states, step
    metadata: dict[str, Any]  # the manifest's: job spec, world size, sizes, created
    url: str


def load_checkpoint(source: Any, step: int | str = "latest") -> Checkpoint:
    """Read a committed checkpoint of a job (a ``JobHandle``), a job's checkpoint directory,
    or one ``step-XXXXXXXX`` directory in it. ``step``: "latest" or a step number."""
    url, pinned = _resolve(source)
    store = CheckpointStore(url)
    committed = store.committed()
    if pinned is not None:
        step = pinned
    if step == "latest":
        if not committed:
            raise ValueError(f"{url} holds no committed checkpoint (a job checkpoints when it "
                             "ends, on stop and preemption, and as its checkpoint= policy says)")
        chosen = committed[0]  # newest first
    else:
        if not isinstance(step, int) or step not in committed:
            have = ", ".join(map(str, sorted(committed, reverse=True)[:8])) or "none"
            raise ValueError(f"{url} has no committed checkpoint of step {step!r}; committed "
                             f"steps: {have}")
        chosen = step
    manifest = store.read_manifest(chosen)
    payload = store.load_shard(chosen, 0, manifest=manifest)
    if manifest.sharded:
        state = load_full(store.dcp_reader(manifest))
    elif not isinstance(payload, Mapping) or "state" not in payload:
        raise CheckpointError(manifest.path, "the shard holds no tracked state")
    else:
        state = {str(k): _plain(v) for k, v in dict(payload["state"]).items()}
    metadata = {"job": dict(manifest.job), "world_size": manifest.world_size,
                "bytes": manifest.bytes, "created_unix": manifest.created_unix,
                "format": manifest.version, **dict(manifest.metadata)}
    return Checkpoint(step=chosen, state=state, meta=dict(payload.get("meta", {})),
                      metadata=metadata, url=store.step_url(chosen))


def export_checkpoint(source: Any, path: str | Path, step: int | str = "latest") -> Path:
    """Write a checkpoint's tracked state (plain state dicts) as one ``torch.save`` file."""
    ckpt = load_checkpoint(source, step)
    out = Path(path)
    torch.save({"step": ckpt.step, "state": ckpt.state, "metadata": ckpt.metadata}, out)
    return out


def _resolve(source: Any) -> tuple[str, int | None]:
    directory = getattr(source, "checkpoint_dir", None)
    if isinstance(directory, str):
        if not directory:
            raise ValueError(f"job {getattr(source, 'name', '?')} has no checkpoint directory")
        return directory, None
    if isinstance(source, str | Path):
        return split_checkpoint_url(str(source))
    raise TypeError(f"load_checkpoint takes a JobHandle or a checkpoint URL/path, got "
                    f"{type(source).__name__}")


def _plain(state: Any) -> Any:
    """A module's state dict without DistributedDataParallel's ``module.`` prefix (every key
    has it, or the dict is left as it is)."""
    if isinstance(state, Mapping) and state and all(
            isinstance(k, str) and k.startswith(_DDP_PREFIX) for k in state):
        return {k[len(_DDP_PREFIX):]: v for k, v in state.items()}
    return state
