"""What the controller holds for a job besides the machine's record (:class:`JobAssets`),
how it keeps tokens (hashed), and the name it is registered under on the scheduler. Read by
the controller, its handlers and its pages, none of which needs the others for these.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, field
from typing import Any

from distributed import Future

from nbtrain.config import Settings
from nbtrain.core.job import JobSpec
from nbtrain.engine.joblog import JobLog
from nbtrain.engine.trackers import TrackerSink

__all__ = ["PLUGIN_NAME", "JobAssets", "token_hash", "token_matches"]

PLUGIN_NAME = "nbtrain"


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def token_matches(token: object, expected_hash: str) -> bool:
    """Whether ``token`` (a string) hashes to ``expected_hash``, compared in constant time."""
    return (isinstance(token, str) and bool(token) and bool(expected_hash)
            and hmac.compare_digest(token_hash(token), expected_hash))


@dataclass
class JobAssets:
    """What the engine holds for a job besides the machine's record: the recipe and where
    its checkpoints go (the machine needs neither to decide)."""

    spec: JobSpec
    recipe: bytes
    settings: Settings
    checkpoint_url: str
    restore: tuple[str, int | None] | None
    token_hash: str
    log: JobLog
    futures: dict[int, dict[int, Future]] = field(default_factory=dict)  # gen -> rank -> future
    rendezvous: dict[int, dict[str, Any]] = field(default_factory=dict)  # gen -> host, port
    result: bytes | None = None  # a training function's return value on rank 0, pickled
    result_error: str | None = None
    trackers: TrackerSink | None = None  # TensorBoard / MLflow, fed from here
    #: The status of a job the machine does not hold: one that had ended before this
    #: controller started, read back from the journal.
    final: dict[str, Any] | None = None
