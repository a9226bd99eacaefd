"""A page the cluster serves (``nbtrain.engine.pages``), shown in the notebook.

``job.dashboard()`` and ``cluster.dashboard()`` return one: in JupyterLab it renders as the
live page in an iframe, with a link to open it in its own tab. The page is served by the Dask
scheduler, so it keeps updating while the kernel runs another cell, waits in ``job.wait()``,
or is restarted; the notebook only holds its address.
"""

from __future__ import annotations

import html

__all__ = ["PageView"]


class PageView:
    """A served page: ``url``, and ``controls`` (whether it can steer the job)."""

    def __init__(self, url: str, title: str, *, controls: bool = False,
                 height: int = 800) -> None:
        self.url = url
        self.title = title
        self.controls = controls
        self.height = height

    def _repr_html_(self) -> str:
        url = html.escape(self.url, quote=True)
        note = "" if self.controls else " (read-only)"
        return (f"<div class='nbtrain-page'><iframe src='{url}' title='{html.escape(self.title)}'"
                f" style='width:100%;height:{self.height}px;border:1px solid #ddd' "
                f"loading='eager'></iframe><div style='font-size:85%'>{html.escape(self.title)}"
                f"{note}: live, served by the cluster (it keeps updating while this kernel is "
                f"busy) · <a href='{url}' target='_blank'>open in a new tab</a></div></div>")

    def __repr__(self) -> str:
        return f"<nbtrain page {self.title}: {self.url}>"
