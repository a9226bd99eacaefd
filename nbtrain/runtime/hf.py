"""A Hugging Face ``Trainer`` inside an nbtrain training function.

``run_trainer(ctx, trainer)`` trains with the ``Trainer`` you built, and nbtrain keeps its
guarantees: the batches come from ``ctx.batches`` (each global batch sharded over the ranks,
the data position in every checkpoint, every sample of an epoch used once across restarts and
resizes), nbtrain's checkpoints hold the model, the optimizer and the LR scheduler the
``Trainer`` made (and the RNG), the ``Trainer``'s logs reach ``ctx.report`` (so the dashboard
plots its loss), and a stop, preemption or resize ends the ``Trainer`` at a step boundary.

What it needs of the ``Trainer`` (each checked, with the fix in the error):

- ``gradient_accumulation_steps=1``: nbtrain's step is the optimizer step, and a checkpoint
  between micro-batches would lose the accumulated gradients;
- ``save_strategy="no"``: nbtrain's checkpoints replace the ``Trainer``'s own;
- ``max_steps`` equal to the job's ``steps`` (or unset: then it is set to them), so the LR
  schedule spans the job.

The ranks look like torchrun's (``nbtrain.runtime.torchrun_env``), so the ``Trainer`` sees a
distributed run of ``world_size`` processes and wraps the model in DDP over nbtrain's process
group. Each rank is a torchrun node of its own there (``LOCAL_RANK`` 0, so that a GPU worker's
one device is ``cuda:0``), which would make the ``Trainer``'s ``PrinterCallback`` print every
log on every rank; it is removed on all ranks but rank 0, so ``job.logs()`` shows each log
line once, as torchrun on one host prints it (every rank's logs still reach ``ctx.report``).
A recovered generation continues bit-exactly: the model, optimizer, scheduler and RNG come
from the checkpoint, the data position too, and the ``Trainer``'s step counter is set to
the restored step before its first step.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

from nbtrain.runtime.context import LoopEnded, RankContext

__all__ = ["run_trainer"]


def run_trainer(ctx: RankContext, trainer: Any, *, global_batch_size: int | None = None,
                **train_kwargs: Any) -> Any:
    """Train ``trainer`` (a ``transformers.Trainer``) on its ``train_dataset`` through
    nbtrain's loop; returns what ``trainer.train()`` returns. ``global_batch_size``: the
    batch over all ranks (default ``per_device_train_batch_size * ctx.dp_size``)."""
    from transformers import TrainerCallback

    args = trainer.args
    steps = ctx.total_steps
    problems = []
    if args.gradient_accumulation_steps != 1:
        problems.append(f"gradient_accumulation_steps={args.gradient_accumulation_steps}: "
                        "use 1 (a larger global_batch_size does the same)")
    if str(getattr(args.save_strategy, "value", args.save_strategy)) != "no":
        problems.append(f"save_strategy={args.save_strategy!r}: use save_strategy='no' "
                        "(nbtrain's checkpoints hold the model, optimizer and scheduler)")
    if steps is None and args.max_steps <= 0:
        problems.append("no step count: submit(..., steps=N) or TrainingArguments(max_steps=N)")
    elif steps is not None and args.max_steps > 0 and args.max_steps != steps:
        problems.append(f"max_steps={args.max_steps} but the job has steps={steps}: make them "
                        "equal (or leave max_steps unset)")
    if trainer.train_dataset is None:
        problems.append("the Trainer has no train_dataset")
    if problems:
        raise ValueError("run_trainer(ctx, trainer): " + "; ".join(problems))
    if steps is not None:
        args.max_steps = steps
    batch = global_batch_size or args.per_device_train_batch_size * ctx.dp_size
    batches = _Batches(ctx, trainer, batch)

    class _Report(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            # The Trainer made its optimizer and scheduler by now; the first batch (after
            # this) starts nbtrain's loop, which restores the checkpoint into them.
            # accelerate wraps both; the wrapped torch objects are what is saved.
            ctx.track(model=trainer.model,
                      optimizer=getattr(trainer.optimizer, "optimizer", trainer.optimizer),
                      scheduler=getattr(trainer.lr_scheduler, "scheduler",
                                        trainer.lr_scheduler))

        def on_log(self, args: Any, state: Any, control: Any, logs: Mapping[str, Any]
                   | None = None, **kw: Any) -> None:
            ctx.report(**{k: float(v) for k, v in (logs or {}).items()
                          if isinstance(v, (int, float)) and math.isfinite(float(v))
                          and k not in ("epoch", "step", "total_flos")
                          and not k.startswith("train_")})  # train_*: the run's summary

    trainer.add_callback(_Report())
    if ctx.rank != 0:
        from transformers.trainer_callback import PrinterCallback

        trainer.remove_callback(PrinterCallback)
    trainer.get_train_dataloader = lambda: batches
    output = trainer.train(**train_kwargs)
    batches.finish()
    return output


class _Batches:
    """The ``Trainer``'s train dataloader: nbtrain's loop over the dataset. No ``len``: the
    ``Trainer`` runs ``max_steps``; a stop or preemption ends it through ``LoopEnded``."""

    def __init__(self, ctx: RankContext, trainer: Any, global_batch_size: int) -> None:
        self.ctx, self.trainer, self.global_batch_size = ctx, trainer, global_batch_size
        self.loop: Iterator[Any] | None = None

    def __iter__(self) -> Iterator[Any]:
        ctx, trainer = self.ctx, self.trainer
        if self.loop is None:
            self.loop = iter(ctx.batches(trainer.train_dataset,
                                         global_batch_size=self.global_batch_size,
                                         collate_fn=trainer.data_collator))
            first = True
        else:
            first = False
        for batch in self.loop:
            if first:  # restored by now: the Trainer counts on from the restored step
                trainer.state.global_step = ctx.step
                for name in ("_initial_global_step", "_globalstep_last_logged"):
                    if hasattr(trainer, name):  # its loss average and logging count from it
                        setattr(trainer, name, ctx.step)
                first = False
            yield batch
        # A stop, preemption or resize ended nbtrain's loop: end the Trainer's too.
        raise LoopEnded(ctx.outcome or "completed")

    def finish(self) -> None:
        """The Trainer is done: end nbtrain's last step (the Trainer asks for no batch after
        its last one), or, if the Trainer stopped early, nbtrain's loop with it."""
        if self.loop is None:
            return
        try:
            next(self.loop)
        except StopIteration:
            return
        close = getattr(self.loop, "close", None)
        if close is not None:
            close()
