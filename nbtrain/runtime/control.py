"""Controller -> ranks control plane.

The controller keeps each generation's control flags (stop, preempt, checkpoint requests).
Rank 0 follows them from a background thread with a long-poll (``nbtrain_control`` on the
scheduler returns as soon as they change), so the step loop never waits on the scheduler and
a request reaches the rank within milliseconds. Ranks agree on the requests with one tiny
all-reduce (MAX) at agreed step boundaries, so every rank acts on the same step and no rank is
left alone in a collective.

The all-reduce costs ~0.1-2 ms on CPU gloo, a lot for a 5 ms step, so ranks do not agree every
step: each agreement also fixes the step of the next one, about ``interval_s`` of training
later (the minimum of every rank's proposal, so all ranks hold the same schedule). Nor do
they wait on it: a rank offers its requests at one step boundary (``offer``, an asynchronous
all-reduce) and every rank acts on the result at the next one (``agreed``), so the
all-reduce runs while that step trains. A request is acted on one step later than it
would be with a blocking agreement, on the same step on every rank.

Live knob changes ride on the same agreement: the controller's pending changes reach rank 0
with the flags, rank 0 offers the newest one's number in the all-reduce, and when the
agreed number is new every rank receives those changes from rank 0 (one broadcast, only
then) and applies them at this very step (``agreed_knobs``).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from distributed import Client

#: Requests, in vector order. ``checkpoint`` is a sequence number: a new number = a new request.
#: ``halt``: stop without the final checkpoint (the state is bad, e.g. a NaN loss). ``due`` is
#: set by a rank itself (its time-based checkpoint policy says a checkpoint is due): keep it
#: last.
FLAGS = ("stop", "preempt", "checkpoint", "halt", "due")
#: Upper bound on steps between agreements, whatever the step time.
MAX_INTERVAL_STEPS = 64
#: How long one long-poll waits for a change before it asks again.
POLL_TIMEOUT_S = 2.0


class ControlChannel:
    """Rank-side view of the generation's control flags."""

    def __init__(self, job_id: str, rank: int, generation: int, client: Client,
                 retry_s: float, device: torch.device,
                 initial: Mapping[str, int] | None = None, secret: str = "") -> None:
        self._requested = torch.zeros(len(FLAGS), dtype=torch.int64)
        # Flags, the newest knob change rank 0 offers, then the negated interval proposal
        # (MAX of negatives = MIN of proposals).
        self._agreed = torch.zeros(len(FLAGS) + 2, dtype=torch.int64, device=device)
        self._rank = rank
        self._knobs: list[dict[str, Any]] = []  # pending changes (rank 0 follows them)
        #: The newest knob change applied (set by the loop from the job's history).
        self.knob_seq = 0
        #: The knob changes agreed at the last agreement (empty: none), in seq order.
        self.agreed_knobs: list[dict[str, Any]] = []
        self._offered: list[dict[str, Any]] = []  # the knob changes of the offer in flight
        self._work: Any = None  # the in-flight agreement's all-reduce (``offer``)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.ended = False  # the controller says this generation is over
        self._set(initial or {})
        if rank == 0:
            self._thread = threading.Thread(
                target=self._follow, args=(client, job_id, generation, retry_s, secret),
                name="nbtrain-control", daemon=True)
            self._thread.start()

    def _set(self, flags: Mapping[str, Any]) -> None:
        with self._lock:
            for i, flag in enumerate(FLAGS[:-1]):
                self._requested[i] = int(flags.get(flag, 0))

    def requested(self) -> dict[str, int]:
        """The flags as this rank knows them now (rank 0: as the controller last said; other
        ranks: as at launch), before any agreement."""
        with self._lock:
            return dict(zip(FLAGS[:-1], (int(v) for v in self._requested.tolist()[:-1]),
                            strict=True))

    def set_knobs(self, pending: Any) -> None:
        """The controller's pending knob changes (what rank 0's long-poll brought)."""
        if isinstance(pending, list | tuple):
            with self._lock:
                self._knobs = sorted((dict(c) for c in pending if isinstance(c, Mapping)),
                                     key=lambda c: int(c.get("seq", 0)))

    def _follow(self, client: Client, job_id: str, generation: int, retry_s: float,
                secret: str) -> None:
        version = 0
        while not self._stop.is_set():
            try:
                reply: Any = client.sync(client.scheduler.nbtrain_control,  # type: ignore[union-attr]
                                         job_id=job_id,
                                         generation=generation, version=version,
                                         secret=secret,
                                         timeout=POLL_TIMEOUT_S,
                                         callback_timeout=POLL_TIMEOUT_S + 30)
            except Exception:  # the scheduler is busy or restarting: ask again soon
                self._stop.wait(retry_s)
                continue
            if not isinstance(reply, Mapping) or not reply.get("ok"):
                self._stop.wait(retry_s)
                continue
            if reply.get("ended"):
                self.ended = True
                return
            version = int(reply["version"])
            self._set(reply.get("flags", {}))
            self.set_knobs(reply.get("knobs", []))

    def offer(self, proposed_interval: int, due: bool = False) -> None:
        """Collective, started here and finished by ``agreed()`` one step later on every
        rank: offer this rank's requests, and its wish for the steps until the next
        agreement (from its own step time). The all-reduce runs while the next step
        trains, so no rank waits on it at this boundary.
        """
        if self._work is not None:
            raise RuntimeError("offer() while an agreement is in flight: call agreed() first")
        with self._lock:
            self._agreed[: len(FLAGS)].copy_(self._requested)
            self._offered = [c for c in self._knobs if int(c["seq"]) > self.knob_seq]
        n = len(FLAGS)
        self._agreed[n - 1] = int(due)
        self._agreed[n] = max((int(c["seq"]) for c in self._offered), default=0)
        self._agreed[n + 1] = -max(1, min(MAX_INTERVAL_STEPS, proposed_interval))
        self._work = dist.all_reduce(self._agreed, op=dist.ReduceOp.MAX, async_op=True)

    @property
    def in_flight(self) -> bool:
        """An ``offer()`` waits for its ``agreed()``."""
        return self._work is not None

    def agreed(self) -> tuple[dict[str, int], int]:
        """Collective: the requests every rank acts on now (what the last ``offer()``
        agreed), and the agreed interval: the smallest wish, clamped to
        1..MAX_INTERVAL_STEPS."""
        work, self._work = self._work, None
        if work is None:
            raise RuntimeError("agreed() without an offer() in flight")
        work.wait()
        n = len(FLAGS)
        values = [int(v) for v in self._agreed.tolist()]
        self.agreed_knobs = []
        if values[n] > self.knob_seq:  # rare: a new change; every rank knows it from here
            box: list[Any] = [[c for c in self._offered if int(c["seq"]) <= values[n]]
                              if self._rank == 0 else None]
            dist.broadcast_object_list(box, src=0, device=self._agreed.device)
            self.agreed_knobs = list(box[0] or [])
            self.knob_seq = values[n]
        return dict(zip(FLAGS, values[:n], strict=True)), -values[n + 1]

    def drain(self) -> None:
        """The loop ended with an agreement in flight (every rank offered it): finish it
        without acting on it, before the final checkpoint and the group's end (collectives
        a training function issues after its loop pair up behind it, in the same order on
        every rank)."""
        work, self._work = self._work, None
        if work is not None:
            work.wait()

    def close(self) -> None:
        """Stop following (the thread ends after its current long-poll, at most a couple of
        seconds later; the controller ends it at once when the generation ends)."""
        self._stop.set()
