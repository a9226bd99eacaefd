"""Where a job's checkpoints live and what a ``resume=`` value points at (notebook side)."""

from __future__ import annotations

import os
from typing import Any

from fsspec.core import url_to_fs

from nbtrain.runtime.storage import CheckpointError, CheckpointStore, split_checkpoint_url


def absolute_root(root: str) -> str:
    """Local roots become absolute, so worker processes in other directories agree."""
    if "://" in root:
        return root.rstrip("/")
    return os.path.abspath(os.path.expanduser(root))


def job_url(root: str, name: str, job_id: str) -> str:
    return f"{absolute_root(root)}/{_safe(name)}/{job_id}"


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name) or "job"


def resolve_resume(root: str, name: str, resume: str) -> tuple[str, int | None] | None:
    """(checkpoint directory URL, newest step to consider) for ``resume``; None when
    ``resume="latest"`` finds no committed checkpoint of this name (a fresh start).

    Raises ValueError when an explicit path holds no committed checkpoint.
    """
    if resume == "latest":
        base = f"{absolute_root(root)}/{_safe(name)}"
        best: tuple[float, str] | None = None
        fs, path = url_to_fs(base)
        if not fs.exists(path):
            return None
        for entry in fs.ls(path, detail=False):
            url = _with_protocol(base, str(entry))
            try:
                manifests = CheckpointStore(url).manifests()
            except (CheckpointError, OSError):
                continue
            if manifests:
                created = manifests[0].created_unix
                if best is None or created > best[0]:
                    best = (created, url)
        return None if best is None else (best[1], None)
    url, step = split_checkpoint_url(resume)
    store = CheckpointStore(url)
    committed = store.committed()
    if not committed or (step is not None and step not in committed):
        what = f"a committed step {step}" if step is not None else "a committed checkpoint"
        have = ", ".join(map(str, committed[:5])) or "none"
        raise ValueError(
            f"resume={resume!r}: {url} does not hold {what} (committed steps: {have}); "
            "pass a checkpoint directory, one of its step-XXXXXXXX directories, or 'latest'"
        )
    return url, step


def _with_protocol(base: str, entry: str) -> str:
    """A listed path as a URL of the same filesystem as ``base``."""
    if "://" in base:
        proto = base.split("://", 1)[0]
        return f"{proto}://{entry.lstrip('/')}" if proto != "file" else entry
    return entry


def committed_checkpoints(url: str) -> list[dict[str, Any]]:
    """Committed checkpoints of one job directory, newest first, for ``job.checkpoints``."""
    fs, path = url_to_fs(url)
    if not fs.exists(path):
        return []
    store = CheckpointStore(url)
    return [
        {"step": m.step, "bytes": m.bytes, "world_size": m.world_size,
         "created": m.created_unix, "url": store.step_url(m.step)}
        for m in store.manifests()
    ]


__all__ = ["absolute_root", "committed_checkpoints", "job_url", "resolve_resume"]
