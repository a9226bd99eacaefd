"""What to do about stragglers: mitigation policies (pure: verdicts and time in, actions out).

The detector says who is slow; a policy decides what to do, and the engine does it. Policies
read no clock: the engine passes its own time in ``MitigationContext.now``, so a unit test can
drive hours of flapping in microseconds and the simulator replays the same decisions.

- ``alert`` (default): one alert per confirmed straggler episode (from suspects on with
  ``alert_on="suspect"``), never an action on the job. A rank that clears and comes back
  within ``alert_cooldown_s`` is not re-alerted.
- ``replace``: alerts as above and, for a *confirmed* straggler that costs the job at least
  ``min_step_share`` of a step and has stayed confirmed without a break for ``persist_s``,
  restarts the gang with the slow slot swapped for a spare and the slow host (or slot)
  excluded for ``exclude_for_s``. At most one restart per ``cooldown_s``, so a flapping rank
  cannot cause a restart storm; a verdict that came up during the cooldown is acted on after
  it only if it stayed confirmed throughout. A deferred or impossible replacement is itself
  an event with its reason.

Every decision is an :class:`Action` with a ``reason`` written for the notebook. New policies
(``shrink`` will come with elastic resizing) register a factory with :func:`register_policy`.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from nbtrain.core.records import Phase
from nbtrain.core.straggler import Diagnosis, Verdict, ratio_text


class ActionKind(str, enum.Enum):
    """What the engine is asked to do (or only to tell the user)."""

    ALERT = "alert"  # tell the user; nothing happens to the job
    REPLACE = "replace"  # restart the gang with ``rank`` moved to ``spare``
    INCLUDE = "include"  # an exclusion expired: the host or slot may be used again


class ExcludeScope(str, enum.Enum):
    """What a replacement keeps away from the job for a while."""

    HOST = "host"  # the whole host: throttling, a noisy neighbour, a bad NIC
    SLOT = "slot"  # only the slow slot: single-host clusters, or a bad device among good ones


@dataclass(frozen=True)
class SlotInfo:
    """A slot (one Dask worker owning one device) and the host it lives on."""

    slot: str
    host: str


@dataclass(frozen=True, kw_only=True)
class MitigationContext:
    """What the engine knows when it asks for a decision."""

    now: float
    """Seconds on the engine's clock (monotonic); only differences matter."""
    step: int
    """The job's current step, for the record."""
    placement: Mapping[int, SlotInfo] = field(default_factory=dict)
    """Where each rank of the current generation runs."""
    spares: Sequence[SlotInfo] = ()
    """Free slots that could take a rank (the engine's inventory, any host)."""


@dataclass(frozen=True, kw_only=True)
class Action:
    """One decision with its reason; also the event the notebook shows."""

    kind: ActionKind
    reason: str
    time: float
    step: int
    level: str = "info"
    """"warning" (suspect), "critical" (confirmed), or "info"."""
    rank: int | None = None
    phase: Phase | None = None
    slot: SlotInfo | None = None
    """The slot the rank runs on (or, for include, the host/slot let back in)."""
    spare: SlotInfo | None = None
    """Replace: the slot that takes the rank over."""
    exclude: str | None = None
    """Replace: the host or slot name kept away; include: the one let back in."""
    exclude_until: float | None = None
    diagnosis: Diagnosis | None = None

    def to_event(self) -> dict[str, Any]:
        """A plain dict for the event plane and ``job.alerts`` (JSON-friendly)."""
        return {
            "topic": "mitigation",
            "kind": self.kind.value,
            "level": self.level,
            "reason": self.reason,
            "time": self.time,
            "step": self.step,
            "rank": self.rank,
            "phase": self.phase.value if self.phase is not None else None,
            "slot": self.slot.slot if self.slot is not None else None,
            "host": self.slot.host if self.slot is not None else None,
            "spare_slot": self.spare.slot if self.spare is not None else None,
            "spare_host": self.spare.host if self.spare is not None else None,
            "exclude": self.exclude,
            "exclude_until": self.exclude_until,
            "diagnosis": self.diagnosis.to_event() if self.diagnosis is not None else None,
        }


@dataclass(frozen=True, kw_only=True)
class MitigationSettings:
    """Settings of the mitigation policies; validated on construction."""

    policy: str = "alert"
    """Name of a registered policy: "alert" or "replace" (see ``policy_names()``)."""
    alert_on: Verdict = Verdict.CONFIRMED
    """Alert from this verdict on: confirmed (default: what is worth acting on) or suspect
    (the early signal, which on a busy machine also fires for passing slowdowns)."""
    alert_cooldown_s: float = 60.0
    """A (rank, phase) that cleared is not alerted again within this many seconds."""
    cooldown_s: float = 600.0
    """At most one gang restart for stragglers per this many seconds. Should be several times
    the restart cost (restore from checkpoint plus warm-up), or replacing loses more than the
    straggler costs."""
    persist_s: float = 30.0
    """Replace only a straggler confirmed without a break for this many seconds (and, when it
    came up during the cooldown, through to its end). Should be longer than the slowdowns
    you expect to pass by themselves (another job's burst on a shared host)."""
    exclude: ExcludeScope = ExcludeScope.HOST
    """What a replacement excludes: the slow host, or only the slow slot."""
    exclude_for_s: float = 1800.0
    """How long an excluded host or slot stays out."""
    min_step_share: float = 0.05
    """Replace only a straggler that costs at least this share of a step; below it a restart
    costs more than it saves, and the straggler is only alerted."""

    def __post_init__(self) -> None:
        problems: list[str] = []
        if not isinstance(self.policy, str) or not self.policy:
            problems.append(f"policy must be a policy name such as 'alert', got {self.policy!r}")
        try:
            alert_on = Verdict(self.alert_on)
        except ValueError:
            alert_on = Verdict.CLEARED
        if alert_on is Verdict.CLEARED:
            problems.append(f"alert_on must be 'suspect' or 'confirmed', got {self.alert_on!r}")
        else:
            object.__setattr__(self, "alert_on", alert_on)
        try:
            object.__setattr__(self, "exclude", ExcludeScope(self.exclude))
        except ValueError:
            problems.append(f"exclude must be 'host' or 'slot', got {self.exclude!r}")
        for name in ("alert_cooldown_s", "cooldown_s", "persist_s", "exclude_for_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value >= 0):
                problems.append(f"{name} must be a number of seconds >= 0, got {value!r}")
        if not 0.0 <= self.min_step_share < 1.0:
            problems.append(f"min_step_share must be in [0, 1), got {self.min_step_share!r}")
        if problems:
            raise ValueError("invalid MitigationSettings: " + "; ".join(problems))


class MitigationPolicy(Protocol):
    """What the engine calls after each batch of step records it fed to the detector."""

    name: str

    @property
    def settings(self) -> MitigationSettings: ...

    def decide(self, verdicts: Sequence[Diagnosis], ctx: MitigationContext) -> list[Action]:
        """Actions for the current verdicts.

        ``verdicts`` is the detector's *full* current set (``StragglerDetector.active()``):
        a pair missing from it has cleared. Call it after every batch, with or without changes.
        """
        ...

    def excluded(self, now: float) -> Mapping[str, float]:
        """Hosts or slots kept away from this job's placements, with the time they return."""
        ...

    def update_settings(self, **changes: Any) -> MitigationSettings:
        """Change settings while the job runs; the policy keeps its memory."""
        ...


_Key = tuple[int, Phase]
_LEVEL = {Verdict.SUSPECT: "warning", Verdict.CONFIRMED: "critical"}


class AlertPolicy:
    """Alert once per straggler episode and once more when it is confirmed; act on nothing."""

    name = "alert"

    def __init__(self, settings: MitigationSettings | None = None) -> None:
        self._settings = settings if settings is not None else MitigationSettings()
        self._active: set[_Key] = set()  # pairs suspect or confirmed at the last call
        self._alerted: dict[_Key, Verdict] = {}  # highest verdict alerted in this episode
        self._muted: set[_Key] = set()  # episodes that began within alert_cooldown_s
        self._last_alert: dict[_Key, float] = {}  # time of the last alert per pair
        self.suppressed = 0
        """Episodes not alerted because the pair flapped back within ``alert_cooldown_s``."""

    @property
    def settings(self) -> MitigationSettings:
        return self._settings

    def update_settings(self, **changes: Any) -> MitigationSettings:
        self._settings = dataclasses.replace(self._settings, **changes)
        return self._settings

    def excluded(self, now: float) -> Mapping[str, float]:
        del now
        return {}

    def decide(self, verdicts: Sequence[Diagnosis], ctx: MitigationContext) -> list[Action]:
        return self._alerts(verdicts, ctx)

    def _alerts(self, verdicts: Sequence[Diagnosis], ctx: MitigationContext) -> list[Action]:
        s = self._settings
        current = {(d.rank, d.phase): d for d in verdicts if d.state is not Verdict.CLEARED}
        for key in [k for k in self._active if k not in current]:  # episodes that ended
            self._active.discard(key)
            self._alerted.pop(key, None)
            self._muted.discard(key)
        actions = []
        for key in sorted(current, key=lambda k: (k[0], k[1].value)):
            d = current[key]
            if key not in self._active:
                self._active.add(key)
                last = self._last_alert.get(key)
                if last is not None and ctx.now - last < s.alert_cooldown_s:
                    self._muted.add(key)  # flapping: back too soon after the last alert
                    self.suppressed += 1
            level = _rank(d.state)
            if level < _rank(s.alert_on) or level <= _rank(self._alerted.get(key, Verdict.CLEARED)):
                continue
            if key in self._muted and d.state is not Verdict.CONFIRMED:
                continue  # a muted episode still escalates once: confirmed means persistent
            self._alerted[key] = d.state
            self._last_alert[key] = ctx.now
            actions.append(
                Action(
                    kind=ActionKind.ALERT,
                    level=_LEVEL[d.state],
                    reason=d.summary(),
                    time=ctx.now,
                    step=ctx.step,
                    rank=d.rank,
                    phase=d.phase,
                    slot=ctx.placement.get(d.rank),
                    diagnosis=d,
                )
            )
        return actions


class ReplacePolicy(AlertPolicy):
    """Alert, and swap a confirmed straggler's slot for a spare, with a restart cooldown."""

    name = "replace"

    def __init__(self, settings: MitigationSettings | None = None) -> None:
        super().__init__(settings)
        self._exclusions: dict[str, float] = {}  # host or slot name -> time it may return
        self._last_replace: float | None = None
        self._noted: dict[_Key, str] = {}  # why a confirmed pair was not replaced, told once
        self._pending: dict[int, SlotInfo] = {}  # rank -> slot it is being moved away from
        self._confirmed_at: dict[_Key, float] = {}  # when each pair's confirmed run began
        self.replacements = 0

    def excluded(self, now: float) -> Mapping[str, float]:
        return {name: until for name, until in self._exclusions.items() if until > now}

    def decide(self, verdicts: Sequence[Diagnosis], ctx: MitigationContext) -> list[Action]:
        s = self._settings
        actions = self._expire(ctx)
        actions += self._alerts(verdicts, ctx)
        confirmed = sorted(
            (d for d in verdicts if d.state is Verdict.CONFIRMED),
            key=lambda d: (-_finite(d.step_share), d.rank, d.phase.value),
        )
        self._track(confirmed, ctx)
        if not confirmed:
            return actions

        last = self._last_replace
        in_cooldown = last is not None and ctx.now - last < s.cooldown_s
        taken: set[str] = set()
        moved: set[int] = set()
        replaced: list[Action] = []
        for d in confirmed:
            key = (d.rank, d.phase)
            where = ctx.placement.get(d.rank)
            if d.rank in moved or (where is not None and self._pending.get(d.rank) == where):
                continue  # being replaced: the restart has not happened yet
            if not _finite(d.step_share) >= s.min_step_share:
                self._note(actions, d, ctx, "small", (
                    f"rank {d.rank} {d.phase.value} is confirmed slow but costs only "
                    f"{_finite(d.step_share):.1%} of a step (replace threshold "
                    f"min_step_share={s.min_step_share:.0%}); alerting only"
                ))
                continue
            held = ctx.now - self._confirmed_at[key]
            if held < s.persist_s:
                continue  # not yet shown to persist: the alert has told the user already
            if where is None:
                self._note(actions, d, ctx, "unplaced", (
                    f"rank {d.rank} is confirmed slow but the engine gave no slot for it; "
                    "cannot replace, alerting only"
                ))
                continue
            if in_cooldown and last is not None:
                self._note(actions, d, ctx, "cooldown", (
                    f"rank {d.rank} on {where.host} ({d.phase.value}) is confirmed slow; the "
                    f"last straggler restart was {ctx.now - last:.0f} s ago, so replacing "
                    f"waits {last + s.cooldown_s - ctx.now:.0f} s more for the cooldown "
                    f"(cooldown_s={s.cooldown_s:.0f}), and happens then only if it stays "
                    "confirmed until then"
                ))
                continue
            spare = self._pick_spare(where, ctx, taken)
            if spare is None:
                scope = "host" if s.exclude is ExcludeScope.HOST else "slot"
                hint = (
                    "; set exclude='slot' to replace within the same host"
                    if s.exclude is ExcludeScope.HOST
                    and any(sp.host == where.host for sp in ctx.spares)
                    else "; add workers to the cluster to give the job a spare"
                )
                self._note(actions, d, ctx, "nospare", (
                    f"rank {d.rank} on {where.host} ({d.phase.value}) is confirmed slow but no "
                    f"spare slot is free outside the slow {scope} and the excluded ones "
                    f"({len(ctx.spares)} spare(s) in all); alerting only{hint}"
                ))
                continue
            taken.add(spare.slot)
            moved.add(d.rank)
            self._pending[d.rank] = where
            name = where.host if s.exclude is ExcludeScope.HOST else where.slot
            until = ctx.now + s.exclude_for_s
            self._exclusions[name] = until
            replaced.append(
                Action(
                    kind=ActionKind.REPLACE,
                    level="critical",
                    reason=(
                        f"replace rank {d.rank}: {d.phase.value} "
                        f"{ratio_text(d.ratio, d.peer_s)} since step {d.since_step} "
                        f"({_finite(d.step_share):.0%} of each step, confirmed for "
                        f"{held:.0f} s); moving it from {where.slot} on {where.host} to "
                        f"{spare.slot} on {spare.host} and excluding {s.exclude.value} "
                        f"{name} for {s.exclude_for_s:.0f} s"
                    ),
                    time=ctx.now,
                    step=ctx.step,
                    rank=d.rank,
                    phase=d.phase,
                    slot=where,
                    spare=spare,
                    exclude=name,
                    exclude_until=until,
                    diagnosis=d,
                )
            )
            self._noted.pop(key, None)
        if replaced:
            # all swaps of this decision share one restart, so one cooldown
            self._last_replace = ctx.now
            self.replacements += len(replaced)
        return actions + replaced

    def _track(self, confirmed: Sequence[Diagnosis], ctx: MitigationContext) -> None:
        """When each confirmed run began, the replacements still under way, and the notes
        of runs that go on."""
        live = {(d.rank, d.phase) for d in confirmed}
        # a confirmed run that breaks (cleared, or back to suspect) starts over
        self._confirmed_at = {
            k: since for k, since in self._confirmed_at.items() if k in live}
        for key in live:
            self._confirmed_at.setdefault(key, ctx.now)
        # a replacement is carried out once the rank runs somewhere else
        self._pending = {
            r: slot for r, slot in self._pending.items() if ctx.placement.get(r) == slot
        }
        self._noted = {k: v for k, v in self._noted.items() if k in live}

    def _pick_spare(
        self, where: SlotInfo, ctx: MitigationContext, taken: set[str]
    ) -> SlotInfo | None:
        s = self._settings
        blocked = self.excluded(ctx.now)
        placed = {p.slot for p in ctx.placement.values()}
        candidates = [
            sp for sp in ctx.spares
            if sp.slot not in taken and sp.slot not in placed
            and sp.slot not in blocked and sp.host not in blocked
            and not (s.exclude is ExcludeScope.HOST and sp.host == where.host)
            and sp.slot != where.slot
        ]
        hosts_in_use = {p.host for p in ctx.placement.values()}
        # prefer hosts the job does not use yet: a different fault domain from the slow one
        candidates.sort(key=lambda sp: (sp.host in hosts_in_use, sp.host, sp.slot))
        return candidates[0] if candidates else None

    def _note(
        self, actions: list[Action], d: Diagnosis, ctx: MitigationContext, why: str, reason: str
    ) -> None:
        """Tell once per episode and reason why a confirmed straggler was not replaced."""
        key = (d.rank, d.phase)
        if self._noted.get(key) == why:
            return
        self._noted[key] = why
        actions.append(
            Action(
                kind=ActionKind.ALERT,
                level="critical",
                reason=reason,
                time=ctx.now,
                step=ctx.step,
                rank=d.rank,
                phase=d.phase,
                slot=ctx.placement.get(d.rank),
                diagnosis=d,
            )
        )

    def _expire(self, ctx: MitigationContext) -> list[Action]:
        actions = []
        for name, until in sorted(self._exclusions.items()):
            if until <= ctx.now:
                del self._exclusions[name]
                actions.append(
                    Action(
                        kind=ActionKind.INCLUDE,
                        reason=(
                            f"exclusion of {self._settings.exclude.value} {name} expired "
                            f"(exclude_for_s={self._settings.exclude_for_s:.0f}); it may take "
                            "ranks again"
                        ),
                        time=ctx.now,
                        step=ctx.step,
                        exclude=name,
                    )
                )
        return actions


def _rank(v: Verdict) -> int:
    return {Verdict.CLEARED: 0, Verdict.SUSPECT: 1, Verdict.CONFIRMED: 2}[v]


def _finite(x: float) -> float:
    return x if x == x and abs(x) != float("inf") else 0.0


PolicyFactory = Callable[[MitigationSettings], MitigationPolicy]

_REGISTRY: dict[str, PolicyFactory] = {"alert": AlertPolicy, "replace": ReplacePolicy}


def register_policy(name: str, factory: PolicyFactory) -> None:
    """Make a policy available by name (``shrink`` will register here).

    Registering the same factory again is a no-op; another factory under a taken name is an
    error, so two plugins cannot silently replace each other.
    """
    existing = _REGISTRY.get(name)
    if existing is not None and existing is not factory:
        raise ValueError(
            f"a mitigation policy named {name!r} is already registered ({existing!r}); "
            "pick another name"
        )
    _REGISTRY[name] = factory


def policy_names() -> tuple[str, ...]:
    return tuple(sorted(_REGISTRY))


def make_policy(settings: MitigationSettings | None = None) -> MitigationPolicy:
    """The policy named by ``settings.policy``, in its initial state."""
    s = settings if settings is not None else MitigationSettings()
    factory = _REGISTRY.get(s.policy)
    if factory is None:
        raise ValueError(
            f"unknown mitigation policy {s.policy!r}: choose one of {list(policy_names())} "
            "('shrink' comes with elastic resizing)"
        )
    return factory(s)


__all__ = [
    "Action",
    "ActionKind",
    "AlertPolicy",
    "ExcludeScope",
    "MitigationContext",
    "MitigationPolicy",
    "MitigationSettings",
    "PolicyFactory",
    "ReplacePolicy",
    "SlotInfo",
    "make_policy",
    "policy_names",
    "register_policy",
]
