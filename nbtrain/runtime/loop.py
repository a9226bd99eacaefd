"""The rank task: one long-running Dask task per rank and generation.

Sequence: rendezvous (rank 0 opens a TCPStore on a free port and publishes it in a Dask
Variable), process group, ``recipe.setup``, then the step loop. Each step: fetch the batch
(data wait), ``recipe.step`` (compute + comm + optimizer), agree on control requests, emit the
record. On any exception the process group is destroyed at once so peers blocked in a
collective get an error now rather than after the collective timeout.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import time
import traceback
from dataclasses import dataclass
from typing import Any

import cloudpickle
import torch
import torch.distributed as dist
from distributed import Variable, get_client, get_worker
from distributed.comm import get_address_host

from nbtrain.config import Settings
from nbtrain.runtime.context import RankContext
from nbtrain.runtime.control import ControlChannel
from nbtrain.runtime.errors import RankFailure, looks_like_peer_failure
from nbtrain.runtime.events import EventEmitter
from nbtrain.runtime.recipe import Recipe


@dataclass(frozen=True)
class RankLaunch:
    """Everything one rank task needs; built by the engine, pickled to the worker."""

    job_id: str
    rank: int
    world_size: int
    generation: int
    recipe: bytes  # cloudpickled Recipe
    steps: int
    seed: int
    host_slots: int  # slots of this job's cluster on this rank's host, to size torch threads
    settings: Settings


def rendezvous_name(job_id: str, generation: int) -> str:
    return f"nbtrain-rdzv-{job_id}-{generation}"


def run_rank(launch: RankLaunch) -> dict[str, Any]:
    """Dask task body for one rank. Returns a summary; raises :class:`RankFailure`."""
    worker = get_worker()
    host = get_address_host(worker.address)
    settings = launch.settings
    emitter = EventEmitter(launch.job_id, launch.rank, launch.generation,
                           flush_s=settings.event_flush_s, batch_max=settings.event_batch_max)
    threads = settings.rank_threads or max(1, (os.cpu_count() or 1) // max(1, launch.host_slots))
    torch.set_num_threads(threads)
    device = _device()
    ctx = RankContext(job_id=launch.job_id, rank=launch.rank, world_size=launch.world_size,
                      generation=launch.generation, device=device, seed=launch.seed, host=host)
    recipe: Recipe | None = None
    control: ControlChannel | None = None
    store: dist.TCPStore | None = None
    try:
        t0 = time.perf_counter()
        store = _init_process_group(launch, host, device, settings)
        control = ControlChannel(launch.job_id, launch.rank, get_client(),
                                 settings.control_poll_s, device)
        recipe = cloudpickle.loads(launch.recipe)
        assert recipe is not None
        state = recipe.setup(ctx) or {}
        for obj in state.values():
            if isinstance(obj, torch.optim.Optimizer):
                ctx.timer.attach_optimizer(obj)
        emitter.emit("rank_started", host=host, pid=os.getpid(), device=str(device),
                     startup_s=time.perf_counter() - t0)
        outcome = _step_loop(launch, recipe, ctx, control, emitter)
        emitter.emit("rank_finished", step=ctx.step, outcome=outcome)
        return {"rank": launch.rank, "step": ctx.step, "outcome": outcome}
    except BaseException as exc:
        text = "".join(traceback.format_exception(exc))
        error = f"{type(exc).__name__}: {exc}"
        peer = looks_like_peer_failure(text)
        # Free peers blocked in a collective with us: closing our gloo/NCCL connections makes
        # their collective raise now instead of after the collective timeout.
        _destroy_process_group()
        with contextlib.suppress(Exception):
            emitter.emit("rank_failed", step=ctx.step, error=error, traceback=text, peer=peer,
                         host=host)
        raise RankFailure(launch.rank, ctx.step, host, error, text, time.time(), peer) from None
    finally:
        if recipe is not None:
            with contextlib.suppress(Exception):
                recipe.teardown(ctx)
        if control is not None:
            control.close()
        _destroy_process_group()
        del store
        with contextlib.suppress(Exception):
            emitter.flush()


def _step_loop(launch: RankLaunch, recipe: Recipe, ctx: RankContext, control: ControlChannel,
               emitter: EventEmitter) -> str:
    perf = time.perf_counter
    timer = ctx.timer
    interval_s = launch.settings.control_interval_s
    next_agreement = ctx.step + 1
    ema_step_s = 0.0
    while ctx.step < launch.steps:
        t0 = perf()
        timer.reset()
        batch = recipe.next_batch(ctx)
        t1 = perf()
        metrics = recipe.step(ctx, batch) or {}
        t2 = perf()
        ctx.step += 1
        requests = None
        if ctx.step >= next_agreement:
            proposal = int(interval_s / ema_step_s) if ema_step_s > 0 else 1
            requests, interval = control.agree(proposal)
            next_agreement = ctx.step + interval
        t3 = perf()
        step_s = t3 - t0
        ema_step_s = step_s if ema_step_s == 0 else 0.9 * ema_step_s + 0.1 * step_s
        comm = timer.comm_s
        opt = timer.opt_s
        compute = max(0.0, (t2 - t1) - comm - opt)
        row: list[Any] = [ctx.step, time.time(), step_s, t1 - t0, compute, comm, opt]
        if metrics:
            row.append({k: float(v) for k, v in metrics.items()})
        emitter.step(row)
        if requests is not None and (requests["stop"] or requests["preempt"]):
            return "preempted" if requests["preempt"] else "stopped"
    return "completed"


def _device() -> torch.device:
    if torch.cuda.is_available():
        # One GPU per Dask worker (dask-cuda sets CUDA_VISIBLE_DEVICES per worker).
        torch.cuda.set_device(0)
        return torch.device("cuda", 0)
    return torch.device("cpu")


def _init_process_group(launch: RankLaunch, host: str, device: torch.device,
                        settings: Settings) -> dist.TCPStore:
    if dist.is_initialized():  # a previous generation in this process did not clean up
        _destroy_process_group()
    var = Variable(rendezvous_name(launch.job_id, launch.generation), client=get_client())
    rdzv_timeout = datetime.timedelta(seconds=settings.rendezvous_timeout_s)
    if launch.rank == 0:
        # Port 0: the OS picks a free port on rank 0's host, so there is no port race.
        store = dist.TCPStore(host, 0, launch.world_size, is_master=True,
                              timeout=rdzv_timeout, wait_for_workers=False)
        var.set({"host": host, "port": store.port})
    else:
        where = var.get(timeout=settings.rendezvous_timeout_s)
        store = dist.TCPStore(where["host"], int(where["port"]), launch.world_size,
                              is_master=False, timeout=rdzv_timeout)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend, store=store, rank=launch.rank, world_size=launch.world_size,
        timeout=datetime.timedelta(seconds=settings.collective_timeout_s),
    )
    return store


def _destroy_process_group() -> None:
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
