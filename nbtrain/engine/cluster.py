"""``connect()`` and ``Cluster``: the notebook's handle on a Dask cluster of slots."""

from __future__ import annotations

import contextlib
import html
import logging
import os
import uuid
import weakref
from typing import Any

import cloudpickle
import dask.config
from distributed import Client, LocalCluster

from nbtrain.config import Settings
from nbtrain.core.job import JobSpec
from nbtrain.core.mitigation import MitigationSettings, make_policy
from nbtrain.engine.checkpoints import job_url
from nbtrain.engine.controller import Controller
from nbtrain.engine.embedded import EmbeddedCluster, WarmUp
from nbtrain.engine.job import JobHandle
from nbtrain.runtime.faults import Fault
from nbtrain.runtime.recipe import Recipe

#: Dask settings for embedded rank workers. On two cores Dask's statistical profiler (every
#: 10 ms) and its monitors compete with the ranks for CPU: measured ~0.89 of torchrun's step
#: rate with the defaults, ~0.97 with these (benchmarks/overhead.py).
QUIET_WORKER_CONFIG = {
    "distributed.worker.profile.enabled": False,
    "distributed.admin.system-monitor.interval": "2s",
    "distributed.admin.system-monitor.gil.enabled": False,
    "distributed.worker.memory.monitor-interval": "1s",
}


def default_worker_count() -> int:
    """One slot per core, at least 2 (so gangs can be shown on one core), at most 8."""
    return max(2, min(os.cpu_count() or 2, 8))


class Cluster:
    """Slots (Dask workers) and the jobs running on them."""

    def __init__(self, client: Client, *, local: LocalCluster | None = None,
                 owns_client: bool = False, settings: Settings | None = None) -> None:
        self.client = client
        self.settings = settings or Settings.load()
        self._local = local
        self._owns_client = owns_client
        self._controller = Controller(client, self.settings)
        self._closed = False
        self._finalizer = weakref.finalize(self, _close_quietly, self._controller, client,
                                           local, owns_client)

    # -- slots ----------------------------------------------------------------------------
    @property
    def slots(self) -> list[str]:
        slots, _, _ = self._controller.snapshot()
        return sorted(slots)

    @property
    def free_slots(self) -> list[str]:
        slots, owner, _ = self._controller.snapshot()
        return sorted(a for a in slots if a not in owner)

    @property
    def jobs(self) -> list[JobHandle]:
        return self._controller.snapshot()[2]

    def scale(self, n: int) -> None:
        """Change the number of workers of an embedded cluster (slots join or leave)."""
        if self._local is None:
            raise RuntimeError("scale() works on an embedded cluster; scale yours with its own "
                               "deployment tools")
        self._local.scale(n)

    def dashboard(self, display: str | None = None, **options: Any) -> Any:
        """Slots grouped by host, coloured by job and state, and the job queue (live);
        a text snapshot when ``display="text"`` (or NBTRAIN_DISPLAY=text)."""
        from nbtrain.ui.cluster_view import cluster_dashboard

        return cluster_dashboard(self, display=display, **options)

    # -- jobs -----------------------------------------------------------------------------
    def submit(self, recipe: Recipe, *, world_size: int, steps: int, name: str | None = None,
               queue: bool = True, seed: int = 0, priority: int = 0,
               team: str = "default", checkpoint: int | str | None = "auto",
               resume: str | None = None, max_restarts: int = 3,
               restart_window_s: float = 3600.0,
               faults: list[Fault] | None = None,
               stragglers: str | MitigationSettings = "alert") -> JobHandle:
        """Start ``recipe`` on ``world_size`` slots at once (gang), or queue it.

        Returns a :class:`JobHandle` immediately; training runs in the background.

        - ``queue=False``: a job that cannot start now raises ValueError instead of waiting.
        - ``checkpoint``: ``"auto"`` (Young/Daly interval from the measured cost), an int N
          (every N steps), a duration (``"10m"``), or None (on demand, stop, preemption only).
        - ``resume``: ``"latest"`` (newest committed checkpoint of a job with this ``name``),
          or a checkpoint directory / ``step-XXXXXXXX`` URL.
        - ``max_restarts`` within ``restart_window_s``: automatic recoveries before FAILED.
        - ``faults``: planned faults (``nbtrain.Fault``) for teaching and tests.
        - ``stragglers``: mitigation policy, ``"alert"`` (report only) or ``"replace"``
          (restart the gang without a confirmed straggler's slot, with a cooldown), or a
          ``nbtrain.core.mitigation.MitigationSettings`` for cooldowns and exclusion scope.
        """
        if self._closed:
            raise RuntimeError("this cluster is closed: call nbtrain.connect() again")
        if not (callable(getattr(recipe, "setup", None)) and callable(getattr(recipe, "step",
                                                                                None))):
            raise TypeError(
                f"recipe must be an nbtrain.Recipe (with setup(ctx) and step(ctx, batch)), "
                f"got {type(recipe).__name__}"
            )
        job_id = uuid.uuid4().hex[:8]
        spec = JobSpec(job_id=job_id, name=name or f"{type(recipe).__name__}-{job_id[:4]}",
                       world_size=world_size, steps=steps, queue=queue, seed=seed,
                       priority=priority, team=team, checkpoint=checkpoint, resume=resume,
                       max_restarts=max_restarts, restart_window_s=restart_window_s)
        payload = _pickle_recipe(recipe)
        url = job_url(self.settings.checkpoint_root, spec.name, job_id)
        mitigation = (stragglers if isinstance(stragglers, MitigationSettings)
                      else MitigationSettings(policy=stragglers))
        make_policy(mitigation)  # unknown names fail here, not on the controller thread
        job = JobHandle(spec, payload, self._controller, url, faults, mitigation)
        self._controller.submit(job)
        return job

    # -- lifecycle ------------------------------------------------------------------------
    def close(self) -> None:
        """Cancel running jobs and shut down what ``connect()`` started."""
        self._closed = True
        self._finalizer()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def address(self) -> str:
        """The Dask scheduler's address."""
        return str(self.client.scheduler_info(n_workers=0).get("address", "?"))

    def __repr__(self) -> str:
        return (f"<nbtrain.Cluster {self.address} slots={len(self.slots)} "
                f"free={len(self.free_slots)} jobs={len(self.jobs)}>")

    def _repr_html_(self) -> str:
        slots, owner, jobs = self._controller.snapshot()
        names = {j.id: j.name for j in jobs}
        rows = "".join(
            f"<tr><td>{html.escape(a)}</td><td>{html.escape(s.host)}</td>"
            f"<td>{html.escape(names.get(owner.get(a, ''), 'free'))}</td></tr>"
            for a, s in sorted(slots.items())
        )
        job_rows = "".join(
            f"<tr><td>{html.escape(j.name)}</td><td>{j.status.value}</td>"
            f"<td>{j.step}/{j.spec.steps}</td><td>{html.escape(j.reason)}</td></tr>"
            for j in jobs
        )
        return (
            f"<div><b>nbtrain cluster</b> at {html.escape(self.address)}: "
            f"{len(slots)} slots, {len(slots) - len(owner)} free, {len(jobs)} jobs"
            f"<table><tr><th>slot (worker)</th><th>host</th><th>job</th></tr>{rows}</table>"
            + (f"<table><tr><th>job</th><th>state</th><th>step</th><th>reason</th></tr>"
               f"{job_rows}</table>" if jobs else "")
            + "</div>"
        )


def connect(address: str | Client | None = None, *, n_workers: int | None = None,
            settings: Settings | None = None, **cluster_kwargs: Any) -> Cluster:
    """Connect to a cluster of slots.

    - ``connect()``: start an embedded ``LocalCluster`` (worker processes, one thread each,
      ``n_workers`` slots; by default one per core, 2 to 8), shut down with this process.
    - ``connect("tcp://host:8786")``: an existing Dask scheduler.
    - ``connect(client)``: an existing ``distributed.Client`` (left open on close).
    """
    settings = settings or Settings.load()
    if isinstance(address, Client):
        return Cluster(address, settings=settings)
    if isinstance(address, str):
        return Cluster(Client(address), owns_client=True, settings=settings)
    if address is not None:
        raise TypeError(f"address must be a scheduler address, a Client or None, got {address!r}")
    n = default_worker_count() if n_workers is None else n_workers
    if n < 1:
        raise ValueError(f"n_workers must be >= 1, got {n}")
    config = QUIET_WORKER_CONFIG if settings.quiet_workers else {}
    kwargs: dict[str, Any] = {"dashboard_address": ":0", "silence_logs": logging.CRITICAL}
    kwargs.update(cluster_kwargs)
    with dask.config.set(config):
        local = EmbeddedCluster(n_workers=n, threads_per_worker=1, processes=True, **kwargs)
        client = Client(local)
    client.register_plugin(WarmUp())
    client.wait_for_workers(n, timeout=120)
    # weakref.finalize also runs at interpreter exit, so the embedded cluster never outlives us.
    return Cluster(client, local=local, owns_client=True, settings=settings)


def _pickle_recipe(recipe: Recipe) -> bytes:
    try:
        payload = cloudpickle.dumps(recipe)
        cloudpickle.loads(payload)
    except Exception as exc:
        raise TypeError(
            f"the recipe {type(recipe).__name__} cannot be pickled to send it to the ranks: "
            f"{type(exc).__name__}: {exc}. Keep open files, locks, clients and live models out "
            "of the recipe's __init__; create them in setup(ctx)"
        ) from exc
    return payload


def _close_quietly(controller: Controller, client: Client, local: LocalCluster | None,
                   owns_client: bool) -> None:
    for close in (controller.close,
                  client.close if owns_client else None,
                  local.close if local is not None else None):
        if close is None:
            continue
        with contextlib.suppress(Exception):
            close()

