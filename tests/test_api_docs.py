"""The API reference builds from the docstrings, and every public name has one."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

import nbtrain
from tests.conftest import load_file_module

pytest.importorskip("pdoc")


def test_every_public_name_is_documented() -> None:
    missing = [name for name in nbtrain.__all__
               if not inspect.getdoc(getattr(nbtrain, name))]
    assert missing == []
    handle = nbtrain.JobHandle
    public = [m for m, v in vars(handle).items() if not m.startswith("_") and callable(v)]
    assert [m for m in public if not inspect.getdoc(getattr(handle, m))] == []


def test_api_reference_builds(tmp_path: Path) -> None:
    path = Path(__file__).resolve().parent.parent / "docs" / "build_api.py"
    module = load_file_module(path, "build_api")
    out = module.build(tmp_path / "api")
    pages = {p.relative_to(out).as_posix() for p in out.rglob("*.html")}
    assert {"nbtrain.html", "nbtrain/engine/job.html", "nbtrain/runtime/context.html"} <= pages
    text = (out / "nbtrain" / "runtime" / "context.html").read_text()
    assert "RankContext.batches" in text and "RankContext.track" in text
