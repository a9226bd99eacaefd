"""The user's side of a job: plain torch in ``setup`` and ``step``; nbtrain owns the loop."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nbtrain.runtime.context import RankContext


class Recipe:
    """Subclass this and implement :meth:`setup` and :meth:`step`.

    The object is pickled (cloudpickle) in the notebook and unpickled once per rank and
    generation, so keep big data out of ``__init__``: build or load it in ``setup``.
    """

    def setup(self, ctx: RankContext) -> dict[str, Any]:
        """Build model, optimizer and data on this rank.

        Return the state a checkpoint must hold: a dict of objects with ``state_dict()``
        (model, optimizer, LR scheduler, ...). Data position and RNG are added by nbtrain.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement setup(self, ctx)")

    def next_batch(self, ctx: RankContext) -> Any:
        """The next batch for this rank; by default from the loader made with ``ctx.loader``."""
        return ctx.next_batch()

    def step(self, ctx: RankContext, batch: Any) -> dict[str, float] | None:
        """One training step on ``batch``; return scalar metrics such as ``{"loss": ...}``."""
        raise NotImplementedError(f"{type(self).__name__} must implement step(self, ctx, batch)")

    def teardown(self, ctx: RankContext) -> None:
        """Called on every rank after the last step (also after a failure); optional."""
