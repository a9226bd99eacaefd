"""What a planned fault is: kind, rank, step (pure data; the rank runtime fires them).

Faults are planned at submit time (``submit(..., faults=[Fault("kill", rank=1, step=30)])``) or
sent to a running job (``job.inject("slow", rank=1, factor=2.0)``). The controller keeps them
and remembers which have fired, so a job that recovers to a step before a one-shot fault does
not hit it again; :mod:`nbtrain.runtime.faults` fires them inside the rank.

Kinds:
- ``kill``: SIGKILL this rank's worker process (the nanny starts a new one).
- ``raise``: raise an exception in the rank (a user-code exception).
- ``hang``: stop making progress (sleep ``duration_s``, forever by default) without exiting.
- ``slow``: make this rank's compute ``factor`` times slower from ``step`` on (persistent until
  a ``slow`` with factor 1 replaces it); the rank sleeps ``(factor - 1) x`` its compute time.
"""

from __future__ import annotations

import uuid
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["KINDS", "Fault"]

KINDS = ("kill", "raise", "hang", "slow")


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int | None = None  # None: at the next step boundary
    factor: float = 1.0  # slow only
    duration_s: float | None = None  # hang only; None = forever
    id: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"fault kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not isinstance(self.rank, int) or self.rank < 0:
            raise ValueError(f"fault rank must be an integer >= 0, got {self.rank!r}")
        if self.step is not None and (not isinstance(self.step, int) or self.step < 1):
            raise ValueError(f"fault step must be an integer >= 1 or None, got {self.step!r}")
        if self.kind == "slow" and not self.factor >= 1.0:
            raise ValueError(f"slow factor must be >= 1.0 (1.0 clears), got {self.factor}")
        if not self.id:
            # Unique, not a clock: two faults planned in the same instant stay distinct.
            object.__setattr__(self, "id", f"{self.kind}-r{self.rank}-s{self.step}-"
                                           f"{uuid.uuid4().hex[:8]}")

    @property
    def one_shot(self) -> bool:
        """Fires once per job (all but ``slow``, which sets a lasting factor)."""
        return self.kind != "slow"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Fault:
        return cls(**{k: data[k] for k in ("kind", "rank", "step", "factor", "duration_s", "id")
                      if k in data})
