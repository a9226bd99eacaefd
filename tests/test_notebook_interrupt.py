"""A notebook's interrupt stops the cell, not the embedded cluster's workers.

Jupyter interrupts a kernel by sending SIGINT to the kernel's whole process group, and the
embedded cluster's worker processes were in it (the kernel spawned them): each one's event
loop raised ``KeyboardInterrupt`` and ended, its nanny did not start it again, and the
cluster was left with no workers. Each worker with a nanny now moves into a session of its
own (``nbtrain.engine.workers.own_session``). A real ipykernel, started and interrupted by
jupyter_client as JupyterLab does it.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import queue
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import process_gone, wait_for

pytestmark = pytest.mark.timeout(420)

SETUP = """
import json, os, time
import nbtrain

def paced(ctx, config):
    import time
    for _ in ctx.batches(range(10_000_000), global_batch_size=2):
        time.sleep(0.02)
        ctx.report(loss=0.0)

cluster = nbtrain.connect(n_workers=2)
job = cluster.submit(paced, world_size=2, steps=10_000_000, checkpoint=None)
deadline = time.monotonic() + 240
while job.step < 5 and time.monotonic() < deadline:
    time.sleep(0.1)

def state():
    return {"workers": sorted(cluster.client.scheduler_info()["workers"]),
            "pids": sorted(cluster.client.run(os.getpid).values()),
            "sids": sorted(cluster.client.run(os.getsid, 0).values()),
            "kernel_sid": os.getsid(0), "status": job.status.value, "step": job.step,
            "restarts": job.restarts}

print(json.dumps(state()))
"""


@pytest.fixture
def kernel(tmp_path: Path) -> Iterator[tuple[Any, Any]]:
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3", cwd=str(tmp_path))
    try:
        yield km, kc
    finally:
        kc.stop_channels()
        if km.is_alive():
            km.shutdown_kernel(now=True)


def run_cell(kc: Any, code: str, timeout: float = 300.0) -> tuple[dict[str, Any], list[str]]:
    """Run ``code`` in the kernel; its reply's content and the text it printed."""
    printed: list[str] = []

    def hook(msg: dict[str, Any]) -> None:
        if msg["msg_type"] == "stream" and msg["content"]["name"] == "stdout":
            printed.append(msg["content"]["text"])

    reply = kc.execute_interactive(code, timeout=timeout, output_hook=hook)
    return reply["content"], printed


def last_json(printed: list[str]) -> dict[str, Any]:
    lines = [line for line in "".join(printed).splitlines() if line.startswith("{")]
    assert lines, f"the cell printed no JSON: {''.join(printed)!r}"
    return dict(json.loads(lines[-1]))


def test_an_interrupted_cell_leaves_the_workers_and_the_running_job_alone(
        kernel: tuple[Any, Any]) -> None:
    km, kc = kernel
    content, printed = run_cell(kc, SETUP)
    assert content["status"] == "ok", content
    before = last_json(printed)
    assert before["status"] == "RUNNING" and before["step"] >= 5, before
    assert len(before["workers"]) == 2
    assert before["kernel_sid"] not in before["sids"], "workers in the kernel's session"

    # A cell the user interrupts while it waits for the job. Interrupted only once it
    # printed: ipykernel announces a cell (execute_input) before IPython runs it, and a
    # SIGINT in between is swallowed by the kernel with no reply.
    cell = kc.execute('print("waiting", flush=True); job.wait(600)')

    def waiting() -> bool:
        try:
            msg = kc.get_iopub_msg(timeout=1)
        except queue.Empty:
            return False
        return bool(msg["msg_type"] == "stream" and "waiting" in msg["content"]["text"]
                    and msg["parent_header"].get("msg_id") == cell)

    wait_for(waiting, timeout=60, what="the cell to wait for the job")
    km.interrupt_kernel()  # SIGINT to the kernel's process group, as JupyterLab sends it
    reply = kc.get_shell_msg(timeout=60)["content"]
    assert reply["status"] == "error" and reply["ename"] == "KeyboardInterrupt", reply

    # The job trains on in the same workers, with no restart.
    content, printed = run_cell(kc, textwrap.dedent("""
        step0 = job.step  # after the interrupt
        deadline = time.monotonic() + 120
        while job.step < step0 + 20 and time.monotonic() < deadline:
            time.sleep(0.1)
        print(json.dumps(state()))
    """))
    assert content["status"] == "ok", content
    after = last_json(printed)
    assert after["workers"] == before["workers"] and after["pids"] == before["pids"], after
    assert after["status"] == "RUNNING" and after["restarts"] == 0, after
    assert after["step"] >= before["step"] + 20, (before, after)

    # Workers in their own sessions still end with the kernel, which kills only its own
    # process group now: Dask's worker processes watch a pipe from their nanny.
    km.shutdown_kernel(now=True)
    wait_for(lambda: all(map(process_gone, before["pids"])), timeout=60,
             what="the workers to exit after the kernel was killed")


def test_own_session_moves_a_child_out_of_its_group_but_not_a_group_leader() -> None:
    code = ("import os, sys\nfrom nbtrain.engine.workers import own_session\n"
            "before = os.getsid(0)\nmoved = own_session()\n"
            "print(moved, before != os.getsid(0), os.getsid(0) == os.getpid())")
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True)
    assert child.stdout.split() == ["True", "True", "True"], child.stdout
    leader = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True, start_new_session=True)
    assert leader.stdout.split() == ["False", "False", "True"], leader.stdout


def _setup_in_child(nanny: str | None, moved: Any) -> None:
    from types import SimpleNamespace

    from nbtrain.engine.workers import NbtrainWorker

    before = os.getsid(0)
    NbtrainWorker(quiet=False, warm_up=False).setup(SimpleNamespace(nanny=nanny))
    moved.put(os.getsid(0) != before)


def test_the_plugin_moves_only_a_process_a_nanny_started() -> None:
    """A worker's nanny starts it with multiprocessing; setting the plugin up anywhere else
    (a test, a ``--no-nanny`` worker) leaves the process's session alone."""
    from types import SimpleNamespace

    from nbtrain.engine.workers import NbtrainWorker

    ctx = multiprocessing.get_context("spawn")
    for nanny, expected in (("tcp://127.0.0.1:1", True), (None, False)):
        moved = ctx.Queue()
        child = ctx.Process(target=_setup_in_child, args=(nanny, moved))
        child.start()
        assert moved.get(timeout=120) is expected, nanny
        child.join(60)
    mine = os.getsid(0)
    NbtrainWorker(quiet=False, warm_up=False).setup(SimpleNamespace(nanny="tcp://127.0.0.1:1"))
    assert os.getsid(0) == mine
