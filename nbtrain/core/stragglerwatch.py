"""Straggler handling for one live job: feeds ``core.straggler`` and ``core.mitigation`` (pure).

The job machine (:mod:`nbtrain.core.lifecycle`) gives it the step rows of the current
generation; verdict changes become ``straggler`` events and the policy's actions
``mitigation`` events. A ``replace`` action is carried out by the machine through the
preemption path (checkpoint at the next boundary, then a new generation with the slow slot
avoided), so a replacement loses no committed step.

Live straggler knobs (:mod:`nbtrain.core.stragglerknobs`): a change applied at step ``s``
judges every step after ``s``. A rank's batch of rows is fed in parts split at the steps of
changes not yet in force, so the detector (which judges a step once every rank's row of it
is in, in step order) has judged step ``s`` before the change, and no later step, whatever
order the ranks' rows come in. A new generation starts with the settings in force at its
first step, so a recovery to before a change judges those steps with the old settings
again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

from nbtrain.core.gpu_health import device_errors, throttling
from nbtrain.core.knobs import KnobChange
from nbtrain.core.mitigation import (
    Action,
    ActionKind,
    MitigationContext,
    MitigationSettings,
    SlotInfo,
    make_policy,
)
from nbtrain.core.records import Phase, StepRecord
from nbtrain.core.straggler import Diagnosis, StragglerDetector, StragglerSettings, Verdict
from nbtrain.core.stragglerknobs import StragglerKnobs, straggler_specs


class StragglerWatch:
    def __init__(self, world_size: int, policy: str = "alert",
                 detector: StragglerSettings | None = None,
                 mitigation: MitigationSettings | None = None) -> None:
        mitigation = mitigation or MitigationSettings(policy=policy)
        self.detector = StragglerDetector(world_size, detector)
        self.policy = make_policy(mitigation)
        self.devices: dict[int, dict[str, float]] = {}  # rank -> its GPU's latest readings
        self.knobs = StragglerKnobs(self.detector.settings)
        self._through = -1  # changes applied at steps <= this are in force

    def specs(self) -> list[Any]:
        """The controller's straggler knobs for this job (``core.knobs.KnobSpec``)."""
        return straggler_specs(self.knobs.base)

    def follow(self, changes: Iterable[KnobChange]) -> list[dict[str, Any]]:
        """Knob changes applied (live ones, or a history restored or replayed): each judges
        the steps after its own; one for steps already judged is in force at once."""
        self.knobs.follow(changes)
        last = self.detector.last_step
        return self._in_force(last) if last is not None else []

    def restart(self, world_size: int, start_step: int) -> list[dict[str, Any]]:
        """A new generation: forget history; returns 'cleared' events for open verdicts."""
        events = [_straggler_event(self._with_device(d).to_event())
                  for d in self.detector.reset(world_size, start_step=start_step)]
        self.devices = {}  # the new generation's ranks may sit on other GPUs
        self._through = -1
        return events + self._in_force(start_step)

    def observe(self, rank: int, rows: Iterable[Sequence[Any]]) -> list[dict[str, Any]]:
        records = [StepRecord.from_row(rank, row) for row in rows]
        changes: list[Diagnosis] = []
        events: list[dict[str, Any]] = []
        for at in [s for s in self.knobs.steps() if s > self._through]:
            if not records:
                break
            changes += self.detector.observe(r for r in records if r.step <= at)
            records = [r for r in records if r.step > at]
            last = self.detector.last_step
            if last is None or last < at:
                break  # step ``at`` waits for another rank's row: so do the later ones
            events += self._in_force(at)
        changes += self.detector.observe(records)
        return [_straggler_event(self._with_device(d).to_event()) for d in changes] + events

    def _in_force(self, step: int) -> list[dict[str, Any]]:
        """The detector judges from step ``step + 1`` on with the settings in force there."""
        self._through = step
        try:
            want = self.knobs.settings_at(step)
        except (TypeError, ValueError):  # a tune_stragglers since made them clash: kept
            return []
        if want == self.detector.settings:
            return []
        fields = {f.name: getattr(want, f.name) for f in dataclasses.fields(want)}
        return [_straggler_event(self._with_device(d).to_event())
                for d in self.detector.update_settings(**fields)]

    def device(self, rank: int, readings: dict[str, float]) -> None:
        """A rank's GPU readings (``device`` events, every ``device_sample_s``)."""
        self.devices[rank] = {str(k): float(v) for k, v in readings.items()}

    def _with_device(self, d: Diagnosis) -> Diagnosis:
        readings = self.devices.get(d.rank)
        if readings is None:
            return d
        if d.state is Verdict.CLEARED:
            return d.with_nvml(readings)
        found = device_errors(readings)
        if d.phase in (Phase.COMPUTE, Phase.OPT):  # device work: a held-down clock explains it
            peers = [r for k, r in self.devices.items() if k != d.rank]
            slow = throttling(readings, peers)
            found += [slow] if slow else []
        return d.with_nvml(readings, hint="; ".join(found) or None)

    def decide(self, now: float, step: int, placement: dict[int, SlotInfo],
               spares: list[SlotInfo]) -> list[Action]:
        ctx = MitigationContext(now=now, step=step, placement=placement, spares=spares)
        return self.policy.decide(self.detector.active(), ctx)

    def excluded(self, now: float) -> set[str]:
        return set(self.policy.excluded(now))

    def update(self, **changes: Any) -> list[dict[str, Any]]:
        """Change detector thresholds (``StragglerSettings`` fields) while the job runs, at
        once and unrecorded (``job.tune_stragglers``): the base under the straggler knobs."""
        base = dataclasses.replace(self.knobs.base, **changes)  # raises before any change
        events = [_straggler_event(self._with_device(d).to_event())
                  for d in self.detector.update_settings(**changes)]
        self.knobs.base = base
        return events


def _straggler_event(info: dict[str, Any]) -> dict[str, Any]:
    """A detector verdict change as a job event."""
    info.pop("topic", None)
    return {"kind": "straggler", **info}


def mitigation_event(action: Action) -> dict[str, Any]:
    info = action.to_event()
    info.pop("topic", None)
    info["action"] = info.pop("kind")
    # The policy's clock is the controller's monotonic one; events carry wall-clock "time",
    # which the machine sets.
    info["policy_time"] = info.pop("time")
    if info.get("exclude_until") is not None:
        info["exclude_for_s"] = info.pop("exclude_until") - info["policy_time"]
    return {"kind": "mitigation", **info}


__all__ = ["ActionKind", "StragglerWatch", "mitigation_event"]
