"""A knob change that the controller accepted (journaled: ``job.set`` returns once the
controller's durable store has it) but the ranks had not applied when the scheduler died:
after the restart it is applied at one agreed step, the same on every rank, and recorded
once. Real processes (``dask scheduler --preload nbtrain.engine.preload`` SIGKILLed and
started again by the supervisor, ``dask worker`` processes, gloo ranks), and a client that
follows through the outage."""

from __future__ import annotations

from pathlib import Path

import pytest

import nbtrain
from nbtrain import JobState, Settings
from nbtrain.core.knobs import values_at
from nbtrain.engine.remote import NOTICE_WITHIN_S
from nbtrain.engine.standalone import standalone_cluster
from tests import recipes
from tests.conftest import wait_for

HOLD = 30  # the first generation's ranks stop agreeing after this step


def _gen(event: dict[str, object]) -> object:
    """A rank event's generation (its key is being renamed: either spelling)."""
    return event.get("gen", event.get("generation"))


@pytest.mark.slow
def test_a_pending_change_survives_a_scheduler_kill_and_applies_once(tmp_path: Path) -> None:
    # The held ranks make no progress: the hang watchdog must not end them first.
    settings = Settings.load(token_file=str(tmp_path / "tokens.json"), hang_floor_s=600.0)
    with standalone_cluster(2, logs=tmp_path / "logs", supervise=True) as cc, \
            nbtrain.connect(cc.address, settings=settings) as c:
        job = c.submit(recipes.steered_train, world_size=2, steps=120,
                       config={"step_sleep": 0.01, "hold_first_generation_at": HOLD},
                       checkpoint=10, name="pending-knob")
        wait_for(lambda: bool(job.knobs.declared) and job.step >= HOLD, 180,
                 "the job held at its step")
        assert job.generation == 0
        job.set(lr=0.02, aux_weight=0.4, checkpoint_every=20, straggler_ratio=1.5, wait=False)
        # Accepted and journaled when set() returns; its event reaches the handle next.
        wait_for(lambda: len(job.knobs.pending) == 1, 30, "the change's knob_set event")
        [pending] = job.knobs.pending  # not applied: nobody agrees
        assert job.knobs.history == ()
        cc.kill_scheduler(down_s=2 * NOTICE_WITHIN_S)  # an outage the handle surely sees
        wait_for(lambda: job.unreachable_since is not None, 30, "the handle noticing")
        assert job.wait(300) is JobState.SUCCEEDED, job.reason
        assert "controller" in [f["what"] for f in job.faults], job.faults
        assert job.generation >= 1

        # Applied once, by the new generation, at a step after the one it restored.
        resumed = next(e for e in job.events if e.get("kind") == "rank_started"
                       and _gen(e) == job.generation and e.get("rank") == 0)["start_step"]
        [change] = job.knobs.history
        assert change.seq == pending.seq and dict(change.values) == dict(pending.values)
        assert change.step is not None and resumed <= change.step < 120
        assert job.knobs.pending == ()
        applied = [e for e in job.events if e.get("kind") == "knob_applied"]
        assert [[d["seq"] for d in e["changes"]] for e in applied] == [[pending.seq]]
        sets = [e for e in job.events if e.get("kind") == "knob_set"]
        assert [e["change"]["seq"] for e in sets] == [pending.seq]

        # Every rank trained every step of the new generation with the values the history
        # says: the old ones up to the agreed step, the new ones after it.
        state = job.knobs
        defaults = {n: s.default for n, s in state.declared.items()}
        m = job.metrics
        last = m[m["generation"] == job.generation].dropna(subset=["lr"])
        assert set(last["rank"]) == {0, 1} and last["step"].max() == 120
        for _, row in last.iterrows():
            want = values_at(defaults, state.history, int(row["step"]) - 1)
            assert (row["lr"], row["aux"]) == (want["lr"], want["aux_weight"]), (row, want)
        assert (last[last["step"] > change.step]["lr"] == 0.02).all()
        assert (last[last["step"] <= change.step]["lr"] == 0.05).all()
        # The new interval from the agreed step on, on both ranks.
        snaps = {r: [int(e["step"]) for e in job.events if e.get("kind") == "checkpoint"
                     and e.get("phase") == "snapshot" and e.get("rank") == r
                     and _gen(e) == job.generation] for r in (0, 1)}
        assert snaps[0] == snaps[1]
        later = [s for s in snaps[0] if s > change.step]
        assert later and all(s % 20 == 0 for s in later), (snaps, change.step)
