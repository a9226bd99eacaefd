"""Settings compose the components' own defaults and check every value, naming each problem."""

from __future__ import annotations

import re
import warnings

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
                 "checkpoint_keep must be an integer from 1 to 10,000, got 0",
                 "collective_timeout_s must be a finite number of seconds, got nan",
                 "team_weights entry 'research'", "NBTRAIN_<NAME>"):
        assert part in text, (part, text)
    assert Settings(device_sample_s=0.0, rank_threads=0).device_sample_s == 0.0


def test_an_environment_value_is_checked_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NBTRAIN_PREEMPT_GRACE_S", "-5")
    with pytest.raises(ValueError, match=r"preempt_grace_s must be > 0 seconds, got -5\.0"):
        Settings.load()


@pytest.mark.parametrize(("changes", "says"), [
    ({"control_poll_s": float("inf")}, "control_poll_s must be a finite number of seconds"),
    ({"state_dir": "a\x00b"}, "state_dir must be a string of at most 4,096 characters"),
    ({"visibility": "friends"}, "visibility must be one of 'all', 'owner', got 'friends'"),
    ({"event_batch_max": 10**9}, "event_batch_max must be an integer from 1 to 100,000"),
    ({"result_max_bytes": 1 << 40}, "result_max_bytes must be an integer from 1 to"),
    ({"priority_ceiling": 1 << 40}, "priority_ceiling must be an integer from"),
    ({"worker_return_s": 100.0, "slot_forget_s": 10.0},
     "worker_return_s (100) must not exceed slot_forget_s (10)"),
    ({"control_poll_s": 5.0, "preempt_grace_s": 3.0},
     "control_poll_s (5) must not exceed preempt_grace_s (3)"),
])
def test_a_bad_or_incoherent_value_is_refused_with_its_fix(changes: dict[str, object],
                                                             says: str) -> None:
    with pytest.raises(ValueError, match=re.escape(says)):
        Settings.load(**changes)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=re.escape(says)), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tests' NBTRAIN_CHECKPOINT_ROOT is left unread
        Settings(**changes)  # type: ignore[arg-type]


@pytest.mark.parametrize(("changes", "says"), [
    ({"quiet_workers": "no"}, "quiet_workers must be True or False, got 'no'"),
    ({"checkpoint_root": 7}, "checkpoint_root must be a string, got 7"),
])
def test_a_value_of_the_wrong_type_in_code_is_refused(changes: dict[str, object],
                                                      says: str) -> None:
    """(``Settings.load`` converts, as from the environment's text: "no" is False.)"""
    with pytest.raises(ValueError, match=re.escape(says)), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        Settings(**changes)  # type: ignore[arg-type]


def test_stop_grace_follows_the_commit_timeout_unless_set() -> None:
    from nbtrain.core.checkpoint_policy import stop_grace_s

    s = Settings.load()
    assert stop_grace_s(s.checkpoint_commit_timeout_s, s.stop_grace_s) == 300
    assert stop_grace_s(400.0, 0.0) == 900 and stop_grace_s(100.0, 250.0) == 250
    with pytest.raises(ValueError, match=r"stop_grace_s \(150\) must be at least twice "
                                         r"checkpoint_commit_timeout_s \(100\)"):
        Settings.load(stop_grace_s=150.0)
    # a longer commit timeout needs no stop_grace_s set with it
    Settings.load(checkpoint_commit_timeout_s=400.0, preempt_grace_s=600.0, retire_wait_s=600.0)


def test_a_commit_timeout_past_the_preemption_grace_warns() -> None:
    with pytest.warns(UserWarning, match=r"checkpoint_commit_timeout_s \(200\) is longer than "
                                         r"preempt_grace_s \(60\)"):
        Settings.load(checkpoint_commit_timeout_s=200.0, preempt_grace_s=60.0)


def test_settings_made_directly_say_what_they_leave_unread(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``Settings(...)`` takes its keywords and the defaults; ``Settings.load`` reads the
    environment too. The difference is a warning, not a surprise."""
    monkeypatch.delenv("NBTRAIN_CHECKPOINT_ROOT", raising=False)
    monkeypatch.setenv("NBTRAIN_JOBS_KEPT", "7")
    assert Settings.load().jobs_kept == 7
    with pytest.warns(UserWarning, match=r"leaves NBTRAIN_JOBS_KEPT from the environment "
                                         r"unread; use nbtrain.Settings.load"):
        assert Settings(token_file="").jobs_kept == 200
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Settings(jobs_kept=3)  # the value is given: nothing is left unread
        Settings.load().replace(jobs_kept=9)


def test_the_operator_token_stays_with_the_client() -> None:
    s = Settings.load(operator_token="s3cret-operator")
    assert "s3cret" not in repr(s)
    sent = s.for_jobs()
    assert "operator_token" not in sent and "token_file" not in sent
    assert Settings.from_dict(sent).operator_token == ""


def test_settings_read_back_from_an_old_journal_fall_back_instead_of_failing() -> None:
    old = {"quiet_workers": "yes", "jobs_kept": 5, "operator_token": "leaked", "gone": 1}
    with pytest.raises(ValueError, match="quiet_workers must be True or False"):
        Settings.from_dict(old)
    s = Settings.from_dict(old, lenient=True)
    assert s.quiet_workers is True and s.jobs_kept == 5 and s.operator_token == ""
