"""``QueueAdaptive``: Dask's ``Adaptive`` sized from nbtrain's queue instead of Dask's tasks.

Dask's ``Adaptive`` asks the scheduler for a target (``adaptive_target``: tasks and memory)
and, when it is below the cluster's plan, for workers to close (``workers_to_close``). A
queued nbtrain job has no tasks yet (its rank tasks exist only once its gang is admitted), so
plain ``adapt()`` starts no worker for it and may close a free worker a waiting gang was
about to use. This subclass asks nbtrain's controller instead (the ``nbtrain_autoscale``
handler, policy in :mod:`nbtrain.core.autoscale`): whole gangs of the served device kind,
never a busy or reserved slot, idle slots after ``idle_s``. Everything else is Dask's:
the loop, ``interval``, ``wait_count`` (a worker is closed only after that many looks in a
row named it), and the cluster manager's ``scale``/``scale_down``.

Use it through :meth:`nbtrain.Cluster.adapt` or any Dask cluster manager's own ``adapt``::

    cluster.adapt(Adaptive=QueueAdaptive, minimum=0, maximum=8, idle_s=120)
"""

from __future__ import annotations

import logging
import math
from typing import Any

from distributed.deploy import Adaptive

__all__ = ["QueueAdaptive"]

logger = logging.getLogger(__name__)


class QueueAdaptive(Adaptive):
    """Dask's ``Adaptive`` with nbtrain's queue as its target (see the module docstring).

    ``idle_s``: how long a free slot no waiting gang needs is kept (default 60 s);
    ``kind``: the device kind this cluster manager's workers provide ("cpu" or "gpu");
    the other keywords are Dask's (``minimum``, ``maximum``, ``interval``, ``wait_count``).
    """

    def __init__(self, cluster: Any, *, idle_s: float = 60.0, kind: str = "cpu",
                 **kwargs: Any) -> None:
        self.idle_s = float(idle_s)
        self.kind = kind
        #: The controller's newest answer (``target``, ``retire``, ``asked``, ``reasons``).
        self.last: dict[str, Any] = {}
        #: Answers received so far (one per Dask adapt round that reached the controller).
        self.rounds = 0
        #: Most slots the controller ever counted as reserved for waiting gangs at once.
        self.most_reserved = 0
        self._warned = False
        super().__init__(cluster, **kwargs)

    async def target(self) -> int:
        maximum = None if math.isinf(self.maximum) else int(self.maximum)
        try:
            reply = await self.scheduler.nbtrain_autoscale(
                minimum=int(self.minimum), maximum=maximum, idle_s=self.idle_s, kind=self.kind)
        except Exception as exc:  # no controller yet (connect() registers it): keep the plan
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        if not reply.get("ok"):
            if not self._warned:
                logger.warning("nbtrain adapt: the controller did not answer (%s); keeping "
                               "%d workers. Call nbtrain.connect(cluster) first",
                               reply.get("error"), len(self.plan))
                self._warned = True
            self.last = {}
            return len(self.plan)
        self._warned = False
        await self._forget_departed(list(reply.get("departed", ())))
        self.last = dict(reply)
        self.rounds += 1
        self.most_reserved = max(self.most_reserved, int(reply.get("reserved", 0)))
        return int(reply["target"])

    async def _forget_departed(self, names: list[Any]) -> None:
        """Drop workers that announced they leave and have gone (a walltime, a SIGTERM)
        from the cluster manager's plan, so it counts them no more and starts replacements:
        Dask's ``SpecCluster`` keeps a worker in its plan until it is scaled down."""
        gone = [n for n in self.plan if n in set(names)]
        scale_down = getattr(self.cluster, "scale_down", None)
        if gone and scale_down is not None:
            result = scale_down(gone)
            if hasattr(result, "__await__"):
                await result

    async def workers_to_close(self, target: int) -> list[Any]:
        """The idle slots the controller offered, as the cluster manager names them."""
        names = {str(n): n for n in self.plan}
        offered = [names[r] for r in self.last.get("retire", ()) if r in names]
        return offered[: max(0, len(self.plan) - target)]
