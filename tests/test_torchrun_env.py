"""Ranks look like torchrun's: the torchrun variables are set for each generation, and code
that calls ``init_process_group()`` / ``destroy_process_group()`` itself (as a torchrun script
does) joins nbtrain's process group; batches keep their types on the way to the device."""

from __future__ import annotations

import dataclasses
import os
from collections import OrderedDict, UserDict
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist

import nbtrain
from nbtrain import JobState
from nbtrain.runtime.batch import to_device
from nbtrain.runtime.torchrun_env import as_torchrun, torchrun_env
from tests.recipes import regression_data

KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
        "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")


def torchrun_style(ctx: Any, config: dict[str, Any]) -> dict[str, Any]:
    """What a torchrun script does first and last, inside an nbtrain rank."""
    env = {k: os.environ.get(k) for k in KEYS}
    dist.init_process_group()  # env:// defaults, as in a torchrun script
    dist.init_process_group(backend="gloo", rank=int(os.environ["RANK"]))
    total = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(total)
    refused = ""
    try:
        dist.init_process_group(world_size=dist.get_world_size() + 3)
    except ValueError as e:
        refused = str(e)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"env": env, "launched":
                                      dist.is_torchelastic_launched()})
    dist.destroy_process_group()  # the script's own clean-up leaves nbtrain's group alone
    for _x, _y in ctx.batches(regression_data(), global_batch_size=8):
        dist.barrier()
        ctx.report(loss=float(total))
    return {"ranks": gathered, "sum": float(total), "refused": refused}


def test_ranks_see_torchrun_variables_and_join_the_group_with_env_defaults(
        free_cluster: nbtrain.Cluster) -> None:
    job = free_cluster.submit(torchrun_style, world_size=2, steps=3, checkpoint=None)
    assert job.wait(120) is JobState.SUCCEEDED, job.error
    result = job.result()
    assert result["sum"] == 3.0  # 1 + 2: one group of two ranks
    assert "world_size=5 (the job has 2)" in result["refused"]
    ports = set()
    for rank, seen in enumerate(result["ranks"]):
        env = seen["env"]
        assert seen["launched"] is True
        assert (env["RANK"], env["WORLD_SIZE"], env["GROUP_RANK"]) == (str(rank), "2", str(rank))
        assert (env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == ("0", "1")
        assert env["TORCHELASTIC_RUN_ID"] == job.id
        assert env["TORCHELASTIC_RESTART_COUNT"] == str(job.generation)
        assert env["MASTER_ADDR"] == "127.0.0.1"
        ports.add(env["MASTER_PORT"])
    assert len(ports) == 1  # every rank points at rank 0's store
    # The workers outlive the rank: their environment is put back.
    left = free_cluster.client.run(lambda: {k: os.environ.get(k) for k in KEYS})
    assert all(v is None for env in left.values() for v in env.values()), left


def test_the_environment_and_torch_are_put_back_after_the_block() -> None:
    os.environ["MASTER_PORT"] = "1234"
    init, destroy = dist.init_process_group, dist.destroy_process_group
    env = torchrun_env(rank=1, world_size=4, master_addr="h", master_port=99, generation=2,
                       run_id="j")
    with as_torchrun(env):
        assert os.environ["MASTER_PORT"] == "99" and os.environ["RANK"] == "1"
        assert dist.init_process_group is not init
    assert os.environ.pop("MASTER_PORT") == "1234" and "RANK" not in os.environ
    assert dist.init_process_group is init and dist.destroy_process_group is destroy


class Pair(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


@dataclasses.dataclass(frozen=True)
class Sample:
    ids: torch.Tensor
    name: str


class Encoding(UserDict[str, Any]):
    """Like HF's BatchEncoding: a mutable mapping with attributes of its own."""

    def __init__(self, data: dict[str, Any], note: str = "") -> None:
        super().__init__(data)
        self.note = note


@pytest.mark.parametrize("make", [
    lambda t: Pair(t, t + 1),
    lambda t: Sample(t, "a"),
    lambda t: Encoding({"input_ids": t, "mask": [t, {"deep": t}]}, note="kept"),
    lambda t: OrderedDict(a=t, b=(t, "s", 3)),
    lambda t: [t, (t, None)],
], ids=["namedtuple", "dataclass", "batchencoding", "ordereddict", "nested"])
def test_batches_reach_the_device_with_their_types(make: Any) -> None:
    batch = make(torch.arange(3.0))
    moved = to_device(batch, torch.device("meta"))  # a real device move, on any machine
    assert type(moved) is type(batch)
    tensors: list[torch.Tensor] = []

    def walk(obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            tensors.append(obj)
        elif isinstance(obj, dict) or hasattr(obj, "items"):
            for v in obj.values():
                walk(v)
        elif dataclasses.is_dataclass(obj):
            for f in dataclasses.fields(obj):
                walk(getattr(obj, f.name))
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v)

    walk(moved)
    assert tensors and all(t.device.type == "meta" for t in tensors)
    if isinstance(batch, Encoding):
        assert moved.note == "kept" and batch["input_ids"].device.type == "cpu"
    if isinstance(batch, Sample):
        assert moved.name == "a"
