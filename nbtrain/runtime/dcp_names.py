"""The file names of a checkpoint's DCP layout (no torch: listing and cleaning a checkpoint
directory, which the notebook's side does, must not import ``torch.distributed``)."""

from __future__ import annotations

METADATA_FILE = ".metadata"  # DCP's metadata (a pickle), for DCP's own readers
INDEX_FILE = "dcp-index.json"  # the same as JSON, what nbtrain reads (no unpickling)


def data_file(rank: int) -> str:
    """The rank's data file, named as DCP's ``FileSystemWriter`` names it."""
    return f"__{rank}_0.distcp"


__all__ = ["INDEX_FILE", "METADATA_FILE", "data_file"]
