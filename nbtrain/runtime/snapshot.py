"""Copy a rank's training state into host memory: the only blocking part of a checkpoint.

The training loop may change its parameters again as soon as this returns, so the snapshot
must be a real copy; it must also be cheap, because the loop pays for it at every checkpoint.
So the host buffers are allocated once and reused: each later snapshot with the same tensor
shapes is one ``copy_`` per tensor into the buffer it used last time, no pickling and no
allocation.

CUDA tensors go to pinned buffers with non-blocking copies on a side stream per device, so
the training loop does not wait for the device-to-host transfer: the side stream first waits
for the work already queued on the current stream (the copies see the step's results), the
device's current stream then waits for the copies (the next step's in-place updates cannot
overwrite a tensor before it is copied), and each source tensor is recorded on the side
stream (the caching allocator does not reuse its memory too early). ``snapshot(wait=False)``
returns as soon as the copies are queued; ``Snapshot.wait()`` blocks until they are done, and
whoever reads the buffers (the checkpoint writer) calls it first.

The buffers belong to the snapshotter: a snapshot is valid until the next ``snapshot()``
call. ``AsyncCheckpointer`` keeps at most one checkpoint in flight for exactly this reason.

The state is whatever ``Recipe.setup`` returned: dicts, lists and tuples of tensors and plain
values, and objects with ``state_dict()`` (modules, optimizers, LR schedulers, the data
loader), which are called and their result copied. The copy holds only types that
``torch.load(..., weights_only=True)`` can read back.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

__all__ = ["HostSnapshotter", "Snapshot", "SnapshotError", "find_in_state", "load_state"]

_PLAIN = (int, float, bool, str, bytes, type(None), complex, torch.dtype, torch.device)

Path = tuple[Any, ...]


class SnapshotError(TypeError):
    """The state holds something a checkpoint cannot carry; the message names where."""


@dataclass(frozen=True)
class Snapshot:
    """A host copy of the state. ``state`` shares buffers with the snapshotter that made it."""

    state: Any
    nbytes: int  # bytes of tensor data in the snapshot
    tensors: int  # distinct tensor buffers
    allocated_bytes: int  # bytes of buffers newly allocated by this snapshot (0 when reused)
    ready: Callable[[], None] = field(default=lambda: None, compare=False, repr=False)

    def wait(self) -> None:
        """Block until every device-to-host copy of this snapshot is done (at once for a
        snapshot without CUDA tensors, or one taken with ``wait=True``)."""
        self.ready()


def find_in_state(state: Any, kinds: tuple[type, ...]) -> list[Any]:
    """The objects of ``kinds`` (e.g. modules, optimizers) in a tracked state's nested
    mappings, lists and tuples, in order; a found object is not looked into."""
    if isinstance(state, kinds):
        return [state]
    if isinstance(state, Mapping):
        return [o for v in state.values() for o in find_in_state(v, kinds)]
    if isinstance(state, (list, tuple)):
        return [o for v in state for o in find_in_state(v, kinds)]
    return []


def _where(path: Path) -> str:
    return "state" + "".join(f"[{p!r}]" for p in path)


class HostSnapshotter:
    """Reusable host buffers keyed by the position of each tensor in the state.

    pin_memory: pin the buffers of CUDA tensors (None: pin when CUDA is available). Pinned
        memory makes device-to-host copies asynchronous and about twice as fast, at the price
        of page-locked RAM the OS cannot swap.
    """

    def __init__(self, *, pin_memory: bool | None = None) -> None:
        self._pin = torch.cuda.is_available() if pin_memory is None else bool(pin_memory)
        self._buffers: dict[Path, torch.Tensor] = {}
        # per snapshot:
        self._seen: dict[tuple[Any, ...], torch.Tensor] = {}
        self._used: dict[Path, torch.Tensor] = {}
        self._nbytes = 0
        self._allocated = 0
        self._cuda_devices: set[torch.device] = set()
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    @property
    def buffer_bytes(self) -> int:
        """Bytes of host memory the snapshotter holds between checkpoints."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def release(self) -> None:
        """Free the buffers (the next snapshot allocates again)."""
        self._buffers = {}

    def snapshot(self, state: Any, *, wait: bool = True) -> Snapshot:
        """Copy ``state`` to host memory and return it with its byte size.

        wait: return only when the copies of CUDA tensors are done. With ``wait=False`` the
            copies are only queued: call ``Snapshot.wait()`` before reading the buffers.
        """
        self._seen = {}
        self._used = {}
        self._nbytes = 0
        self._allocated = 0
        self._cuda_devices = set()
        with torch.no_grad():
            copied = self._copy(state, ())
        ready = self._copies_queued()
        if wait:
            ready()
        # Buffers for tensors no longer in the state are dropped, so memory follows the state.
        self._buffers = self._used
        tensors = len(self._seen)
        self._seen = {}
        return Snapshot(
            state=copied, nbytes=self._nbytes, tensors=tensors, allocated_bytes=self._allocated,
            ready=ready,
        )

    def _side_stream(self, dev: torch.device) -> torch.cuda.Stream:
        stream = self._streams.get(dev)
        if stream is None:
            stream = self._streams[dev] = torch.cuda.Stream(device=dev)
        if dev not in self._cuda_devices:
            # The first copy from this device in this snapshot: see everything the training
            # loop queued so far (its optimizer step).
            stream.wait_stream(torch.cuda.current_stream(dev))
            self._cuda_devices.add(dev)
        return stream

    def _copies_queued(self) -> Callable[[], None]:
        """Order the device's later work after the copies; a callable that waits for them."""
        events = []
        for dev in self._cuda_devices:
            stream = self._streams[dev]
            done = torch.cuda.Event()
            done.record(stream)
            torch.cuda.current_stream(dev).wait_stream(stream)
            events.append(done)

        def ready() -> None:
            for done in events:
                done.synchronize()

        return ready

    # -- walking ------------------------------------------------------------------------------
    def _copy(self, value: Any, path: Path) -> Any:
        if isinstance(value, torch.Tensor):
            return self._copy_tensor(value, path)
        if isinstance(value, _PLAIN):
            return value
        if isinstance(value, Mapping):
            out: dict[Any, Any]
            if isinstance(value, collections.OrderedDict):
                out = collections.OrderedDict()
                meta = getattr(value, "_metadata", None)  # module versions for load_state_dict
                if meta is not None:
                    out._metadata = self._copy(meta, (*path, "_metadata"))  # type: ignore[attr-defined]
            else:
                out = {}
            for k, v in value.items():
                if not isinstance(k, _PLAIN):
                    raise SnapshotError(
                        f"{_where(path)} has a key of type {type(k).__name__}; checkpoint "
                        "dict keys must be str, int, float, bool or None"
                    )
                out[k] = self._copy(v, (*path, k))
            return out
        if isinstance(value, torch.Size):
            return value
        if isinstance(value, (list, tuple)):
            items = [self._copy(v, (*path, i)) for i, v in enumerate(value)]
            return items if isinstance(value, list) else tuple(items)
        if isinstance(value, np.generic):
            return value.item()
        state_dict = getattr(value, "state_dict", None)
        if callable(state_dict):
            return self._copy(state_dict(), path)
        if isinstance(value, np.ndarray):
            raise SnapshotError(
                f"{_where(path)} is a numpy array of shape {value.shape}; checkpoints are loaded "
                "with weights_only=True, which refuses numpy objects: store "
                "torch.from_numpy(array) instead"
            )
        raise SnapshotError(
            f"{_where(path)} is a {type(value).__module__}.{type(value).__qualname__}, which a "
            "checkpoint cannot carry: give it a state_dict() method, or store tensors, dicts, "
            "lists, tuples and int/float/bool/str/None"
        )

    def _copy_tensor(self, t: torch.Tensor, path: Path) -> torch.Tensor:
        if type(t) not in (torch.Tensor, torch.nn.Parameter):
            raise SnapshotError(
                f"{_where(path)} is a tensor subclass {type(t).__name__}, not supported yet: "
                "store its local or full tensor"
            )
        if t.layout != torch.strided or t.is_quantized:
            raise SnapshotError(
                f"{_where(path)} has layout {t.layout} (quantized={t.is_quantized}); only dense "
                "tensors are supported: store t.to_dense() or t.dequantize()"
            )
        # Tied weights appear under several keys as views of one storage: copy them once.
        key = (t.device, t.dtype, t.data_ptr(), tuple(t.shape), t.stride())
        done = self._seen.get(key)
        if done is not None:
            return done
        buf = self._buffers.get(path)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            pin = self._pin and t.device.type == "cuda"
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
            self._allocated += buf.numel() * buf.element_size()
        if t.device.type == "cuda":
            side = self._side_stream(t.device)
            with torch.cuda.stream(side):
                buf.copy_(t, non_blocking=buf.is_pinned())
            t.record_stream(side)
        else:
            buf.copy_(t)
        self._used[path] = buf
        self._seen[key] = buf
        self._nbytes += buf.numel() * buf.element_size()
        return buf


def load_state(target: Any, saved: Any, path: Path = ()) -> Any:
    """Put a loaded snapshot back into the live state that ``Recipe.setup`` returned.

    Objects with ``load_state_dict()`` (modules, optimizers, schedulers, loaders) load their
    part in place; tensors are copied in place (so optimizers keep pointing at them); dicts
    and lists are updated in place, key by key; plain values are replaced. Returns the
    restored structure. Keys must match both ways, so a recipe that changed its state since
    the checkpoint fails here with the difference named, not later with a silent default.
    """
    if isinstance(target, torch.Tensor):
        if not isinstance(saved, torch.Tensor) or saved.shape != target.shape:
            got = tuple(saved.shape) if isinstance(saved, torch.Tensor) else type(saved).__name__
            raise SnapshotError(
                f"{_where(path)}: the checkpoint holds {got}, the live tensor has shape "
                f"{tuple(target.shape)}; the model changed since the checkpoint was taken"
            )
        with torch.no_grad():
            target.copy_(saved)
        return target
    load = getattr(target, "load_state_dict", None)
    if callable(load) and not isinstance(target, Mapping):
        load(saved)
        return target
    if isinstance(target, Mapping):
        if not isinstance(saved, Mapping):
            raise SnapshotError(
                f"{_where(path)}: the checkpoint holds a {type(saved).__name__}, the live "
                "state a dict"
            )
        missing = [k for k in target if k not in saved]
        extra = [k for k in saved if k not in target]
        if missing or extra:
            raise SnapshotError(
                f"{_where(path)}: keys differ from the checkpoint (missing there: {missing}, "
                f"only there: {extra}); restore with the recipe that wrote it, or adapt "
                "the state before resuming"
            )
        restored = {k: load_state(target[k], saved[k], (*path, k)) for k in target}
        if isinstance(target, dict):
            target.update(restored)
            return target
        return restored
    if isinstance(target, (list, tuple)) and not isinstance(target, torch.Size):
        if not isinstance(saved, (list, tuple)) or len(saved) != len(target):
            raise SnapshotError(
                f"{_where(path)}: the checkpoint holds {type(saved).__name__} of length "
                f"{len(saved) if isinstance(saved, (list, tuple)) else '?'}, the live state "
                f"a {type(target).__name__} of length {len(target)}"
            )
        items = [
            load_state(t, s, (*path, i)) for i, (t, s) in enumerate(zip(target, saved, strict=True))
        ]
        if isinstance(target, list):
            target[:] = items
            return target
        return tuple(items)
    return saved
