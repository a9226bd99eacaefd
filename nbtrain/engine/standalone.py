"""A cluster on this machine started from the ``dask scheduler`` and ``dask worker`` commands.

Unlike ``connect()``'s embedded cluster, it runs in processes of its own, so it outlives the
kernel that uses it: a notebook kernel can be restarted and ``connect(address)`` finds its
jobs still running. nbtrain's controller is preloaded into the scheduler with the settings of
the environment that starts it (e.g. ``NBTRAIN_OPERATOR_TOKEN``, ``NBTRAIN_TEAM_WEIGHTS``).
Everything listens on the loopback interface.

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
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

__all__ = ["StandaloneCluster", "free_port", "standalone_cluster"]

BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class StandaloneCluster:
    address: str
    operator_token: str
    logs: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    _files: list[IO[bytes]] = field(default_factory=list)

    def add_workers(self, n: int, *, env: Mapping[str, str] | None = None,
                    name: str = "w") -> subprocess.Popen[bytes]:
        """``dask worker`` with ``n`` worker processes (each under a nanny), one thread each.
        ``env`` labels them, e.g. ``{"NBTRAIN_WORKER_HOST": "node1"}``."""
        log = open(self.logs / f"worker-{name}.log", "ab")  # noqa: SIM115 (closed in stop)
        self._files.append(log)
        proc = subprocess.Popen(
            [str(BIN / "dask"), "worker", self.address, "--nworkers", str(n), "--nthreads", "1",
             "--host", "127.0.0.1", "--name", name, "--no-dashboard"],
            stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, "DASK_DISTRIBUTED__WORKER__DAEMON": "False", **(env or {})},
            start_new_session=True)
        self.procs.append(proc)
        return proc

    def stop(self, timeout: float = 20.0) -> None:
        for proc in reversed(self.procs):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        for f in self._files:
            f.close()


def start(workers: int, *, logs: Path, scheduler_env: Mapping[str, str] | None = None,
          worker_env: Mapping[str, str] | None = None, port: int = 0,
          timeout: float = 120.0) -> StandaloneCluster:
    """Start a scheduler (nbtrain's controller preloaded) and ``workers`` workers; wait until
    they are all connected."""
    from distributed import Client

    port = port or free_port()
    token = (scheduler_env or {}).get("NBTRAIN_OPERATOR_TOKEN") or secrets.token_hex(16)
    env = {**os.environ, **(scheduler_env or {}), "NBTRAIN_OPERATOR_TOKEN": token}
    logs.mkdir(parents=True, exist_ok=True)
    log = open(logs / "scheduler.log", "ab")  # noqa: SIM115 (closed in stop)
    sched = subprocess.Popen(
        [str(BIN / "dask"), "scheduler", "--host", "127.0.0.1", "--port", str(port),
         "--dashboard-address", "127.0.0.1:0", "--preload", "nbtrain.engine.preload"],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    cluster = StandaloneCluster(f"tcp://127.0.0.1:{port}", token, logs, [sched], [log])
    try:
        if workers:
            cluster.add_workers(workers, env=worker_env)
        with Client(cluster.address, timeout=timeout) as client:
            if workers:
                client.wait_for_workers(workers, timeout=timeout)
    except BaseException:
        cluster.stop()
        raise
    return cluster


@contextlib.contextmanager
def standalone_cluster(workers: int = 2, *, logs: Path,
                       scheduler_env: Mapping[str, str] | None = None,
                       worker_env: Mapping[str, str] | None = None,
                       timeout: float = 120.0) -> Iterator[StandaloneCluster]:
    """A standalone cluster for the duration of a ``with`` block."""
    cluster = start(workers, logs=logs, scheduler_env=scheduler_env, worker_env=worker_env,
                    timeout=timeout)
    try:
        yield cluster
    finally:
        cluster.stop()


def main(argv: list[str]) -> int:
    """``nbtrain cluster``: run a standalone cluster on this machine until Ctrl-C."""
    import argparse
    import tempfile

    parser = argparse.ArgumentParser(
        prog="nbtrain cluster",
        description="Run a Dask cluster with nbtrain's controller on this machine (loopback "
                    "only) until Ctrl-C; connect to it with nbtrain.connect(ADDRESS). It "
                    "outlives the notebooks that use it.")
    parser.add_argument("--workers", type=int, default=2, help="worker processes (slots)")
    parser.add_argument("--port", type=int, default=8786, help="scheduler port (default 8786)")
    parser.add_argument("--logs", default=None, help="directory for the processes' logs")
    args = parser.parse_args(argv)
    logs = Path(args.logs or tempfile.mkdtemp(prefix="nbtrain-cluster-"))
    cluster = start(args.workers, logs=logs, port=args.port)
    print(f"nbtrain cluster at {cluster.address} with {args.workers} slots; logs in {logs}",
          flush=True)
    print(f"operator token: {cluster.operator_token}", flush=True)
    try:
        while all(p.poll() is None for p in cluster.procs):
            time.sleep(1.0)
        print("a cluster process exited; see the logs", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        cluster.stop()
