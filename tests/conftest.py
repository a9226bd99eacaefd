from __future__ import annotations

import importlib.util
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import cloudpickle
import psutil
import pytest

import nbtrain
from tests import recipes

# Test recipes travel by value: worker processes cannot import the tests package.
cloudpickle.register_pickle_by_value(recipes)


# The suite runs as two streams (README: ``pytest -n 2 --dist loadfile``), each test file
# whole on one of them. Files handed out first finish first: the longest (measured with
# ``--durations=0``, 2026-12-02) go first, so one stream is not left with a 2-minute file
# while the other is done. Only the order changes; a file missing here runs after these.
LONG_FIRST = ("test_controller_restart.py", "test_shared_cluster.py", "test_recovery.py",
              "test_browser.py", "test_parallel_live.py", "test_chaos.py",
              "test_knobs_live.py", "test_scripts.py", "test_slurm.py",
              "test_elastic_live.py", "05_stragglers.ipynb", "test_engine.py",
              "test_pages.py", "test_cluster_managers.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONG_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable otherwise


def load_file_module(path: Path, name: str) -> ModuleType:
    """A script that is not in a package (a benchmark, a docs builder) as a module, listed
    in ``sys.modules`` under ``name`` (dataclasses look their module up there)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def wait_for(cond: Callable[[], object], timeout: float = 60.0, what: str = "condition") -> None:
    """Poll ``cond`` until true; fail with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


def process_gone(pid: int) -> bool:
    """Whether process ``pid`` has exited (gone, or a zombie its parent has not reaped)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.fixture(scope="session")
def cluster() -> Iterator[nbtrain.Cluster]:
    """A real embedded LocalCluster with two worker processes, shared by the session (CPU
    workers even on a GPU machine: these tests' recipes train on the CPU with gloo; the GPU
    tests in test_gpu.py make their own cluster)."""
    with nbtrain.connect(n_workers=2, gpus=False) as c:
        yield c


@pytest.fixture
def free_cluster(cluster: nbtrain.Cluster) -> nbtrain.Cluster:
    """The shared cluster, checked to have every slot free before and after the test.

    If an earlier test left the cluster short of workers (its own teardown has then already
    failed), the cluster is scaled back so one failure does not cascade into every later test.
    """
    if len(cluster.slots) < 2:
        cluster.scale(2)
    wait_for(lambda: len(cluster.free_slots) == len(cluster.slots) == 2, 60, "free slots")
    yield cluster
    # A test that failed half-way may leave a long job running: end it so the next tests get
    # their slots (the failed test has already reported its failure).
    for job in cluster.jobs:
        if not job.status.terminal:
            job.stop()
    wait_for(lambda: len(cluster.free_slots) == len(cluster.slots) == 2, 60,
             "slots freed after the test")


@pytest.fixture(scope="session", autouse=True)
def _checkpoint_root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Checkpoints of every test job go to a temporary directory, not the working tree."""
    import os

    root = tmp_path_factory.mktemp("checkpoints")
    old = os.environ.get("NBTRAIN_CHECKPOINT_ROOT")
    os.environ["NBTRAIN_CHECKPOINT_ROOT"] = str(root)
    yield
    if old is None:
        os.environ.pop("NBTRAIN_CHECKPOINT_ROOT", None)
    else:
        os.environ["NBTRAIN_CHECKPOINT_ROOT"] = old
