"""Does the course fit what Binder gives? Every notebook in a 2-CPU, 2 GB box.

What it does, in order:

1. builds the environment from ``binder/`` files alone, in a fresh venv: ``requirements.txt``
   (its ``--extra-index-url`` line for PyTorch's CPU wheels is left out where that index
   cannot be reached: ``torch==2.13.0`` resolves from the local wheels), then ``postBuild``
   run in a copy of the repository's tracked files (nbtrain itself, ``--no-deps -e .``);
   ``--venv DIR`` reuses a venv built before (the build is minutes, the notebooks are not);
2. for each notebook: a memory cgroup with a 2 GB limit and no swap (cgroup v2's
   ``memory.max``, or v1's ``memory.limit_in_bytes`` where v1 is what the machine has),
   and in it, pinned to 2 CPUs with ``taskset``, through ``binder/start``: a JupyterLab
   server (what Binder runs; its memory counts), then papermill running the notebook
   (``display=text`` where the notebook takes it);
3. samples, every 0.2 s, the proportional set size (PSS, ``/proc/PID/smaps_rollup``) of
   every process in the cgroup (JupyterLab, papermill, the kernel, the embedded scheduler
   and every worker) and keeps the peak; the cgroup's own peak too;
4. fails a notebook that papermill reports failed, that the cgroup's OOM killer touched,
   or whose peak PSS exceeded the limit; reports the ones over ``--target-mb`` (1600).

``--quick`` runs a subset (01 quick start, 04 headless report, 06 shared cluster); the full
mode runs all ten. Ends stdout with one JSON line: ``notebooks``, ``passed``,
``peak_mb_max``, ``peak_mb_by_notebook``, ``over_target``, ``failed``, ``cgroup``, ...

Needs root (cgroups), ``taskset`` and the network only for the packages the venv needs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BINDER = REPO / "binder"
QUICK = ("01_quickstart", "04_headless_report", "06_shared_cluster")
LIMIT_MB = 2048
TARGET_MB = 1600
CPUS = "0,1"
NOTEBOOK_TIMEOUT_S = 900


# ------------------------------------------------------------------------- the venv
def requirements_for_here(dest: Path) -> Path:
    """``binder/requirements.txt`` without the PyTorch index line when that index cannot be
    reached here (the local wheels have the pinned torch)."""
    lines = (BINDER / "requirements.txt").read_text().splitlines()
    reachable = True
    for line in lines:
        if line.startswith("--extra-index-url"):
            url = line.split(None, 1)[1]
            try:
                urllib.request.urlopen(url, timeout=5).close()
            except OSError:
                reachable = False
    kept = [ln for ln in lines if reachable or not ln.startswith("--extra-index-url")]
    out = dest / "requirements.txt"
    out.write_text("\n".join(kept) + "\n")
    return out


def tracked_copy(dest: Path) -> Path:
    """The repository's tracked files (what Binder clones), as they are in the work tree."""
    if dest.exists():
        shutil.rmtree(dest)
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, check=True,
                           capture_output=True).stdout.decode().split("\0")
    for name in filter(None, files):
        src = REPO / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


def build_venv(work: Path, venv: Path, log: Path) -> float:
    """A fresh venv from binder/ alone; returns the seconds it took."""
    t0 = time.monotonic()
    if venv.exists():
        shutil.rmtree(venv)
    with log.open("w") as out:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, stdout=out,
                       stderr=subprocess.STDOUT)
        subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "-r",
                        str(requirements_for_here(work))], check=True, stdout=out,
                       stderr=subprocess.STDOUT)
    return time.monotonic() - t0


def post_build(repo: Path, venv: Path, log: Path) -> None:
    env = {**os.environ, "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
           "VIRTUAL_ENV": str(venv)}
    with log.open("a") as out:
        subprocess.run(["bash", str(repo / "binder" / "postBuild")], cwd=repo, env=env,
                       check=True, stdout=out, stderr=subprocess.STDOUT)


# ------------------------------------------------------------------------- the box
class MemoryBox:
    """A memory cgroup with a hard limit and no swap: v2 where its memory controller is
    there, else v1's memory hierarchy."""

    @staticmethod
    def version_here() -> int:
        return 2 if "memory" in _read(Path("/sys/fs/cgroup/cgroup.controllers")).split() else 1

    def __init__(self, name: str, limit_mb: int) -> None:
        v2 = Path("/sys/fs/cgroup")
        if self.version_here() == 2:
            self.version = 2
            self.path = v2 / name
            self.path.mkdir()
            (self.path / "memory.max").write_text(str(limit_mb << 20))
            with contextlib.suppress(OSError):
                (self.path / "memory.swap.max").write_text("0")
        else:
            self.version = 1
            self.path = Path("/sys/fs/cgroup/memory") / name
            self.path.mkdir()
            (self.path / "memory.limit_in_bytes").write_text(str(limit_mb << 20))
            with contextlib.suppress(OSError):
                (self.path / "memory.memsw.limit_in_bytes").write_text(str(limit_mb << 20))
        self.limit_mb = limit_mb

    def enter_command(self) -> list[str]:
        """A prefix that moves the command's shell into the box, then runs the command."""
        return ["sh", "-c", f'echo $$ > "{self.path}/cgroup.procs" && exec "$@"', "box"]

    def pids(self) -> list[int]:
        return [int(p) for p in _read(self.path / "cgroup.procs").split()]

    def oom_kills(self) -> int:
        if self.version == 2:
            for line in _read(self.path / "memory.events").splitlines():
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
            return 0
        for line in _read(self.path / "memory.oom_control").splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
        return 0

    def peak_mb(self) -> float | None:
        name = "memory.peak" if self.version == 2 else "memory.max_usage_in_bytes"
        text = _read(self.path / name).strip()
        return int(text) / 2**20 if text.isdigit() else None

    def close(self) -> None:
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
        deadline = time.monotonic() + 20
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.1)
        with contextlib.suppress(OSError):
            self.path.rmdir()


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def pss_mb(pids: list[int]) -> float:
    """The PSS of these processes together (shared pages split among their sharers)."""
    kb = 0
    for pid in pids:
        for line in _read(Path(f"/proc/{pid}/smaps_rollup")).splitlines():
            if line.startswith("Pss:"):
                kb += int(line.split()[1])
                break
    return kb / 1024


class Sampler(threading.Thread):
    def __init__(self, box: MemoryBox, interval_s: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.box, self.interval_s = box, interval_s
        self.peak_mb = 0.0
        self.peak_procs = 0
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            pids = self.box.pids()
            mb = pss_mb(pids)
            if mb > self.peak_mb:
                self.peak_mb, self.peak_procs = mb, len(pids)
            self._halt.wait(self.interval_s)

    def stop(self) -> None:
        self._halt.set()
        self.join(5)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def jupyterlab(box: MemoryBox, venv: Path, repo: Path, env: dict[str, str],
               home: Path) -> Iterator[str]:
    port, token = free_port(), secrets.token_hex(16)
    log = (home / "jupyterlab.log").open("w")
    cmd = [*box.enter_command(), "taskset", "-c", CPUS, "bash", str(repo / "binder" / "start"),
           str(venv / "bin" / "python"), "-m", "jupyterlab", "--no-browser", "--allow-root",
           "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
           f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={repo}"]
    server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/api/status?token={token}"
    deadline = time.monotonic() + 180
    try:
        while True:
            try:
                with urllib.request.urlopen(url, timeout=2):
                    break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("JupyterLab did not start: "
                                       + (home / "jupyterlab.log").read_text()[-2000:]) from None
                time.sleep(0.3)
        yield url
    finally:
        server.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.wait(30)
        log.close()


def takes_display(path: Path) -> bool:
    nb = json.loads(path.read_text())
    return any("parameters" in c.get("metadata", {}).get("tags", [])
               and "display" in "".join(c["source"]) for c in nb["cells"])


def run_notebook(path: Path, venv: Path, repo: Path, work: Path, limit_mb: int,
                 parameters: dict[str, str] | None = None) -> dict[str, Any]:
    """``path`` under papermill beside JupyterLab in a ``limit_mb`` box (``parameters``:
    papermill's ``-p`` pairs besides ``display=text``); its figures and why it failed."""
    name = path.stem
    home = work / "runs" / name
    if home.exists():
        shutil.rmtree(home)
    home.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("NBTRAIN_", "VIRTUAL_ENV", "PYTHONPATH", "JUPYTER"))}
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", HOME=str(home),
               JUPYTER_CONFIG_DIR=str(home / "config"), JUPYTER_RUNTIME_DIR=str(home / "rt"),
               JUPYTER_DATA_DIR=str(home / "data"), NBTRAIN_TOKEN_FILE=str(home / "tok.json"),
               NBTRAIN_CHECKPOINT_ROOT=str(home / "checkpoints"),
               # as on Binder, where binder/start routes dashboard links through the hub
               JUPYTERHUB_SERVICE_PREFIX="/user/course-box/")
    box = MemoryBox(f"nbtrain-course-box-{os.getpid()}-{name}", limit_mb)
    sampler = Sampler(box)
    result: dict[str, Any] = {"notebook": name, "executed": home / "executed.ipynb"}
    t0 = time.monotonic()
    try:
        sampler.start()
        with jupyterlab(box, venv, repo, env, home):
            params = ["-p", "display", "text"] if takes_display(path) else []
            for key, value in (parameters or {}).items():
                params += ["-p", key, value]
            cmd = [*box.enter_command(), "taskset", "-c", CPUS, "bash",
                   str(repo / "binder" / "start"), str(venv / "bin" / "python"), "-m",
                   "papermill", str(repo / "notebooks" / path.name),
                   str(home / "executed.ipynb"), "-k", "python3", "--cwd", str(home),
                   "--no-progress-bar", *params]
            with (home / "papermill.log").open("w") as log:
                try:
                    proc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                          timeout=NOTEBOOK_TIMEOUT_S)
                    rc: int | None = proc.returncode
                except subprocess.TimeoutExpired:
                    rc = None
    finally:
        sampler.stop()
        result.update(seconds=round(time.monotonic() - t0, 1), peak_mb=round(sampler.peak_mb),
                      peak_procs=sampler.peak_procs, oom_kills=box.oom_kills())
        cgroup_peak = box.peak_mb()
        result["cgroup_peak_mb"] = None if cgroup_peak is None else round(cgroup_peak)
        box.close()
    tail = _read(home / "papermill.log")[-1500:]
    why = []
    if rc is None:
        why.append(f"timed out after {NOTEBOOK_TIMEOUT_S} s")
    elif rc != 0:
        why.append(f"papermill exited {rc}")
    if result["oom_kills"]:
        why.append(f"{result['oom_kills']} process(es) killed by the cgroup's OOM killer")
    if result["peak_mb"] > limit_mb:
        why.append(f"peak PSS {result['peak_mb']} MB over the {limit_mb} MB limit")
    result.update(passed=not why, why="; ".join(why), log_tail="" if not why else tail)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"only {', '.join(QUICK)} (the full mode runs every notebook)")
    parser.add_argument("--notebooks", nargs="*", help="run these notebooks (stems or "
                        "prefixes like 06) instead")
    parser.add_argument("--work", default="/tmp/nbtrain-course-box",
                        help="where the venv, the repository's copy and the runs go")
    parser.add_argument("--venv", help="reuse this venv (built from binder/ before) instead "
                        "of building a fresh one")
    parser.add_argument("--limit-mb", type=int, default=LIMIT_MB)
    parser.add_argument("--target-mb", type=int, default=TARGET_MB)
    args = parser.parse_args()
    # a SIGTERM (timeout, kill) unwinds like an exception: each box's JupyterLab, kernel and
    # workers are killed and its cgroup removed
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if os.geteuid() != 0:
        sys.exit("course_box needs root: it makes a memory cgroup per notebook")
    if shutil.which("taskset") is None:
        sys.exit("course_box needs taskset (util-linux)")

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    repo = tracked_copy(work / "repo")
    build_s = None
    if args.venv:
        venv = Path(args.venv)
    else:
        venv = work / "venv"
        print(f"building a fresh venv from binder/ in {venv} ...", flush=True)
        build_s = round(build_venv(work, venv, work / "build.log"), 1)
    post_build(repo, venv, work / "build.log")

    every = sorted((repo / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    if args.notebooks:
        chosen = [p for p in every if any(p.stem.startswith(n) for n in args.notebooks)]
    elif args.quick:
        chosen = [p for p in every if p.stem in QUICK]
    else:
        chosen = every
    results = []
    print(f"{'notebook':24} {'ok':>4} {'peak MB':>8} {'cgroup MB':>9} {'procs':>5} "
          f"{'s':>6}  why", flush=True)
    for path in chosen:
        r = run_notebook(path, venv, repo, work, args.limit_mb)
        results.append(r)
        print(f"{r['notebook']:24} {'yes' if r['passed'] else 'NO':>4} {r['peak_mb']:>8} "
              f"{r['cgroup_peak_mb'] if r['cgroup_peak_mb'] is not None else '-':>9} "
              f"{r['peak_procs']:>5} {r['seconds']:>6}  {r['why']}", flush=True)
        if r["log_tail"]:
            print(r["log_tail"], flush=True)
    peaks = {r["notebook"]: r["peak_mb"] for r in results}
    print(json.dumps({
        "notebooks": len(results), "passed": sum(r["passed"] for r in results),
        "peak_mb_max": max(peaks.values(), default=0), "peak_mb_by_notebook": peaks,
        "over_target": {n: mb - args.target_mb for n, mb in peaks.items()
                        if mb > args.target_mb},
        "failed": {r["notebook"]: r["why"] for r in results if not r["passed"]},
        "cgroup_peak_mb_by_notebook": {r["notebook"]: r["cgroup_peak_mb"] for r in results},
        "seconds_by_notebook": {r["notebook"]: r["seconds"] for r in results},
        "limit_mb": args.limit_mb, "target_mb": args.target_mb, "cpus": CPUS,
        "cgroup": f"v{MemoryBox.version_here()}", "venv_build_s": build_s,
        "mode": "notebooks" if args.notebooks else "quick" if args.quick else "full"}))


if __name__ == "__main__":
    main()
