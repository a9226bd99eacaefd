"""RNG capture/restore: python, numpy, torch; loadable with weights_only=True."""

from __future__ import annotations

import io
import random

import numpy as np
import pytest
import torch

from nbtrain.runtime.rng import capture_rng_state, restore_rng_state


def draws() -> tuple[list[float], list[float], list[float], list[float]]:
    return (
        [random.random() for _ in range(3)] + [random.gauss(0.0, 1.0)],
        [*np.random.rand(3).tolist(), float(np.random.standard_normal())],
        torch.rand(3).tolist(),
        torch.randn(3, dtype=torch.float64).tolist(),
    )


def roundtrip(obj: object) -> object:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_restore_replays_the_same_numbers_after_weights_only_load() -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    # Leave a cached Gaussian in python's and numpy's state: it is part of the stream.
    random.gauss(0.0, 1.0)
    np.random.standard_normal()
    state = roundtrip(capture_rng_state())
    expected = draws()
    draws()  # move on
    assert isinstance(state, dict)
    assert restore_rng_state(state) == []
    assert draws() == expected


def test_captured_form_is_only_plain_types_and_tensors() -> None:
    def check(x: object) -> None:
        if isinstance(x, dict):
            for v in x.values():
                check(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                check(v)
        else:
            assert x is None or isinstance(x, (int, float, str, torch.Tensor)), type(x)

    check(capture_rng_state())


def test_restore_rejects_a_foreign_state() -> None:
    with pytest.raises(ValueError, match="RNG state has format"):
        restore_rng_state({"python": []})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only fallback")
def test_cuda_states_on_a_cpu_machine_are_reported_not_fatal() -> None:
    state = capture_rng_state()
    state["cuda"] = [torch.get_rng_state()]  # stands in for a GPU run's saved state
    expected_torch = torch.rand(2).tolist()
    torch.set_rng_state(state["torch"])
    notes = restore_rng_state(state)
    assert len(notes) == 1 and "CUDA is not available" in notes[0]
    assert torch.rand(2).tolist() == expected_torch


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_generator_restored() -> None:
    torch.cuda.manual_seed_all(5)
    state = roundtrip(capture_rng_state())
    expected = torch.rand(4, device="cuda").tolist()
    assert isinstance(state, dict)
    restore_rng_state(state)
    assert torch.rand(4, device="cuda").tolist() == expected
