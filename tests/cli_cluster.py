"""A real cluster started from the ``dask scheduler`` and ``dask worker`` commands, as an
operator would: separate processes, nbtrain's controller preloaded into the scheduler."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from distributed import Client

BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class CliCluster:
    address: str
    operator_token: str
    logs: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def add_workers(self, n: int, *, env: Mapping[str, str] | None = None,
                    name: str = "w") -> subprocess.Popen[bytes]:
        """``dask worker`` with ``n`` worker processes (nannies), one thread each."""
        log = open(self.logs / f"worker-{name}.log", "ab")  # noqa: SIM115 (closed with proc)
        proc = subprocess.Popen(
            [str(BIN / "dask"), "worker", self.address, "--nworkers", str(n), "--nthreads", "1",
             "--host", "127.0.0.1", "--name", name, "--no-dashboard"],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
            start_new_session=True)
        self.procs.append(proc)
        return proc


@contextlib.contextmanager
def cli_cluster(workers: int = 2, *, scheduler_env: Mapping[str, str] | None = None,
                worker_env: Mapping[str, str] | None = None, logs: Path,
                timeout: float = 120.0) -> Iterator[CliCluster]:
    port = free_port()
    token = "operator-" + os.urandom(8).hex()
    env = {**os.environ, "NBTRAIN_OPERATOR_TOKEN": token, **(scheduler_env or {})}
    logs.mkdir(parents=True, exist_ok=True)
    log = open(logs / "scheduler.log", "ab")  # noqa: SIM115 (closed below)
    sched = subprocess.Popen(
        [str(BIN / "dask"), "scheduler", "--host", "127.0.0.1", "--port", str(port),
         "--dashboard-address", "127.0.0.1:0", "--preload", "nbtrain.engine.preload"],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    cluster = CliCluster(f"tcp://127.0.0.1:{port}", token, logs, [sched])
    try:
        if workers:
            cluster.add_workers(workers, env=worker_env)
        with Client(cluster.address, timeout=timeout) as client:
            client.wait_for_workers(workers, timeout=timeout)
        yield cluster
    finally:
        for proc in reversed(cluster.procs):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        for proc in cluster.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        log.close()


def run_client(script: str, *, env: Mapping[str, str] | None = None,
               timeout: float = 300.0) -> subprocess.Popen[str]:
    """Start another client process running ``script`` (Python, dedented) from the repo root,
    with the test recipes importable and pickled by value."""
    prelude = ("import cloudpickle, sys, json\n"
               "sys.path.insert(0, '.')\n"
               "from tests import recipes\n"
               "cloudpickle.register_pickle_by_value(recipes)\n")
    return subprocess.Popen([sys.executable, "-c", prelude + textwrap.dedent(script)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})},
                            cwd=Path(__file__).resolve().parent.parent)
