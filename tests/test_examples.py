"""The bundled digits data: the same arrays as scikit-learn's loader, read without it."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from nbtrain.examples import digits


def test_digits_are_scikit_learns_arrays_split_as_before() -> None:
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    n_test = int(len(y) * 0.2)
    train, test = digits("train"), digits("test")
    assert torch.equal(train.tensors[0], x[order[n_test:]])
    assert torch.equal(train.tensors[1], y[order[n_test:]])
    assert torch.equal(test.tensors[0], x[order[:n_test]])
    assert torch.equal(test.tensors[1], y[order[:n_test]])


def test_reading_the_digits_loads_neither_scikit_learn_nor_scipy() -> None:
    """What a rank of the course imports for its data (in a fresh process): scikit-learn and
    SciPy would cost each rank ~90 MB and seconds of CPU."""
    probe = (
        "import json, sys\n"
        "from nbtrain.examples import digits\n"
        "assert len(digits()) == 1438\n"
        "print(json.dumps({k: k in sys.modules for k in ('sklearn', 'scipy')}))\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True, timeout=120)
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert loaded == {"sklearn": False, "scipy": False}
