"""Host snapshots: real copies, reused buffers, weights_only-loadable, clear errors."""

from __future__ import annotations

import collections
import io

import numpy as np
import pytest
import torch

from nbtrain.runtime.snapshot import HostSnapshotter, SnapshotError, load_state


def roundtrip(obj: object) -> object:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def trained() -> tuple[torch.nn.Module, torch.optim.Optimizer, object]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    for _ in range(3):
        model(torch.randn(5, 4)).square().mean().backward()
        opt.step()
        sched.step()
    return model, opt, sched


def equal(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(equal, a, b))
    return a == b


def test_snapshot_is_a_copy_that_loads_back_into_the_objects() -> None:
    model, opt, sched = trained()
    snap = HostSnapshotter().snapshot({"model": model, "optimizer": opt, "sched": sched, "n": 3})
    expected = {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "sched": sched.state_dict(),
        "n": 3,
    }
    assert equal(snap.state, expected)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # training goes on: the snapshot must not change
    assert not equal(snap.state["model"], model.state_dict())
    loaded = roundtrip(snap.state)
    assert equal(loaded, snap.state)
    assert isinstance(loaded, dict)
    model2, opt2, sched2 = trained()
    model2.load_state_dict(loaded["model"])
    opt2.load_state_dict(loaded["optimizer"])
    sched2.load_state_dict(loaded["sched"])
    assert equal(opt2.state_dict(), expected["optimizer"])
    assert snap.nbytes == sum(t.numel() * t.element_size() for t in _tensors(snap.state))


def _tensors(obj: object) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def test_buffers_are_reused_when_shapes_match() -> None:
    model, opt, _ = trained()
    s = HostSnapshotter()
    first = s.snapshot({"model": model, "optimizer": opt})
    assert first.allocated_bytes == first.nbytes > 0
    ptrs = [t.data_ptr() for t in _tensors(first.state)]
    with torch.no_grad():
        next(model.parameters()).mul_(2.0)
    second = s.snapshot({"model": model, "optimizer": opt})
    assert second.allocated_bytes == 0
    assert [t.data_ptr() for t in _tensors(second.state)] == ptrs
    assert equal(second.state["model"], model.state_dict())
    assert s.buffer_bytes == second.nbytes


def test_shape_or_dtype_change_reallocates_only_that_tensor_and_drops_removed_ones() -> None:
    s = HostSnapshotter()
    s.snapshot({"a": torch.zeros(10), "b": torch.zeros(5), "c": torch.zeros(7)})
    snap = s.snapshot({"a": torch.ones(10), "b": torch.ones(6, dtype=torch.float64)})
    assert snap.allocated_bytes == 6 * 8
    assert s.buffer_bytes == 10 * 4 + 6 * 8  # "c" is gone
    assert torch.equal(snap.state["a"], torch.ones(10))


def test_tied_weights_are_copied_once() -> None:
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    snap = HostSnapshotter().snapshot(model)
    assert snap.state["emb.weight"] is snap.state["head.weight"]
    assert snap.nbytes == 10 * 4 * 4 and snap.tensors == 1


def test_views_and_non_contiguous_tensors() -> None:
    base = torch.arange(12.0).reshape(3, 4)
    snap = HostSnapshotter().snapshot({"t": base.t(), "row": base[1]})
    assert torch.equal(snap.state["t"], base.t()) and torch.equal(snap.state["row"], base[1])
    loaded = roundtrip(snap.state)
    assert isinstance(loaded, dict) and torch.equal(loaded["t"], base.t())


def test_plain_values_metadata_and_numpy_scalars() -> None:
    od = collections.OrderedDict(w=torch.ones(2))
    od._metadata = {"": {"version": 2}}  # type: ignore[attr-defined]
    state = {
        "od": od,
        "tuple": (1, 2.5, "x", None, True),
        "np": np.float32(1.5),
        "npint": np.int64(7),
        "size": torch.Size([2, 3]),
        "dtype": torch.float16,
        "nested": [{"k": [torch.zeros(1)]}],
    }
    snap = HostSnapshotter().snapshot(state)
    loaded = roundtrip(snap.state)
    assert isinstance(loaded, dict)
    assert loaded["od"]._metadata == {"": {"version": 2}}
    assert loaded["tuple"] == (1, 2.5, "x", None, True)
    assert loaded["np"] == 1.5 and type(loaded["np"]) is float
    assert loaded["npint"] == 7 and type(loaded["npint"]) is int
    assert loaded["size"] == torch.Size([2, 3]) and loaded["dtype"] is torch.float16


class _Counter:
    def __init__(self) -> None:
        self.n = 4

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}


def test_any_object_with_state_dict() -> None:
    snap = HostSnapshotter().snapshot({"loader": _Counter()})
    assert snap.state == {"loader": {"n": 4}}


@pytest.mark.parametrize(
    ("state", "match"),
    [
        ({"a": {"b": np.zeros(3)}}, r"state\['a'\]\['b'\] is a numpy array .*torch.from_numpy"),
        ({"f": lambda x: x}, r"state\['f'\] is a .*function.*state_dict\(\)"),
        ({"s": [object()]}, r"state\['s'\]\[0\] is a builtins.object"),
        ({("tuple", "key"): 1}, r"has a key of type tuple"),
        ({"sp": torch.eye(3).to_sparse()}, r"state\['sp'\] has layout torch.sparse_coo"),
    ],
)
def test_unsupported_values_name_their_path(state: object, match: str) -> None:
    with pytest.raises(SnapshotError, match=match):
        HostSnapshotter().snapshot(state)


def test_release_frees_buffers() -> None:
    s = HostSnapshotter()
    s.snapshot({"a": torch.zeros(100)})
    s.release()
    assert s.buffer_bytes == 0
    assert s.snapshot({"a": torch.zeros(100)}).allocated_bytes == 400


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors_go_to_pinned_buffers() -> None:
    x = torch.randn(1000, device="cuda")
    s = HostSnapshotter()
    snap = s.snapshot({"x": x})
    assert snap.state["x"].device.type == "cpu" and snap.state["x"].is_pinned()
    assert torch.equal(snap.state["x"], x.cpu())
    x.add_(1)
    snap2 = s.snapshot({"x": x})
    assert snap2.allocated_bytes == 0 and torch.equal(snap2.state["x"], x.cpu())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_copies_run_on_a_side_stream_ordered_before_the_next_update() -> None:
    x = torch.randn(64 * 1024 * 1024 // 4, device="cuda")  # 64 MB: the copy takes a while
    expected = x.cpu()
    s = HostSnapshotter()
    snap = s.snapshot({"x": x}, wait=False)
    # The loop goes on at once; its next in-place update is queued behind the copy.
    x.mul_(0).add_(7)
    snap.wait()
    assert torch.equal(snap.state["x"], expected)
    assert torch.equal(x.cpu(), torch.full_like(expected, 7.0))
    assert s._streams and all(st != torch.cuda.current_stream(d) for d, st in s._streams.items())


def test_load_state_puts_everything_back_in_place() -> None:
    model, opt, sched = trained()
    extra = torch.arange(3.0)
    counters = {"epoch": 4, "seen": [1, 2]}
    state = {"model": model, "optimizer": opt, "sched": sched, "extra": extra, "c": counters}
    saved = roundtrip(HostSnapshotter().snapshot(state).state)
    expected = roundtrip(HostSnapshotter().snapshot(state).state)
    model2, opt2, sched2 = trained()
    with torch.no_grad():
        for p in model2.parameters():
            p.zero_()
    extra2 = torch.zeros(3)
    counters2: dict[str, object] = {"epoch": 0, "seen": [0, 0]}
    live = {"model": model2, "optimizer": opt2, "sched": sched2, "extra": extra2, "c": counters2}
    out = load_state(live, saved)
    assert out is live and live["extra"] is extra2 and torch.equal(extra2, torch.arange(3.0))
    assert counters2 == {"epoch": 4, "seen": [1, 2]}
    assert equal(roundtrip(HostSnapshotter().snapshot(live).state), expected)


@pytest.mark.parametrize(
    ("live", "saved", "match"),
    [
        ({"a": 1, "b": 2}, {"a": 1, "c": 3}, r"missing there: \['b'\], only there: \['c'\]"),
        (
            {"w": torch.zeros(3)},
            {"w": torch.zeros(4)},
            r"state\['w'\]: the checkpoint holds \(4,\)",
        ),
        ({"l": [1, 2]}, {"l": [1]}, r"state\['l'\]: the checkpoint holds list of length 1"),
        ({"d": {"x": 1}}, {"d": 5}, r"holds a int, the live state a dict"),
    ],
)
def test_load_state_names_mismatches(live: object, saved: object, match: str) -> None:
    with pytest.raises(SnapshotError, match=match):
        load_state(live, saved)
