"""Writing checkpoints in ``torch.distributed.checkpoint``'s (DCP) layout, without collectives.

DCP's own ``save`` plans with collectives: every rank sends its plan to a coordinator, which
removes duplicates of replicated tensors and sends the plans back, then gathers what each
rank wrote to write ``.metadata``. nbtrain writes in the background, where a collective
would race with the training loop's (and hang when a peer dies), and commits through storage
(receipts, then the manifest). So each rank decides on its own, deterministically, which
items it writes, and the committer builds DCP's ``.metadata`` from the ranks' receipts:

- **Sharded tensors** (DTensors of FSDP and TP): each rank writes its own chunk. A chunk
  that several ranks hold (a ``Replicate`` mesh dimension, or a dimension of the job's mesh
  that the tensor's mesh lacks, such as ``tp`` for an FSDP parameter that TP left whole) is
  written by one of them, chosen by a hash of the tensor's name.
- **Plain tensors** are data-parallel replicas (DDP keeps every rank's copy equal): each is
  written once, spread over the ranks by size (largest first, to the least loaded rank), the
  same assignment on every rank because every rank holds the same tensors.
- **Other values** (optimizer hyper-parameters, step counters, scheduler state) are written
  by rank 0 (``torch.save`` bytes, as DCP does).

The plan comes from DCP's own ``DefaultSavePlanner`` (flattening, chunk offsets of DTensors,
``_StridedShard`` included), so the keys and chunks are the ones ``dcp.load`` expects. The
committer checks that the chunks of every tensor cover it exactly once before committing: a
rank whose state differed from its peers' fails the commit with the tensor named, never
silently.
"""

from __future__ import annotations

import io
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from torch.distributed.tensor import DTensor

from nbtrain.runtime.dcp_names import INDEX_FILE, METADATA_FILE, data_file

__all__ = [
    "DCP_VERSION",
    "INDEX_FILE",
    "METADATA_FILE",
    "DcpItem",
    "DcpShard",
    "data_file",
    "dtype_name",
    "index_from_receipts",
    "metadata_from_index",
    "plan_shard",
    "write_items",
]

INDEX_FORMAT = "nbtrain-dcp-index"


def _dcp_version() -> str:
    """The DCP metadata version this torch writes."""
    try:
        from torch.distributed.checkpoint import filesystem
    except ImportError:  # pragma: no cover
        return "1.0.0"
    return str(getattr(filesystem, "CURRENT_DCP_VERSION", "1.0.0"))


DCP_VERSION = _dcp_version()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in a checkpoint index")
    return dtype


@dataclass
class DcpItem:
    """One value this rank writes: a tensor chunk (``offsets``/``sizes`` of the global
    ``size``) or a ``torch.save``'d object (``kind == "bytes"``)."""

    fqn: str
    kind: str  # "tensor" | "bytes"
    data: Any  # the tensor to copy (then its host copy), or the object's bytes
    offsets: tuple[int, ...] = ()
    sizes: tuple[int, ...] = ()
    size: tuple[int, ...] = ()
    dtype: str = ""

    @property
    def key(self) -> str:
        """A name unique within a rank: the fqn, and the chunk's offsets."""
        return f"{self.fqn}@{','.join(map(str, self.offsets))}"


@dataclass
class DcpShard:
    """What one rank contributes to a DCP checkpoint.

    ``held``: every value this rank has (fqn -> numel, -1 for objects), so the committer can
    check that what the ranks wrote covers it; ``paths``: where each written fqn sits in the
    nested state dict (DCP's ``planner_data``, which its readers use to rebuild nesting).
    """

    items: list[DcpItem]
    held: dict[str, int]
    paths: dict[str, list[Any]] = field(default_factory=dict)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors to copy to host memory, by item key."""
        return {i.key: i.data for i in self.items if i.kind == "tensor"}

    def with_tensors(self, host: Mapping[str, torch.Tensor]) -> DcpShard:
        """The same shard with each tensor replaced by its host copy."""
        items = [DcpItem(i.fqn, i.kind, host[i.key] if i.kind == "tensor" else i.data,
                         i.offsets, i.sizes, i.size, i.dtype) for i in self.items]
        return DcpShard(items, self.held, self.paths)


# -- planning (training thread) -------------------------------------------------------------
def plan_shard(state_dict: dict[str, Any], *, rank: int, world_size: int,
               root_dims: Mapping[str, tuple[int, int]] | None = None) -> DcpShard:
    """This rank's items of ``state_dict`` (nested; values tensors, DTensors, plain values).

    ``root_dims``: the job's mesh, name -> (this rank's coordinate, size), to find the
    copies of a DTensor on a sub-mesh held along the dimensions it lacks.
    """
    planner = DefaultSavePlanner()
    planner.set_up_planner(state_dict, is_coordinator=rank == 0)
    flat: dict[str, Any] = planner.state_dict
    mappings: Mapping[str, Any] = planner.mappings
    plan = planner.create_local_plan()
    held: dict[str, int] = {}
    for fqn, obj in flat.items():
        held[fqn] = int(obj.numel()) if isinstance(obj, torch.Tensor) else -1
    plain = [(wi.index.fqn, _nbytes(wi)) for wi in plan.items
             if wi.type == WriteItemType.TENSOR and not isinstance(flat[wi.index.fqn], DTensor)]
    mine_plain = _spread(plain, world_size, rank)
    items: list[DcpItem] = []
    for wi in plan.items:
        fqn = wi.index.fqn
        obj = flat[fqn]
        if wi.type == WriteItemType.BYTE_IO:
            if rank != 0:
                continue
            _check_plain(obj, fqn)
            buf = planner.resolve_data(wi)
            assert isinstance(buf, io.BytesIO)
            items.append(DcpItem(fqn, "bytes", buf.getvalue()))
            continue
        if isinstance(obj, DTensor):
            if not _writes_chunk(obj, fqn, root_dims or {}):
                continue
        elif fqn not in mine_plain:
            continue
        td = wi.tensor_data
        assert td is not None
        data = planner.resolve_data(wi)
        assert isinstance(data, torch.Tensor)
        items.append(DcpItem(fqn, "tensor", data.detach(), tuple(td.chunk.offsets),
                             tuple(td.chunk.sizes), tuple(td.size),
                             dtype_name(td.properties.dtype)))
    paths = {i.fqn: list(mappings.get(i.fqn, (i.fqn,))) for i in items}
    return DcpShard(items, held, paths)


_PLAIN = (int, float, bool, str, bytes, type(None), complex, torch.dtype, torch.device,
          torch.Size, torch.Tensor)


def _check_plain(value: Any, fqn: str) -> None:
    """Refuse values that ``torch.load(..., weights_only=True)`` cannot read back, at save
    time, with the key named (rather than a restore that fails later)."""
    if isinstance(value, _PLAIN):
        return
    if isinstance(value, Mapping):
        for k, v in value.items():
            _check_plain(k, fqn)
            _check_plain(v, fqn)
        return
    if isinstance(value, (list, tuple, set, frozenset)):
        for v in value:
            _check_plain(v, fqn)
        return
    from nbtrain.runtime.snapshot import SnapshotError

    raise SnapshotError(
        f"{fqn} is a {type(value).__module__}.{type(value).__qualname__}, which a checkpoint "
        "cannot carry (it is loaded with weights_only=True): give it a state_dict() method, "
        "or store tensors, dicts, lists and int/float/bool/str/None"
        + (" (a numpy value: store torch.from_numpy(...) or .item())"
           if type(value).__module__.startswith("numpy") else ""))


def _nbytes(wi: WriteItem) -> int:
    return int(wi.tensor_storage_size() or 0)


def _spread(items: list[tuple[str, int]], world_size: int, rank: int) -> set[str]:
    """Replicated tensors this rank writes: largest first, each to the least loaded rank."""
    loads = [0] * world_size
    mine: set[str] = set()
    for fqn, nbytes in sorted(items, key=lambda x: (-x[1], x[0])):
        r = min(range(world_size), key=lambda i: (loads[i], i))
        loads[r] += max(nbytes, 1)
        if r == rank:
            mine.add(fqn)
    return mine


def _writes_chunk(t: DTensor, fqn: str, root_dims: Mapping[str, tuple[int, int]]) -> bool:
    """Whether this rank writes its chunk of ``t``: one of the ranks holding the same chunk,
    picked by a hash of the name (so the copies of different tensors spread over ranks)."""
    mesh = t.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:
        return False
    names = mesh.mesh_dim_names or ()
    replica: list[tuple[int, int]] = [
        (coord[i], mesh.size(i)) for i, p in enumerate(t.placements) if p.is_replicate()]
    if names and all(n in root_dims for n in names):
        replica += [cs for n, cs in root_dims.items() if n not in names]
    index, count = 0, 1
    for c, s in replica:
        index, count = index * s + c, count * s
    return count == 1 or index == zlib.crc32(fqn.encode()) % count


# -- writing (writer thread) ----------------------------------------------------------------
class _Counter:
    def __init__(self, out: Any) -> None:
        self.out = out
        self.count = 0

    def write(self, data: Any) -> int:
        n = memoryview(data).nbytes
        self.out.write(data)
        self.count += n
        return n

    def flush(self) -> None:
        self.out.flush()


def write_items(out: Any, shard: DcpShard, file: str) -> list[dict[str, Any]]:
    """Append the shard's items to ``out`` (DCP's data-file format: each tensor a
    ``torch.save`` of its host copy, each object its bytes); their index entries."""
    counter = _Counter(out)
    entries: list[dict[str, Any]] = []
    for item in shard.items:
        start = counter.count
        if item.kind == "bytes":
            counter.write(item.data)
            entries.append({"fqn": item.fqn, "kind": "bytes", "file": file, "offset": start,
                            "length": counter.count - start})
            continue
        torch.save(item.data, counter)  # type: ignore[arg-type]
        entries.append({"fqn": item.fqn, "kind": "tensor", "offsets": list(item.offsets),
                        "sizes": list(item.sizes), "size": list(item.size),
                        "dtype": item.dtype, "file": file, "offset": start,
                        "length": counter.count - start})
    return entries


# -- committing (committer's writer thread) -------------------------------------------------
def index_from_receipts(receipts: Mapping[int, Mapping[str, Any]],
                        fail: Callable[[str], Exception]) -> dict[str, Any]:
    """The checkpoint's index (JSON) from every rank's receipt part (``{"entries", "held",
    "paths"}``): each value with its chunks and where they lie. Raises ``fail(why)`` when the
    chunks of a value do not cover it (ranks held different state)."""
    items: dict[str, dict[str, Any]] = {}
    paths: dict[str, list[Any]] = {}
    held: dict[str, int] = {}
    for rank in sorted(receipts):
        part = receipts[rank]
        paths.update(part.get("paths") or {})
        for fqn, n in (part.get("held") or {}).items():
            held.setdefault(fqn, int(n))
        for e in part.get("entries") or ():
            fqn = str(e["fqn"])
            if e["kind"] == "bytes":
                items.setdefault(fqn, {"kind": "bytes", "file": e["file"],
                                       "offset": int(e["offset"]), "length": int(e["length"])})
                continue
            entry = items.setdefault(fqn, {"kind": "tensor", "dtype": e["dtype"],
                                           "size": list(e["size"]), "chunks": []})
            if entry["kind"] != "tensor" or entry["size"] != list(e["size"]):
                raise fail(f"{fqn}: rank {rank} wrote a tensor of size {e['size']}, another "
                           f"rank {entry.get('size')}; the ranks' states differ")
            if any(c["offsets"] == list(e["offsets"]) for c in entry["chunks"]):
                continue  # the same chunk from another holder: keep the first
            entry["chunks"].append({k: e[k] for k in ("offsets", "sizes", "file", "offset",
                                                      "length")})
    for fqn, n in held.items():
        got = items.get(fqn)
        if got is None:
            raise fail(f"{fqn}: no rank wrote it (every rank holds it, each expected another "
                       "to write it): the ranks' states differ")
        if got["kind"] == "tensor":
            if _volume(got["size"]) != n:
                raise fail(f"{fqn}: a rank holds {n} elements, the written chunks describe a "
                           f"tensor of size {got['size']}: the ranks' states differ")
            covered = sum(_volume(c["sizes"]) for c in got["chunks"])
            if covered != _volume(got["size"]):
                raise fail(f"{fqn}: the ranks' chunks cover {covered} of its "
                           f"{_volume(got['size'])} elements: the ranks' states differ")
            got["chunks"].sort(key=lambda c: c["offsets"])
    return {"format": INDEX_FORMAT, "version": 1, "items": items, "paths": paths}


def _volume(sizes: list[int]) -> int:
    n = 1
    for s in sizes:
        n *= int(s)
    return n


def metadata_from_index(index: Mapping[str, Any], checkpoint_id: str = "",
                        save_id: str = "") -> Metadata:
    """DCP's ``Metadata`` for an index (what ``.metadata`` holds, built without pickle)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    state: dict[str, Any] = {}
    storage: dict[MetadataIndex, Any] = {}
    for fqn, entry in index["items"].items():
        if entry["kind"] == "bytes":
            state[fqn] = BytesStorageMetadata()
            storage[MetadataIndex(fqn)] = _StorageInfo(str(entry["file"]), int(entry["offset"]),
                                                      int(entry["length"]))
            continue
        chunks = [ChunkStorageMetadata(offsets=torch.Size(c["offsets"]),
                                       sizes=torch.Size(c["sizes"])) for c in entry["chunks"]]
        state[fqn] = TensorStorageMetadata(
            properties=TensorProperties(dtype=parse_dtype(entry["dtype"])),
            size=torch.Size(entry["size"]), chunks=chunks)
        for i, c in enumerate(entry["chunks"]):
            storage[MetadataIndex(fqn, c["offsets"], i)] = _StorageInfo(
                str(c["file"]), int(c["offset"]), int(c["length"]))
    planner_data = {fqn: tuple(path) for fqn, path in index.get("paths", {}).items()}
    return Metadata(state_dict_metadata=state, planner_data=planner_data,
                    storage_data=storage,
                    storage_meta=StorageMeta(checkpoint_id=checkpoint_id or None,
                                             save_id=save_id or None),
                    version=DCP_VERSION)
