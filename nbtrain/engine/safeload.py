"""Reading another user's pickled bytes as data only (client side).

A training function's return value comes back pickled. Unpickling runs whatever the bytes say,
so a job of one user must not run code in the kernel of another who reads its result (the
operator's, above all). :func:`data_loads` reads a pickle that holds plain data only: ``None``,
bools, numbers, strings, bytes, lists, tuples, dicts, sets, ``OrderedDict``, NumPy arrays and
torch tensors (their storage read back through ``torch.load(weights_only=True)``, never the
full unpickler torch itself would call). Anything else, a class instance or a function, is
refused with :class:`UntrustedResultError` naming what the bytes wanted to load; nothing of it
runs. ``JobHandle.result(trust=True)`` is the reader's explicit opt-in to the full unpickler.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

__all__ = ["SAFE_GLOBALS", "UntrustedResultError", "data_loads", "result_loads"]


class UntrustedResultError(pickle.UnpicklingError, PermissionError):
    """Another user's result holds more than data: nbtrain will not load it here."""


def _tensor_storage(data: bytes) -> Any:
    """The storage of a pickled tensor, read back with torch's weights-only loader."""
    import torch

    return torch.load(io.BytesIO(data), weights_only=True)


def _numpy(name: str) -> Any:
    import numpy as np

    core = getattr(np, "_core", None) or np.core
    return {"_reconstruct": core.multiarray._reconstruct, "scalar": core.multiarray.scalar,
            "_frombuffer": core.numeric._frombuffer, "ndarray": np.ndarray,
            "dtype": np.dtype}[name]


#: (module, name) a data pickle may name, and what it gets instead of the module's attribute
#: (callables are resolved lazily: torch and NumPy load only when a result holds them).
SAFE_GLOBALS: dict[tuple[str, str], Any] = {
    ("builtins", "set"): lambda: set,
    ("builtins", "frozenset"): lambda: frozenset,
    ("builtins", "complex"): lambda: complex,
    ("builtins", "slice"): lambda: slice,
    ("builtins", "bytearray"): lambda: bytearray,
    ("collections", "OrderedDict"): lambda: __import__("collections").OrderedDict,
    ("torch._utils", "_rebuild_tensor_v2"):
        lambda: __import__("torch")._utils._rebuild_tensor_v2,
    ("torch.storage", "_load_from_bytes"): lambda: _tensor_storage,
    **{(mod, name): (lambda n=name: _numpy(n))
       for mod in ("numpy.core.multiarray", "numpy._core.multiarray")
       for name in ("_reconstruct", "scalar")},
    **{(mod, "_frombuffer"): (lambda: _numpy("_frombuffer"))
       for mod in ("numpy.core.numeric", "numpy._core.numeric")},
    ("numpy", "ndarray"): lambda: _numpy("ndarray"),
    ("numpy", "dtype"): lambda: _numpy("dtype"),
}


class _DataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        make = SAFE_GLOBALS.get((module, name))
        if make is None:
            raise UntrustedResultError(f"{module}.{name}")
        return make()

    def persistent_load(self, pid: Any) -> Any:
        raise UntrustedResultError(f"a persistent id ({type(pid).__name__})")


def data_loads(data: bytes) -> Any:
    """The value in ``data`` if it is plain data (see the module's docstring); else
    :class:`UntrustedResultError` with the first thing that is not."""
    return _DataUnpickler(io.BytesIO(data)).load()


def result_loads(data: bytes, *, job: str, owner: str, trusted: bool) -> Any:
    """A job's pickled result: the full unpickler where ``trusted`` (the reader submitted the
    job, holds its token, or said ``trust=True``), else data only, refused in words that say
    why and what to do."""
    if trusted:
        import cloudpickle

        return cloudpickle.loads(data)
    try:
        return data_loads(data)
    except UntrustedResultError as exc:
        raise UntrustedResultError(
            f"job {job} belongs to {owner or 'another user'} and its result holds {exc}: "
            "loading that would run their code in this kernel. nbtrain reads a result this "
            "kernel did not submit as data only (numbers, strings, lists, dicts, NumPy arrays, "
            "torch tensors). Return plain data (e.g. a state_dict) from the training "
            "function, or call result(trust=True) if you trust that user's code") from None
