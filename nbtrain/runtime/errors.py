"""Exceptions that cross from a rank to the notebook."""

from __future__ import annotations

PEER_ERROR_MARKERS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "DistBackendError",
    "NCCL communicator was aborted",
)


class RankFailure(Exception):
    """One rank of a job failed; carries where, when and the remote traceback as text."""

    def __init__(self, rank: int, step: int, host: str, error: str, traceback: str,
                 when: float, peer: bool) -> None:
        super().__init__(rank, step, host, error, traceback, when, peer)
        self.rank = rank
        self.step = step
        self.host = host
        self.error = error
        self.traceback = traceback
        self.when = when
        #: True when the failure looks like a consequence of another rank's death
        #: (a collective whose peer went away), not a cause.
        self.peer = peer

    def __str__(self) -> str:
        cause = " (a peer rank went away)" if self.peer else ""
        return (
            f"rank {self.rank} on {self.host} failed at step {self.step}{cause}: {self.error}\n"
            f"--- remote traceback (rank {self.rank}) ---\n{self.traceback}"
        )


def looks_like_peer_failure(text: str) -> bool:
    return any(marker in text for marker in PEER_ERROR_MARKERS)


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written, committed or read. ``path`` names the file."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = path
        self.problem = problem
