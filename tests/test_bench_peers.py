"""benchmarks/_peers.py: a benchmark's peer is retried once with a fresh rendezvous, a second
failure becomes a record in the JSON, and an attempt's processes do not outlive it.

The peers here are real subprocesses (``python -c``, no torch), so each test takes well under
a second."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

from tests.conftest import process_gone, wait_for

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("_peers", BENCHMARKS / "_peers.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("_peers", module)
    spec.loader.exec_module(module)
    return module


peers = _load()

#: Fails (exit 1, an error on stderr) the first time, when the marker file is missing.
FLAKY = textwrap.dedent("""
    import sys
    from pathlib import Path
    marker = Path(sys.argv[1])
    if not marker.exists():
        marker.touch()
        print("RuntimeError: first try", file=sys.stderr)
        sys.exit(1)
    print("ok")
""")

#: Always fails the way TorchElastic's rendezvous did (worker output carries a rank prefix).
BROKEN = ("import sys; print('[rank0]: torch.distributed.DistStoreError: wait timeout after "
          "60000ms, keys: /torch.rendezvous.x.1/MASTER_ADDR', file=sys.stderr); sys.exit(1)")

#: Starts a sleeper in a session of its own, writes its pid and exits: an orphan that only
#: the attempt's token finds (its parent is gone).
ORPHAN = textwrap.dedent("""
    import subprocess, sys
    from pathlib import Path
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                         start_new_session=True)
    Path(sys.argv[1]).write_text(str(p.pid))
""")


def test_a_peer_failing_once_is_retried_and_succeeds(tmp_path: Path) -> None:
    marker = tmp_path / "tried"

    def peer(attempt: peers.PeerAttempt) -> int:
        attempt.run([sys.executable, "-c", FLAKY, str(marker)], timeout=60)
        return int(attempt.number)

    result = peers.run_peer("flaky", peer)
    assert result.ok and result.get() == 2
    assert result.attempts == 2
    assert result.errors == ("RuntimeError: first try (flaky exited 1)",)
    assert peers.peer_figures([result]) == {"peer_attempts": {"flaky": 2}, "peer_failed": {}}


def test_a_peer_failing_twice_yields_the_failure_record() -> None:
    calls: list[int] = []

    def peer(attempt: peers.PeerAttempt) -> float:
        calls.append(attempt.number)
        attempt.run([sys.executable, "-c", BROKEN], timeout=60, what="torchrun")
        return 1.0

    result = peers.run_peer("torchelastic", peer)
    assert calls == [1, 2]
    assert result.failed and result.value is None and result.attempts == 2
    error = ("DistStoreError: wait timeout after 60000ms, keys: "
             "/torch.rendezvous.x.1/MASTER_ADDR (torchrun exited 1)")
    assert result.error == error and result.errors == (error, error)
    assert peers.peer_figures([result]) == {"peer_attempts": {"torchelastic": 2},
                                            "peer_failed": {"torchelastic": error}}
    assert peers.ratio(3.0, result.value) is None
    with pytest.raises(ValueError, match="torchelastic failed after 2 attempts"):
        result.get()
    once = peers.run_peer("torchelastic", peer, retries=0)
    assert once.failed and once.attempts == 1 and calls == [1, 2, 1]


def test_the_retry_gets_a_fresh_rendezvous() -> None:
    seen: list[tuple[str, Path, set[int]]] = []

    def peer(attempt: peers.PeerAttempt) -> str:
        endpoint, stores = attempt.port_block(), attempt.port_block(4)
        ports = {endpoint, *range(stores, stores + 4)}
        assert len(ports) == 5  # distinct within the attempt too
        assert attempt.workdir.is_dir()
        seen.append((attempt.rdzv_id, attempt.workdir, ports))
        if attempt.number == 1:
            raise TimeoutError("the rendezvous timed out")
        return str(attempt.rdzv_id)

    result = peers.run_peer("torchelastic", peer)
    assert result.ok and result.errors == ("TimeoutError: the rendezvous timed out",)
    (id1, dir1, ports1), (id2, dir2, ports2) = seen
    assert id1 != id2 and result.value == id2 and id1.startswith("torchelastic-1-")
    assert dir1 != dir2 and not dir1.exists() and not dir2.exists()
    assert not ports1 & ports2


def test_a_failed_attempts_processes_are_killed(tmp_path: Path) -> None:
    pids: dict[str, int] = {}

    def peer(attempt: peers.PeerAttempt) -> None:
        pidfile = tmp_path / f"orphan-{attempt.number}"
        attempt.run([sys.executable, "-c", ORPHAN, str(pidfile)], timeout=60)
        pids[f"orphan-{attempt.number}"] = int(pidfile.read_text())
        sleeper = attempt.spawn([sys.executable, "-c", "import time; time.sleep(120)"])
        pids[f"sleeper-{attempt.number}"] = sleeper.pid
        raise RuntimeError("the peer's first step never came")

    result = peers.run_peer("stray", peer)
    assert result.failed and result.error == "RuntimeError: the peer's first step never came"
    assert sorted(pids) == ["orphan-1", "orphan-2", "sleeper-1", "sleeper-2"]
    for name, pid in pids.items():
        wait_for(lambda pid=pid: process_gone(pid), 15, f"{name} ({pid}) killed")


def test_failures_injected_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    def peer(attempt: peers.PeerAttempt) -> str:
        calls.append(attempt.name)
        return str(attempt.name)

    monkeypatch.setenv(peers.FAIL_ENV, "a:1, b")
    a, b, c = (peers.run_peer(name, peer) for name in "abc")
    assert a.ok and a.attempts == 2 and "injected by NBTRAIN_BENCH_FAIL_PEER" in a.errors[0]
    assert b.failed and b.attempts == 2
    assert c.ok and c.attempts == 1
    assert calls == ["a", "c"]


def test_last_error_line() -> None:
    text = ("[rank0]: torch.distributed.DistStoreError: wait timeout after 60000ms\n"
            "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
            "=====\n")
    assert peers.last_error_line(text) == "DistStoreError: wait timeout after 60000ms"
    assert peers.last_error_line("all fine\nduring handling of an exception:") is None
