"""Seals on what ranks send the controller: only a generation's own ranks can speak for it.

The controller draws a random secret for each generation it launches and hands it to that
generation's ranks with their launch (never in events, pages or the journal). Each event a
rank sends carries a sequence number and a seal: an HMAC of (job, generation, rank, sequence
number, kind) under the secret. The controller accepts an event whose seal is right and whose
number it has not seen from that rank, so another client can neither forge an event (it has
no secret) nor replay one it saw on Dask's event topic (its number is spent). The rendezvous
and control long-polls carry the secret itself (they go to the scheduler, not a topic).

Pure: stdlib ``hmac`` only, no clock.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, field

__all__ = ["RankSeals", "seal", "secret_matches"]

#: Sequence numbers below a rank's newest one that may still arrive (out of order).
WINDOW = 1024


def seal(secret: str, job_id: str, generation: int, rank: int, seq: int, kind: str) -> str:
    """The seal of one rank event."""
    body = f"{job_id}|{generation}|{rank}|{seq}|{kind}".encode()
    return hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()[:32]


def secret_matches(given: object, expected: str) -> bool:
    """``given`` is the generation's secret (constant-time)."""
    return (isinstance(given, str) and bool(expected)
            and hmac.compare_digest(given.encode(), expected.encode()))


@dataclass
class _Seen:
    newest: int = -1
    recent: set[int] = field(default_factory=set)  # numbers within WINDOW below ``newest``


class RankSeals:
    """The secrets of the generations a controller launched, and the numbers each rank has
    spent. Bounded: a generation's entry goes when it ends."""

    def __init__(self) -> None:
        self._secrets: dict[tuple[str, int], str] = {}
        self._seen: dict[tuple[str, int, int], _Seen] = {}

    def open(self, job_id: str, generation: int, secret: str) -> None:
        self._secrets[(job_id, generation)] = secret

    def close(self, job_id: str, generation: int) -> None:
        """Refuse the generation's messages from now on (and forget what it spent)."""
        self._secrets.pop((job_id, generation), None)
        for key in [k for k in self._seen if k[:2] == (job_id, generation)]:
            del self._seen[key]

    def forget(self, job_id: str) -> None:
        """Close every generation of a job."""
        for key in [k for k in self._secrets if k[0] == job_id]:
            self.close(*key)

    def secret(self, job_id: str, generation: int) -> str:
        """The generation's secret ("" when it is not open)."""
        return self._secrets.get((job_id, generation), "")

    def admits(self, job_id: str, generation: int, rank: int, seq: object, kind: str,
               given: object) -> bool:
        """Whether an event is its rank's own and new; spends its number if so."""
        secret = self._secrets.get((job_id, generation))
        if secret is None or not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
            return False
        expected = seal(secret, job_id, generation, rank, seq, kind)
        if not (isinstance(given, str)
                and hmac.compare_digest(given.encode(), expected.encode())):
            return False
        seen = self._seen.setdefault((job_id, generation, rank), _Seen())
        if seq > seen.newest:
            if seen.newest >= 0:
                seen.recent.add(seen.newest)
            seen.newest = seq
            if len(seen.recent) > WINDOW:  # numbers below the window are refused anyway
                seen.recent = {n for n in seen.recent if n > seq - WINDOW}
            return True
        if seq == seen.newest or seq in seen.recent or seq <= seen.newest - WINDOW:
            return False
        seen.recent.add(seq)
        return True
