"""The client's line to the controller: calls, and one follower thread per cluster.

Job handles are mirrors: the controller (inside the Dask scheduler) owns every job's state,
and a handle holds what it last heard. One daemon thread per :class:`~nbtrain.engine.cluster.
Cluster` long-polls ``nbtrain_follow`` for all the handles it follows: the call returns as
soon as any of them has new step rows, events or a new state (or every couple of seconds with
fresh statuses), so handles are current within milliseconds and the kernel never waits.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from typing import Any, Protocol

from distributed import Client

from nbtrain.engine.wire import ControllerError, raise_for

logger = logging.getLogger(__name__)

__all__ = ["Follower", "Mirror", "Remote"]


class Mirror(Protocol):
    """What the follower keeps current (a ``JobHandle``)."""

    @property
    def id(self) -> str: ...
    def follow_position(self) -> tuple[int, int, int]: ...
    @property
    def token(self) -> str: ...
    def follow_update(self, update: Mapping[str, Any]) -> None: ...
    def follow_lost(self, exc: BaseException, since: float | None = None) -> None: ...
    def follow_finished(self) -> bool: ...

#: How long one follow call may wait for news before it returns statuses alone.
FOLLOW_TIMEOUT_S = 2.0
#: Timeout of a plain call to the controller.
CALL_TIMEOUT_S = 60.0
#: A follow call that has not returned this long after its own timeout counts as the
#: controller being unreachable (a dead scheduler: Dask's connect retries for 30 s).
UNREACHABLE_AFTER_S = 2.0
#: An outage of the controller this long is always noticed by a followed handle: a follow
#: call in flight fails at once, one started while the controller is down fails by its
#: timeout (Dask retries a refused connection until then). One shorter than this may pass
#: unnoticed, when no call was in flight and the controller is back before the next
#: connects; the job's ``faults`` record every restart of the controller either way.
NOTICE_WITHIN_S = FOLLOW_TIMEOUT_S + UNREACHABLE_AFTER_S
#: Longest pause between the follower's tries to reach a lost controller.
RETRY_MAX_S = 2.0


class Remote:
    """Calls the controller's handlers through a Dask client (from any thread but the
    client's own event loop)."""

    def __init__(self, client: Client, operator_token: str = "") -> None:
        self.client = client
        self.operator_token = operator_token
        self.address = str(client.scheduler.address) if client.scheduler else ""
        self._security = getattr(client, "security", None)
        self._lock = threading.Lock()
        #: Clients this Remote made to replace one that gave up reconnecting (closed by us).
        self.made: list[Client] = []

    def _live_client(self) -> Client:
        """The client, or a new one to the same address when Dask closed it (a client whose
        scheduler stays away longer than its connect timeout closes itself)."""
        with self._lock:
            if self.client.status in ("closed", "closing") and self.address:
                self.client = Client(self.address, security=self._security,
                                     set_as_default=False, timeout=5)
                self.made.append(self.client)
            return self.client

    def call(self, op: str, *, rpc_timeout: float = CALL_TIMEOUT_S, **kwargs: Any
             ) -> Mapping[str, Any]:
        try:
            client = self._live_client()
            reply = client.sync(getattr(client.scheduler, op), callback_timeout=rpc_timeout,
                                **kwargs)
        except (OSError, TimeoutError) as exc:
            raise ControllerError(f"the nbtrain controller did not answer {op}: "
                                  f"{type(exc).__name__}: {exc}") from exc
        if not isinstance(reply, Mapping):
            raise ControllerError(
                f"the Dask scheduler does not run nbtrain's controller (reply to {op}: "
                f"{reply!r}); connect with nbtrain.connect(), which registers it")
        return raise_for(reply)


class Follower:
    """Keeps the handles of one cluster current (a daemon thread, started on first use)."""

    def __init__(self, remote: Remote) -> None:
        self.remote = remote
        self._handles: dict[str, Mirror] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self.errors = 0
        self.lost_at: float | None = None

    def follow(self, handle: Mirror) -> None:
        with self._lock:
            self._handles[handle.id] = handle
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="nbtrain-follower",
                                                daemon=True)
                self._thread.start()
        self._wake.set()

    def close(self) -> None:
        self._closed.set()
        self._wake.set()

    def _run(self) -> None:
        while not self._closed.is_set():
            with self._lock:
                handles = {jid: h for jid, h in self._handles.items() if not h.follow_finished()}
                self._handles = dict(handles)
            if not handles:
                self._wake.wait(1.0)
                self._wake.clear()
                continue
            cursors = {jid: list(h.follow_position()) for jid, h in handles.items()}
            tokens = {jid: h.token for jid, h in handles.items() if h.token}
            try:
                reply = self.remote.call("nbtrain_follow", cursors=cursors, tokens=tokens,
                                         token=self.remote.operator_token,
                                         timeout=FOLLOW_TIMEOUT_S,
                                         rpc_timeout=NOTICE_WITHIN_S)
            except Exception as exc:
                if self._closed.is_set():
                    return
                if self.errors == 0:
                    self.lost_at = time.time()
                self.errors += 1
                for h in handles.values():
                    h.follow_lost(exc, self.lost_at)
                # Reconnect with backoff: soon after a blip, every couple of seconds after.
                self._closed.wait(min(RETRY_MAX_S, 0.1 * 2 ** min(self.errors, 5)))
                continue
            self.errors = 0
            for jid, update in dict(reply.get("jobs", {})).items():
                handle = handles.get(jid)
                if handle is not None:
                    try:
                        handle.follow_update(update)
                    except Exception:  # a malformed update must not stop following
                        logger.exception("nbtrain: applying an update to job %s failed", jid)
