"""Straggler handling for one live job: feeds ``core.straggler`` and ``core.mitigation`` (pure).

The job machine (:mod:`nbtrain.core.lifecycle`) gives it the step rows of the current
generation; verdict changes become ``straggler`` events and the policy's actions
``mitigation`` events. A ``replace`` action is carried out by the machine through the
preemption path (checkpoint at the next boundary, then a new generation with the slow slot
avoided), so a replacement loses no committed step.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from nbtrain.core.gpu_health import device_errors, throttling
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


class StragglerWatch:
    def __init__(self, world_size: int, policy: str = "alert",
                 detector: StragglerSettings | None = None,
                 mitigation: MitigationSettings | None = None) -> None:
        mitigation = mitigation or MitigationSettings(policy=policy)
        self.detector = StragglerDetector(world_size, detector)
        self.policy = make_policy(mitigation)
        self.devices: dict[int, dict[str, float]] = {}  # rank -> its GPU's latest readings

    def restart(self, world_size: int, start_step: int) -> list[dict[str, Any]]:
        """A new generation: forget history; returns 'cleared' events for open verdicts."""
        events = [_straggler_event(self._with_device(d).to_event())
                  for d in self.detector.reset(world_size, start_step=start_step)]
        self.devices = {}  # the new generation's ranks may sit on other GPUs
        return events

    def observe(self, rank: int, rows: Iterable[Sequence[Any]]) -> list[dict[str, Any]]:
        changes = self.detector.observe(StepRecord.from_row(rank, row) for row in rows)
        return [_straggler_event(self._with_device(d).to_event()) for d in changes]

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
        """Change detector thresholds (``StragglerSettings`` fields) while the job runs."""
        return [_straggler_event(self._with_device(d).to_event())
                for d in self.detector.update_settings(**changes)]


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
