"""One rank of a script job: the script in a child process, supervised like torchrun does.

The rank task stays a normal nbtrain rank (rendezvous, nbtrain's process group, control), so
gang scheduling, placement, restarts and the control plane are unchanged. It starts
``python -u script_boot.py SCRIPT ARGS`` (:mod:`nbtrain.runtime.script_boot`) with the
torchrun environment of its generation, and then:

- **rendezvous of the children**: rank 0's task opens a fresh TCPStore on a free port and
  shares the port through nbtrain's store; every child gets it as ``MASTER_PORT`` with
  ``TORCHELASTIC_USE_AGENT_STORE=True`` (torchrun's agent store), so the script's own
  ``init_process_group()`` with env:// builds the children's group on it;
- **output**: the child's stdout and stderr are read by threads and written to the rank's
  streams (the :class:`~nbtrain.runtime.output.OutputForwarder`'s), line by line;
- **step times**: the boot's lines (one per optimizer step) become the rank's step rows;
- **control**: every ``control_interval_s`` the tasks agree (one small all-reduce over
  nbtrain's group) on stop/preempt requests and on how many children still run; on a
  request every task sends SIGTERM to its child, waits ``term_grace_s``, then SIGKILL;
- **end**: a child that exits 0 completes its rank (the task waits for its peers' children);
  one that exits otherwise, unasked, fails the rank with its exit code and stderr's tail.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from nbtrain.runtime import script_boot
from nbtrain.runtime.control import ControlChannel
from nbtrain.runtime.events import EventEmitter
from nbtrain.runtime.script_work import ScriptWork

__all__ = ["ScriptFailed", "ScriptRank"]

#: Lines of the child's stderr kept for the error of a failed rank.
STDERR_TAIL_LINES = 30
_PORT_KEY = "nbtrain/script_master_port"


def _pidfd(pid: int) -> int:
    """A pidfd of the child ``pid`` (Linux 5.3+), or -1 where there is none."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):  # not Linux, an old kernel, or seccomp says no
        return -1


class ScriptFailed(RuntimeError):
    """The script's child process exited with a non-zero code nobody asked for."""


class ScriptRank:
    """Runs one rank's child and supervises it (see the module docstring)."""

    def __init__(self, work: ScriptWork, *, rank: int, world_size: int, host: str,
                 store: dist.TCPStore, env: Mapping[str, str], emitter: EventEmitter,
                 control: ControlChannel, interval_s: float, term_grace_s: float,
                 rendezvous_timeout_s: float, threads: int) -> None:
        self.work = work
        self.rank = rank
        self.world_size = world_size
        self.host = host
        self.store = store
        self.env = dict(env)
        self.emitter = emitter
        self.control = control
        self.interval_s = interval_s
        self.term_grace_s = term_grace_s
        self.rendezvous_timeout_s = rendezvous_timeout_s
        self.threads = threads
        self.steps = 0
        self.outcome = ""
        self.proc: subprocess.Popen[bytes] | None = None
        self._exit_fd = -1  # the child's pidfd (Linux): readable once it has exited
        self._tail: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL_LINES)
        self._readers: list[threading.Thread] = []

    # -- the child -------------------------------------------------------------------------
    def _children_store(self) -> tuple[dist.TCPStore | None, int]:
        """Rank 0 hosts the children's store; every task learns its port."""
        timeout = datetime.timedelta(seconds=self.rendezvous_timeout_s)
        if self.rank == 0:
            own = dist.TCPStore(self.host, 0, self.world_size, is_master=True,
                                timeout=timeout, wait_for_workers=False)
            self.store.set(_PORT_KEY, str(own.port))
            return own, int(own.port)
        return None, int(self.store.get(_PORT_KEY).decode())

    def _place(self, tmp: str) -> tuple[str, str]:
        """The script's copy and the directory the child runs in."""
        path = Path(tmp) / self.work.filename
        path.write_text(self.work.source, encoding="utf-8")
        cwd = self.work.cwd if self.work.cwd and os.path.isdir(self.work.cwd) else tmp
        return str(path), cwd

    def _start(self, script: str, cwd: str, port: int, step_fd: int) -> subprocess.Popen[bytes]:
        env = dict(os.environ)
        # Dask's nanny gives its workers MALLOC_TRIM_THRESHOLD_=65536, which makes every
        # large tensor a fresh mmap (see engine/workers.tune_malloc); a user's torchrun
        # script gets no such thing: the child gets glibc's defaults (unless the job's env
        # sets it).
        env.pop("MALLOC_TRIM_THRESHOLD_", None)
        env.update(self.env)
        env.update(self.work.env)
        env.update({"MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True",
                    "OMP_NUM_THREADS": str(self.threads), "PYTHONUNBUFFERED": "1",
                    "NBTRAIN_STEP_FD": str(step_fd)})
        if self.work.script_dir and os.path.isdir(self.work.script_dir):
            env["NBTRAIN_SCRIPT_PATH"] = self.work.script_dir
        return subprocess.Popen(
            [sys.executable, "-u", str(Path(script_boot.__file__)), script, *self.work.args],
            cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL, pass_fds=(step_fd,), start_new_session=True)

    def _read(self, pipe: Any, into: Callable[[str], object]) -> None:
        for raw in iter(pipe.readline, b""):
            into(raw.decode("utf-8", errors="replace"))
        pipe.close()

    def _reader(self, pipe: Any, into: Callable[[str], object]) -> None:
        t = threading.Thread(target=self._read, args=(pipe, into), daemon=True,
                             name=f"nbtrain-script-{len(self._readers)}")
        t.start()
        self._readers.append(t)

    def _step_line(self, line: str) -> None:
        try:
            step_s, opt_s = (float(v) for v in line.split())
        except ValueError:
            return
        self.steps += 1
        # No data or comm split is visible from outside the script: both count as compute.
        self.emitter.step([self.steps, time.time(), step_s, 0.0, max(0.0, step_s - opt_s),
                           0.0, opt_s])

    # -- supervision -----------------------------------------------------------------------
    def run(self, stdout: Callable[[str], object], stderr: Callable[[str], object],
            on_started: Callable[[int], None]) -> str:
        """Run the child to its end; the rank's outcome. Raises :class:`ScriptFailed`.
        ``stdout``/``stderr`` take the child's output (the rank's streams' ``write``)."""
        own_store, port = self._children_store()
        read_fd, write_fd = os.pipe()
        try:
            with tempfile.TemporaryDirectory(prefix="nbtrain-script-") as tmp:
                script, cwd = self._place(tmp)
                self.proc = self._start(script, cwd, port, write_fd)
                self._exit_fd = _pidfd(self.proc.pid)  # before anything can reap it
                os.close(write_fd)
                write_fd = -1
                on_started(self.proc.pid)
                self._reader(os.fdopen(read_fd, "rb"), self._step_line)
                read_fd = -1
                self._reader(self.proc.stdout, stdout)

                def err(text: str) -> None:
                    self._tail.append(text)
                    stderr(text)

                self._reader(self.proc.stderr, err)
                outcome = self._supervise(self.proc)
                for t in self._readers:
                    t.join(timeout=5.0)
                return outcome
        finally:
            for fd in (read_fd, write_fd):
                if fd >= 0:
                    os.close(fd)
            self.kill()
            if self._exit_fd >= 0:
                os.close(self._exit_fd)
                self._exit_fd = -1
            del own_store

    def _supervise(self, proc: subprocess.Popen[bytes]) -> str:
        vote = torch.zeros(3, dtype=torch.int64)  # stop, preempt, children still running
        while True:
            code = proc.poll()
            if code is not None and code != 0:
                raise self._failure(code)
            flags = self.control.requested()
            vote[0], vote[1], vote[2] = (int(flags["stop"] or flags["halt"]),
                                         int(flags["preempt"]), int(code is None))
            dist.all_reduce(vote, op=dist.ReduceOp.SUM)
            stop, preempt, running = (int(v) for v in vote.tolist())
            if preempt or stop:
                self.terminate()
                self.outcome = "preempted" if preempt else "stopped"
                return self.outcome
            if running == 0:
                self.outcome = "completed"
                return self.outcome
            self._wait_exit(proc, self.interval_s)

    def _wait_exit(self, proc: subprocess.Popen[bytes], timeout: float) -> None:
        """Until the child exits or ``timeout`` passes. ``Popen.wait(timeout)`` polls (sleeps
        of 0.5 ms doubling up to 50 ms: ~50 wake-ups a second of this worker for the whole
        run), and on a host whose cores the ranks keep busy every wake-up of a worker takes
        a core from a rank, which its peers then wait for; a pidfd wakes this thread once."""
        if self._exit_fd >= 0:
            select.select([self._exit_fd], [], [], timeout)
            return
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout)

    def _failure(self, code: int) -> ScriptFailed:
        for t in self._readers[1:]:
            t.join(timeout=2.0)  # the rest of stderr, for the message
        how = (f"was killed by signal {-code} ({signal.Signals(-code).name})" if code < 0
               else f"exited with code {code}")
        tail = "".join(self._tail).rstrip() or "(nothing on stderr)"
        return ScriptFailed(
            f"the script {self.work.filename} (rank {self.rank}, pid "
            f"{self.proc.pid if self.proc else '?'}) {how} after {self.steps} optimizer "
            f"steps; the end of its stderr:\n{tail}")

    def terminate(self) -> None:
        """SIGTERM (the script may snapshot and exit), SIGKILL after ``term_grace_s``."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(self.term_grace_s)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        proc = self.proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # its own session: helpers go too
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10.0)
