"""Which checkpoint a generation restores: one source and one step for every rank.

Each rank lists what it sees in each restore source (the job's own directory first, then a
``resume=`` source), the ranks exchange those lists, and every rank runs :func:`choose_restore`
on the same lists, so all make the same choice without a further round:

- the first source in which some rank sees a committed checkpoint is the one; its candidate
  steps are those *every* rank sees there, newest first (the ranks then load the newest they
  all can, falling back together);
- a source in which some ranks see checkpoints and others see none, or that has no step all of
  them see, is not skipped for the next one (that would silently lose progress): it is an
  error naming what each rank saw, because the ranks do not share one storage;
- no rank sees anything anywhere: a fresh start, unless a ``resume=`` source was given (it
  held a checkpoint when the job was submitted), or a pinned step is gone: those are errors.

Pure: no I/O, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["ProbeReport", "RankView", "RestoreChoice", "RestoreError", "choose_restore",
           "storage_problem"]

#: Committed steps a rank reports per source (the newest): enough to fall back past a few
#: corrupt ones, small enough to exchange.
STEPS_SHOWN = 16


class RestoreError(ValueError):
    """The ranks cannot restore one checkpoint together: what each saw, and the fix."""


@dataclass(frozen=True)
class RankView:
    """What one rank sees: per restore source, its committed steps (newest first, at most
    ``STEPS_SHOWN``; only steps at or before the source's bound)."""

    rank: int
    host: str
    steps: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class RestoreChoice:
    source: int  # index into the plan's sources
    steps: tuple[int, ...]  # steps every rank sees there, newest first


def choose_restore(sources: Sequence[tuple[str, int | None]],
                   views: Sequence[RankView]) -> RestoreChoice | None:
    """The source and candidate steps every rank restores from; None for a fresh start.
    Raises :class:`RestoreError`."""
    for i, (url, pinned) in enumerate(sources):
        seen = [set(v.steps[i]) if i < len(v.steps) else set() for v in views]
        if not any(seen):
            continue
        common = set.intersection(*seen)
        if pinned is not None and pinned not in common:
            raise RestoreError(
                f"the pinned resume step {pinned} of {url} is not there for every rank now "
                f"({_what_each_saw(views, i)}): it was pruned or deleted after the job was "
                "submitted; submit again with another step, or resume='latest'")
        if not common:
            raise RestoreError(
                f"the ranks do not see the same checkpoints in {url} "
                f"({_what_each_saw(views, i)}), so they cannot restore one state together: "
                "every worker must see the checkpoint storage the same way (a shared "
                "filesystem mounted at the same path on every host, or an object store URL "
                "as checkpoint_root)")
        return RestoreChoice(i, tuple(sorted(common, reverse=True)))
    if len(sources) > 1:
        url, _ = sources[-1]
        raise RestoreError(
            f"resume source {url} held a committed checkpoint when the job was submitted but "
            "holds none now (pruned or deleted while the job waited); submit again with "
            "another source, or without resume= for a fresh start")
    return None


@dataclass(frozen=True)
class ProbeReport:
    """One rank's part of the storage check at a generation's start: whether it could write
    its probe file into the job's checkpoint directory, and whose probes it cannot see."""

    rank: int
    host: str
    write_error: str
    unseen: tuple[int, ...]


def storage_problem(url: str, reports: Sequence[ProbeReport]) -> str:
    """What is wrong with checkpoint storage that not every rank sees the same ("" if
    nothing): every rank must see what every other rank writes, or commits wait for files
    they cannot see and restores diverge."""
    parts = [f"rank {r.rank} on {r.host} could not write there ({r.write_error})"
             for r in sorted(reports, key=lambda r: r.rank) if r.write_error]
    parts += [f"rank {r.rank} on {r.host} does not see the files of ranks "
              f"{', '.join(map(str, r.unseen))}"
              for r in sorted(reports, key=lambda r: r.rank) if r.unseen and not r.write_error]
    if not parts:
        return ""
    return (f"the ranks do not share the checkpoint storage {url}: " + "; ".join(parts)
            + ". Every worker must see it the same way: a shared filesystem mounted at the "
            "same path on every host, or an object store URL as checkpoint_root (a local "
            "path or memory:// works only for one process)")


def _what_each_saw(views: Sequence[RankView], source: int) -> str:
    parts = []
    for v in sorted(views, key=lambda v: v.rank):
        steps = v.steps[source] if source < len(v.steps) else ()
        shown = ", ".join(map(str, steps[:4])) + (", ..." if len(steps) > 4 else "")
        parts.append(f"rank {v.rank} on {v.host}: {'steps ' + shown if steps else 'none'}")
    return "; ".join(parts)
