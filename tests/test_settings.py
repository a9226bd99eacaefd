"""Settings compose the components' own defaults and check every value, naming each problem."""

from __future__ import annotations

import pytest

from nbtrain import Settings
from nbtrain.core.checkpoint_policy import DEFAULT_COMMIT_TIMEOUT_S
from nbtrain.core.lifecycle_types import JobPolicy, MachineConfig
from nbtrain.core.sched_types import SchedulerConfig
from nbtrain.core.watchdog import WatchdogSettings
from nbtrain.runtime.launch import CheckpointPlan


def test_defaults_come_from_the_components() -> None:
    s, policy, machine = Settings(), JobPolicy(), MachineConfig()
    watch = WatchdogSettings()
    for name in ("hang_factor", "hang_floor_s", "setup_timeout_s", "restore_timeout_s",
                 "rendezvous_timeout_s"):
        assert getattr(s, name) == getattr(policy, name) == getattr(watch, name), name
    assert (s.peer_release_s, s.failure_grace_s) == (policy.peer_release_s,
                                                     policy.failure_grace_s)
    for name in ("host_failure_limit", "host_failure_window_s", "host_exclusion_s",
                 "worker_return_s"):
        assert getattr(s, name) == getattr(machine, name), name
    assert s.preempt_grace_s == SchedulerConfig().preempt_grace_s
    assert s.checkpoint_commit_timeout_s == DEFAULT_COMMIT_TIMEOUT_S
    assert CheckpointPlan.__dataclass_fields__["keep"].default == s.checkpoint_keep


def test_every_problem_is_named() -> None:
    with pytest.raises(ValueError) as err:
        Settings(hang_floor_s=-1, checkpoint_keep=0, collective_timeout_s=float("nan"),
                 team_weights="research")
    text = str(err.value)
    for part in ("hang_floor_s must be > 0 seconds, got -1",
                 "checkpoint_keep must be an integer >= 1, got 0",
                 "collective_timeout_s must be a number of seconds, got nan",
                 "team_weights entry 'research'", "NBTRAIN_<NAME>"):
        assert part in text, (part, text)
    assert Settings(device_sample_s=0.0, rank_threads=0).device_sample_s == 0.0


def test_an_environment_value_is_checked_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NBTRAIN_PREEMPT_GRACE_S", "-5")
    with pytest.raises(ValueError, match=r"preempt_grace_s must be > 0 seconds, got -5\.0"):
        Settings.load()
