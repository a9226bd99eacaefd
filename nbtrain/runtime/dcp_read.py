"""Reading nbtrain's DCP-layout checkpoints with ``torch.distributed.checkpoint.load``.

DCP's own ``FileSystemReader`` unpickles ``.metadata``, which can run code; nbtrain's
guarantee is that a checkpoint directory cannot. So nbtrain reads through
:class:`IndexReader`, a DCP ``StorageReader`` whose metadata comes from the JSON index the
committer wrote next to ``.metadata`` (checksummed in the manifest), and which loads tensors
and objects with ``torch.load(..., weights_only=True)``.

Each data file a load needs is read once, front to back, and hashed as it is read (the gaps
between the chunks this rank needs are read and hashed too, see
:class:`~nbtrain.runtime.checksum.StreamCheck`); its size and checksum are checked when its
last byte is in, and a mismatch raises ``CheckpointError`` naming the file before the load
returns. The targets have been written into by then: a load that raises leaves them
garbage, and the caller loads another checkpoint into them or fails (restore does).

``dcp.load`` plans the reads: each rank reads the parts of the saved chunks that overlap the
chunks it holds now, so a checkpoint restores at another world size or mesh shape
(resharding) with no collective.

DCP's own readers (``dcp.load(state_dict, checkpoint_id=dir)``,
``format_utils.dcp_to_torch_save``) read the same directory through ``.metadata``.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import os
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from nbtrain.runtime.checksum import StreamCheck
from nbtrain.runtime.dcp_write import metadata_from_index
from nbtrain.runtime.errors import CheckpointError

__all__ = ["IndexReader", "WeightsOnlyLoadPlanner", "load_full", "load_into"]


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, loading objects with ``weights_only=True`` (DCP's uses
    ``weights_only=False`` for them)."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


class IndexReader(StorageReader):
    """A DCP ``StorageReader`` over one committed step directory.

    open_file(name) -> (binary file object, seekable; what verifies it as it is read) for a
    file of the step directory.
    """

    def __init__(self, index: Mapping[str, Any],
                 open_file: Callable[[str], tuple[Any, StreamCheck]],
                 checkpoint_id: str = "") -> None:
        super().__init__()
        self.index = index
        self.open_file = open_file
        self.id = checkpoint_id
        self.storage_data: dict[Any, Any] = {}

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.storage_data = {}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return metadata_from_index(self.index, checkpoint_id=self.id)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        self.storage_data = dict(metadata.storage_data or {})

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path,
                                []).append(item)
        for name, items in per_file.items():
            f, check = self.open_file(name)
            with f:
                try:
                    for item in sorted(items, key=lambda i: self.storage_data[
                            i.storage_index].offset):
                        info = self.storage_data[item.storage_index]
                        self._load_item(item, check.read_at(f, info.offset, info.length),
                                        planner)
                except CheckpointError:
                    raise
                except Exception:
                    # Corrupt bytes can fail to parse before the checksum is known: if the
                    # file is corrupt, say that, naming it.
                    with contextlib.suppress(OSError, ValueError):
                        check.finish(f)
                    raise
                check.finish(f)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    @staticmethod
    def _load_item(item: ReadItem, data: bytes, planner: LoadPlanner) -> None:
        raw = io.BytesIO(data)
        if item.type == LoadItemType.BYTE_IO:
            planner.load_bytes(item, raw)
            return
        saved = torch.load(raw, map_location="cpu", weights_only=True)
        part = _narrow(saved, item.storage_offsets, item.lengths)
        target = planner.resolve_tensor(item).detach()
        if target.size() != part.size():
            raise ValueError(f"{item.storage_index.fqn}: checkpoint chunk "
                             f"{tuple(part.size())} does not fit the target "
                             f"{tuple(target.size())}")
        target.copy_(part)
        planner.commit_tensor(item, target)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False  # only used by passing it in


def _narrow(t: torch.Tensor, offsets: Any, lengths: Any) -> torch.Tensor:
    for dim, (off, length) in enumerate(zip(offsets, lengths, strict=True)):
        t = t.narrow(dim, int(off), int(length))
    return t


def load_into(state_dict: dict[str, Any], reader: IndexReader) -> None:
    """Load the checkpoint into ``state_dict`` in place (tensors and DTensors copied into,
    other values replaced), resharding as the targets' chunks say. Keys must match."""
    _load(state_dict, reader, WeightsOnlyLoadPlanner())


def _load(state_dict: dict[str, Any], reader: IndexReader, planner: LoadPlanner) -> None:
    """``dcp.load`` without collectives, raising the error that stopped it (DCP wraps it in
    a ``CheckpointException``, a ``BaseException``)."""
    try:
        with warnings.catch_warnings():
            # dcp.load warns that no_dist means one process; here each rank reads its part.
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state_dict, storage_reader=reader, planner=planner, no_dist=True)
    except CheckpointException as e:
        causes = [exc for exc, _ in e.failures.values()]
        if not causes:
            raise
        raise causes[0] from None


def load_full(reader: IndexReader) -> dict[str, Any]:
    """The whole checkpoint as a nested state dict of full tensors (one process)."""
    metadata = reader.read_metadata()
    flat: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        flat[fqn] = (torch.empty(md.size, dtype=md.properties.dtype)
                     if isinstance(md, TensorStorageMetadata) else None)
    _load(flat, reader, WeightsOnlyLoadPlanner(flatten_state_dict=False,
                                               flatten_sharded_tensors=False))
    nested: dict[str, Any] = {}
    paths = metadata.planner_data or {}
    for fqn, value in flat.items():
        path = paths.get(fqn, (fqn,))
        _set(nested, list(path), value)
    return nested


def _set(root: dict[str, Any], path: list[Any], value: Any) -> None:
    """Put ``value`` at ``path`` (str keys make dicts, int keys lists)."""
    cur: Any = root
    for key, nxt in itertools.pairwise(path):
        if isinstance(cur, list):
            while len(cur) <= key:
                cur.append(None)
            if cur[key] is None:
                cur[key] = [] if isinstance(nxt, int) else {}
            cur = cur[key]
        else:
            cur = cur.setdefault(key, [] if isinstance(nxt, int) else {})
    last = path[-1]
    if isinstance(cur, list):
        while len(cur) <= last:
            cur.append(None)
        cur[last] = value
    else:
        cur[last] = value
