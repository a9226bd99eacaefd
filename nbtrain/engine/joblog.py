"""What the controller keeps of each job for clients that follow or attach later (torch-free).

Step rows (``nbtrain.core.records.JOB_ROW_COLUMNS``) and events, each an append-only list
addressed by absolute position, so a client asks for "everything after position n" and never
misses or repeats anything. Memory is bounded: past ``rows_kept`` rows (or ``events_kept``
events) the oldest are dropped from memory. With a ``sink`` (the controller's durable store)
every item is also journaled at its position, and older positions are read from there; without
one a client that was further behind starts at the oldest kept position (``base``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from nbtrain.core.jobevents import generation_of

#: Where a job log journals what it adds: (table, first position, items).
Sink = Callable[[str, int, list[Any]], None]

__all__ = ["JobLog", "Tail"]


class Tail:
    """An append-only list that forgets its oldest items beyond ``keep``."""

    def __init__(self, keep: int, base: int = 0) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.keep = keep
        self.base = base  # absolute position of items[0]
        self.items: list[Any] = []

    @property
    def end(self) -> int:
        return self.base + len(self.items)

    def extend(self, items: Iterable[Any]) -> None:
        self.items.extend(items)
        # Trim in chunks, so a steady stream does not shift the list on every append.
        if len(self.items) > self.keep + max(1, self.keep // 8):
            drop = len(self.items) - self.keep
            del self.items[:drop]
            self.base += drop

    def since(self, position: int, limit: int) -> tuple[int, list[Any]]:
        """(absolute position of the first item returned, items after ``position``)."""
        start = max(position, self.base)
        i = start - self.base
        return start, self.items[i : i + limit]

    def put(self, at: int, items: Sequence[Any]) -> None:
        """Items that start at absolute position ``at`` (a mirror's copy of another tail):
        what it holds already is skipped; after a gap the tail starts again at ``at``."""
        if at > self.end or not self.items:
            self.items.clear()
            self.base = at
        elif at < self.end:
            items = items[self.end - at:]
        self.extend(items)

    def rewind(self, end: int) -> None:
        """Forget the items at ``end`` and after (the source lost them)."""
        if end < self.end:
            del self.items[max(0, end - self.base):]
            self.base = min(self.base, end)


class JobLog:
    """Rows and events of one job, plus what a client needs to rebuild its handle."""

    def __init__(self, *, rows_kept: int, events_kept: int = 20_000,
                 output_kept: int = 10_000, sink: Sink | None = None,
                 ends: Mapping[str, int] | None = None) -> None:
        ends = ends or {}
        self.rows = Tail(rows_kept, ends.get("rows", 0))
        self.events = Tail(events_kept, ends.get("events", 0))
        self.output = Tail(output_kept, ends.get("output", 0))
        self.sink = sink

    def _add(self, table: str, tail: Tail, items: list[Any]) -> None:
        if self.sink is not None and items:
            self.sink(table, tail.end, items)
        tail.extend(items)

    def add_rows(self, generation: int, rank: int, rows: Sequence[Sequence[Any]]) -> None:
        self._add("rows", self.rows, [(generation, rank, *row) for row in rows])

    def add_event(self, event: Mapping[str, Any]) -> None:
        self._add("events", self.events, [dict(event)])

    def add_output(self, msg: Mapping[str, Any]) -> None:
        """A rank's batch of output lines (and how many it dropped)."""
        rank, gen, t = int(msg["rank"]), int(generation_of(msg)), float(msg.get("time", 0.0))
        lines = [{"rank": rank, "generation": gen, "stream": s, "text": text, "time": t}
                 for s, text in msg.get("lines", ())]
        if msg.get("dropped"):
            lines.append({"rank": rank, "generation": gen, "stream": "nbtrain", "time": t,
                          "text": f"... {msg['dropped']} lines dropped (more than "
                                  "Settings.log_lines_per_s)"})
        self._add("output", self.output, lines)

    def since(self, rows_from: int, events_from: int, max_rows: int,
              output_from: int = 0) -> dict[str, Any]:
        """What a follower at these positions has not seen yet (``*_at`` are the absolute
        positions of the first returned items, ``*_end`` the ends now)."""
        rows_at, rows = self.rows.since(rows_from, max_rows)
        events_at, events = self.events.since(events_from, 10_000)
        output_at, output = self.output.since(output_from, 10_000)
        return {"rows_at": rows_at, "rows": rows, "events_at": events_at, "events": events,
                "output_at": output_at, "output": output, "rows_end": self.rows.end,
                "events_end": self.events.end, "output_end": self.output.end}

    def has_news(self, rows_from: int, events_from: int, output_from: int = 0) -> bool:
        return (self.rows.end > rows_from or self.events.end > events_from
                or self.output.end > output_from)
