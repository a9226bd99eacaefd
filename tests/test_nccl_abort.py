"""The abort path's plumbing in one process, on gloo (the NCCL run is in tests/test_gpu.py).

``abort_generation`` is what the controller runs on the workers of a failed generation's
peers: it must act only on the generation it names, return at once, and end the group from
a thread of its own.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch.distributed as dist

from nbtrain.runtime import nccl


@pytest.fixture
def group() -> object:
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    nccl.bind("job1", 3)
    yield store
    nccl.bind("job1", None)
    if dist.is_initialized():
        dist.destroy_process_group()


def test_abort_acts_only_on_the_generation_it_names(group: object) -> None:
    assert nccl.abort_generation("job1", 2).startswith("no process group")
    assert nccl.abort_generation("other", 3).startswith("no process group")
    assert dist.is_initialized() and not nccl.was_aborted("job1", 3)


def test_abort_ends_the_group_from_its_own_thread(group: object) -> None:
    before = set(threading.enumerate())
    assert nccl.abort_generation("job1", 3) == "aborting"
    for t in set(threading.enumerate()) - before:
        if t.name == "nbtrain-nccl-abort":
            t.join(timeout=60)
    assert not dist.is_initialized()
    assert nccl.was_aborted("job1", 3)  # the rank's own failure is then a peer's consequence
    nccl.abort_process_group()  # a second end (the rank's own except path) is harmless


def test_nccl_error_handling_keeps_the_process_unless_the_user_chose(monkeypatch:
                                                                     pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    nccl.configure_env()
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    nccl.configure_env()
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
