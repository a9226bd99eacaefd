"""Running a benchmark's peer (torchrun, TorchElastic) so that its failure does not fail the run.

A peer is the system a benchmark compares nbtrain with. It runs processes, rendezvous and
ports nbtrain does not own, and on a loaded machine it sometimes fails for reasons of its own
(``DistStoreError: wait timeout after 60000ms`` in TorchElastic's rendezvous). ``run_peer``
runs one: on a failure it kills what that attempt left running, prints why to stderr, and
tries once more with a fresh rendezvous (a new ``rdzv_id``, ports no earlier attempt had, a
new working directory). A peer that fails again comes back as a :class:`PeerResult` holding
the error's one-line text; the benchmark then prints its JSON with the ratios that need the
peer as null (:func:`peer_figures` gives the ``peer_attempts`` / ``peer_failed`` entries)
and exits 0. nbtrain's own failures are not caught here: they still fail the run.

Testing: ``NBTRAIN_BENCH_FAIL_PEER=NAME[:K][,NAME[:K]...]`` makes the first ``K`` attempts of
the peer called ``NAME`` fail before they start (every attempt when ``:K`` is left out), e.g.
``NBTRAIN_BENCH_FAIL_PEER=torchelastic python benchmarks/elastic.py --quick``.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

import psutil

T = TypeVar("T")

#: Names the peers whose attempts fail on purpose (see the module docstring).
FAIL_ENV = "NBTRAIN_BENCH_FAIL_PEER"
#: Set in every process an attempt starts (and so inherited by torchrun's workers): what
#: :meth:`PeerAttempt.reap` looks for, so a worker its agent no longer parents is found too.
TOKEN_ENV = "NBTRAIN_BENCH_PEER_TOKEN"
#: How long a peer process gets to exit after SIGKILL before reap() says so.
REAP_WAIT_S = 10.0
#: Characters of an error kept in a failure record (the whole text goes to stderr).
ERROR_CHARS = 300

#: ``[rank0]: torch.distributed.DistStoreError: wait timeout ...``: the name and the message.
_ERROR_LINE = re.compile(r"(?<![\w.])(?:[A-Za-z_][\w]*\.)*(\w*(?:Error|Exception)): +(\S.*)")


class PeerError(RuntimeError):
    """A peer failed: ``summary`` is the one line for the JSON, ``details`` what it printed."""

    def __init__(self, summary: str, details: str = "") -> None:
        super().__init__(summary if not details else f"{summary}\n{details}")
        self.summary = summary
        self.details = details


def last_error_line(text: str) -> str | None:
    """The last line of ``text`` that reads like a raised error (``DistStoreError: wait
    timeout ...``, module prefix dropped), or None."""
    found = None
    for line in text.splitlines():
        m = _ERROR_LINE.search(line)
        if m:
            found = f"{m.group(1)}: {m.group(2).strip()}"
    return found


def one_line(exc: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    if isinstance(exc, PeerError):
        text = exc.summary
    else:
        first = str(exc).strip().splitlines()
        text = f"{type(exc).__name__}: {first[0]}" if first else type(exc).__name__
    return text if len(text) <= ERROR_CHARS else text[: ERROR_CHARS - 3] + "..."


@dataclass
class PeerAttempt:
    """What one attempt of a peer gets: fresh rendezvous parameters and a process tracker.

    ``rdzv_id`` and ``workdir`` are new for every attempt; :meth:`port_block` never hands out
    a port an earlier attempt of the same peer had (a failed attempt's port may still be held
    by one of its processes or in TIME_WAIT). Start processes with :meth:`spawn` or
    :meth:`run`: :meth:`reap` then kills all of them, their children and any process that
    inherited this attempt's token, when the attempt ends.
    """

    name: str
    number: int  # 1-based
    of: int
    rdzv_id: str
    workdir: Path
    token: str
    _used_ports: set[int]
    _procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    _logs: list[Path] = field(default_factory=list)

    def port_block(self, n: int = 1) -> int:
        """A port P with P .. P+n-1 free now, none of them handed out before to any attempt
        of this peer."""
        for _ in range(200):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                base = int(s.getsockname()[1])
            block = range(base, base + n)
            if base + n > 65536 or self._used_ports.intersection(block):
                continue
            held: list[socket.socket] = []
            try:
                for port in block[1:]:
                    sock = socket.socket()
                    held.append(sock)
                    sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            finally:
                for sock in held:
                    sock.close()
            self._used_ports.update(block)
            return base
        raise PeerError(f"no block of {n} free ports found for peer {self.name}")

    def spawn(self, cmd: Sequence[str], *, env: Mapping[str, str] | None = None,
              log: str = "peer.log") -> subprocess.Popen[bytes]:
        """Start ``cmd`` in a session of its own, stdout and stderr into ``workdir/log``."""
        path = self.workdir / log
        self._logs.append(path)
        with open(path, "ab") as out:
            proc = subprocess.Popen(list(cmd), stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True,
                                    env={**(os.environ if env is None else env),
                                         TOKEN_ENV: self.token})
        self._procs.append(proc)
        return proc

    def run(self, cmd: Sequence[str], *, env: Mapping[str, str] | None = None,
            timeout: float, log: str = "peer.log", what: str | None = None) -> None:
        """Run ``cmd`` to its end; PeerError when it exits non-zero or outlives ``timeout``."""
        what = what or self.name
        proc = self.spawn(cmd, env=env, log=log)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise self.error(f"{what} still running after {timeout:.0f} s") from None
        if code != 0:
            raise self.error(f"{what} exited {code}")

    def error(self, what: str) -> PeerError:
        """A PeerError for ``what``, naming the last error the attempt's processes printed."""
        logs = self.logs()
        cause = last_error_line(logs)
        return PeerError(f"{cause} ({what})" if cause else what, logs)

    def logs(self, chars: int = 3000) -> str:
        """The tail of each log this attempt's processes wrote."""
        parts = []
        for path in dict.fromkeys(self._logs):
            if path.exists():
                parts.append(f"--- {path.name} ---\n"
                             + path.read_text(errors="replace")[-chars:])
        return "\n".join(parts)

    def reap(self) -> list[int]:
        """SIGKILL every process this attempt started, their children, and any process whose
        environment carries this attempt's token; the pids killed."""
        victims: dict[int, psutil.Process] = {}
        for proc in self._procs:
            with contextlib.suppress(psutil.Error):
                root = psutil.Process(proc.pid)
                for p in [root, *root.children(recursive=True)]:
                    victims[p.pid] = p
        me = os.getpid()
        for p in psutil.process_iter():
            if p.pid == me or p.pid in victims:
                continue
            with contextlib.suppress(psutil.Error):
                if p.environ().get(TOKEN_ENV) == self.token:
                    victims[p.pid] = p
        for p in victims.values():
            with contextlib.suppress(psutil.Error):
                p.kill()
        _, alive = psutil.wait_procs(list(victims.values()), timeout=REAP_WAIT_S)
        for proc in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(REAP_WAIT_S)  # no zombies of our own children left behind
        if alive:
            print(f"peer {self.name}: processes {[p.pid for p in alive]} outlived SIGKILL",
                  file=sys.stderr, flush=True)
        return sorted(victims)


@dataclass(frozen=True)
class PeerResult(Generic[T]):
    """A peer's outcome: ``value`` when an attempt succeeded, else ``error`` (one line)."""

    name: str
    value: T | None
    attempts: int
    errors: tuple[str, ...]  # one line per failed attempt
    seconds: float

    @property
    def ok(self) -> bool:
        return not self.failed

    @property
    def failed(self) -> bool:
        return len(self.errors) == self.attempts

    @property
    def error(self) -> str | None:
        return self.errors[-1] if self.failed else None

    def get(self) -> T:
        """The value; ValueError when the peer failed."""
        if self.failed or self.value is None:
            raise ValueError(f"peer {self.name} failed after {self.attempts} attempts: "
                             f"{self.error}")
        return self.value


def _injected(name: str, attempt: int) -> bool:
    for item in os.environ.get(FAIL_ENV, "").split(","):
        peer, _, count = item.strip().partition(":")
        if peer == name and (not count or attempt <= int(count)):
            return True
    return False


def run_peer(name: str, fn: Callable[[PeerAttempt], T], *, retries: int = 1) -> PeerResult[T]:
    """Run the peer ``fn`` up to ``1 + retries`` times until one attempt returns.

    Each attempt gets a :class:`PeerAttempt` (fresh rendezvous id, ports, working directory);
    whatever it started is killed when it ends, failed or not. An ``Exception`` from ``fn``
    is the peer's failure: printed in full to stderr, kept as one line in the result.
    """
    if retries < 0:
        raise ValueError(f"retries must be >= 0, got {retries}")
    used: set[int] = set()
    errors: list[str] = []
    t0 = time.monotonic()
    total = 1 + retries
    for number in range(1, total + 1):
        token = uuid.uuid4().hex
        workdir = Path(tempfile.mkdtemp(prefix=f"nbtrain-peer-{name}-{number}-"))
        attempt = PeerAttempt(name=name, number=number, of=total,
                              rdzv_id=f"{name}-{number}-{token[:8]}", workdir=workdir,
                              token=token, _used_ports=used)
        try:
            if _injected(name, number):
                raise PeerError(f"PeerError: failure injected by {FAIL_ENV}="
                                f"{os.environ[FAIL_ENV]}")
            value = fn(attempt)
        except Exception as exc:  # the peer's failure, whatever it is: reported, not raised
            errors.append(one_line(exc))
            again = "; trying again with a fresh rendezvous" if number < total else ""
            details = str(exc).strip()
            print(f"peer {name}: attempt {number}/{total} failed: {errors[-1]}{again}"
                  + (f"\n{details}" if details and details != errors[-1] else ""),
                  file=sys.stderr, flush=True)
        else:
            return PeerResult(name, value, number, tuple(errors), time.monotonic() - t0)
        finally:
            attempt.reap()
            shutil.rmtree(workdir, ignore_errors=True)
    print(f"peer {name}: failed {total} times; its figures are null", file=sys.stderr,
          flush=True)
    return PeerResult(name, None, total, tuple(errors), time.monotonic() - t0)


def peer_figures(results: Iterable[PeerResult[Any]]) -> dict[str, Any]:
    """``peer_attempts`` (per peer name, summed over its runs) and ``peer_failed`` (per peer
    that failed every attempt of a run: that run's error; the last such run's when several)."""
    attempts: dict[str, int] = {}
    failed: dict[str, str] = {}
    for r in results:
        attempts[r.name] = attempts.get(r.name, 0) + r.attempts
        if r.error is not None:
            failed[r.name] = r.error
    return {"peer_attempts": attempts, "peer_failed": failed}


def ratio(a: float | None, b: float | None, digits: int = 4) -> float | None:
    """``a / b`` rounded, or None when either is missing (a figure that needs a failed peer)."""
    return None if a is None or b is None or b == 0 else round(a / b, digits)
