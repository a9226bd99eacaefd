"""Which view to show (live widget or text lines) and how often to refresh it.

"Am I in a notebook?" heuristics all answer yes under papermill and nbval: they run a real
ipykernel. So the choice is explicit: ``display="page" | "widget" | "text"``, or ``"auto"``
which reads the environment variable ``NBTRAIN_DISPLAY`` (or Dask config ``nbtrain.display``)
first and only then guesses (the served page inside an IPython kernel, text anywhere else).
A CI job or a papermill run sets ``NBTRAIN_DISPLAY=text`` once instead of editing notebooks.
"""

from __future__ import annotations

import os
import sys
from typing import Literal

import dask.config

Mode = Literal["page", "widget", "text"]

DISPLAY_ENV = "NBTRAIN_DISPLAY"
RATE_ENV = "NBTRAIN_DASHBOARD_HZ"

#: Default refresh rate of live widgets. Each tick pulls new rows and sends one batched patch
#: per plot; 4 Hz looks live and costs the kernel a few ms per second.
DEFAULT_HZ = 4.0
#: Bounds of the refresh rate: below, the view looks frozen; above, the browser and the kernel
#: spend more on drawing than the eye can follow.
MIN_HZ, MAX_HZ = 0.2, 20.0

_CHOICES = ("auto", "page", "widget", "text")


def resolve_display(display: str | None = None) -> Mode:
    """``"page"``, ``"widget"`` or ``"text"`` from the argument, the environment, or a guess.

    Order: an explicit argument; then ``NBTRAIN_DISPLAY``; then Dask config
    ``nbtrain.display``; then ``"page"`` (the live page the cluster serves, in an iframe)
    inside an IPython kernel, else text. ``"widget"`` is the kernel-side widget: it updates
    on the kernel's event loop, so it freezes while a cell runs.
    """
    choice = _check(display or "auto", "display")
    if choice != "auto":
        return choice
    for source, value in (
        (f"environment variable {DISPLAY_ENV}", os.environ.get(DISPLAY_ENV)),
        ("Dask config nbtrain.display", dask.config.get("nbtrain.display", None)),
    ):
        if value:
            picked = _check(str(value).strip().lower(), source)
            if picked != "auto":
                return picked
    return "page" if in_kernel() else "text"


def in_kernel() -> bool:
    """True inside an IPython kernel (JupyterLab, Notebook, papermill, nbval...)."""
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return False
    shell = ipython.get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def dashboard_hz(value: float | None = None) -> float:
    """The live widgets' refresh rate: argument, ``NBTRAIN_DASHBOARD_HZ``, Dask config
    ``nbtrain.dashboard-hz``, or :data:`DEFAULT_HZ`."""
    raw: object = value
    source = "rate_hz"
    if raw is None:
        raw, source = os.environ.get(RATE_ENV), f"environment variable {RATE_ENV}"
    if raw is None:
        raw, source = dask.config.get("nbtrain.dashboard-hz", None), "Dask config"
    if raw is None:
        return DEFAULT_HZ
    try:
        hz = float(str(raw))
    except ValueError:
        raise ValueError(f"dashboard refresh rate from {source} must be a number of "
                         f"updates per second, got {raw!r}") from None
    if not MIN_HZ <= hz <= MAX_HZ:
        raise ValueError(f"dashboard refresh rate from {source} is {hz} Hz; use "
                         f"{MIN_HZ} to {MAX_HZ} (default {DEFAULT_HZ})")
    return hz


def _check(value: str, source: str) -> Literal["auto", "page", "widget", "text"]:
    for choice in ("auto", "page", "widget", "text"):
        if value == choice:
            return choice
    raise ValueError(f"display from {source} must be one of {', '.join(_CHOICES)}; "
                     f"got {value!r}")
