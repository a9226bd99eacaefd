"""A cluster on this machine started from the ``dask scheduler`` and ``dask worker`` commands.

Unlike ``connect()``'s embedded cluster, it runs in processes of its own, so it outlives the
kernel that uses it: a notebook kernel can be restarted and ``connect(address)`` finds its
jobs still running. nbtrain's controller is preloaded into the scheduler with the settings of
the environment that starts it (e.g. ``NBTRAIN_OPERATOR_TOKEN``, ``NBTRAIN_TEAM_WEIGHTS``)
and journals into a state directory (``NBTRAIN_STATE_DIR``; ``<logs>/state`` by default).
Everything listens on the loopback interface.

**Supervision.** With ``supervise=True`` (what ``nbtrain cluster`` runs) a thread watches the
processes and starts again whichever exits: the scheduler at the same address on the same
state directory (its controller restores every job from the journal), and the ``dask worker``
processes, which Dask ends when their scheduler connection breaks. A process that keeps dying
is started again with a growing pause (up to ``MAX_BACKOFF_S``).

``nbtrain cluster --workers 2`` runs one until Ctrl-C; tests and benchmarks use
:func:`standalone_cluster`.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

__all__ = ["StandaloneCluster", "free_port", "standalone_cluster"]

BIN = Path(sys.executable).parent
#: Longest pause before a process that keeps exiting is started again.
MAX_BACKOFF_S = 5.0
#: A process that ran at least this long before it exited is started again at once.
HEALTHY_S = 10.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Supervised:
    """One process the cluster runs, and how to start it again."""

    name: str
    argv: Sequence[str]
    env: Mapping[str, str]
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    restarts: int = 0
    #: When this process last exited (monotonic), for measurements.
    exits: list[float] = field(default_factory=list)

    def start(self, files: list[IO[bytes]]) -> subprocess.Popen[bytes]:
        out = open(self.log, "ab")  # noqa: SIM115 (closed in stop)
        files.append(out)
        self.proc = subprocess.Popen(list(self.argv), stdout=out, stderr=subprocess.STDOUT,
                                     env=dict(self.env), start_new_session=True)
        self.started = time.monotonic()
        return self.proc


@dataclass
class StandaloneCluster:
    address: str
    operator_token: str
    logs: Path
    state_dir: Path
    scheduler: Supervised
    workers: list[Supervised] = field(default_factory=list)
    _files: list[IO[bytes]] = field(default_factory=list)
    _supervisor: threading.Thread | None = None
    _stopping: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    #: What the supervisor did: (monotonic time, process name, "exited"/"started").
    history: list[tuple[float, str, str]] = field(default_factory=list)
    #: Process name -> monotonic time before which the supervisor does not start it again.
    _held: dict[str, float] = field(default_factory=dict)

    @property
    def procs(self) -> list[subprocess.Popen[bytes]]:
        """The processes running now (the scheduler first)."""
        with self._lock:
            return [p.proc for p in (self.scheduler, *self.workers) if p.proc is not None]

    def add_workers(self, n: int, *, env: Mapping[str, str] | None = None,
                    name: str = "w") -> subprocess.Popen[bytes]:
        """``dask worker`` with ``n`` worker processes (each under a nanny), one thread each.
        ``env`` labels them, e.g. ``{"NBTRAIN_WORKER_HOST": "node1"}``."""
        worker = Supervised(
            name=f"worker-{name}",
            argv=[str(BIN / "dask"), "worker", self.address, "--nworkers", str(n),
                  "--nthreads", "1", "--host", "127.0.0.1", "--name", name, "--no-dashboard",
                  "--preload-nanny", "nbtrain.engine.forkstart"],
            env={**_without_operator_token(os.environ), "DASK_DISTRIBUTED__WORKER__DAEMON": "False",
                 **(env or {})},
            log=self.logs / f"worker-{name}.log")
        with self._lock:
            self.workers.append(worker)
            return worker.start(self._files)

    def remove_workers(self, name: str) -> None:
        """SIGKILL the ``dask worker`` named ``name`` (its worker processes exit with it) and stop
        supervising it: workers that never come back (a fault for tests and benchmarks)."""
        with self._lock:
            gone = [w for w in self.workers if w.name == f"worker-{name}"]
            if not gone:
                raise KeyError(f"no workers named {name!r}; named: "
                               f"{', '.join(w.name[len('worker-'):] for w in self.workers)}")
            self.workers = [w for w in self.workers if w not in gone]
        for w in gone:
            if w.proc is not None:
                _kill_group(w.proc)
                w.proc.wait(10)

    def supervise(self, *, poll_s: float = 0.1) -> None:
        """Start again, from now on, whichever of the cluster's processes exits."""
        if self._supervisor is None:
            self._supervisor = threading.Thread(target=self._watch, args=(poll_s,),
                                                name="nbtrain-supervisor", daemon=True)
            self._supervisor.start()

    def _watch(self, poll_s: float) -> None:
        due: dict[str, float] = {}  # process name -> when to start it again (monotonic)
        while not self._stopping.wait(poll_s):
            with self._lock:
                everyone = [self.scheduler, *self.workers]
            now = time.monotonic()
            for p in everyone:
                if p.proc is None or p.name in due or p.proc.poll() is None:
                    continue
                p.exits.append(now)
                self.history.append((now, p.name, "exited"))
                # A process that keeps dying soon after its start waits longer each time.
                p.restarts = 0 if now - p.started > HEALTHY_S else p.restarts + 1
                due[p.name] = now + min(MAX_BACKOFF_S, 0.5 * (2 ** p.restarts) - 0.5)
                if p is self.scheduler:
                    # Dask ends every worker whose scheduler connection breaks, a few
                    # seconds later; start them again now, so they are connecting (they
                    # wait for the scheduler) while it starts.
                    for w in everyone[1:]:
                        if w.proc is not None and w.name not in due:
                            _kill_group(w.proc)
                            w.proc.wait(10)
                            self.history.append((now, w.name, "stopped"))
                            due[w.name] = now
            for p in everyone:
                when = due.get(p.name)
                if when is None or self._stopping.is_set():
                    continue
                with self._lock:
                    when = max(when, self._held.get(p.name, 0.0))
                if time.monotonic() < when:
                    continue
                del due[p.name]
                assert p.proc is not None
                _kill_group(p.proc)  # children left in its group (a worker process, in a session
                # of its own since nbtrain's plugin set it up, exits with its nanny)
                with self._lock:
                    p.start(self._files)
                self.history.append((time.monotonic(), p.name, "started"))

    def kill_scheduler(self, down_s: float = 0.0) -> int:
        """SIGKILL the scheduler process (a fault for tests and benchmarks); its pid.

        ``down_s``: the supervisor starts it again no sooner than this many seconds after
        the kill (an outage of known length; 0: as soon as it notices, as for any exit).
        A handle notices an outage only when a call to the controller fails, so one shorter
        than a follow call (:data:`nbtrain.engine.remote.NOTICE_WITHIN_S`) may pass
        unnoticed; hold it longer than that to see ``unreachable_since`` set."""
        proc = self.scheduler.proc
        assert proc is not None
        with self._lock:
            self._held[self.scheduler.name] = time.monotonic() + max(0.0, float(down_s))
        os.kill(proc.pid, signal.SIGKILL)
        return proc.pid

    def stop(self, timeout: float = 20.0) -> None:
        self._stopping.set()
        if self._supervisor is not None:
            self._supervisor.join(timeout)
        procs = self.procs
        for proc in reversed(procs):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        # The whole cluster ends: a worker's first SIGTERM is a departure for nbtrain's
        # nanny plugin (it retires through the scheduler, which is ending too); the second
        # is Dask's own, which closes it (its worker process, in a session of its own,
        # is stopped by its nanny, or exits when the nanny is gone).
        time.sleep(0.1)
        for proc in procs[1:]:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for proc in procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                proc.wait(10)
        for f in self._files:
            f.close()


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def _without_operator_token(env: Mapping[str, str]) -> dict[str, str]:
    """A worker's environment: the operator token stays with the scheduler."""
    return {k: v for k, v in env.items() if k != "NBTRAIN_OPERATOR_TOKEN"}


def start(workers: int, *, logs: Path, scheduler_env: Mapping[str, str] | None = None,
          worker_env: Mapping[str, str] | None = None, port: int = 0,
          timeout: float = 120.0, state_dir: Path | None = None,
          supervise: bool = False) -> StandaloneCluster:
    """Start a scheduler (nbtrain's controller preloaded) and ``workers`` workers; wait until
    they are all connected. ``supervise``: start again whichever process exits."""
    from distributed import Client

    port = port or free_port()
    token = (scheduler_env or {}).get("NBTRAIN_OPERATOR_TOKEN") or secrets.token_hex(16)
    state = Path(state_dir or (scheduler_env or {}).get("NBTRAIN_STATE_DIR")
                 or os.environ.get("NBTRAIN_STATE_DIR") or logs / "state")
    env = {**os.environ, **(scheduler_env or {}), "NBTRAIN_OPERATOR_TOKEN": token,
           "NBTRAIN_STATE_DIR": str(state)}
    logs.mkdir(parents=True, exist_ok=True)
    sched = Supervised(
        name="scheduler",
        argv=[str(BIN / "dask"), "scheduler", "--host", "127.0.0.1", "--port", str(port),
              "--dashboard-address", "127.0.0.1:0", "--preload", "nbtrain.engine.preload"],
        env=env, log=logs / "scheduler.log")
    cluster = StandaloneCluster(f"tcp://127.0.0.1:{port}", token, logs, state, sched)
    sched.start(cluster._files)
    try:
        if workers:
            cluster.add_workers(workers, env=worker_env)
        with Client(cluster.address, timeout=timeout) as client:
            if workers:
                client.wait_for_workers(workers, timeout=timeout)
    except BaseException:
        cluster.stop()
        raise
    if supervise:
        cluster.supervise()
    return cluster


@contextlib.contextmanager
def standalone_cluster(workers: int = 2, *, logs: Path,
                       scheduler_env: Mapping[str, str] | None = None,
                       worker_env: Mapping[str, str] | None = None,
                       timeout: float = 120.0, state_dir: Path | None = None,
                       supervise: bool = False) -> Iterator[StandaloneCluster]:
    """A standalone cluster for the duration of a ``with`` block."""
    cluster = start(workers, logs=logs, scheduler_env=scheduler_env, worker_env=worker_env,
                    timeout=timeout, state_dir=state_dir, supervise=supervise)
    try:
        yield cluster
    finally:
        cluster.stop()


def main(argv: list[str]) -> int:
    """``nbtrain cluster``: run a supervised standalone cluster on this machine until Ctrl-C."""
    import argparse
    import tempfile

    parser = argparse.ArgumentParser(
        prog="nbtrain cluster",
        description="Run a Dask cluster with nbtrain's controller on this machine (loopback "
                    "only) until Ctrl-C; connect to it with nbtrain.connect(ADDRESS). It "
                    "outlives the notebooks that use it, and its scheduler and workers are "
                    "started again when they die (jobs continue from the state directory).")
    parser.add_argument("--workers", type=int, default=2, help="worker processes (slots)")
    parser.add_argument("--port", type=int, default=8786, help="scheduler port (default 8786)")
    parser.add_argument("--logs", default=None, help="directory for the processes' logs")
    parser.add_argument("--state-dir", default=None,
                        help="the controller's state directory (default: NBTRAIN_STATE_DIR, "
                             "else ~/.nbtrain/state/127.0.0.1-PORT)")
    args = parser.parse_args(argv)
    logs = Path(args.logs or tempfile.mkdtemp(prefix="nbtrain-cluster-"))
    state = Path(args.state_dir or os.environ.get("NBTRAIN_STATE_DIR")
                 or Path("~/.nbtrain/state").expanduser() / f"127.0.0.1-{args.port}")
    cluster = start(args.workers, logs=logs, port=args.port, state_dir=state, supervise=True)
    print(f"nbtrain cluster at {cluster.address} with {args.workers} slots; logs in {logs}; "
          f"state in {state}", flush=True)
    print(f"operator token: {cluster.operator_token}", flush=True)
    seen = 0
    try:
        while True:
            time.sleep(1.0)
            for _when, name, what in cluster.history[seen:]:
                print(f"{time.strftime('%H:%M:%S')} {name} {what}", flush=True)
            seen = len(cluster.history)
    except KeyboardInterrupt:
        return 0
    finally:
        cluster.stop()
