"""``connect()`` and ``Cluster``: a client's handle on a Dask cluster of slots and its jobs.

The jobs live in the cluster's controller (a Dask scheduler plugin, see
:mod:`nbtrain.engine.controller`); ``connect()`` registers it if no client has yet, so every
client of one scheduler shares one queue. A ``Cluster`` submits, lists and attaches to jobs;
closing it ends nothing on an external cluster.
"""

from __future__ import annotations

import contextlib
import getpass
import html
import logging
import math
import os
import secrets
import tempfile
import time
import uuid
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import cloudpickle
import dask.config
from distributed import Client, LocalCluster
from distributed.deploy import Cluster as DaskCluster

from nbtrain.config import Settings
from nbtrain.core.checkpoint_policy import parse_checkpoint_setting, stop_grace_s
from nbtrain.core.faults import Fault
from nbtrain.core.job import JobSpec, default_name, status_progress
from nbtrain.core.lifecycle_types import JobPolicy, JobSubmission
from nbtrain.core.mitigation import MitigationSettings, make_policy
from nbtrain.engine import pages
from nbtrain.engine.assets import token_hash
from nbtrain.engine.checkpoints import job_url, resolve_resume
from nbtrain.engine.controller import ClusterController
from nbtrain.engine.embedded import EmbeddedCluster
from nbtrain.engine.forkstart import fork_workers
from nbtrain.engine.gpus import embedded_gpus
from nbtrain.engine.job import JobHandle
from nbtrain.engine.remote import Follower, Remote
from nbtrain.engine.tokens import TokenStore
from nbtrain.engine.topoview import TopologyView
from nbtrain.engine.trackers import Tracker, TrackerSpec, split_trackers
from nbtrain.engine.wire import plain, submission_to_wire
from nbtrain.engine.workers import QUIET_TICK_MS, NbtrainNanny, NbtrainWorker
from nbtrain.runtime.function import TrainFunction
from nbtrain.runtime.script_work import ScriptWork, load_script

__all__ = ["QUIET_WORKER_CONFIG", "Cluster", "connect", "default_worker_count"]

#: Dask settings for embedded rank workers, applied before they start (the worker plugin
#: quiets the profiler and monitors of any cluster's workers after they start; the GIL
#: monitor can only be turned off before). The tick period also reaches the embedded
#: scheduler and nannies, which share this process's event loop with the controller.
QUIET_WORKER_CONFIG = {
    "distributed.worker.profile.enabled": False,
    "distributed.admin.system-monitor.interval": "2s",
    "distributed.admin.system-monitor.gil.enabled": False,
    "distributed.worker.memory.monitor-interval": "1s",
    "distributed.admin.tick.interval": f"{QUIET_TICK_MS}ms",
}


def default_worker_count() -> int:
    """One slot per core, at least 2 (so gangs can be shown on one core), at most 8."""
    return max(2, min(os.cpu_count() or 2, 8))


class Cluster:
    """Slots (Dask workers) and the jobs running on them, as one client sees them."""

    def __init__(self, client: Client, *, local: LocalCluster | None = None,
                 owns_client: bool = False, settings: Settings | None = None,
                 operator_token: str = "", manager: DaskCluster | None = None) -> None:
        self.settings = settings or Settings.load()
        self._local = local
        #: The Dask cluster manager behind the client (the embedded cluster, or the one
        #: given to ``connect``), which ``scale``/``adapt`` act through; None for an address.
        self.manager: DaskCluster | None = local if local is not None else manager
        self._owns_client = owns_client
        self._remote = Remote(client, operator_token)
        self._follower = Follower(self._remote)
        self._tokens = TokenStore(self.settings.token_file)
        self._handles: weakref.WeakValueDictionary[str, JobHandle] = (
            weakref.WeakValueDictionary())
        self._closed = False
        self._finalizer = weakref.finalize(self, _close_quietly, self._follower, client, local,
                                           owns_client)

    def rpc(self, op: str, **kwargs: Any) -> Mapping[str, Any]:
        """Call a handler of the cluster's controller (``nbtrain_*``); raises the error its
        reply names. Job handles call through here."""
        return self._remote.call(op, **kwargs)

    def credential(self, token: str) -> str:
        """What a request on a job carries: the job's ``token``, else this client's operator
        token (empty when it has none)."""
        return token or self._remote.operator_token

    def read_tokens(self, job_id: str, token: str) -> dict[str, Any]:
        """What a read of one job carries: its token (if this client has one) and this
        client's operator token; the controller grants the better of the two."""
        return {"tokens": {job_id: token} if token else {}, "token": self._remote.operator_token}

    def credentials(self) -> dict[str, Any]:
        """What a listing carries so the controller shows this client what it may read:
        its operator token and the tokens of the jobs it holds handles of."""
        tokens = {jid: h.token for jid, h in list(self._handles.items()) if h.token}
        return {"token": self._remote.operator_token, "tokens": tokens}

    @property
    def operator_token(self) -> str:
        """This client's operator token ("" when it has none)."""
        return self._remote.operator_token

    def follow(self, handle: JobHandle) -> None:
        """Keep ``handle`` current (the cluster's follower thread)."""
        self._follower.follow(handle)

    @property
    def client(self) -> Client:
        """The Dask client this cluster talks through (a new one after the old gave up
        reconnecting to a scheduler that was away for long)."""
        return self._remote.client

    # -- slots ----------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """The controller's view of the cluster: ``slots`` (slot, host, nvlink, address,
        state, job), ``jobs`` (statuses), ``queue`` (job ids in order), ``team_usage``
        (slot-seconds per team), ``log`` (recent cluster events: workers, restarts)."""
        return dict(self.rpc("nbtrain_cluster", **self.credentials()))

    def _wait_for_slots(self, expected: int, timeout: float = 120.0) -> None:
        """Until the controller has taken in the workers Dask knows of (it reads each
        joining worker's labels first), and at least ``expected`` slots are up."""
        deadline = time.monotonic() + timeout
        while True:
            snap = self.snapshot()
            online = sum(1 for s in snap["slots"] if s["state"] in ("free", "held"))
            if not snap.get("pending_workers") and online >= expected:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"nbtrain's controller has {online} slots after {timeout:.0f} s "
                    f"({snap.get('pending_workers')} workers still joining, {expected} "
                    f"expected); see cluster.snapshot()['log'] for workers it refused")
            time.sleep(0.02)

    @property
    def slots(self) -> list[str]:
        """Worker addresses of the slots that have a worker now."""
        return sorted(s["address"] for s in self.snapshot()["slots"]
                      if s["address"] and s["state"] in ("free", "held"))

    @property
    def topology(self) -> TopologyView:
        """The slots by leaf switch, host and NVLink domain, with their GPUs (UUID, PCI bus
        id) and where each domain came from (NVML, a multi-node NVLink clique, nvidia-smi,
        or a declared label): what the gang scheduler places on."""
        return TopologyView(self.snapshot()["slots"])

    @property
    def free_slots(self) -> list[str]:
        return sorted(s["address"] for s in self.snapshot()["slots"] if s["state"] == "free")

    @property
    def jobs(self) -> list[JobHandle]:
        """Every job the cluster's controller knows, from every client, in submit order."""
        listing = self._remote.call("nbtrain_jobs", **self.credentials())["jobs"]
        return [self._handle_for(status) for status in listing]

    def job(self, key: str, *, token: str | None = None) -> JobHandle:
        """Attach to a job by id or name (the newest of that name), from any client.

        Its metrics, events and dashboard work as on the submitting client. It can be
        steered with its ``token`` (found automatically when this user submitted it, see
        ``Settings.token_file``) or as the operator; otherwise the handle only watches.
        """
        if not isinstance(key, str) or not key:
            raise TypeError(f"cluster.job() takes a job's id or name (a string), got {key!r}")
        info = self._remote.call("nbtrain_job", key=key, token=self._remote.operator_token)
        job_id = str(info["status"]["job_id"])
        if token is not None or not info["checkpoint_url"]:
            # This client may be its owner (a token given, or one kept from an earlier
            # kernel): ask again with it, for what only the owner may read.
            own = token or self._tokens.get(self.address, job_id)
            if own:
                info = self._remote.call("nbtrain_job", key=job_id, token=own,
                                         operator=self._remote.operator_token)
            held = self._handles.get(job_id)
            if token is not None and held is not None and held.token != token:
                # A handle that watched without the token saw less: start a fresh one.
                del self._handles[job_id]
        handle = self._handle_for(info["status"], spec=info["spec"],
                                  checkpoint_url=info["checkpoint_url"])
        if token is not None:
            handle.steer_with(token)
        return handle

    def _handle_for(self, status: dict[str, Any], *, spec: dict[str, Any] | None = None,
                    checkpoint_url: str = "") -> JobHandle:
        job_id = str(status["job_id"])
        existing = self._handles.get(job_id)
        if existing is not None:
            return existing
        own = self._tokens.get(self.address, job_id)
        if spec is None:
            info = self._remote.call("nbtrain_job", key=job_id,
                                     token=own or self._remote.operator_token)
            spec, checkpoint_url = info["spec"], info["checkpoint_url"]
        handle = JobHandle(JobSpec(**spec), self, checkpoint_url=checkpoint_url, status=status,
                           token=own)
        self._handles[job_id] = handle
        return handle

    def scale(self, n: int) -> None:
        """Ask the cluster manager for ``n`` workers (slots join or leave). Workers that
        leave while they run a rank take their jobs through the preemption path first
        (checkpoint, then queued again on other slots; ``nbtrain.engine.departures``)."""
        self._cluster_manager("scale").scale(n)

    def adapt(self, *, minimum: int = 0, maximum: int | None = None, idle_s: float = 60.0,
              kind: str = "cpu", **kwargs: Any) -> Any:
        """Scale from nbtrain's queue (:class:`nbtrain.engine.adaptive.QueueAdaptive`): the
        cluster manager is asked for the whole gangs queued jobs of ``kind`` need (up to
        ``maximum`` workers), never retires a slot that runs a rank or that a waiting gang
        needs, and retires a free slot after ``idle_s``. Other keywords go to Dask's
        ``Adaptive`` (``interval``, ``wait_count``). Returns the ``Adaptive``; ``.stop()``
        it to scale by hand again. Dask's own ``adapt()`` without ``Adaptive=`` sizes from
        Dask tasks and cannot see nbtrain's queue."""
        from nbtrain.engine.adaptive import QueueAdaptive

        manager = self._cluster_manager("adapt")
        cls = kwargs.pop("Adaptive", QueueAdaptive)  # a subclass of it, e.g. to observe
        return manager.adapt(Adaptive=cls, minimum=minimum,
                             maximum=math.inf if maximum is None else maximum,
                             idle_s=idle_s, kind=kind, **kwargs)

    def _cluster_manager(self, what: str) -> DaskCluster:
        if self.manager is None:
            raise RuntimeError(
                f"{what}() needs the cluster manager, and this Cluster was connected by "
                "address or Client: pass the manager itself, connect(SLURMCluster(...)) or "
                "connect(KubeCluster(...)), or scale it with its own tools")
        if type(self.manager).scale is DaskCluster.scale:
            raise RuntimeError(f"{what}() is not supported by {type(self.manager).__name__}: "
                               "it cannot add or remove workers (Dask's Cluster.scale is "
                               "not implemented there); scale it with its own tools")
        return self.manager

    def dashboard(self, display: str | None = None, **options: Any) -> Any:
        """The class view: slots by host and NVLink domain coloured by job, every client's
        jobs with their goodput, the queue with reasons, preemptions as they happen. In a
        notebook the page the cluster serves (live while the kernel is busy); a text
        snapshot when ``display="text"`` (or NBTRAIN_DISPLAY=text); ``display="widget"``
        for the kernel-side widget."""
        from nbtrain.ui.cluster_view import cluster_dashboard

        return cluster_dashboard(self, display=display, **options)

    def page(self) -> Any:
        """The class view served by the cluster (a ``PageView``)."""
        from nbtrain.ui.pageview import PageView

        reply = self._remote.call("nbtrain_view")
        if reply["served"] == "none":
            raise RuntimeError("this cluster's scheduler has no web server (its dashboard is "
                               "off), so it serves no pages: use display='widget' or 'text'")
        return PageView(self.page_url(reply["path"]), "nbtrain cluster")

    def page_url(self, path: str) -> str:
        """A page of the scheduler's web server, addressed like Dask's dashboard link (which
        follows ``distributed.dashboard.link``, e.g. through jupyter-server-proxy on a hub)."""
        link = str(self.client.dashboard_link)
        base = link[: -len("status")] if link.endswith("status") else link.rstrip("/") + "/"
        return base + path.lstrip("/")

    # -- jobs -----------------------------------------------------------------------------
    def submit(self, recipe: Any, *, world_size: int, steps: int | None = None,
               min_size: int | None = None, max_size: int | None = None,
               name: str | None = None, config: Mapping[str, Any] | None = None,
               queue: bool = True, seed: int = 0, priority: int = 0,
               team: str = "default", checkpoint: int | str | None = "auto",
               resume: str | None = None, max_restarts: int = 3,
               restart_window_s: float = 3600.0, fail_fast: bool = True,
               faults: list[Fault] | None = None,
               stragglers: str | MitigationSettings = "alert",
               device: str = "auto",
               on_nonfinite: str = "alert",
               trackers: Sequence[str | TrackerSpec | Tracker] | None = None,
               mesh: Mapping[str, int] | None = None, replay: Any = None,
               sizing: str = "fixed") -> JobHandle:
        """Start a training job on ``world_size`` slots at once (gang), or queue it.

        ``recipe``: a training function ``train(ctx, config)`` with its own loop over
        ``ctx.batches(...)`` (``config`` is passed to it; its return value on rank 0 is
        ``job.result()``), or an ``nbtrain.Recipe`` (``setup``/``step``, nbtrain's loop).
        ``steps``: steps to train (required for a Recipe; for a function None lets its loop
        decide).
        ``min_size`` / ``max_size``: an elastic job, which runs at any size in between:
        :meth:`JobHandle.resize` changes it, a lost worker without a spare shrinks it
        (down to ``min_size``) instead of stopping it, and it grows back into free slots.
        The global batch stays the same at every size (see the README's *Elastic jobs*).
        ``sizing="goodput"`` (an elastic job) lets the scheduler choose the size in that range
        from the job's measured step times at each size it ran at: it starts at
        ``world_size``, gives back ranks that add little while other jobs wait, and takes
        idle slots where they add most (see the README's *Goodput-driven sizing*).

        Returns a :class:`JobHandle` immediately; training runs in the background, in the
        cluster, and goes on if this kernel stops.

        - ``queue=False``: a job that cannot start now raises ValueError instead of waiting.
        - ``priority``: higher runs first and may preempt lower-priority jobs (they
          checkpoint, release their slots and resume later); up to the cluster's
          ``priority_ceiling`` without the operator token. ``team``: fair share between
          teams of equal priority (``Settings.team_weights``).
        - ``checkpoint``: ``"auto"`` (Young/Daly interval from the measured cost), an int N
          (every N steps), a duration (``"10m"``), or None (on demand, stop, preemption only).
        - ``resume``: ``"latest"`` (newest committed checkpoint of a job with this ``name``),
          or a checkpoint directory / ``step-XXXXXXXX`` URL.
        - ``max_restarts`` within ``restart_window_s``: automatic recoveries before FAILED.
        - ``fail_fast`` (default True): an exception with the same message on the same rank
          at the same step as the fault before it (a bug, not a flaky node) fails the job at
          once, after one retry; False retries it like any fault.
        - ``faults``: planned faults (``nbtrain.Fault``) for teaching and tests.
        - ``stragglers``: mitigation policy, ``"alert"`` (report only) or ``"replace"``
          (restart the gang without a confirmed straggler's slot, with a cooldown), or a
          ``nbtrain.core.mitigation.MitigationSettings`` for cooldowns and exclusion scope.
        - ``device``: ``"gpu"`` (GPU slots only; NCCL), ``"cpu"`` (CPU slots only; gloo) or
          ``"auto"`` (GPU slots if the cluster has any, else CPU slots).
        - ``on_nonfinite``: a NaN or infinite reported metric raises an alert (``"alert"``),
          or also stops the job with nothing checkpointed from that step on (``"halt"``:
          the newest committed checkpoint stays the last good state; FAILED; ranks still
          running ``stop_grace_s`` after the halt are stopped, as after ``job.stop()``).
        - ``trackers``: ``"tensorboard:LOGDIR"``, ``"mlflow:TRACKING_URI"`` (e.g.
          ``mlflow:file:///home/me/mlruns``): the controller writes every step's metrics
          and phase times, checkpoints and faults there (it must reach the target);
          ``"wandb:PROJECT"`` and your own ``nbtrain.Tracker`` objects run in this notebook
          instead (your credentials stay here; see ``nbtrain.engine.trackers``).
        - ``mesh``: the device mesh, ``{"dp": 2, "tp": 2}`` (``dp`` follows from the world
          size): each TP group is placed inside one NVLink domain (declared with worker
          labels on CPU clusters), DP outermost; each rank gets ``ctx.mesh`` (a
          ``DeviceMesh`` in that rank order) and ``ctx.mesh_info``. An elastic job resizes
          in whole TP groups.
        - ``replay``: a job (handle or ``nbtrain.load_run`` record) whose live knob changes
          this job applies at the same steps (or those changes, ``job.knobs.changes()``): with
          the same recipe, seed and world size it reproduces the steered run exactly.
        """
        if self._closed:
            raise RuntimeError("this cluster is closed: call nbtrain.connect() again")
        is_recipe = (callable(getattr(recipe, "setup", None))
                     and callable(getattr(recipe, "step", None)))
        if is_recipe:
            if config is not None:
                raise TypeError("config= is for training functions; a Recipe takes its "
                                "settings in its constructor")
            if steps is None:
                raise ValueError(f"a Recipe job needs steps=N (got steps=None): nbtrain's loop "
                                 f"runs {type(recipe).__name__}.step that many times")
            work: Any = recipe
            label = type(recipe).__name__
        elif isinstance(recipe, ScriptWork):
            if config is not None or steps is not None:
                raise TypeError("config= and steps= are for training functions; a script "
                                "takes its settings as args=[...] and runs its own loop")
            work, label = recipe, recipe.name
        elif callable(recipe):
            work = TrainFunction(recipe, dict(config or {}))
            label = work.name
        else:
            raise TypeError(
                f"submit takes a training function train(ctx, config) or an nbtrain.Recipe "
                f"(with setup(ctx) and step(ctx, batch)), got {type(recipe).__name__}"
            )
        job_id = uuid.uuid4().hex[:8]
        spec = JobSpec(job_id=job_id, name=name or default_name(label, job_id),
                       world_size=world_size, steps=steps, min_size=min_size,
                       max_size=max_size, queue=queue, seed=seed,
                       priority=priority, team=team, checkpoint=checkpoint, resume=resume,
                       max_restarts=max_restarts, restart_window_s=restart_window_s,
                       fail_fast=fail_fast,
                       on_nonfinite=on_nonfinite, device=device,
                       mesh=dict(mesh) if mesh is not None else None, sizing=sizing,
                       extra={"kind": "recipe" if is_recipe else
                              "script" if isinstance(work, ScriptWork) else "function"})
        parse_checkpoint_setting(spec.checkpoint)  # raises ValueError naming the fix
        payload = _pickle_recipe(work)
        mitigation = (stragglers if isinstance(stragglers, MitigationSettings)
                      else MitigationSettings(policy=stragglers))
        make_policy(mitigation)  # unknown names fail here, not in the controller
        s = self.settings
        url = job_url(s.checkpoint_root, spec.name, job_id)
        restore = resolve_resume(s.checkpoint_root, spec.name, resume) if resume else None
        resume_step = 0
        if restore is not None:
            from nbtrain.runtime.storage import CheckpointStore

            committed = [c for c in CheckpointStore(restore[0]).committed()
                         if restore[1] is None or c <= restore[1]]
            resume_step = max(committed, default=0)
        sub = JobSubmission(
            spec=spec, owner=_whoami(), mitigation=mitigation, faults=tuple(faults or ()),
            policy=JobPolicy(hang_factor=s.hang_factor, hang_floor_s=s.hang_floor_s,
                             setup_timeout_s=s.setup_timeout_s,
                             restore_timeout_s=s.restore_timeout_s,
                             rendezvous_timeout_s=s.rendezvous_timeout_s,
                             peer_release_s=s.peer_release_s,
                             failure_grace_s=s.failure_grace_s,
                             stop_grace_s=stop_grace_s(s.checkpoint_commit_timeout_s,
                                                       s.stop_grace_s)),
            resume_step=resume_step, knob_history=_replayed(replay))
        on_controller, here = split_trackers(trackers)
        tracked = [plain(t) for t in on_controller]
        reply = self._remote.call(
            "nbtrain_submit", job=submission_to_wire(sub), recipe=payload,
            settings=s.for_jobs(), checkpoint_url=url,
            restore=list(restore) if restore else None, token=self._remote.operator_token,
            trackers=tracked or None)
        token = str(reply["token"])
        self._tokens.put(self.address, job_id, token)
        handle = JobHandle(spec, self, token=token, checkpoint_url=url, status=reply["status"],
                           follow=True)
        self._handles[job_id] = handle
        if here:
            handle.track(*here)
        return handle

    def submit_script(self, path: str | os.PathLike[str], *,
                      args: Sequence[str] = (), world_size: int,
                      env: Mapping[str, str] | None = None, cwd: str | None = None,
                      **options: Any) -> JobHandle:
        """Run an unmodified torchrun-style script on ``world_size`` ranks, as
        ``torchrun --nnodes=N --nproc-per-node=1 path ARGS`` would.

        The script's source is read here and sent with the job (workers need not see the
        file). Each rank runs ``python -u SCRIPT *args`` in a child process of its worker with
        the torchrun environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` 0,
        ``MASTER_ADDR``/``MASTER_PORT`` of a store made for this generation's children,
        ``TORCHELASTIC_RESTART_COUNT`` = generation) plus ``env``, in ``cwd`` (default: this
        process's working directory) when the worker sees it, else in a temporary directory.

        What a script gets, unchanged: gang scheduling, queueing, priorities and fair share
        (``options`` are :meth:`submit`'s: ``name``, ``priority``, ``team``, ``queue``,
        ``max_restarts``, ``restart_window_s``, ``device``, ``trackers``, ...); restarts on
        failure like torchrun (a child that exits non-zero or dies fails its rank, with its
        exit code and the end of its stderr in ``job.error``; the next generation runs the
        script again, which resumes from its own snapshots if it writes them); its output
        per rank in ``job.logs()`` and the notebook; per-rank step times in ``job.metrics``
        (one row per step of its first optimizer, from torch's global optimizer hooks; data
        wait and communication are counted as compute); stop and preemption by SIGTERM to
        every child at once (a script that handles SIGTERM can snapshot and exit; SIGKILL
        after 0.75 x ``Settings.preempt_grace_s``). What needs a training function with
        ``ctx`` instead: exactly-once data (``ctx.batches``), bit-exact recovery, nbtrain's
        checkpoints (``checkpoint=``, ``resume=``, ``job.checkpoint()``), live knobs, planned
        faults and the per-phase straggler diagnosis (a script's rows have no data/comm split).
        """
        if "checkpoint" in options or "resume" in options or "faults" in options:
            raise TypeError("checkpoint=, resume= and faults= need a training function with "
                            "ctx; a script keeps its own snapshots (see the docstring)")
        work = load_script(path, list(args), cwd=cwd, env=dict(env or {}))
        return self.submit(work, world_size=world_size, checkpoint=None, **options)

    # -- lifecycle ------------------------------------------------------------------------
    def close(self) -> None:
        """Disconnect. An embedded cluster shuts down with its jobs; on an external cluster
        the jobs go on (attach again with ``connect(address).job(name)``)."""
        self._closed = True
        self._finalizer()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def address(self) -> str:
        """The Dask scheduler's address."""
        return str(self.client.scheduler.address)  # type: ignore[union-attr]

    @property
    def dashboard_link(self) -> str:
        """Dask's own dashboard."""
        return str(self.client.dashboard_link)

    def __repr__(self) -> str:
        snap = self.snapshot()
        online = [s for s in snap["slots"] if s["state"] in ("free", "held")]
        free = [s for s in online if s["state"] == "free"]
        memory = self.memory_limit_text()
        return (f"<nbtrain.Cluster {self.address} slots={len(online)} free={len(free)} "
                f"jobs={len(snap['jobs'])}" + (f" memory_limit={memory}" if memory else "")
                + ">")

    def memory_limits(self) -> dict[str, int | None]:
        """Each worker's Dask memory limit in bytes (None: no limit). Dask's nanny kills a
        worker whose process passes ``distributed.worker.memory.terminate`` (95%) of it; a
        rank killed so fails with a cause that says it (``job.faults``)."""
        workers = self.client.scheduler_info(n_workers=-1)["workers"]
        return {a: (int(w["memory_limit"]) or None) if w.get("memory_limit") else None
                for a, w in workers.items()}

    def memory_limit_text(self) -> str:
        """The per-worker memory limit, for reprs: "2.0GiB", "none", "1.0-2.0GiB" ("" when
        there are no workers)."""
        limits = set(self.memory_limits().values())
        if not limits:
            return ""
        if None in limits:
            return "none" if len(limits) == 1 else "mixed"
        lo, hi = min(limits), max(limits)  # type: ignore[type-var]
        gib = (lambda n: f"{n / 2**30:.1f}")  # noqa: E731
        return f"{gib(lo)}GiB" if lo == hi else f"{gib(lo)}-{gib(hi)}GiB"

    def _repr_html_(self) -> str:
        snap = self.snapshot()
        names = {j["job_id"]: j["name"] for j in snap["jobs"]}
        online = [s for s in snap["slots"] if s["address"]]
        rows = "".join(
            f"<tr><td>{html.escape(s['address'])}</td><td>{html.escape(s['host'])}</td>"
            f"<td>{html.escape(names.get(s['job'] or '', s['state']))}</td></tr>"
            for s in sorted(online, key=lambda s: s["address"])
        )
        job_rows = "".join(
            f"<tr><td>{html.escape(j['name'])}</td><td>{j['state']}</td>"
            f"<td>{status_progress(j)}</td><td>{html.escape(j['owner'])}</td>"
            f"<td>{html.escape(j['reason'])}</td></tr>"
            for j in snap["jobs"]
        )
        free = sum(1 for s in online if s["state"] == "free")
        memory = self.memory_limit_text()
        return (
            f"<div><b>nbtrain cluster</b> at {html.escape(self.address)}: "
            f"{len(online)} slots, {free} free, {len(snap['jobs'])} jobs"
            + (f", memory limit per worker {html.escape(memory)}" if memory else "")
            + f"<table><tr><th>slot (worker)</th><th>host</th><th>job</th></tr>{rows}</table>"
            + (f"<table><tr><th>job</th><th>state</th><th>step</th><th>owner</th>"
               f"<th>reason</th></tr>{job_rows}</table>" if snap["jobs"] else "")
            + "</div>"
        )


def connect(address: str | Client | DaskCluster | None = None, *, n_workers: int | None = None,
            settings: Settings | None = None, operator_token: str | None = None,
            security: Any = None, gpus: bool | Sequence[str] | None = None,
            hosts: int | None = None, **cluster_kwargs: Any) -> Cluster:
    """Connect to a cluster of slots, starting nbtrain's controller there if needed.

    - ``connect()``: start an embedded ``LocalCluster`` on this machine's loopback interface
      (worker processes, one thread each, ``n_workers`` slots; by default one per core, 2 to
      8), shut down with this process. This client is its operator. On a machine with GPUs
      there is one worker per visible GPU instead, each seeing only its own GPU
      (``gpus=False``: CPU workers; ``gpus=["0", "2"]``: those GPUs). ``hosts=2`` declares
      the CPU workers as that many hosts of equal size (``node0``, ``node1``, ...; each host
      one NVLink domain): a topology to place TP groups and pipeline stages on, on one
      machine.
    - ``connect("tcp://host:8786")``: an existing Dask scheduler (``"tls://..."`` with
      ``security=`` a ``distributed.Security``; an embedded cluster takes it too).
    - ``connect(client)``: an existing ``distributed.Client`` (left open on close), e.g. of a
      dask-jobqueue or dask-kubernetes cluster.
    - ``connect(cluster)``: any Dask cluster manager (``LocalCluster``, dask-jobqueue's
      ``SLURMCluster``/``PBSCluster``, dask-kubernetes' ``KubeCluster``): a client of it, and
      ``Cluster.scale``/``Cluster.adapt`` act through it (left running on close; closing it
      is its owner's).

    ``operator_token``: steer every job and submit above the priority ceiling (default:
    ``Settings.operator_token``). The first client to connect starts the controller with its
    settings; later ones join it.
    """
    settings = settings or Settings.load()
    token = settings.operator_token if operator_token is None else operator_token
    local: LocalCluster | None = None
    manager: DaskCluster | None = None
    if hosts is not None and address is not None:
        raise ValueError(
            "hosts= declares the hosts of an embedded cluster (connect() without an address); "
            "on an existing cluster each worker declares its own with NBTRAIN_WORKER_HOST in "
            "its environment")
    if isinstance(address, DaskCluster):
        manager = address
        client, owns = Client(manager, security=security, set_as_default=False), True
    elif isinstance(address, Client):
        client, owns = address, False
    elif isinstance(address, str):
        client, owns = Client(address, security=security, set_as_default=False), True
    elif address is not None:
        raise TypeError(f"address must be a scheduler address, a Client, a Dask cluster "
                        f"manager (distributed.deploy.Cluster) or None, got {address!r}")
    if address is None:
        gpu_ids = embedded_gpus(gpus, n_workers)
        n = len(gpu_ids) or (default_worker_count() if n_workers is None else n_workers)
        if n < 1:
            raise ValueError(f"n_workers must be >= 1, got {n}")
        per_host = declared_host_size(hosts, n, gpus=bool(gpu_ids))
        token = token or secrets.token_hex(16)  # the embedded cluster's owner is its operator
        config = QUIET_WORKER_CONFIG if settings.quiet_workers else {}
        kwargs: dict[str, Any] = {"host": "127.0.0.1", "dashboard_address": "127.0.0.1:0",
                                  "silence_logs": logging.CRITICAL}
        if security is not None:
            kwargs["security"] = security
        # Worker processes inherit this process's environment: not the operator's token.
        kwargs["env"] = {"NBTRAIN_OPERATOR_TOKEN": ""}
        if gpus is False:
            # CPU workers on a GPU machine: hide the GPUs, or each worker would report (and
            # use) GPU 0.
            kwargs["env"]["CUDA_VISIBLE_DEVICES"] = ""
        kwargs["env"].update(cluster_kwargs.pop("env", None) or {})
        kwargs.update(cluster_kwargs)
        # Worker processes that may start children (DataLoader workers). Nannies read this
        # each time they (re)start a worker, so it stays set in this process.
        dask.config.set({"distributed.worker.daemon": False})
        if not gpu_ids:
            fork_workers()  # NBTRAIN_WORKER_START=fork: forked from one preloaded torch
        pages.install()  # the job and class pages join the dashboard this scheduler serves
        with dask.config.set(config):
            staged = bool(gpu_ids) or bool(per_host)  # workers from new_worker_spec
            local = EmbeddedCluster(n_workers=0 if staged else n, gpus=gpu_ids,
                                    per_host=per_host, threads_per_worker=1, processes=True,
                                    **kwargs)
            if staged:
                local.scale(n)  # one per GPU, or labelled by host (new_worker_spec)
            client = Client(local, set_as_default=False)
        owns = True
    controller_settings = settings.replace(operator_token="")
    if local is not None and not settings.state_dir:
        # The embedded cluster ends with this process: its journal starts fresh each time.
        controller_settings = controller_settings.replace(
            state_dir=tempfile.mkdtemp(prefix="nbtrain-state-"))
    client.register_plugin(ClusterController(  # the token stays here; its hash goes there
        controller_settings, operator_hash=token_hash(token) if token else ""))
    client.register_plugin(NbtrainWorker(quiet=settings.quiet_workers,
                                         sessions=settings.worker_sessions))
    try:  # SIGTERM as a retirement; nannies of an older nbtrain cannot load it: go on
        client.register_plugin(NbtrainNanny())
    except Exception as exc:
        logging.getLogger(__name__).warning(
            "nbtrain: the nanny plugin (SIGTERM checkpoints first) could not be registered "
            "on this cluster's nannies: %s: %s", type(exc).__name__, exc)
    if local is not None:
        client.wait_for_workers(len(local.worker_spec), timeout=120)
    cluster = Cluster(client, local=local, owns_client=owns, settings=settings,
                      operator_token=token, manager=manager)
    joined = len(client.scheduler_info(n_workers=-1)["workers"]) if manager is not None else 0
    cluster._wait_for_slots(len(local.worker_spec) if local is not None else joined)
    return cluster


def declared_host_size(hosts: int | None, n_workers: int, *, gpus: bool) -> int:
    """Slots per declared host of an embedded cluster (0: none declared)."""
    if hosts is None:
        return 0
    if gpus:
        raise ValueError(
            f"hosts={hosts} declares hosts of CPU workers; GPU workers' hosts and NVLink "
            "domains are discovered (connect(gpus=False, hosts=...) for CPU workers)")
    if hosts < 1 or n_workers % hosts:
        divisors = ", ".join(str(d) for d in range(1, n_workers + 1) if n_workers % d == 0)
        raise ValueError(
            f"hosts={hosts} must split n_workers={n_workers} into hosts of equal size: "
            f"a divisor of {n_workers} ({divisors})")
    return n_workers // hosts


def _whoami() -> str:
    try:
        return getpass.getuser()
    except Exception:  # no user name in some containers
        return "unknown"


def _pickle_recipe(work: Any) -> bytes:
    try:
        payload = cloudpickle.dumps(work)
        cloudpickle.loads(payload)
    except Exception as exc:
        if isinstance(work, TrainFunction):
            raise TypeError(
                f"the training function {work.name} or its config cannot be pickled to send "
                f"them to the ranks: {type(exc).__name__}: {exc}. Keep open files, locks, "
                "clients and live models out of the config and of the globals the function "
                "uses; create them inside the function") from exc
        raise TypeError(
            f"the recipe {type(work).__name__} cannot be pickled to send it to the ranks: "
            f"{type(exc).__name__}: {exc}. Keep open files, locks, clients and live models out "
            "of the recipe's __init__; create them in setup(ctx)"
        ) from exc
    return payload


def _close_quietly(follower: Follower, client: Client, local: LocalCluster | None,
                   owns_client: bool) -> None:
    follower.close()
    for made in follower.remote.made:
        with contextlib.suppress(Exception):
            made.close()
    for close in (client.close if owns_client else None,
                  local.close if local is not None else None):
        if close is None:
            continue
        with contextlib.suppress(Exception):
            close()


def _replayed(replay: Any) -> tuple[dict[str, Any], ...]:
    """The applied knob changes ``submit(replay=...)`` re-applies (checked here first)."""
    from nbtrain.core.knobs import KnobBook, knob_state

    if replay is None:
        return ()
    if isinstance(replay, list | tuple):
        changes = list(replay)
    elif hasattr(replay, "knobs"):
        changes = replay.knobs.changes()
    elif hasattr(replay, "events"):
        changes = knob_state(replay.events, 0).changes()
    else:
        raise TypeError(f"replay= takes a job handle, a load_run record or a list of knob "
                        f"changes, got {type(replay).__name__}")
    return tuple(c.to_dict() for c in KnobBook.replaying(changes).history)
