"""A rank's last checkpoint (the one a preemption or resize takes before the ranks exit): one
that cannot commit in time is reported as uncommitted, never raised, and fenced, so it cannot
commit later behind the next generation's back."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from nbtrain.core.checkpoint_policy import (
    PREEMPT_COMMIT_SHARE,
    CheckpointPolicyConfig,
    preemption_commit_s,
)
from nbtrain.runtime.checkpointing import RankCheckpointing
from nbtrain.runtime.launch import CheckpointPlan
from nbtrain.runtime.storage import CheckpointStore


def committer(url: str, *, world_size: int) -> tuple[RankCheckpointing, list[str]]:
    kinds: list[str] = []

    def on_event(kind: str, info: dict[str, Any]) -> None:
        kinds.append(kind)

    plan = CheckpointPlan(url=url, policy=CheckpointPolicyConfig(), commit_timeout_s=60.0,
                          preempt_commit_s=0.5)
    ckpt = RankCheckpointing(plan, rank=0, world_size=world_size, generation=3,
                             job={"name": "j"}, on_event=on_event)
    ckpt.bind({"model": torch.nn.Linear(8, 8)}, None)
    return ckpt, kinds


def test_a_final_commit_that_runs_out_of_time_is_reported_and_fenced(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    ckpt, _ = committer(url, world_size=2)  # rank 1 never writes: the commit waits for it
    assert ckpt.save(7) is not None
    t0 = time.monotonic()
    final = ckpt.finish(timeout=ckpt.plan.final_commit_s("preempted"))
    assert time.monotonic() - t0 < 5.0  # not the 60 s commit timeout
    assert final is not None and not final.committed
    assert final.step == 7 and "did not persist and commit within 0.5 s" in str(final.error)
    # Rank 1's shard turning up late must not make the fenced committer commit.
    late = RankCheckpointing(ckpt.plan, rank=1, world_size=2, generation=3, job={},
                             on_event=lambda kind, info: None)
    late.bind({"model": torch.nn.Linear(8, 8)}, None)
    late.save(7)
    persisted = late.finish(timeout=30)
    assert persisted is not None and persisted.error is None
    time.sleep(1.0)
    assert not CheckpointStore(url).is_committed(7)
    assert CheckpointStore(url).committed() == []


def test_a_final_commit_in_time_commits(tmp_path: Path) -> None:
    ckpt, kinds = committer(str(tmp_path / "ckpt"), world_size=1)
    ckpt.save(4)
    final = ckpt.finish(timeout=ckpt.plan.final_commit_s("preempted"))
    assert final is not None and final.committed and final.error is None
    assert kinds[-1] == "committed"
    assert CheckpointStore(str(tmp_path / "ckpt")).committed() == [4]


@pytest.mark.parametrize(("commit", "grace", "bound"), [
    (100.0, 120.0, 90.0),  # the defaults: 3/4 of the grace
    (30.0, 120.0, 30.0),  # a short commit timeout stays as it is
    (300.0, 10.0, 7.5),  # a long one is cut to fit the grace
])
def test_the_final_commit_always_fits_inside_the_grace(commit: float, grace: float,
                                                       bound: float) -> None:
    assert preemption_commit_s(commit, grace) == pytest.approx(bound)
    assert preemption_commit_s(commit, grace) <= max(0.1, PREEMPT_COMMIT_SHARE * grace)
    plan = CheckpointPlan(url="x", policy=CheckpointPolicyConfig(), commit_timeout_s=commit,
                          preempt_commit_s=preemption_commit_s(commit, grace))
    assert plan.final_commit_s("preempted") == pytest.approx(bound)
    assert plan.final_commit_s("completed") == commit
