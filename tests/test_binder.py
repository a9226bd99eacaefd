"""Binder's files agree with the README and keep repo2docker's dependency layer cached."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_binder_pins_the_readme_torch_and_caches_dependencies() -> None:
    readme_torch = re.search(r"pip install torch==([0-9.]+)", (REPO / "README.md").read_text())
    assert readme_torch is not None
    lines = [ln.split("#")[0].strip() for ln in
             (REPO / "binder" / "requirements.txt").read_text().splitlines()]
    reqs = [ln for ln in lines if ln and not ln.startswith("--")]
    assert f"torch=={readme_torch.group(1)}" in reqs
    # repo2docker installs requirements.txt before copying the repo (a cached layer) only
    # when it does not point into the repo
    assert not [r for r in reqs if r.startswith(("-e", ".", "/")) or "file:" in r], reqs
    assert all("==" in r for r in reqs), f"unpinned: {[r for r in reqs if '==' not in r]}"
    post = (REPO / "binder" / "postBuild").read_text()
    assert "--no-deps -e ." in post
    assert "DASK_DISTRIBUTED__DASHBOARD__LINK" in (REPO / "binder" / "start").read_text()
