"""Functions the engine tests run on workers (importable by name in a child process)."""

from __future__ import annotations

from typing import Any


def parent_command_line() -> str:
    """The command line of this process's parent (a forkserver, or a nanny)."""
    import psutil
    parent = psutil.Process().parent()
    return " ".join(parent.cmdline()) if parent else ""


def tracked_train(ctx: Any, config: dict[str, Any]) -> None:
    """A DDP training function that leaves weak references to its model, optimizer and
    process group on its worker, for :func:`live_job_objects`."""
    import weakref

    import torch
    import torch.distributed as dist
    from distributed import get_worker

    model = ctx.prepare(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ctx.track(model=model, optimizer=opt)
    refs = [weakref.ref(model), weakref.ref(opt), weakref.ref(dist.group.WORLD)]
    setattr(get_worker(), "_nbtrain_test_refs", refs)  # noqa: B010 (not a Worker attribute)
    for _ in ctx.steps():
        loss = model(torch.ones(2, 4)).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()


def live_job_objects(dask_worker: Any) -> int:
    """How many of the objects :func:`tracked_train` made on this worker are still alive
    (no garbage collection here: that would hide what the rank left behind)."""
    return sum(ref() is not None for ref in getattr(dask_worker, "_nbtrain_test_refs", []))
