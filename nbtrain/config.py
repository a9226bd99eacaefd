"""Settings: one place for every default and every timeout.

``Settings.load(...)`` (what ``connect()`` uses) takes a value from, in order: the keyword
passed in code, the environment variable ``NBTRAIN_<NAME>`` (upper case), Dask's config key
``nbtrain.<name-with-dashes>``, the default below. Cluster operators can therefore configure
nbtrain like Dask itself. ``Settings(...)`` takes the keywords and the defaults only; it warns
when it leaves a value of the environment or Dask's config unread.

Every value is checked where it is made (type, range, finite, coherent with the others):
a bad one raises ValueError naming the value, what is allowed and where to set it.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import os
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import dask.config

from nbtrain.core.checkpoint_policy import (
    DEFAULT_COMMIT_TIMEOUT_S,
    DEFAULT_MTBF_S,
    PREEMPT_COMMIT_SHARE,
    preemption_commit_s,
)
from nbtrain.core.lifecycle_types import JobPolicy, MachineConfig
from nbtrain.core.sched_types import SchedulerConfig

# Each component owns its defaults; Settings composes them (one definition per value).
_POLICY = JobPolicy()
_MACHINE = MachineConfig()
_SCHED = SchedulerConfig()


@dataclass(frozen=True, kw_only=True)
class Settings:
    """Tunables of the controller and the rank runtime (seconds unless named otherwise)."""

    #: How long ranks wait for rank 0's rendezvous store. Longer than a worker's cold start.
    rendezvous_timeout_s: float = _POLICY.rendezvous_timeout_s
    #: Timeout of one gloo/NCCL collective. Should be longer than the slowest step, or a
    #: slow-but-healthy step is reported as a failure.
    collective_timeout_s: float = 120.0
    #: How often rank 0 polls the job's control variable (stop/checkpoint/preempt requests).
    control_poll_s: float = 0.1
    #: About how often (in training time) the ranks agree on control requests. A stop takes
    #: effect within ``control_poll_s + control_interval_s`` plus one step.
    control_interval_s: float = 0.2
    #: Step records are batched and sent at most this often per rank.
    event_flush_s: float = 0.25
    #: ... or when this many records are buffered.
    event_batch_max: int = 512
    #: How often the controller checks deadlines (failure grace, hang watchdog, preemption
    #: grace). It runs next to the Dask scheduler; a tick costs microseconds per job.
    controller_tick_s: float = 0.05
    #: After a rank fails on its own (an exception), how long its peers get to notice before
    #: the failed rank's worker is restarted. Peers blocked in a gloo collective only see the
    #: failure when the failed rank's connections close, and they close with its process.
    peer_release_s: float = _POLICY.peer_release_s
    #: After the first rank fails, how long the other ranks get to exit before their tasks are
    #: cancelled and their workers restarted.
    failure_grace_s: float = _POLICY.failure_grace_s
    #: After ``job.stop()`` (or a halt, ``on_nonfinite="halt"``), how long the ranks get to
    #: reach a step boundary, finish the checkpoint in flight and commit the final one (each
    #: commit waits up to ``checkpoint_commit_timeout_s``). Ranks still running then are
    #: stopped, their workers restarted, and the job ends CANCELLED (a halt: FAILED) with the
    #: reason saying so. 0: twice the commit timeout plus 100 s (300 s at the defaults); set,
    #: at least twice the commit timeout.
    stop_grace_s: float = 0.0
    #: How often a rank on a GPU samples its GPU's health through NVML (clocks, throttle
    #: reasons, temperature, power, ECC, XID) for straggler verdicts; 0 = never. Needs
    #: nvidia-ml-py (``pip install nbtrain[gpu]``) on the workers.
    device_sample_s: float = 10.0
    #: Torch intra-op threads per rank on CPU; 0 = the host's cores divided among its slots.
    rank_threads: int = 0
    #: Quiet Dask's own background work on embedded workers: the statistical profiler off and
    #: the system/memory monitors slowed (on two cores they otherwise cost ~8% of step rate);
    #: and on every worker glibc's malloc set to reuse blocks up to 32 MB, which Dask's
    #: ``MALLOC_TRIM_THRESHOLD_`` turns off (``nbtrain.engine.workers.tune_malloc``).
    quiet_workers: bool = True
    #: Each worker process that has a nanny moves into a session (and process group) of its
    #: own (``nbtrain.engine.workers.own_session``): a notebook's interrupt, which Jupyter
    #: sends to the kernel's whole process group, then no longer kills the embedded
    #: cluster's workers, and Linux's autogroup scheduler stops weighing the ranks together
    #: with the notebook's process.
    worker_sessions: bool = True
    #: Text progress lines at most this often (seconds).
    progress_interval_s: float = 2.0
    #: Where checkpoints go: a local directory (relative to the notebook's working directory)
    #: or any fsspec URL that every worker can reach. Each job writes under
    #: ``<root>/<job name>/<job id>/``.
    checkpoint_root: str = "nbtrain-checkpoints"
    #: Committed checkpoints kept per job (the newest is never deleted).
    checkpoint_keep: int = 3
    #: How long rank 0 waits for every rank's shard before a checkpoint is marked failed.
    #: Longer than the slowest rank's write of one shard. A preemption's or resize's final
    #: checkpoint waits at most ``min(this, 0.75 x preempt_grace_s)``, so it gives up before
    #: the ranks are stopped; the job then resumes from its previous checkpoint, uncharged.
    checkpoint_commit_timeout_s: float = DEFAULT_COMMIT_TIMEOUT_S
    #: Mean time between failures of a job, for ``checkpoint="auto"`` (Young/Daly).
    mtbf_s: float = DEFAULT_MTBF_S
    #: Hang watchdog: a running job with no step progress for
    #: ``max(hang_factor x median step time, hang_floor_s, 2 x its longest step)`` seconds is
    #: looked at: the ranks' call stacks are read twice a few seconds apart, and only a rank
    #: whose stack did not move (outside a collective) is declared hung; ranks that are busy
    #: but slow are not. The floor should exceed the longest pause between steps (a
    #: checkpoint snapshot, an evaluation).
    hang_factor: float = _POLICY.hang_factor
    hang_floor_s: float = _POLICY.hang_floor_s
    #: Startup watchdog: the longest a rank may spend in its setup (a Recipe's ``setup``, a
    #: training function's code before its loop) and again in its first step, and in
    #: restoring a checkpoint. Longer than loading the data and the model on a busy machine.
    setup_timeout_s: float = _POLICY.setup_timeout_s
    restore_timeout_s: float = _POLICY.restore_timeout_s
    #: A host whose ranks fail this many times within ``host_failure_window_s`` is avoided
    #: (softly: used only when nothing else fits) for ``host_exclusion_s``.
    host_failure_limit: int = _MACHINE.host_failure_limit
    host_failure_window_s: float = _MACHINE.host_failure_window_s
    host_exclusion_s: float = _MACHINE.host_exclusion_s

    # -- the cluster's controller: read from the settings of the client that first
    # -- connects (or of the scheduler's process, with ``--preload nbtrain.engine.preload``)
    #: Time a job told to release its slots (preempted by a higher-priority job or its user)
    #: gets to checkpoint at a step boundary; after it the ranks are stopped and the job
    #: resumes from its last committed checkpoint. Longer than a step plus a checkpoint.
    preempt_grace_s: float = _SCHED.preempt_grace_s
    #: An elastic job grows into idle slots (or back after a lost worker returns) at most
    #: this long after its last start or resize, so a worker that comes and goes cannot
    #: restart it over and over. Shrinks (a lost worker, a job that needs the slots) and the
    #: user's own resizes are not held back.
    resize_interval_s: float = 30.0
    #: A job submitted with ``sizing="goodput"`` is resized by its measured goodput at most
    #: this long after its last start or resize (each resize is a restart from a
    #: checkpoint; see ``SchedulerConfig.goodput_interval_s``).
    goodput_interval_s: float = _SCHED.goodput_interval_s
    #: Fair-share weights of teams, ``"research:3,teaching:1"``; unnamed teams weigh 1.
    team_weights: str = ""
    #: The recent window over which the class view (and ``cluster.snapshot()["teams"]``)
    #: reports each team's share of slot-time against its weight; decides nothing.
    share_window_s: float = _SCHED.share_window_s
    #: Highest priority a job may have without the operator token.
    priority_ceiling: int = 10
    #: The operator's token: a client holding it may steer every job, read every job's
    #: results and logs, and submit above the priority ceiling. Empty: no operator (the
    #: embedded cluster makes one for its owner). It never leaves the client: the controller
    #: keeps its hash, jobs never see it (not shown in reprs either).
    operator_token: str = field(default="", repr=False)
    #: Who sees a job's metrics, events and status details: "all" (every client of the
    #: cluster: a class that shares its curves) or "owner" (the job's owner and the operator;
    #: others see only what scheduling needs: name, owner, team, priority, state and size).
    #: Results, logs and checkpoints are always the owner's and the operator's alone.
    visibility: str = "all"
    #: How long the ticket in a job page's URL (from ``job.dashboard()``) lets its holder
    #: steer the job. The URL is saved with the notebook's output: keep this short.
    view_ticket_s: float = 12 * 3600.0
    #: Where the controller journals everything it knows (SQLite, see ARCHITECTURE.md), so a
    #: scheduler restarted on the same directory restores every job. "" = a directory per
    #: scheduler address, ``~/.nbtrain/state/<host>-<port>`` on the scheduler's machine (the
    #: embedded cluster uses a fresh temporary one). On Kubernetes mount a persistent volume
    #: here; on Slurm/HPC use a path on the scheduler's node (or a shared file system).
    state_dir: str = ""
    #: Most jobs that may be queued, held or running at once (every client together): a
    #: submit beyond is refused, so no client can fill the controller's memory with jobs.
    jobs_max: int = 10_000
    #: Ended jobs the controller keeps in memory (for ``cluster.jobs`` and reattaching);
    #: older ones are read from the state directory.
    jobs_kept: int = 200
    #: Step rows per job the controller keeps in memory (the newest); older rows are read
    #: from the state directory.
    rows_kept: int = 50_000
    #: How often the controller journals the step progress of running jobs.
    journal_interval_s: float = 1.0
    #: Largest pickled recipe or training function (with its config and the globals it
    #: captured) a job may have; load big data inside the function instead.
    recipe_max_bytes: int = 32 * 1024 * 1024
    #: A worker restarted by nbtrain that has not come back after this long is reported lost.
    worker_return_s: float = _MACHINE.worker_return_s
    #: A slot offline this long that no job holds (a departed host's) is forgotten, so the
    #: controller's book of slots stays the size of what was recently there.
    slot_forget_s: float = _MACHINE.slot_forget_s
    #: How long the controller waits for a nanny to kill a worker it restarts.
    worker_restart_timeout_s: float = 30.0
    #: A worker that is retired (a cluster manager scaling down, its lifetime/walltime, a
    #: SIGTERM) while it runs a rank is held back this long at most while its job
    #: checkpoints and moves to other slots (``nbtrain.engine.departures``); at least
    #: ``preempt_grace_s``. Keep dask-jobqueue's ``--lifetime`` this much below the walltime.
    retire_wait_s: float = 120.0
    #: A worker near its memory limit that leaves: how long the controller waits for Dask's
    #: nanny to say it killed it for memory (its event races the worker's own connection),
    #: so the fault's cause names the memory limit rather than a lost worker.
    exit_cause_wait_s: float = 0.5

    #: A rank's output (print, logging, warnings) reaches the notebook at up to this many lines
    #: per second on average (bursts of 200); the rest is counted as dropped.
    log_lines_per_s: float = 50.0
    #: Largest return value of a training function that comes back as ``job.result()``
    #: (pickled); save bigger things to storage and return their path.
    result_max_bytes: int = 64 * 1024 * 1024

    # -- this client
    #: Step rows a job handle keeps in memory (the newest); ``job.metrics`` reads older ones
    #: from the controller's journal.
    handle_rows_kept: int = 50_000
    #: Where a client keeps the tokens of the jobs it submitted, so a restarted kernel can
    #: steer them again ("" keeps them in memory only). One file per user, mode 0600.
    token_file: str = "~/.nbtrain/tokens.json"

    # -- a worker's labels (set in the worker's environment, e.g. NBTRAIN_WORKER_HOST=node3)
    #: The host this worker counts as ("" = its network address's host). Declares a topology
    #: on one machine for teaching labs, or names hosts behind NAT.
    worker_host: str = ""
    #: The NVLink domain of this worker's device ("" = its whole host).
    worker_nvlink: str = ""
    #: The leaf switch of this worker's host ("" = one switch for all).
    worker_leaf: str = ""

    def __post_init__(self) -> None:
        problems = [problem for f in fields(self)
                    if (problem := _check(f.name, getattr(self, f.name), type(f.default)))
                    is not None]
        try:
            self.team_weight_map()
        except ValueError as exc:
            problems.append(str(exc))
        if not problems:
            problems.extend(_incoherent(self))
        if problems:
            raise ValueError("invalid nbtrain settings: " + "; ".join(problems) + " (set them "
                             "in code, as NBTRAIN_<NAME> or as Dask config nbtrain.<name>)")
        if not _LOADING.get():
            _warn_unread(self)

    def replace(self, **changes: Any) -> Settings:
        with _loading():
            return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, lenient: bool = False) -> Settings:
        """Settings sent as a dict (by a client, or read from the journal): known fields only
        and never a client's own (its operator token), each checked; the environment is not
        read (they are someone else's settings). ``lenient``: values that do not pass today's
        checks (a journal written under older rules) fall back to their defaults instead of
        raising."""
        known = {f.name for f in fields(cls)} - set(CLIENT_ONLY)
        values = {k: v for k, v in data.items() if k in known}
        with _loading():
            try:
                return cls(**values)
            except (TypeError, ValueError):
                if not lenient:
                    raise
            kinds = {f.name: type(f.default) for f in fields(cls)}
            values = {k: v for k, v in values.items() if _check(k, v, kinds[k]) is None}
            try:
                return cls(**values)
            except (TypeError, ValueError):
                return cls()

    def for_jobs(self) -> dict[str, Any]:
        """What a job carries to the controller and its ranks: every value but this client's
        own (its operator token and token file never leave it)."""
        out = self.to_dict()
        for name in CLIENT_ONLY:
            out.pop(name, None)
        return out

    def team_weight_map(self) -> dict[str, float]:
        """``team_weights`` parsed; raises ValueError naming the bad entry."""
        out: dict[str, float] = {}
        for part in filter(None, (p.strip() for p in self.team_weights.split(","))):
            team, sep, weight = part.partition(":")
            try:
                value = float(weight)
            except ValueError:
                value = float("nan")
            if not sep or not team.strip() or not value > 0:
                raise ValueError(
                    f"team_weights entry {part!r} is not 'team:weight' with a weight > 0; "
                    "write e.g. team_weights='research:3,teaching:1'")
            out[team.strip()] = value
        return out

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def load(cls, **overrides: Any) -> Settings:
        """Defaults, then Dask config, then environment, then ``overrides``."""
        values: dict[str, Any] = {}
        for f in fields(cls):
            default = f.default
            value: Any = dask.config.get(f"nbtrain.{f.name.replace('_', '-')}", default)
            env = os.environ.get(f"NBTRAIN_{f.name.upper()}")
            if env is not None:
                value = env
            values[f.name] = _coerce(f.name, value, type(default))
        for key, value in overrides.items():
            if key not in values:
                known = ", ".join(sorted(values))
                raise TypeError(f"unknown nbtrain setting {key!r}; known settings: {known}")
            values[key] = _coerce(key, value, type(values[key]))
        with _loading(unread_only=True):
            return cls(**values)


#: Settings that stay in the client that holds them.
CLIENT_ONLY = ("operator_token", "token_file")
#: The allowed values of settings that are a choice.
CHOICES: dict[str, tuple[str, ...]] = {"visibility": ("all", "owner")}
#: Upper bounds: a value above them is a typo or an attempt to exhaust the controller (a
#: client's settings travel with its jobs).
MAXIMA: dict[str, float] = {
    "event_batch_max": 100_000, "jobs_max": 1_000_000, "checkpoint_keep": 10_000,
    "jobs_kept": 1_000_000,
    "rows_kept": 10_000_000, "handle_rows_kept": 10_000_000, "rank_threads": 4_096,
    "host_failure_limit": 1_000_000, "recipe_max_bytes": 1 << 30, "result_max_bytes": 1 << 30,
    "log_lines_per_s": 1_000_000, "priority_ceiling": 1 << 31}

#: Set while settings are made from given values on purpose (``load``, ``replace``,
#: ``from_dict``): no warning that the environment went unread. ``_REMADE``: made again
#: from settings that were already checked (``replace``, ``from_dict``): no second
#: coherence warning either.
_LOADING: contextvars.ContextVar[bool] = contextvars.ContextVar("nbtrain_settings_loading",
                                                                 default=False)
_REMADE: contextvars.ContextVar[bool] = contextvars.ContextVar("nbtrain_settings_remade",
                                                                default=False)


@contextlib.contextmanager
def _loading(*, unread_only: bool = False) -> Iterator[None]:
    token = _LOADING.set(True)
    again = None if unread_only else _REMADE.set(True)
    try:
        yield
    finally:
        _LOADING.reset(token)
        if again is not None:
            _REMADE.reset(again)


def _warn_unread(settings: Settings) -> None:
    """``Settings(...)`` reads no environment: say so when the environment had a value."""
    unread = [f"NBTRAIN_{f.name.upper()}" for f in fields(settings)
              if f"NBTRAIN_{f.name.upper()}" in os.environ
              and getattr(settings, f.name) == f.default]
    if unread:
        warnings.warn(
            f"nbtrain.Settings(...) takes only the values passed to it and the defaults, so it "
            f"leaves {', '.join(unread)} from the environment unread; use "
            "nbtrain.Settings.load(...) to read the environment and Dask's config too",
            UserWarning, stacklevel=4)


def _incoherent(s: Settings) -> list[str]:
    """Values that are each fine but do not work together."""
    out = []
    if s.worker_return_s > s.slot_forget_s:
        out.append(f"worker_return_s ({s.worker_return_s:g}) must not exceed slot_forget_s "
                   f"({s.slot_forget_s:g}): a restarted worker's slot would be forgotten before "
                   "it is given up")
    if s.retire_wait_s < s.preempt_grace_s:
        out.append(f"retire_wait_s ({s.retire_wait_s:g}) must be at least preempt_grace_s "
                   f"({s.preempt_grace_s:g}): a leaving worker would go before its job's "
                   "checkpoint had its grace")
    if s.control_poll_s > s.preempt_grace_s:
        out.append(f"control_poll_s ({s.control_poll_s:g}) must not exceed preempt_grace_s "
                   f"({s.preempt_grace_s:g}): a preempted job would not hear of it in time")
    if 0 < s.stop_grace_s < 2 * s.checkpoint_commit_timeout_s:
        out.append(f"stop_grace_s ({s.stop_grace_s:g}) must be at least twice "
                   f"checkpoint_commit_timeout_s ({s.checkpoint_commit_timeout_s:g}): a stopped "
                   "job's ranks may wait for the checkpoint in flight and then for the final one")
    commit, grace = s.checkpoint_commit_timeout_s, s.preempt_grace_s
    if commit > grace and not _REMADE.get():
        warnings.warn(
            f"checkpoint_commit_timeout_s ({commit:g}) is longer than preempt_grace_s "
            f"({grace:g}): a preempted job's final checkpoint may take only "
            f"{preemption_commit_s(commit, grace):g} s ({PREEMPT_COMMIT_SHARE:g} of the grace); "
            "one that takes longer does not commit and the job resumes from its previous one "
            "(no restart charged); raise preempt_grace_s if checkpoints take that long",
            UserWarning, stacklevel=4)
    return out


#: Durations where 0 means "off" (``stop_grace_s``: "derived from the commit timeout").
_ZERO_MEANS_OFF = frozenset({"device_sample_s", "stop_grace_s"})
#: Counts that may be 0 (``rank_threads``: 0 = the host's cores divided among its slots).
_ZERO_ALLOWED = frozenset({"rank_threads"})


def _check(name: str, value: Any, kind: type) -> str | None:
    """What is wrong with one setting's value (None: nothing); ``kind``: its default's type."""
    if kind is bool:
        return None if isinstance(value, bool) else f"{name} must be True or False, got {value!r}"
    if kind is str:
        if not isinstance(value, str):
            return f"{name} must be a string, got {value!r}"
        if "\x00" in value or len(value) > 4096:
            return f"{name} must be a string of at most 4,096 characters without NUL"
        choices = CHOICES.get(name)
        if choices and value not in choices:
            return f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}"
        return None
    top = MAXIMA.get(name, math.inf)
    if kind is int:
        low = -top if name == "priority_ceiling" else 0 if name in _ZERO_ALLOWED else 1
        ok = (isinstance(value, int) and not isinstance(value, bool)
              and low <= value <= top)
        return None if ok else (f"{name} must be an integer from {low:,.0f} to {top:,.0f}, "
                                f"got {value!r}" if top < math.inf
                                else f"{name} must be an integer >= {low}, got {value!r}")
    unit = " seconds" if name.endswith("_s") else ""
    if (not isinstance(value, int | float) or isinstance(value, bool)
            or not math.isfinite(value)):
        return f"{name} must be a finite number{' of seconds' if unit else ''}, got {value!r}"
    if value > top:
        return f"{name} must be at most {top:,.0f}{unit}, got {value!r}"
    if name in _ZERO_MEANS_OFF:
        return None if value >= 0 else f"{name} must be >= 0{unit} (0 = off), got {value!r}"
    return None if value > 0 else f"{name} must be > 0{unit}, got {value!r}"


def _coerce(name: str, value: Any, kind: type) -> Any:
    if isinstance(value, kind):
        return value
    try:
        if kind is bool:
            if isinstance(value, str):
                return value.strip().lower() in ("1", "true", "yes", "on")
            return bool(value)
        return kind(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"nbtrain setting {name} must be a {kind.__name__}, got {value!r}"
        ) from exc
