"""The rank task: one long-running Dask task per rank and generation.

Sequence: rendezvous (rank 0 opens a TCPStore on a free port and publishes it through the
controller), process group, then the user's work: a ``Recipe`` (``setup``, then nbtrain's loop
over ``next_batch``/``step``) or a training function (``train(ctx, config)``, its own loop over
``ctx.batches``). Either way the loop starts by restoring the agreed checkpoint, and every step
boundary goes through :class:`~nbtrain.runtime.stepper.Stepper` (faults, timing, control,
checkpoints, the step's row). Stop, preempt and completion end with a checkpoint that the rank
waits for (a halt, after a NaN, does not). On any exception the process group is destroyed at
once so peers blocked in a collective get an error now rather than after the collective
timeout.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
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
from nbtrain.core.checkpoint_policy import PREEMPT_COMMIT_SHARE
from nbtrain.runtime import nccl
from nbtrain.runtime.checkpointing import RankCheckpointing
from nbtrain.runtime.context import LoopEnded, RankContext
from nbtrain.runtime.control import ControlChannel
from nbtrain.runtime.errors import RankFailure, looks_like_peer_failure
from nbtrain.runtime.events import EventEmitter
from nbtrain.runtime.faults import FaultInjector
from nbtrain.runtime.function import TrainFunction
from nbtrain.runtime.launch import RankLaunch
from nbtrain.runtime.memory import state_memory
from nbtrain.runtime.mesh import build_device_mesh, default_plan
from nbtrain.runtime.noiseprobe import NoiseProbe
from nbtrain.runtime.nvml import monitor_device
from nbtrain.runtime.output import OutputForwarder
from nbtrain.runtime.recipe import Recipe
from nbtrain.runtime.script_rank import ScriptRank
from nbtrain.runtime.script_work import ScriptWork
from nbtrain.runtime.stepper import Stepper
from nbtrain.runtime.torchrun_env import as_torchrun, torchrun_env

__all__ = ["RankLaunch", "run_rank"]


def run_rank(launch: RankLaunch) -> dict[str, Any]:
    """Dask task body for one rank. Returns a summary; raises :class:`RankFailure`."""
    summary = _run_rank(launch)
    # What the job made outlives it in reference cycles (the rank's context and its driver;
    # an HF Trainer and its callbacks): the model, the optimizer and, through DDP, the
    # process group with its gloo threads (one wakes ~100 times a second) and rank 0's
    # store. Python frees cycles only at a full collection, which can come much later:
    # inside the next job's training on this worker, with the old model (on a GPU, its
    # memory) held until then. Every collective is done here, so the group's teardown
    # waits for nobody. A failed rank skips this: its traceback holds the frames anyway,
    # and a collective a lost peer never finishes could hold up the teardown.
    gc.collect()
    return summary


def _run_rank(launch: RankLaunch) -> dict[str, Any]:
    worker = get_worker()
    host = get_address_host(worker.address)
    settings = launch.settings
    emitter = EventEmitter(launch.job_id, launch.rank, launch.generation,
                           flush_s=settings.event_flush_s, batch_max=settings.event_batch_max,
                           secret=launch.secret)
    threads = settings.rank_threads or max(1, (os.cpu_count() or 1) // max(1, launch.host_slots))
    torch.set_num_threads(threads)
    device = _device(launch.device)
    mesh_plan = launch.mesh or default_plan(launch.world_size, host)
    ctx = RankContext(job_id=launch.job_id, rank=launch.rank, world_size=launch.world_size,
                      generation=launch.generation, device=device, seed=launch.seed, host=host,
                      base_world_size=int((launch.job_info or {}).get("world_size")
                                          or launch.world_size), mesh_info=mesh_plan)
    recipe: Recipe | None = None
    control: ControlChannel | None = None
    ckpt: RankCheckpointing | None = None
    store: dist.TCPStore | None = None
    exits = contextlib.ExitStack()
    monitor = monitor_device(device, lambda readings: emitter.emit("device", readings=readings),
                             settings.device_sample_s)
    try:
        t0 = time.perf_counter()
        client = get_client()
        store = _init_process_group(launch, host, device, settings, client)
        exits.enter_context(as_torchrun(torchrun_env(
            rank=launch.rank, world_size=launch.world_size, master_addr=store.host,
            master_port=store.port, generation=launch.generation, run_id=launch.job_id)))
        ctx._mesh = build_device_mesh(mesh_plan, device)
        emitter.emit("phase", phase="setup")  # for the controller's startup watchdog
        control = ControlChannel(launch.job_id, launch.rank, launch.generation, client,
                                 settings.control_poll_s, device, initial=launch.control,
                                 secret=launch.secret)
        control.set_knobs(launch.knobs.get("pending", []))
        ctx.knobs.load(launch.knobs)
        work = cloudpickle.loads(launch.recipe)
        if isinstance(work, ScriptWork):
            return _script_rank(work, launch, ctx, store, emitter, control, threads, t0)
        if launch.checkpoint is not None:
            ckpt = RankCheckpointing(
                launch.checkpoint, rank=launch.rank, world_size=launch.world_size,
                generation=launch.generation, job=launch.job_info or {}, seed=launch.seed,
                on_event=lambda kind, info: emitter.emit("checkpoint", phase=kind, **info),
                mesh_dims={name: (c, mesh_plan.size(name))
                           for name, c in mesh_plan.coords(launch.rank).items()})
        stepper = Stepper(timer=ctx.timer, steps=launch.steps, control=control, emitter=emitter,
                          checkpointing=ckpt,
                          injector=FaultInjector(launch.job_id, launch.rank,
                                                 list(launch.faults)),
                          interval_s=settings.control_interval_s,
                          halt_on_nonfinite=launch.halt_on_nonfinite)
        stepper.memory_probe = lambda: _memory(ctx)
        stepper.knobs, stepper.is_main = ctx.knobs, launch.rank == 0
        if (launch.rank == 0 and launch.world_size >= 2
                and (launch.job_info or {}).get("sizing") == "goodput"):
            stepper.noise = NoiseProbe(ctx.timer, emitter)
        if ckpt is not None:
            ckpt.meta_hook = lambda: {"knobs": ctx.knobs.checkpoint_meta()}
            # The interval of step-based checkpoints as a live knob (0: none by steps).
            ctx.knobs.provide("checkpoint_every", float(ckpt.every_steps or 0),
                              ckpt.set_every_steps, min=0.0, integer=True)
        driver = _Driver(ctx, stepper, ckpt, emitter, t0)
        ctx._driver = driver
        result: Any = None
        with OutputForwarder(emitter, lines_per_s=settings.log_lines_per_s):
            if isinstance(work, TrainFunction):
                try:
                    result = work.fn(ctx, dict(work.config))
                    outcome = stepper.outcome or "completed"
                except LoopEnded as ended:
                    outcome = ended.outcome
            else:
                recipe = work
                outcome = _recipe_loop(recipe, ctx, stepper, driver)
        # However the loop ended (its step budget, a user's break, data run out), an
        # agreement its last boundary offered is finished here, before the final checkpoint.
        control.drain()
        summary: dict[str, Any] = {"rank": launch.rank, "step": ctx.step, "outcome": outcome}
        if ckpt is not None and driver.started:
            plan = ckpt.plan
            if outcome == "preempted" or (plan.policy.on_stop and outcome != "halted"
                                          and not stepper.tainted):
                ckpt.save(ctx.step)
            # A preemption's checkpoint that does not commit in time is not a failure: the
            # job resumes from its previous one (the controller reads checkpoint_committed).
            final = ckpt.finish(timeout=plan.final_commit_s(outcome))
            summary["checkpoint_step"] = final.step if final else None
            summary["checkpoint_committed"] = bool(final and final.committed)
            summary["checkpoint_error"] = final.error if final else None
            ckpt = None
        if launch.rank == 0 and result is not None:
            summary.update(_pickled_result(result, settings.result_max_bytes))
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
        with contextlib.suppress(Exception):
            ctx.close_data()
        if control is not None:
            control.close()
        exits.close()
        _destroy_process_group()
        nccl.bind(launch.job_id, None)
        if monitor is not None:
            monitor.stop()
        del store
        with contextlib.suppress(Exception):
            emitter.flush()


class _Driver:
    """Starts a rank's training loop: restores the newest checkpoint into what is tracked
    (model, optimizer, data position, RNG), then announces the rank."""

    def __init__(self, ctx: RankContext, stepper: Stepper, ckpt: RankCheckpointing | None,
                 emitter: EventEmitter, t0: float) -> None:
        self.ctx = ctx
        self.stepper = stepper
        self.ckpt = ckpt
        self.emitter = emitter
        self.t0 = t0
        self.started = False

    def start_loop(self) -> int:
        ctx = self.ctx
        step, skipped = 0, list[tuple[int, str]]()
        ctx.knobs.bind(ctx._state)  # before the restore: the optimizers' own LR
        if self.ckpt is not None:
            self.emitter.emit("phase", phase="restore")
            self.ckpt.bind(ctx._state, ctx._loader)
            step, skipped = self.ckpt.restore()
        self.stepper.start(step)
        self.started = True
        ctx.step = step
        data = ctx.restored()
        restored = self.ckpt.restored_meta.get("knobs") if self.ckpt is not None else None
        own = self.ckpt is not None and self.ckpt.restored_own
        knobs = ctx.knobs.start(step, restored, own)  # after the LR rule: an absolute LR wins
        self.stepper.control.knob_seq = max(self.stepper.control.knob_seq, ctx.knobs.seq)
        if ctx.rank == 0:
            self.emitter.emit("data", **data)
            self.emitter.emit("knobs", **knobs)
            # Changes the checkpoint holds that the controller never recorded as applied:
            # reported at their own steps, so they leave its pending list for the history.
            for at in sorted({c.step for c in ctx.knobs.recovered if c.step is not None}):
                self.emitter.emit("knob_applied", step=at, values=knobs["values"], changes=[
                    c.to_dict() for c in ctx.knobs.recovered if c.step == at])
        self.emitter.emit("rank_started", host=ctx.host, pid=os.getpid(),
                          device=str(ctx.device), startup_s=time.perf_counter() - self.t0,
                          start_step=step, skipped=[f"step {s}: {why}" for s, why in skipped])
        return step


def _script_rank(work: ScriptWork, launch: RankLaunch, ctx: RankContext, store: dist.TCPStore,
                 emitter: EventEmitter, control: ControlChannel, threads: int,
                 t0: float) -> dict[str, Any]:
    """A script job's rank: the script in a child process (:mod:`~nbtrain.runtime.script_rank`);
    nbtrain's checkpoints and step loop are not used (the script keeps its own snapshots)."""
    settings = launch.settings
    runner = ScriptRank(
        work, rank=launch.rank, world_size=launch.world_size, host=ctx.host, store=store,
        env=torchrun_env(rank=launch.rank, world_size=launch.world_size,
                         master_addr=store.host, master_port=store.port,
                         generation=launch.generation, run_id=launch.job_id),
        emitter=emitter, control=control, interval_s=settings.control_interval_s,
        term_grace_s=PREEMPT_COMMIT_SHARE * settings.preempt_grace_s,
        rendezvous_timeout_s=settings.rendezvous_timeout_s, threads=threads)

    def started(pid: int) -> None:  # pid: the child's, the process that runs user code
        emitter.emit("rank_started", host=ctx.host, pid=pid, device=str(ctx.device),
                     startup_s=time.perf_counter() - t0, start_step=0, skipped=[])

    try:
        with OutputForwarder(emitter, lines_per_s=settings.log_lines_per_s) as out:
            outcome = runner.run(out.stdout.write, out.stderr.write, started)
    finally:
        ctx.step = runner.steps
    emitter.emit("rank_finished", step=runner.steps, outcome=outcome)
    return {"rank": launch.rank, "step": runner.steps, "outcome": outcome}


def _recipe_loop(recipe: Recipe, ctx: RankContext, stepper: Stepper, driver: _Driver) -> str:
    """nbtrain's own loop around a ``Recipe``'s ``next_batch`` and ``step``."""
    state = recipe.setup(ctx) or {}
    for obj in state.values():
        if isinstance(obj, torch.optim.Optimizer):
            ctx.timer.attach_optimizer(obj)
    # A recipe's state may also hold plain tensors and containers (the snapshotter copies
    # them), so it is not validated like ctx.track's objects.
    ctx._state.update(state)
    ctx.step = driver.start_loop()
    while stepper.begin():
        batch = recipe.next_batch(ctx)
        stepper.batch_ready()
        metrics = recipe.step(ctx, batch) or {}
        ending = stepper.end(metrics)
        ctx.step = stepper.step
        if ending:
            break
    return stepper.outcome or "completed"


def _memory(ctx: RankContext) -> dict[str, Any]:
    """The ``memory`` event: this rank's state bytes, how its model was prepared, its RSS."""
    info: dict[str, Any] = dict(state_memory(ctx._state))
    how = ctx._prepared[-1] if ctx._prepared else None
    info["strategy"] = how.strategy if how else ""
    info["precision"] = how.precision if how else ""
    with contextlib.suppress(Exception):
        import psutil

        info["rss_bytes"] = int(psutil.Process().memory_info().rss)
    return info


def _pickled_result(result: Any, limit: int) -> dict[str, Any]:
    """Rank 0's return value, pickled here so the controller carries it without unpickling
    user objects in the scheduler's process."""
    try:
        data = cloudpickle.dumps(result)
    except Exception as exc:
        return {"result_error": f"the training function's return value cannot be pickled: "
                                f"{type(exc).__name__}: {exc}"}
    if len(data) > limit:
        return {"result_error": (
            f"the training function's return value is {len(data) / 1e6:.1f} MB pickled, over "
            f"the {limit / 1e6:.0f} MB limit (Settings.result_max_bytes): save large objects "
            "to storage and return their path")}
    return {"result": data}


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
            generation=launch.generation, rank=launch.rank, secret=launch.secret,
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
