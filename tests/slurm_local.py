"""A one-node Slurm on this machine (Debian's ``slurm-wlm`` + ``munge``), for the tests and
``benchmarks/slurm.py``: ``slurmctld`` and ``slurmd`` as root on 127.0.0.1, with their
configuration, state and logs in a temporary directory and ports of their own.

``LocalSlurm.start(root)`` returns a running Slurm (``SLURM_CONF`` set in this process, so
``sbatch``/``squeue`` and dask-jobqueue's ``SLURMCluster`` use it) or raises ``SlurmMissing``
with the reason (not root, the packages are not installed). ``stop()`` ends the daemons it
started, by their process ids, and cancels the jobs left in its queue.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: How long the daemons get to answer ``sinfo`` with an idle node.
START_TIMEOUT_S = 60.0

CONF = """\
ClusterName=nbtrain-test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
SchedulerParameters=sched_interval=1
MinJobAge=2
KillWait=5
InactiveLimit=0
JobAcctGatherType=jobacct_gather/none
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=4000 State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


class SlurmMissing(RuntimeError):
    """No Slurm can run here; the message says why."""


def _program(proc: subprocess.Popen[Any]) -> str:
    """The program a ``Popen`` started (its first argument)."""
    args = proc.args
    if isinstance(args, str | bytes | os.PathLike):
        return os.fsdecode(args)
    return os.fsdecode(args[0])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class LocalSlurm:
    root: Path
    conf: Path
    #: Processes this object started (slurmctld, slurmd, and munged when none ran).
    started: list[subprocess.Popen[bytes]] = field(default_factory=list)
    _old_conf: str | None = None

    @classmethod
    def start(cls, root: Path, cpus: int = 8) -> LocalSlurm:
        missing = [c for c in ("slurmctld", "slurmd", "munged", "sbatch")
                   if shutil.which(c) is None]
        if missing:
            raise SlurmMissing(f"{', '.join(missing)} not installed (apt-get install -y "
                               "slurm-wlm munge)")
        if os.geteuid() != 0:
            raise SlurmMissing("a one-node Slurm here runs its daemons as root; not root")
        root.mkdir(parents=True, exist_ok=True)
        for sub in ("state", "spool"):
            (root / sub).mkdir(exist_ok=True)
        host = socket.gethostname().split(".")[0]
        conf = root / "slurm.conf"
        conf.write_text(CONF.format(host=host, root=root, cpus=cpus, ctld_port=_free_port(),
                                    d_port=_free_port()))
        self = cls(root=root, conf=conf, _old_conf=os.environ.get("SLURM_CONF"))
        os.environ["SLURM_CONF"] = str(conf)
        try:
            self._munge()
            for daemon in ("slurmctld", "slurmd"):
                # -D: in the foreground, so the process is this one's child to end by pid.
                self.started.append(subprocess.Popen(
                    [daemon, "-D", "-f", str(conf)], stdout=subprocess.DEVNULL,
                    stderr=open(root / f"{daemon}.err", "wb")))  # noqa: SIM115
            self._wait_idle()
        except BaseException:
            self.stop()
            raise
        return self

    def _munge(self) -> None:
        ok = subprocess.run("munge -n | unmunge", shell=True, capture_output=True)
        if ok.returncode == 0:
            return
        Path("/run/munge").mkdir(parents=True, exist_ok=True)
        shutil.chown("/run/munge", "munge", "munge")
        # -F: foreground, a child of this process; as the munge user, as Debian runs it.
        self.started.append(subprocess.Popen(
            ["runuser", "-u", "munge", "--", "munged", "-F"], stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL))
        deadline = time.monotonic() + 10
        while subprocess.run("munge -n | unmunge", shell=True,
                             capture_output=True).returncode != 0:
            if time.monotonic() > deadline:
                raise SlurmMissing("munged did not start (is /etc/munge/munge.key there?)")
            time.sleep(0.1)

    def _wait_idle(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            out = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True)
            if out.returncode == 0 and out.stdout.strip() == "idle":
                return
            for p in self.started:
                if p.poll() is not None:
                    raise SlurmMissing(f"{_program(p)} exited with {p.returncode}; see "
                                       f"{self.root}/*.log and *.err")
            if time.monotonic() > deadline:
                raise SlurmMissing(f"Slurm's node is not idle after {START_TIMEOUT_S:.0f} s "
                                   f"(sinfo: {out.stdout.strip()!r} {out.stderr.strip()!r})")
            time.sleep(0.2)

    def jobs(self) -> list[str]:
        """Ids of the jobs in the queue (pending or running)."""
        out = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True)
        return out.stdout.split()

    def stop(self) -> None:
        if self.jobs():
            subprocess.run(["scancel", "--full", *self.jobs()], capture_output=True)
            deadline = time.monotonic() + 15
            while self.jobs() and time.monotonic() < deadline:
                time.sleep(0.2)
        for p in reversed(self.started):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        self.started.clear()
        if self._old_conf is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = self._old_conf


def slurm_cluster(root: Path, lifetime_file: Path) -> Any:
    """A ``SLURMCluster`` as a user would write one, plus a prologue that gives the first
    batch job to start (only that one) a lifetime: it takes the file away."""
    (root / "logs").mkdir(exist_ok=True)
    import dask_jobqueue

    return dask_jobqueue.SLURMCluster(
        cores=1, processes=1, memory="1GiB", walltime="00:10:00", queue="debug",
        python=sys.executable, log_directory=str(root / "logs"),
        local_directory=str(root / "scratch"),
        scheduler_options={"host": "127.0.0.1", "dashboard_address": "127.0.0.1:0"},
        worker_extra_args=["--host", "127.0.0.1", "--lifetime",
                           "${NBTRAIN_TEST_LIFETIME:-0}", "--lifetime-stagger", "0s"],
        job_script_prologue=[
            f"if mv {lifetime_file} {lifetime_file}.$SLURM_JOB_ID 2>/dev/null; then "
            f"export NBTRAIN_TEST_LIFETIME=$(cat {lifetime_file}.$SLURM_JOB_ID); fi"])
