"""The rank task: one long-running Dask task per rank and generation.

Sequence: rendezvous (rank 0 opens a TCPStore on a free port and publishes it through the
controller), process group, ``recipe.setup``, restore from the agreed checkpoint, then the step
loop. Each step: planned faults, fetch the batch (data wait), ``recipe.step`` (compute + comm +
optimizer), at agreed steps the control agreement, a checkpoint when due, emit the record.
Stop, preempt and completion end with a checkpoint that the rank waits for. On any exception
the process group is destroyed at once so peers blocked in a collective get an error now
rather than after the collective timeout.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import time
import traceback
from typing import Any

import cloudpickle
import torch
import torch.distributed as dist
from distributed import get_client, get_worker
from distributed.comm import get_address_host

from nbtrain.config import Settings
from nbtrain.runtime import nccl
from nbtrain.runtime.checkpointing import RankCheckpointing
from nbtrain.runtime.context import RankContext
from nbtrain.runtime.control import ControlChannel
from nbtrain.runtime.errors import RankFailure, looks_like_peer_failure
from nbtrain.runtime.events import EventEmitter
from nbtrain.runtime.faults import FaultInjector
from nbtrain.runtime.launch import RankLaunch
from nbtrain.runtime.nvml import monitor_device
from nbtrain.runtime.recipe import Recipe

__all__ = ["KILL_NOTICE_S", "RankLaunch", "run_rank"]

#: Seconds between announcing an injected kill and doing it.
KILL_NOTICE_S = 0.2


def run_rank(launch: RankLaunch) -> dict[str, Any]:
    """Dask task body for one rank. Returns a summary; raises :class:`RankFailure`."""
    worker = get_worker()
    host = get_address_host(worker.address)
    settings = launch.settings
    emitter = EventEmitter(launch.job_id, launch.rank, launch.generation,
                           flush_s=settings.event_flush_s, batch_max=settings.event_batch_max)
    threads = settings.rank_threads or max(1, (os.cpu_count() or 1) // max(1, launch.host_slots))
    torch.set_num_threads(threads)
    device = _device(launch.device)
    ctx = RankContext(job_id=launch.job_id, rank=launch.rank, world_size=launch.world_size,
                      generation=launch.generation, device=device, seed=launch.seed, host=host)
    recipe: Recipe | None = None
    control: ControlChannel | None = None
    ckpt: RankCheckpointing | None = None
    store: dist.TCPStore | None = None
    monitor = monitor_device(device, lambda readings: emitter.emit("device", readings=readings),
                             settings.device_sample_s)
    try:
        t0 = time.perf_counter()
        client = get_client()
        store = _init_process_group(launch, host, device, settings, client)
        control = ControlChannel(launch.job_id, launch.rank, launch.generation, client,
                                 settings.control_poll_s, device, initial=launch.control)
        recipe = cloudpickle.loads(launch.recipe)
        assert recipe is not None
        state = recipe.setup(ctx) or {}
        for obj in state.values():
            if isinstance(obj, torch.optim.Optimizer):
                ctx.timer.attach_optimizer(obj)
        skipped: list[tuple[int, str]] = []
        if launch.checkpoint is not None:
            ckpt = RankCheckpointing(
                launch.checkpoint, rank=launch.rank, world_size=launch.world_size,
                generation=launch.generation, job=launch.job_info or {}, state=state,
                loader=ctx._loader,
                on_event=lambda kind, info: emitter.emit("checkpoint", phase=kind, **info))
            ctx.step, skipped = ckpt.restore()
        emitter.emit("rank_started", host=host, pid=os.getpid(), device=str(device),
                     startup_s=time.perf_counter() - t0, start_step=ctx.step,
                     skipped=[f"step {s}: {why}" for s, why in skipped])
        injector = FaultInjector(launch.job_id, launch.rank, list(launch.faults))
        outcome = _step_loop(launch, recipe, ctx, control, emitter, ckpt, injector)
        summary: dict[str, Any] = {"rank": launch.rank, "step": ctx.step, "outcome": outcome}
        if ckpt is not None:
            plan = ckpt.plan
            if outcome == "preempted" or plan.policy.on_stop:
                ckpt.save(ctx.step)
            final = ckpt.finish(timeout=plan.commit_timeout_s)
            summary["checkpoint_step"] = final.step if final else None
            summary["checkpoint_committed"] = bool(final and final.committed)
            summary["checkpoint_error"] = final.error if final else None
            ckpt = None
            if (outcome == "preempted" and launch.rank == 0
                    and not summary["checkpoint_committed"]):
                raise RuntimeError(
                    f"preemption checkpoint at step {ctx.step} did not commit "
                    f"({summary['checkpoint_error']}); the job keeps its previous checkpoint")
        emitter.emit("rank_finished", step=ctx.step, outcome=outcome)
        return summary
    except BaseException as exc:
        text = "".join(traceback.format_exception(exc))
        error = f"{type(exc).__name__}: {exc}"
        peer = looks_like_peer_failure(text) or nccl.was_aborted(launch.job_id,
                                                                 launch.generation)
        # Free peers blocked in a collective with us: closing our gloo connections (or
        # aborting our NCCL communicator) makes their collective raise now instead of after
        # the collective timeout.
        nccl.abort_process_group()
        with contextlib.suppress(Exception):
            emitter.emit("rank_failed", step=ctx.step, error=error, traceback=text, peer=peer,
                         host=host)
        raise RankFailure(launch.rank, ctx.step, host, error, text, time.time(), peer) from None
    finally:
        if ckpt is not None:
            ckpt.abandon()
        if recipe is not None:
            with contextlib.suppress(Exception):
                recipe.teardown(ctx)
        if control is not None:
            control.close()
        _destroy_process_group()
        nccl.bind(launch.job_id, None)
        if monitor is not None:
            monitor.stop()
        del store
        with contextlib.suppress(Exception):
            emitter.flush()


def _step_loop(launch: RankLaunch, recipe: Recipe, ctx: RankContext, control: ControlChannel,
               emitter: EventEmitter, ckpt: RankCheckpointing | None,
               injector: FaultInjector) -> str:
    perf = time.perf_counter
    timer = ctx.timer
    interval_s = launch.settings.control_interval_s
    next_agreement = ctx.step + 1
    ema_step_s = 0.0
    last_compute = 0.0
    checkpoint_seq = 0
    while ctx.step < launch.steps:
        for fault in injector.poll(ctx.step + 1):
            # A kill gives the event a moment to leave before the process dies; ``when`` is
            # the moment of the kill, for the engine's detection latency.
            delay = KILL_NOTICE_S if fault.kind == "kill" else 0.0
            emitter.emit("fault_injected", fault=fault.to_dict(), step=ctx.step,
                         when=time.time() + delay)
            if delay:
                time.sleep(delay)
            injector.fire(fault)
        t0 = perf()
        timer.reset()
        batch = recipe.next_batch(ctx)
        t1 = perf()
        if injector.slow_factor > 1.0:
            injector.stretch(last_compute)  # inside the compute window: peers wait for us
        metrics = recipe.step(ctx, batch) or {}
        t2 = perf()
        ctx.step += 1
        requests = None
        want_checkpoint = ckpt is not None and ckpt.deterministic_due(ctx.step)
        if ctx.step >= next_agreement:
            proposal = int(interval_s / ema_step_s) if ema_step_s > 0 else 1
            due = ckpt is not None and ckpt.locally_due(ctx.step)
            requests, interval = control.agree(proposal, due)
            next_agreement = ctx.step + interval
            if requests["due"] or requests["checkpoint"] > checkpoint_seq:
                want_checkpoint = True
                checkpoint_seq = requests["checkpoint"]
        ending = requests is not None and (requests["stop"] or requests["preempt"])
        if want_checkpoint and ckpt is not None and not ending:
            ckpt.save(ctx.step)
        t3 = perf()
        step_s = t3 - t0
        ema_step_s = step_s if ema_step_s == 0 else 0.9 * ema_step_s + 0.1 * step_s
        comm = timer.comm_s
        opt = timer.opt_s
        compute = max(0.0, (t2 - t1) - comm - opt)
        last_compute = compute if injector.slow_factor <= 1.0 else last_compute
        row: list[Any] = [ctx.step, time.time(), step_s, t1 - t0, compute, comm, opt]
        if metrics:
            row.append({k: float(v) for k, v in metrics.items()})
        emitter.step(row)
        if ending:
            assert requests is not None
            return "preempted" if requests["preempt"] else "stopped"
    return "completed"


def _device(kind: str = "") -> torch.device:
    if kind == "cpu":
        return torch.device("cpu")
    if torch.cuda.is_available():
        # One GPU per Dask worker (CUDA_VISIBLE_DEVICES per worker: nbtrain's embedded
        # cluster and dask-cuda set it), so the worker's GPU is always cuda:0.
        torch.cuda.set_device(0)
        return torch.device("cuda", 0)
    if kind == "gpu":
        raise RuntimeError(
            f"this job runs on GPU slots, but torch {torch.__version__} on this worker sees "
            "no CUDA device (torch.cuda.is_available() is False): install a CUDA build of "
            "torch in the workers' environment")
    return torch.device("cpu")


def _init_process_group(launch: RankLaunch, host: str, device: torch.device,
                        settings: Settings, client: Any) -> dist.TCPStore:
    if dist.is_initialized():  # a previous generation in this process did not clean up
        _destroy_process_group()
    rdzv_timeout = datetime.timedelta(seconds=settings.rendezvous_timeout_s)

    def rendezvous(**kwargs: Any) -> dict[str, Any]:
        reply: dict[str, Any] = client.sync(
            client.scheduler.nbtrain_rendezvous, job_id=launch.job_id,
            generation=launch.generation, rank=launch.rank,
            timeout=settings.rendezvous_timeout_s,
            callback_timeout=settings.rendezvous_timeout_s + 30, **kwargs)
        if not reply.get("ok"):
            raise RuntimeError(f"rendezvous of rank {launch.rank} failed: {reply.get('message')}")
        return reply

    if launch.rank == 0:
        # Port 0: the OS picks a free port on rank 0's host, so there is no port race.
        store = dist.TCPStore(host, 0, launch.world_size, is_master=True,
                              timeout=rdzv_timeout, wait_for_workers=False)
        rendezvous(host=host, port=store.port)
    else:
        where = rendezvous()
        store = dist.TCPStore(where["host"], int(where["port"]), launch.world_size,
                              is_master=False, timeout=rdzv_timeout)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl":
        nccl.configure_env()
    dist.init_process_group(
        backend, store=store, rank=launch.rank, world_size=launch.world_size,
        timeout=datetime.timedelta(seconds=settings.collective_timeout_s),
        # Binding the GPU creates the NCCL communicator now (rendezvous errors surface
        # here) and gives the controller's abort a communicator to abort.
        device_id=device if backend == "nccl" else None,
    )
    nccl.bind(launch.job_id, launch.generation)
    return store


def _destroy_process_group() -> None:
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
