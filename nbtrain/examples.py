"""Ready-made recipes for the demo, the notebooks and the benchmarks.

``DigitsMLP`` trains a small MLP on scikit-learn's bundled handwritten digits (1,797 8x8
images shipped inside the scikit-learn package: no download).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from nbtrain.runtime.context import RankContext
from nbtrain.runtime.recipe import Recipe


def digits_file() -> Path:
    """The digits as scikit-learn ships them (``sklearn/datasets/data/digits.csv.gz``: 64
    pixel values, then the label, per row), found without importing scikit-learn."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "the digits data ships with scikit-learn, which is not installed here: "
            "pip install scikit-learn")
    package = Path(next(iter(spec.submodule_search_locations)))
    return package / "datasets" / "data" / "digits.csv.gz"


def digits(split: str = "train", test_fraction: float = 0.2) -> TensorDataset:
    """The digits data as float tensors, split deterministically into train and test.

    Read straight from scikit-learn's file (the same arrays as ``load_digits()``): importing
    ``sklearn.datasets`` would load scikit-learn and SciPy into every rank, about 160 MB of
    memory and 3 s of CPU per process, which a Binder-sized box cannot spare.
    """
    table = np.loadtxt(digits_file(), delimiter=",")
    x = torch.tensor(table[:, :-1], dtype=torch.float32) / 16.0
    y = torch.tensor(table[:, -1].astype(np.int64), dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    n_test = int(len(y) * test_fraction)
    idx = order[:n_test] if split == "test" else order[n_test:]
    return TensorDataset(x[idx], y[idx])


class DigitsMLP(Recipe):
    """An MLP classifier on the digits; rank 0 reports held-out accuracy every few steps."""

    def __init__(self, hidden: int = 256, layers: int = 2, batch_size: int = 128,
                 lr: float = 2e-3, eval_every: int = 25) -> None:
        self.hidden = hidden
        self.layers = layers
        self.batch_size = batch_size
        self.lr = lr
        self.eval_every = eval_every

    def build_model(self) -> torch.nn.Module:
        torch.manual_seed(0)
        mods: list[torch.nn.Module] = []
        width = 64
        for _ in range(self.layers):
            mods += [torch.nn.Linear(width, self.hidden), torch.nn.ReLU()]
            width = self.hidden
        mods.append(torch.nn.Linear(width, 10))
        return torch.nn.Sequential(*mods)

    def setup(self, ctx: RankContext) -> dict[str, Any]:
        self.model = ctx.prepare(self.build_model())
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=self.lr)
        ctx.loader(digits("train"), global_batch_size=self.batch_size)
        self.test = digits("test")
        return {"model": self.model, "optimizer": self.opt}

    def step(self, ctx: RankContext, batch: Any) -> dict[str, float]:
        x, y = batch
        loss = F.cross_entropy(self.model(x), y)
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        metrics = {"loss": loss.item()}
        if ctx.is_main and self.eval_every and (ctx.step + 1) % self.eval_every == 0:
            metrics["val_acc"] = self.accuracy(ctx)
        return metrics

    @torch.no_grad()
    def accuracy(self, ctx: RankContext) -> float:
        x, y = self.test.tensors
        module = getattr(self.model, "module", self.model)
        pred = module(x.to(ctx.device)).argmax(dim=1).cpu()
        return float((pred == y).float().mean())


def digits_train(ctx: RankContext, config: dict[str, Any]) -> dict[str, float]:
    """``DigitsMLP`` as a training function (the same model, data and steps): the user's own
    loop over ``ctx.batches``. Returns the held-out accuracy at the end."""
    recipe = DigitsMLP(hidden=config.get("hidden", 256), layers=config.get("layers", 2),
                       batch_size=config.get("batch_size", 128), lr=config.get("lr", 2e-3))
    model = ctx.prepare(recipe.build_model())
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr)
    ctx.track(model=model, optimizer=opt)
    for x, y in ctx.batches(digits("train"), global_batch_size=recipe.batch_size):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        ctx.report(loss=loss.item())
    recipe.model, recipe.test = model, digits("test")
    return {"val_acc": recipe.accuracy(ctx), "steps": float(ctx.step)}


def elastic_digits_train(ctx: RankContext, config: dict[str, Any]) -> None:
    """``digits_train`` for elastic jobs: the same model and data at any world size, each
    step's sample ids recorded to ``config["ids_dir"]`` (when given) for
    :func:`nbtrain.accounting.account`; ``step_sleep`` slows each step (to watch resizes),
    and with ``sleep_shared`` it stands for compute the ranks share: it divides by the world
    size, so the job scales (to watch goodput sizing)."""
    import time

    from nbtrain.accounting import Indexed, SampleLog

    recipe = DigitsMLP(hidden=config.get("hidden", 256), layers=config.get("layers", 2),
                       batch_size=config.get("batch_size", 128), lr=config.get("lr", 2e-3))
    model = ctx.prepare(recipe.build_model())
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr)
    ctx.track(model=model, optimizer=opt)
    log = SampleLog(config["ids_dir"]) if config.get("ids_dir") else None
    for x, y, ids in ctx.batches(Indexed(digits("train")), global_batch_size=recipe.batch_size,
                                 num_workers=config.get("num_workers", 0)):
        if log is not None:
            log.record(ctx, ids)
        time.sleep(config.get("step_sleep", 0.0)
                   / (ctx.world_size if config.get("sleep_shared") else 1))
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        ctx.report(loss=loss.item())
