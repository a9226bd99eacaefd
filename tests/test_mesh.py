"""The job's device mesh without a cluster: what ``mesh=`` accepts, rank coordinates and
groups, TP groups in NVLink, the FSDP wrap rule and ``prepare``'s argument checks."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from nbtrain.core.job import JobSpec
from nbtrain.core.mesh import MeshPlan, RankPlace, mesh_plan, validate_mesh
from nbtrain.runtime.parallel import fsdp_units, prepare_model


def places(nvlinks: list[str]) -> list[RankPlace]:
    return [RankPlace(slot=f"s{i}", host=n.split("-")[0], nvlink=n)
            for i, n in enumerate(nvlinks)]


def test_validate_mesh_derives_dp_and_names_the_fix() -> None:
    assert validate_mesh({"tp": 2}, 4) == {"dp": 2, "tp": 2}
    assert validate_mesh({"dp": 2, "tp": 2}, 4) == {"dp": 2, "tp": 2}
    assert validate_mesh({"dp": 3}, 3) == {"dp": 3, "tp": 1}
    cases: list[tuple[Any, int, tuple[int, ...], str]] = [
        ({}, 2, (), "dict of dimension sizes"),
        ({"pp": 2}, 4, (), "reserved for later"),
        ({"ep": 2}, 4, (), "unknown mesh dimension 'ep'"),
        ({"tp": 0}, 4, (), "positive integer"),
        ({"tp": True}, 4, (), "positive integer"),
        ({"tp": 3}, 4, (), "world size of k*3"),
        ({"dp": 4, "tp": 2}, 4, (), "make world_size=8"),
        ({"tp": 2}, 4, (2, 3), "multiples of 2"),
    ]
    for mesh, world, sizes, words in cases:
        with pytest.raises(ValueError, match=words.replace("*", r"\*")):
            validate_mesh(mesh, world, sizes)


def test_job_spec_checks_the_mesh_against_its_elastic_bounds() -> None:
    spec = JobSpec(job_id="j", name="j", world_size=4, steps=10, mesh={"tp": 2}, min_size=2)
    assert spec.layout.tp == 2
    with pytest.raises(ValueError, match="whole TP groups"):
        JobSpec(job_id="j", name="j", world_size=4, steps=10, mesh={"tp": 2}, min_size=1)


def test_mesh_plan_coordinates_groups_and_nvlink() -> None:
    plan = mesh_plan({"tp": 2}, places(["a-0", "a-0", "b-1", "b-1"]))
    assert (plan.dim_names, plan.shape, plan.world_size) == (("dp", "tp"), (2, 2), 4)
    assert [plan.coords(r) for r in range(4)] == [
        {"dp": 0, "tp": 0}, {"dp": 0, "tp": 1}, {"dp": 1, "tp": 0}, {"dp": 1, "tp": 1}]
    assert plan.groups("tp") == [[0, 1], [2, 3]]
    assert plan.groups("dp") == [[0, 2], [1, 3]]
    assert plan.tp_groups_in_nvlink() == (2, 2)
    assert plan.to_dict()["ranks"][3] == {"rank": 3, "dp": 1, "tp": 1, "slot": "s3",
                                          "host": "b", "nvlink": "b-1"}
    text = plan.describe()
    assert text.splitlines()[0] == ("mesh dp=2 x tp=2 (4 ranks; DP outermost, TP innermost); "
                                    "2 of 2 TP groups inside one NVLink domain")
    assert "dp 1: TP group ranks [2, 3] on host b, NVLink domain b-1" in text
    split = mesh_plan({"tp": 2}, places(["a-0", "b-1", "a-0", "b-1"]))
    assert split.tp_groups_in_nvlink() == (0, 2)
    assert "(crosses the network)" in split.describe()
    plain = mesh_plan(None, places(["a-0", "a-1"]))
    assert (plain.dim_names, plain.shape, plain.size("tp")) == (("dp",), (2,), 1)
    assert plain.groups("tp") == [[0], [1]] and plain.tp_groups_in_nvlink() == (0, 0)
    with pytest.raises(ValueError, match="holds 4 ranks, but 2 are placed"):
        MeshPlan(("dp", "tp"), (2, 2), tuple(places(["a-0", "a-0"])))


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn, self.mlp = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)


class Transformer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.layers = torch.nn.ModuleList([Block(), Block()])
        self.head = torch.nn.Linear(4, 10)


def test_fsdp_wrap_rule() -> None:
    mlp = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    assert fsdp_units(mlp) == [mlp[0], mlp[2]]  # the Sequential's blocks with parameters
    model = Transformer()
    assert fsdp_units(model) == list(model.layers)  # the outermost ModuleList's blocks
    assert fsdp_units(model, Block) == list(model.layers)
    assert fsdp_units(model, torch.nn.Linear) == [
        model.layers[0].attn, model.layers[0].mlp, model.layers[1].attn, model.layers[1].mlp,
        model.head]
    assert fsdp_units(model, lambda name, _m: name in ("embed", "layers")) == [
        model.embed, model.layers]  # nothing inside a unit already picked
    flat = torch.nn.Module()
    flat.a, flat.act, flat.b = torch.nn.Linear(2, 2), torch.nn.ReLU(), torch.nn.Linear(2, 2)
    assert fsdp_units(flat) == [flat.a, flat.b]  # no container: the children with parameters


def test_prepare_names_the_fix_for_wrong_arguments() -> None:
    model = torch.nn.Linear(2, 2)
    plain = mesh_plan(None, places(["a-0", "a-0"]))
    tp2 = mesh_plan({"tp": 2}, places(["a-0", "a-0"]))
    cases: list[tuple[MeshPlan, dict[str, Any], str]] = [
        (plain, {"strategy": "zero3"}, "use one of ddp, fsdp, tp\\+fsdp"),
        (plain, {"precision": "fp16"}, "use one of fp32, bf16-mixed"),
        (tp2, {"strategy": "tp+fsdp"}, "needs tp_plan"),
        (tp2, {"strategy": "fsdp"}, "use strategy='tp\\+fsdp' with a tp_plan"),
        (plain, {"strategy": "ddp", "tp_plan": {"0": "colwise"}}, "tp_plan is for"),
        (plain, {"strategy": "fsdp", "ddp_kwargs": {"bucket_cap_mb": 5}},
         "DistributedDataParallel arguments"),
    ]
    for plan, kwargs, words in cases:
        with pytest.raises(ValueError, match=words):
            prepare_model(model, mesh=None, plan=plan, device=torch.device("cpu"),  # type: ignore[arg-type]
                          timer=None, **kwargs)  # type: ignore[arg-type]
