"""A rank's output (``print``, ``logging``, warnings, tqdm) forwarded to the notebook.

Dask workers run with their output out of sight, so a ``print`` in a rank was lost. While a
rank task runs, :class:`OutputForwarder` stands in for ``sys.stdout``/``sys.stderr`` (one rank
per worker process, so swapping the process's streams is safe) and adds a handler to the root
logger. Lines are batched into ``log`` events (one per ``flush_s`` at most) and rate-limited
(a token bucket of ``burst`` lines refilled at ``lines_per_s``; what exceeds it is counted and
reported as dropped, never queued without bound). Carriage returns rewrite the current line,
as on a terminal: a tqdm bar becomes one line, re-sent at most every ``progress_s``.
"""

from __future__ import annotations

import io
import logging
import sys
import threading
import time
from typing import Any, TextIO

from nbtrain.core.jobevents import generation_of
from nbtrain.runtime.events import EventEmitter

__all__ = ["OutputForwarder"]

#: Loggers of the machinery around the rank, not of the user's code.
_QUIET_LOGGERS = ("distributed", "tornado", "asyncio", "bokeh", "urllib3", "fsspec")


class _Stream(io.TextIOBase):
    """A text stream that hands complete lines (and progress rewrites) to the forwarder."""

    def __init__(self, forwarder: OutputForwarder, name: str) -> None:
        super().__init__()
        self._fwd = forwarder
        self.name = name
        self._partial = ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self._fwd._write(self, text)
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


class _Handler(logging.Handler):
    def __init__(self, forwarder: OutputForwarder) -> None:
        super().__init__(logging.NOTSET)
        self._fwd = forwarder
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.startswith(_QUIET_LOGGERS):
            return
        try:
            self._fwd._line("logging", self.format(record))
        except Exception:  # logging must never break the rank
            self.handleError(record)


class OutputForwarder:
    """While active (a context manager), forward this process's output as ``log`` events."""

    def __init__(self, emitter: EventEmitter, *, lines_per_s: float = 50.0, burst: int = 200,
                 flush_s: float = 0.5, progress_s: float = 2.0, max_line: int = 2000) -> None:
        self.emitter = emitter
        self.lines_per_s = lines_per_s
        self.burst = burst
        self.flush_s = flush_s
        self.progress_s = progress_s
        self.max_line = max_line
        self._lock = threading.Lock()
        self._lines: list[list[str]] = []  # [stream, text]
        self._dropped = 0
        self._tokens = float(burst)
        self._refilled = time.monotonic()
        self._progress_sent: dict[str, float] = {}
        self._stop = threading.Event()
        self._saved: tuple[TextIO, TextIO] | None = None
        self._handler = _Handler(self)
        self._thread: threading.Thread | None = None
        self.stdout = _Stream(self, "stdout")
        self.stderr = _Stream(self, "stderr")

    def __enter__(self) -> OutputForwarder:
        self._saved = (sys.stdout, sys.stderr)
        sys.stdout = self.stdout
        sys.stderr = self.stderr
        logging.getLogger().addHandler(self._handler)
        self._thread = threading.Thread(target=self._run, name="nbtrain-output", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        logging.getLogger().removeHandler(self._handler)
        if self._saved is not None:
            sys.stdout, sys.stderr = self._saved
        self._stop.set()
        for stream in (self.stdout, self.stderr):
            if stream._partial:
                self._line(stream.name, stream._partial)
                stream._partial = ""
        self.flush()

    # -- input ---------------------------------------------------------------------------------
    def _write(self, stream: _Stream, text: str) -> None:
        with self._lock:
            pieces = (stream._partial + text).split("\n")
            stream._partial = pieces.pop()
            complete = [p.rsplit("\r", 1)[-1] for p in pieces]
            partial = stream._partial
        for line in complete:
            self._line(stream.name, line)
        if "\r" in partial:
            # A line rewritten in place (a progress bar): keep its latest text, send it now and
            # then, not on every rewrite.
            current = partial.rsplit("\r", 1)[-1]
            stream._partial = current
            now = time.monotonic()
            if current and now - self._progress_sent.get(stream.name, 0.0) >= self.progress_s:
                self._progress_sent[stream.name] = now
                self._append(stream.name, current, counted=False)

    def _line(self, stream: str, text: str) -> None:
        self._append(stream, text, counted=True)

    def _append(self, stream: str, text: str, *, counted: bool) -> None:
        text = text if len(text) <= self.max_line else text[: self.max_line] + " [...]"
        with self._lock:
            if counted:
                now = time.monotonic()
                self._tokens = min(self.burst,
                                   self._tokens + (now - self._refilled) * self.lines_per_s)
                self._refilled = now
                if self._tokens < 1.0:
                    self._dropped += 1
                    return
                self._tokens -= 1.0
            self._lines.append([stream, text])

    # -- output --------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(self.flush_s):
            self.flush()

    def flush(self) -> None:
        with self._lock:
            lines, self._lines = self._lines, []
            dropped, self._dropped = self._dropped, 0
        if lines or dropped:
            self.emitter.emit("log", lines=lines, dropped=dropped)

    @property
    def active(self) -> bool:
        return self._saved is not None and not self._stop.is_set()


def format_lines(records: list[dict[str, Any]]) -> list[str]:
    """Log records as people read them: ``[rank 1 g0 stderr] text``."""
    return [f"[rank {r['rank']} g{generation_of(r)}"
            f"{'' if r['stream'] == 'stdout' else ' ' + r['stream']}] {r['text']}"
            for r in records]
