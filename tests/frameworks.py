"""Training functions that run other frameworks' training inside an nbtrain job, with tiny
models built from configs (nothing downloaded): a Hugging Face ``Trainer``, an ``accelerate``
loop and a Lightning Fabric loop. Each saves its final parameters as ``rank{r}.pt``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import nbtrain

VOCAB, SEQ = 64, 16


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Fixed random token sequences (seeded): a language-modelling dataset."""

    def __init__(self, n: int = 256) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2,
                                      n_head=2, resid_pdrop=0.1, embd_pdrop=0.1,
                                      attn_pdrop=0.1, bos_token_id=0,
                                      eos_token_id=0))


def _save(model: torch.nn.Module, config: dict[str, Any], rank: int) -> None:
    if config.get("out_dir"):
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        torch.save(state, Path(config["out_dir"]) / f"rank{rank}.pt")


def hf_trainer_train(ctx: nbtrain.RankContext, config: dict[str, Any]) -> dict[str, Any]:
    import time

    from transformers import Trainer, TrainerCallback, TrainingArguments

    from nbtrain.runtime.hf import run_trainer

    class Slow(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, *a: Any, **k: Any) -> None:
            time.sleep(config.get("step_sleep", 0.0))

    model = tiny_gpt2()
    args = TrainingArguments(output_dir=config["work_dir"], per_device_train_batch_size=4,
                             learning_rate=1e-3, logging_steps=1, save_strategy="no",
                             report_to=[], use_cpu=True, seed=0, disable_tqdm=True,
                             lr_scheduler_type="linear", warmup_steps=2,
                             gradient_accumulation_steps=config.get("accumulate", 1),
                             max_steps=config.get("max_steps", -1))
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[Slow()])
    info = {"world_size": args.world_size, "parallel_mode": str(args.parallel_mode)}
    out = run_trainer(ctx, trainer)
    _save(trainer.model, config, ctx.rank)
    return {**info, "global_step": out.global_step, "loss": out.training_loss}


def _lm_steps(ctx: nbtrain.RankContext, model: Any, opt: Any, backward: Any,
              config: dict[str, Any]) -> float:
    """The loop both accelerate and Fabric recipes run: nbtrain's batches, their backward."""
    import time

    loss = torch.zeros(())
    for batch in ctx.batches(Tokens(), global_batch_size=8):
        loss = model(**batch).loss
        opt.zero_grad()
        backward(loss)
        opt.step()
        ctx.report(loss=loss.item())
        time.sleep(config.get("step_sleep", 0.0))
    return float(loss)


def accelerate_train(ctx: nbtrain.RankContext, config: dict[str, Any]) -> dict[str, Any]:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = tiny_gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = accelerator.prepare(model, opt)  # not the data: ctx.batches shards it
    ctx.track(model=model, optimizer=opt.optimizer)
    loss = _lm_steps(ctx, model, opt, accelerator.backward, config)
    _save(accelerator.unwrap_model(model), config, ctx.rank)
    return {"num_processes": accelerator.num_processes,
            "distributed_type": str(accelerator.distributed_type), "loss": loss}


def fabric_train(ctx: nbtrain.RankContext, config: dict[str, Any]) -> dict[str, Any]:
    from lightning_fabric import Fabric

    # One device per rank, one rank per "node": torchrun --nproc-per-node=1 (see the docs).
    fabric = Fabric(accelerator="cpu", strategy="ddp", devices=1, num_nodes=ctx.world_size)
    fabric.launch()
    model = tiny_gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = fabric.setup(model, opt)
    # The module Fabric wrapped (its parameters are the DDP replica's), and the torch
    # optimizer inside Fabric's.
    ctx.track(model=model.module, optimizer=opt.optimizer)
    loss = _lm_steps(ctx, model, opt, fabric.backward, config)
    _save(model.module, config, ctx.rank)
    return {"world_size": fabric.world_size, "strategy": type(fabric.strategy).__name__,
            "loss": loss}
