"""The hang and startup watchdog of one generation (pure: time passed in, never read).

The job machine (:mod:`nbtrain.core.lifecycle`) keeps one :class:`GenerationWatch` per
generation, tells it what happens (step rows, a rank's startup phase, the ranks' call stacks
it asked for) and asks it on every tick whether to look. What it finds is typed: a
:class:`Probe` while it looks at a silent generation, a :class:`Hang` when it declares one
hung, :class:`Slow` when the stacks moved. The machine carries the verdicts out (asks the
engine for the stacks, restarts the culprits' workers, publishes the ``slow`` event).

- **Running.** A generation is *silent* when no step row came for longer than its limit: the
  largest of ``hang_factor`` x the median step, ``hang_floor_s`` and ``longest_step_factor``
  x the longest step the job has taken (a machine that stalled a step that long before can
  stall it again). A silent generation is looked at twice, the second look a confirmation
  interval after the first (``confirm_share`` of the limit, within ``confirm_min_s`` ..
  ``confirm_max_s``): a rank whose call stack did not move while nothing progressed, outside
  a collective, is stuck (a rank waiting in a collective waits for it); when no stack moved
  at all the generation is hung too (its ranks wait for each other, or none can be told
  apart; the cause names each rank's innermost frame). A rank whose stack moved is slow,
  not hung: said once, and looked at again, until the generation has been silent for
  ``give_up_factor`` times the limit. A request for stacks that got no answer within
  ``answer_timeout_s`` is sent again.
- **Starting.** Each rank gets ``rendezvous_timeout_s`` (+ ``dispatch_s`` for its task to
  reach its worker) to reach its setup, ``setup_timeout_s`` for the setup (and a training
  function's code before its loop), ``restore_timeout_s`` for the restore and
  ``setup_timeout_s`` again for its first step (compilation, warm-up). Ranks further on wait
  for the ones behind in a collective, so the culprits are the late ranks in the earliest
  phase.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from nbtrain.core.health import waits_for_checkpoint_writer

__all__ = ["STARTUP_PHASES", "GenerationWatch", "Hang", "Probe", "Slow", "WatchdogSettings",
           "top_frame"]

#: A rank's startup phases in order, and the setting that bounds each.
STARTUP_PHASES: dict[str, str] = {"rendezvous": "rendezvous_timeout_s",
                                  "setup": "setup_timeout_s",
                                  "restore": "restore_timeout_s",
                                  "first step": "setup_timeout_s"}


def _positive(v: float) -> bool:
    return bool(v > 0)


def _not_negative(v: float) -> bool:
    return bool(v >= 0)


#: (field, rule, what the rule asks, tuning advice) for each number of the settings.
_RULES: tuple[tuple[str, Callable[[float], bool], str, str], ...] = (
    ("hang_factor", _positive, "> 0", "e.g. 20: looked at after 20 median steps without one"),
    ("hang_floor_s", _not_negative, ">= 0 seconds",
     "longer than the longest pause between steps (a checkpoint snapshot, an evaluation)"),
    ("longest_step_factor", _not_negative, ">= 0", "e.g. 2: twice the longest step seen"),
    ("setup_timeout_s", _positive, "> 0 seconds",
     "longer than loading the data and the model on a busy machine"),
    ("restore_timeout_s", _positive, "> 0 seconds",
     "longer than reading the largest checkpoint on a busy machine"),
    ("rendezvous_timeout_s", _positive, "> 0 seconds", "longer than a worker's cold start"),
    ("dispatch_s", _not_negative, ">= 0 seconds",
     "longer than a busy scheduler takes to start a rank's task on its worker"),
    ("confirm_share", _positive, "> 0", "e.g. 0.5: the second look half a limit after the first"),
    ("confirm_min_s", _positive, "> 0 seconds",
     "long enough for a slow but moving rank's stack to change"),
    ("answer_timeout_s", _positive, "> 0 seconds",
     "longer than a busy scheduler takes to read the ranks' call stacks"),
    ("give_up_factor", lambda v: bool(v >= 1), ">= 1",
     "e.g. 10: a generation silent for 10 limits is hung even if its stacks move"),
)


@dataclass(frozen=True, kw_only=True)
class WatchdogSettings:
    """Every bound of the hang and startup watchdog (seconds unless named otherwise);
    validated on construction, every problem named with its fix.

    The first five come from the submitting client's ``nbtrain.Settings`` (through
    ``JobPolicy``); the rest are the watchdog's own.
    """

    hang_factor: float = 20.0
    """A running generation is silent after this many median steps without a step row."""
    hang_floor_s: float = 3.0
    """...and never before this many seconds: longer than the longest pause between steps."""
    setup_timeout_s: float = 600.0
    """The longest a rank may spend in its setup, and again in its first step."""
    restore_timeout_s: float = 600.0
    """The longest a rank may spend restoring a checkpoint."""
    rendezvous_timeout_s: float = 60.0
    """How long ranks wait for rank 0's rendezvous store (the ranks' own bound)."""
    dispatch_s: float = 30.0
    """Added to ``rendezvous_timeout_s`` for a rank not yet in its setup: the time its task
    takes to reach its worker and start."""
    longest_step_factor: float = 2.0
    """...and never before this many times the longest step the job has taken."""
    median_window: int = 64
    """Steps the median step is taken over (the newest ones of the generation)."""
    confirm_share: float = 0.5
    """The second look at a silent generation comes this share of its limit after the
    first..."""
    confirm_min_s: float = 2.0
    """...but no sooner than this many seconds..."""
    confirm_max_s: float = 60.0
    """...and no later than this many."""
    answer_timeout_s: float = 30.0
    """A request for the ranks' call stacks unanswered this long is sent again."""
    give_up_factor: float = 10.0
    """A generation silent for this many times its limit is hung even if its stacks move."""

    def __post_init__(self) -> None:
        problems = [f"{name} must be {need}, got {getattr(self, name)!r} ({advice})"
                    for name, ok, need, advice in _RULES if not ok(getattr(self, name))]
        if not (isinstance(self.median_window, int) and self.median_window >= 1):
            problems.append(f"median_window must be an integer >= 1 step, got "
                            f"{self.median_window!r} (e.g. 64)")
        if not self.confirm_max_s >= self.confirm_min_s:
            problems.append(f"confirm_max_s must be >= confirm_min_s={self.confirm_min_s!r}, "
                            f"got {self.confirm_max_s!r} (e.g. 60)")
        if problems:
            raise ValueError("invalid WatchdogSettings: " + "; ".join(problems))

    def bound(self, phase: str) -> float:
        """How long a rank may spend in a startup phase (one of ``STARTUP_PHASES``)."""
        if phase == "rendezvous":
            return self.rendezvous_timeout_s + self.dispatch_s
        value: float = getattr(self, STARTUP_PHASES[phase])
        return value

    def confirm_s(self, limit_s: float) -> float:
        """Seconds between the two looks at a generation silent past ``limit_s``."""
        return min(max(self.confirm_min_s, limit_s * self.confirm_share), self.confirm_max_s)


@dataclass(frozen=True, kw_only=True)
class Hang:
    """What the watchdog found: a generation that made no progress, and why it says so."""

    silent_s: float  # how long nothing progressed (a startup phase: how long the rank spent)
    limit_s: float  # the bound it passed
    why: str  # how the bound came about ("max(...)", or the setting)
    evidence: str  # what the call stacks (or the startup phases) showed
    detected_wall: float
    detected_mono: float
    phase: str = ""  # the startup phase the culprits are in; "" for a running generation
    #: The stuck ranks, whose workers are restarted; empty when none could be told apart
    #: (then every rank's is).
    culprits: tuple[int, ...] = ()


@dataclass
class Probe:
    """The watchdog's look at a silent running generation: the ranks' call stacks, twice."""

    since: float  # the last progress when the look began; progress ends the look
    asked: float  # when the stacks were last asked for
    limit_s: float  # the limit it was silent past, and why
    why: str
    first: dict[int, str] | None = None  # the stacks of the first look, rank -> stack
    first_at: float = 0.0  # when they came
    second_asked: bool = False
    said_slow: bool = False  # the "slow, not hung" event was published for this look


@dataclass(frozen=True)
class Slow:
    """The stacks moved while nothing progressed: slow, not hung (said once per look)."""

    silent_s: float
    limit_s: float


class GenerationWatch:
    """The watchdog's state for one generation: its progress, its ranks' startup phases, the
    look at it while it is silent, and the hang it found."""

    def __init__(self, settings: WatchdogSettings, started: float) -> None:
        self.settings = settings
        self.started = started
        self.last_progress = started
        self.step_times: deque[float] = deque(maxlen=settings.median_window)
        #: rank -> (the startup phase it is in, since when); a rank not in it is in rendezvous
        self.phases: dict[int, tuple[str, float]] = {}
        self.probe: Probe | None = None
        #: A startup bound ran out (the stacks are asked for) or the generation was declared
        #: hung; either way it ends as failed, with this as its cause.
        self.hang: Hang | None = None
        self.declared = False  # the hang's culprits' workers are being restarted

    # ------------------------------------------------------------------ what happened
    def progressed(self, now: float) -> None:
        """A step row arrived (from any rank)."""
        self.last_progress = now

    def record_steps(self, step_s: Iterable[float]) -> float:
        """Rank 0's step times, for the median; returns the longest of them that counts for
        the job's longest step (a generation's first step warms up: not counted), 0 if none."""
        longest = 0.0
        for seconds in step_s:
            if self.step_times:
                longest = max(longest, seconds)
            self.step_times.append(seconds)
        return longest

    def entered(self, rank: int, phase: str, now: float) -> None:
        """A rank reached a startup phase (``setup``, ``restore``, ``first step``)."""
        self.phases[rank] = (phase, now)

    def median_step(self) -> float:
        return statistics.median(self.step_times) if self.step_times else 0.0

    def limit(self, longest_step: float) -> tuple[float, str]:
        """How long the running generation may go without a step row, and why."""
        s = self.settings
        median = self.median_step()
        parts = {f"{s.hang_factor:g} x median step {median:.3f} s": s.hang_factor * median,
                 f"floor {s.hang_floor_s:g} s": s.hang_floor_s,
                 f"{s.longest_step_factor:g} x longest step {longest_step:.2f} s":
                 s.longest_step_factor * longest_step}
        return max(parts.values()), f"max({', '.join(parts)})"

    # ------------------------------------------------------------------ ticks
    def look(self, now: float, longest_step: float) -> bool:
        """A tick of a running generation not declared hung: True to ask for the ranks' call
        stacks (a first look, the confirming one, or a request unanswered too long)."""
        limit, why = self.limit(longest_step)
        probe = self.probe
        if probe is not None and probe.since != self.last_progress:
            self.probe = probe = None  # it progressed: whatever was slow has passed
        if now - self.last_progress <= limit:
            return False
        if probe is None:
            self.probe = Probe(since=self.last_progress, asked=now, limit_s=limit, why=why)
            return True
        if probe.first is None or probe.second_asked:
            if now - probe.asked > self.settings.answer_timeout_s:  # a busy scheduler: again
                probe.asked = now
                return True
            return False
        if now - probe.first_at >= self.settings.confirm_s(limit):
            probe.second_asked = True
            probe.asked = now
            return True
        return False

    def check_startup(self, now: float, wall: float, unfinished: Iterable[int]) -> bool:
        """A tick of a generation that has not stepped yet: True when a rank overran its
        phase's bound (the culprits are known; the stacks are asked for the record)."""
        if self.hang is not None:
            return False
        s = self.settings
        late: list[tuple[int, str, float]] = []
        for rank in unfinished:
            phase, since = self.phases.get(rank, ("rendezvous", self.started))
            if now - since > s.bound(phase):
                late.append((rank, phase, now - since))
        if not late:
            return False
        order = list(STARTUP_PHASES)
        first = min(order.index(phase) for _, phase, _ in late)
        late = [x for x in late if order.index(x[1]) == first]
        rank, phase, spent = late[0]
        setting, bound = STARTUP_PHASES[phase], s.bound(phase)
        self.hang = Hang(silent_s=spent, limit_s=bound, phase=phase,
                         why=f"{setting} {bound:g} s",
                         evidence=f"rank {rank} spent {spent:.1f} s in {phase} (bound "
                                  f"{bound:g} s, {setting})",
                         culprits=tuple(r for r, _, _ in late),
                         detected_wall=wall, detected_mono=now)
        return True

    # ------------------------------------------------------------------ the stacks
    def diagnosed(self, now: float, wall: float, culprits: tuple[int, ...],
                  stacks: Mapping[int, str], size: int) -> Hang | Slow | None:
        """The ranks' call stacks came (``culprits``: the ranks outside a collective). A
        :class:`Hang` to declare (restart its culprits' workers, every rank's when it has
        none), :class:`Slow` to say, or None (a first look, or nothing to do)."""
        if self.hang is not None and not self.declared:
            return self._declare(self.hang)  # a startup bound ran out: culprits are known
        probe = self.probe
        if probe is None or self.hang is not None:
            return None
        stacks = dict(stacks)
        if probe.first is None:
            probe.first, probe.first_at = stacks, now
            return None
        silent = now - self.last_progress
        first = probe.first
        # a rank waiting for its checkpoint writer counts as moving: the writer thread works
        unmoved = sorted(r for r in range(size)
                         if r in stacks and stacks.get(r) == first.get(r)
                         and not waits_for_checkpoint_writer(stacks[r]))
        stuck = tuple(r for r in culprits if r in unmoved)
        waited = now - probe.first_at
        give_up = silent > self.settings.give_up_factor * probe.limit_s
        if not stacks or stuck or len(unmoved) == size or give_up:
            return self._declare(Hang(
                silent_s=silent, limit_s=probe.limit_s, why=probe.why,
                evidence=self._evidence(stacks, stuck, waited, silent, give_up),
                detected_wall=wall, detected_mono=now, culprits=stuck))
        said, probe.said_slow = probe.said_slow, True
        probe.first, probe.first_at, probe.second_asked = stacks, now, False
        return None if said else Slow(silent_s=silent, limit_s=probe.limit_s)

    def _declare(self, hang: Hang) -> Hang:
        self.hang = hang
        self.declared = True
        self.probe = None
        return hang

    def _evidence(self, stacks: Mapping[int, str], stuck: tuple[int, ...], waited: float,
                  silent: float, give_up: bool) -> str:
        if stuck:
            return (f"rank {stuck[0]}'s call stack did not change in {waited:.1f} s, outside "
                    f"a collective, at {top_frame(stacks[stuck[0]])}")
        if not stacks:
            return "the ranks' call stacks could not be read"
        if give_up:
            return (f"still no step after {self.settings.give_up_factor:g} x the limit "
                    f"({silent:.1f} s)")
        where = "; ".join(f"rank {r} at {top_frame(stacks[r])}" for r in sorted(stacks)[:2])
        more = f"; {len(stacks) - 2} more ranks" if len(stacks) > 2 else ""
        return f"no rank's call stack changed in {waited:.1f} s ({where}{more})"


def top_frame(stack: str) -> str:
    """The innermost frame of a call stack text that is not the Python standard library's
    (``threading.Event().wait()`` in faults.py, not ``waiter.acquire()`` in threading.py),
    for a one-line cause."""
    frames = [f for f in stack.split('File "') if f.strip()]
    for frame in reversed(frames):
        path = frame.split('"', 1)[0]
        if "/lib/python" in path and "-packages/" not in path:
            continue
        where, _, code = frame.partition("\n")
        short = path.rsplit("/", 2)
        place = where.replace(path, "/".join(short[-2:])).replace('"', "").strip(" ,")
        text = f"{place}: {code.strip()}" if code.strip() else place
        return text[:200]
    lines = [line.strip() for line in stack.splitlines() if line.strip()]
    return lines[-1][:200] if lines else "(no frames)"
