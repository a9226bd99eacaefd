"""Recipes used by the integration tests (pickled by value to the workers, see conftest)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import nbtrain
from nbtrain.accounting import Indexed, SampleLog
from nbtrain.runtime.loader import ShardedLoader


def unwrapped(model: Any) -> torch.nn.Module:
    """The module inside a wrapper with ``.module`` (DDP), or the model itself."""
    inner = getattr(model, "module", model)
    assert isinstance(inner, torch.nn.Module), type(inner)
    return inner


def regression_data(n: int = 256, d: int = 8, seed: int = 1) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    w = torch.randn(d, 1, generator=g, dtype=torch.float64)
    y = x @ w + 0.1 * torch.randn(n, 1, generator=g, dtype=torch.float64)
    return TensorDataset(x, y)


def make_model(d: int = 8) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(d, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 1)).double()


class Regression(nbtrain.Recipe):
    """Float64 MLP regression; optional faults and a place to drop final parameters."""

    def __init__(self, out_dir: str | None = None, batch: int = 32, raise_at: int | None = None,
                 raise_rank: int = 1, step_sleep: float = 0.0, wait_file: str | None = None,
                 lr: float = 0.05, slow_until: str | None = None) -> None:
        self.out_dir = out_dir
        self.batch = batch
        self.raise_at = raise_at
        self.raise_rank = raise_rank
        self.step_sleep = step_sleep
        self.wait_file = wait_file
        self.lr = lr
        self.slow_until = slow_until  # step_sleep applies until this file exists

    def setup(self, ctx: nbtrain.RankContext) -> dict[str, Any]:
        if self.wait_file is not None:
            while not os.path.exists(self.wait_file):
                time.sleep(0.01)
        self.model = ctx.prepare(make_model())
        self.opt = torch.optim.SGD(self.model.parameters(), lr=self.lr, momentum=0.9)
        ctx.loader(regression_data(), global_batch_size=self.batch)
        return {"model": self.model, "optimizer": self.opt}

    def step(self, ctx: nbtrain.RankContext, batch: Any) -> dict[str, float]:
        if self.raise_at is not None and ctx.rank == self.raise_rank and ctx.step == self.raise_at:
            raise ValueError(f"injected failure at step {ctx.step}")
        if self.step_sleep and not (self.slow_until and os.path.exists(self.slow_until)):
            time.sleep(self.step_sleep)
        x, y = batch
        loss = F.mse_loss(self.model(x), y)
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        return {"loss": loss.item()}

    def teardown(self, ctx: nbtrain.RankContext) -> None:
        if self.out_dir is not None:
            torch.save(unwrapped(self.model).state_dict(),
                       Path(self.out_dir) / f"rank{ctx.rank}.pt")


class GpuRegression(Regression):
    """``Regression`` on the rank's GPU (the loader's batches arrive on ``ctx.device``); the
    parameters are saved from the CPU so the test compares them with the CPU reference."""

    def teardown(self, ctx: nbtrain.RankContext) -> None:
        if self.out_dir is not None:
            torch.save({k: v.cpu() for k, v in unwrapped(self.model).state_dict().items()},
                       Path(self.out_dir) / f"rank{ctx.rank}.pt")


def single_process_params(steps: int, batch: int = 32, lr: float = 0.05,
                          n: int = 256, clip: float = 0.0) -> dict[str, torch.Tensor]:
    """The same training as ``Regression`` on one process over the same global batches
    (``clip``: the gradients' norm clipped to it before every step, as torch does)."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    loader = ShardedLoader(regression_data(n), global_batch_size=batch, rank=0, world_size=1)
    for _ in range(steps):
        x, y = loader.next_batch()
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return model.state_dict()


def assert_params_equal(out_dir: str | Path, expected: dict[str, torch.Tensor],
                        ranks: tuple[int, ...] = (0, 1)) -> None:
    for rank in ranks:
        got = torch.load(Path(out_dir) / f"rank{rank}.pt")
        for name, value in expected.items():
            torch.testing.assert_close(got[name], value, rtol=0, atol=1e-6)


def _fork_servers() -> list[Any]:
    """This process's fork servers (``psutil.Process``): where ``nbtrain.runtime.loader``
    starts DataLoader worker processes."""
    import psutil

    return [p for p in psutil.Process().children() if "forkserver" in " ".join(p.cmdline())]


def dataloader_workers() -> int:
    """Run on a Dask worker: how many DataLoader worker processes it has (the children of
    its fork server)."""
    import psutil

    return sum(1 for server in _fork_servers() for child in server.children()
               if child.status() != psutil.STATUS_ZOMBIE)


def dataloader_processes() -> list[int]:
    """Run on a Dask worker: the pids of its fork servers and their children (its DataLoader
    worker processes)."""
    return [p.pid for server in _fork_servers() for p in (server, *server.children())]


def what_the_worker_sees() -> tuple[int, str]:
    """Run on a worker: how many CUDA devices it sees, and the UUID of its ``cuda:0``."""
    return torch.cuda.device_count(), str(torch.cuda.get_device_properties(0).uuid)
def regression_train(ctx: nbtrain.RankContext, config: dict[str, Any]) -> dict[str, Any]:
    """``Regression`` as a training function: the user's own loop over ``ctx.batches``."""
    model = ctx.prepare(make_model())
    opt = torch.optim.SGD(model.parameters(), lr=config.get("lr", 0.05), momentum=0.9)
    ctx.track(model=model, optimizer=opt)
    loss = torch.zeros(())
    for x, y in ctx.batches(regression_data(), global_batch_size=config.get("batch", 32)):
        if config.get("step_sleep"):
            time.sleep(config["step_sleep"])
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        ctx.report(loss=loss.item())
    # Runs only when the loop completed (not after a stop or preemption).
    if config.get("out_dir"):
        torch.save(unwrapped(model).state_dict(), Path(config["out_dir"]) / f"rank{ctx.rank}.pt")
    return {"steps": ctx.step, "final_loss": float(loss.item())}


def steered_train(ctx: nbtrain.RankContext, config: dict[str, Any]) -> dict[str, Any]:
    """``regression_train`` with a user knob: ``aux_weight`` weighs an L2 penalty on the
    parameters. Every rank reports the LR and the knob it trained each step with.
    ``hold_first_generation_at``: the first generation's ranks stop in the step after that
    one, so they never agree again (until their workers end)."""
    aux = ctx.knobs.declare("aux_weight", 0.1, min=0.0, max=1.0)
    ctx.knobs.declare("lr", min=0.0, max=1.0)  # bounds for the built-in
    model = ctx.prepare(make_model())
    opt = torch.optim.SGD(model.parameters(), lr=config.get("lr", 0.05), momentum=0.9)
    ctx.track(model=model, optimizer=opt)
    for x, y in ctx.batches(regression_data(), global_batch_size=config.get("batch", 32)):
        if config.get("step_sleep"):
            time.sleep(config["step_sleep"])
        hold = config.get("hold_first_generation_at")
        while hold is not None and ctx.generation == 0 and ctx.step >= hold:
            time.sleep(0.05)
        aux = ctx.knob("aux_weight")
        penalty = sum((p * p).sum() for p in model.parameters())
        loss = F.mse_loss(model(x), y) + aux * 1e-3 * penalty
        opt.zero_grad()
        loss.backward()
        opt.step()
        ctx.report(loss=loss.item(), lr=opt.param_groups[0]["lr"], aux=aux)
    if config.get("out_dir"):
        torch.save(unwrapped(model).state_dict(), Path(config["out_dir"]) / f"rank{ctx.rank}.pt")
    return {"steps": ctx.step}


def diverging_train(ctx: nbtrain.RankContext, config: dict[str, Any]) -> None:
    """Regression whose loss turns NaN from step ``config["nan_from"]`` on (the state too)."""
    model = ctx.prepare(make_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ctx.track(model=model, optimizer=opt)
    for x, y in ctx.batches(regression_data(), global_batch_size=32):
        time.sleep(0.01)
        loss = F.mse_loss(model(x), y)
        if ctx.step + 1 >= config["nan_from"]:
            loss = loss * float("nan")
        opt.zero_grad()
        loss.backward()
        opt.step()
        ctx.report(loss=loss.item())


class ElasticRegression(Regression):
    """``Regression`` over ``IndexedRegression``, logging each step's sample ids;
    ``num_workers``: DataLoader worker processes prefetch the batches."""

    def __init__(self, out_dir: str, *, n: int = 256, num_workers: int = 0,
                 **kwargs: Any) -> None:
        super().__init__(out_dir=out_dir, **kwargs)
        self.n = n
        self.num_workers = num_workers

    def setup(self, ctx: nbtrain.RankContext) -> dict[str, Any]:
        self.model = ctx.prepare(make_model())
        self.opt = torch.optim.SGD(self.model.parameters(), lr=self.lr, momentum=0.9)
        ctx.loader(Indexed(regression_data(self.n)), global_batch_size=self.batch,
                   num_workers=self.num_workers)
        return {"model": self.model, "optimizer": self.opt}

    def step(self, ctx: nbtrain.RankContext, batch: Any) -> dict[str, float]:
        x, y, ids = batch
        assert self.out_dir is not None
        SampleLog(self.out_dir).record(ctx, ids)
        return super().step(ctx, (x, y))


def elastic_train(ctx: nbtrain.RankContext, config: dict[str, Any]) -> None:
    """The same as a training function; saves its parameters however the loop ends."""
    model = ctx.prepare(make_model())
    opt = torch.optim.SGD(model.parameters(), lr=config.get("lr", 0.05), momentum=0.9)
    ctx.track(model=model, optimizer=opt)
    try:
        for x, y, ids in ctx.batches(Indexed(regression_data(config["n"])),
                                     global_batch_size=config["batch"]):
            SampleLog(config["out_dir"]).record(ctx, ids)
            # ``sleep_shared`` (as in ``nbtrain.examples.elastic_digits_train``): the sleep
            # stands for compute the ranks share (it halves at twice the ranks: a job that
            # scales); else every rank sleeps it whole.
            time.sleep(config.get("step_sleep", 0.0)
                       / (ctx.world_size if config.get("sleep_shared") else 1))
            loss = F.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            ctx.report(loss=loss.item())
    finally:
        torch.save(unwrapped(model).state_dict(), Path(config["out_dir"]) / f"rank{ctx.rank}.pt")


def per_rank_batch_train(ctx: nbtrain.RankContext, config: dict[str, Any]) -> None:
    """A fixed per-rank batch (the global batch follows the world size) with the LR scaled
    linearly; records the LR it trains with at each step."""
    model = ctx.prepare(make_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ctx.track(model=model, optimizer=opt)
    ctx.scale_lr(opt, "linear")
    for x, y in ctx.batches(regression_data(), batch_size=8):
        time.sleep(config.get("step_sleep", 0.0))
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        ctx.report(loss=loss.item(), lr=opt.param_groups[0]["lr"], batch=float(len(x)))


TP_PLAN = {"0": "colwise", "2": "rowwise"}  # make_model's two Linear layers


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every rank's full parameters, however the model is wrapped (a collective: call it on
    every rank)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return cast(dict[str, torch.Tensor],
                get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)))


def parallel_train(ctx: nbtrain.RankContext, config: dict[str, Any]) -> dict[str, Any]:
    """``Regression`` under any strategy and precision (``config``: strategy, precision,
    compile, tp_plan, dtype, lr, batch, step_sleep, out_dir); saves each rank's full
    parameters when the loop completes, returns the mesh and the losses."""
    dtype = getattr(torch, config.get("dtype", "float64"))
    model = ctx.prepare(make_model().to(dtype), strategy=config.get("strategy", "ddp"),
                        precision=config.get("precision", "fp32"),
                        compile=config.get("compile", False), tp_plan=config.get("tp_plan"))
    opt = torch.optim.SGD(model.parameters(), lr=config.get("lr", 0.05), momentum=0.9)
    ctx.track(model=model, optimizer=opt)
    losses = []
    for x, y in ctx.batches(regression_data(), global_batch_size=config.get("batch", 32)):
        time.sleep(config.get("step_sleep", 0.0))
        loss = F.mse_loss(model(x.to(dtype)), y.to(dtype))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        ctx.report(loss=losses[-1])
    params = full_params(model)
    if config.get("out_dir"):
        out = Path(config["out_dir"])
        torch.save({k: v.to(torch.float64) for k, v in params.items()}, out / f"rank{ctx.rank}.pt")
        where = {"rank": ctx.rank, "dp_rank": ctx.dp_rank, "tp_rank": ctx.tp_rank,
                 # the NVLink label of the worker this rank really runs in
                 "worker_nvlink": os.environ.get("NBTRAIN_WORKER_NVLINK", ""),
                 "tp_group": ctx.mesh["tp"].mesh.tolist() if "tp" in (
                     ctx.mesh.mesh_dim_names or ()) else [ctx.rank],
                 "nbtrain": nbtrain.__file__}
        (out / f"rank{ctx.rank}.json").write_text(json.dumps(where))
    from torch._dynamo.utils import counters

    return {"mesh": ctx.mesh_info.to_dict() if ctx.mesh_info else None,
            "describe": str(ctx.mesh_info), "losses": losses,
            "compiled_graphs": int(counters["stats"]["unique_graphs"])}


def bad_rows_train(ctx: nbtrain.RankContext, config: dict[str, Any]) -> None:
    """Sends the controller step rows it cannot read (a step that is not a number), sealed
    as its own rank's (a rank bug, not a forgery), then waits to be stopped: the controller
    must fail this job alone."""
    import gc

    from distributed import get_worker

    from nbtrain.core.rankseal import seal

    launch = next(o for o in gc.get_objects() if type(o).__name__ == "RankLaunch"
                  and o.job_id == ctx.job_id and o.generation == ctx.generation)
    seq = 1 << 40  # past every number the rank's own emitter will use
    get_worker().log_event("nbtrain-ranks", {
        "kind": "steps", "job": ctx.job_id, "generation": ctx.generation, "rank": ctx.rank,
        "seq": seq, "seal": seal(launch.secret, ctx.job_id, ctx.generation, ctx.rank, seq,
                                 "steps"),
        "rows": [["not-a-step", 0.0, 0.01, 0.0, 0.01, 0.0, 0.0]]})
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        time.sleep(0.05)


def unknown_kind_train(ctx: nbtrain.RankContext, config: dict[str, Any]) -> None:
    """Sends the controller a sealed rank message of a kind no machine event stands for (a
    rank runtime of another version), then trains: the job must go on."""
    import gc

    from distributed import get_worker

    from nbtrain.core.rankseal import seal

    launch = next(o for o in gc.get_objects() if type(o).__name__ == "RankLaunch"
                  and o.job_id == ctx.job_id and o.generation == ctx.generation)
    # Above every number the rank's own emitter uses in a short job, and close enough that
    # its lower numbers are still inside the seal's window.
    seq = 1000
    get_worker().log_event("nbtrain-ranks", {
        "kind": "telemetry", "job": ctx.job_id, "generation": ctx.generation,
        "rank": ctx.rank, "seq": seq, "seal": seal(launch.secret, ctx.job_id, ctx.generation,
                                                   ctx.rank, seq, "telemetry")})
    for _ in ctx.steps():
        ctx.report(loss=1.0)


class Payload:
    """A result whose unpickling runs a shell command (touches ``marker``): what a hostile
    user's training function could return to whoever reads its result."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        import os

        return (os.system, (f"touch {self.marker}",))


def payload_train(ctx: nbtrain.RankContext, config: dict[str, Any]) -> Any:
    """Returns ``Payload(config["marker"])`` with ordinary data beside it."""
    return {"loss": 0.5, "weights": torch.ones(3), "evil": Payload(config["marker"])}


def data_train(ctx: nbtrain.RankContext, config: dict[str, Any]) -> Any:
    """Returns plain data and tensors only."""
    from collections import OrderedDict

    import numpy as np

    return {"loss": 0.25, "steps": [1, 2, 3], "name": "ok", "tags": {"a", "b"},
            "state": OrderedDict(w=torch.arange(4.0, dtype=torch.float64)),
            "array": np.arange(3), "pair": (1.5, None)}


def launch_secrets_train(ctx: nbtrain.RankContext, config: dict[str, Any]) -> dict[str, Any]:
    """What a rank could find of the cluster's secrets: the operator token in every launch
    this process holds, and its whole environment (the test looks for the token there)."""
    import gc

    launches = [o for o in gc.get_objects() if type(o).__name__ == "RankLaunch"]
    print(f"rank {ctx.rank} holds {len(launches)} launch(es)")
    for _ in ctx.batches(regression_data(), global_batch_size=32):
        ctx.report(loss=1.0)
    return {"launch_tokens": [o.settings.operator_token for o in launches],
            "launches": len(launches), "environ": dict(os.environ)}


def memory_hog_train(ctx: nbtrain.RankContext, config: dict[str, Any]) -> None:
    """Holds ``config["mb"]`` more MB every step (touched, so resident) until the worker's
    memory limit ends it."""
    held = []
    for _ in range(config.get("steps", 1000)):
        held.append(torch.ones(config["mb"] * (1 << 20) // 8, dtype=torch.float64))
        time.sleep(config.get("step_sleep", 0.2))
        ctx.report(held_mb=len(held) * config["mb"])
