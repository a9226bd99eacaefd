"""The controller's inbox: long step-row batches split, every event fed in arrival order, the
loop given back between slices, and the machine deciding the same as without it."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

from nbtrain.core.lifecycle_types import Event, Publish, Tick
from nbtrain.core.machine_events import RankCheckpoint, RankEvent, RankSteps
from nbtrain.engine.inbox import Inbox, split_rows
from tests.test_lifecycle import Harness


def _rows(first: int, n: int, *, slow_rank: bool = False) -> list[list[Any]]:
    step_s = 0.03 if slow_rank else 0.01
    return [[s, 1e9 + s, step_s, 0.0, step_s * 0.8, 0.0, step_s * 0.2, {"loss": 1.0 / s}]
            for s in range(first, first + n)]


def _steps(job: str, rank: int, rows: list[list[Any]], t: float = 5.0) -> RankSteps:
    return RankSteps(t, 1e9 + t, job, 0, rank, rows=rows)


def test_a_long_batch_is_split_in_order_with_its_times() -> None:
    event = _steps("a", 1, _rows(1, 20))
    parts = split_rows(event, 8)
    assert all(isinstance(p, RankSteps) for p in parts)
    assert [len(p.rows) for p in parts] == [8, 8, 4]  # type: ignore[union-attr]
    assert [r[0] for p in parts for r in p.rows] == list(range(1, 21))  # type: ignore[union-attr]
    assert {(p.now, p.wall, p.rank, p.generation) for p in parts} == {  # type: ignore[union-attr]
        (5.0, 1e9 + 5.0, 1, 0)}
    as_tuple = replace(event, rows=tuple(event.rows))
    assert len(split_rows(as_tuple, 8)) == 3  # rows that came over the wire as a tuple
    assert split_rows(_steps("a", 1, _rows(1, 8)), 8) == [_steps("a", 1, _rows(1, 8))]
    tick = Tick(1.0, 2.0)
    assert split_rows(tick, 8) == [tick]
    ckpt = RankCheckpoint(1.0, 2.0, "a", 0, 0, phase="snapshot",
                          record={"kind": "checkpoint", "rows": list(range(100))})
    assert split_rows(ckpt, 8) == [ckpt]  # only step rows are split


def test_events_are_fed_in_arrival_order_and_the_loop_runs_between_slices() -> None:
    fed: list[tuple[str, int]] = []
    woken: list[int] = []

    def feed(event: Event) -> None:
        if isinstance(event, RankEvent):
            fed.append((event.kind, int(event.rows[0][0])
                        if isinstance(event, RankSteps) else -1))
        else:
            fed.append(("tick", -1))

    async def main() -> list[str]:
        order: list[str] = []
        # one event per slice: every slice gives the loop back
        inbox = Inbox(feed, lambda: woken.append(len(fed)), rows_per_event=8, slice_s=0.0)
        inbox.put(_steps("a", 0, _rows(1, 40)))
        assert fed == [("steps", 1)]  # nothing was waiting: the first part at once
        inbox.put(Tick(6.0, 1e9 + 6.0))  # queued behind the rows, not ahead of them
        then: list[int] = []
        inbox.put(RankCheckpoint(7.0, 1e9 + 7.0, "a", 0, 0),
                  then=lambda: then.append(len(fed)))
        asyncio.get_running_loop().call_soon(lambda: order.append(f"other after {len(fed)}"))
        while len(inbox):
            await asyncio.sleep(0)
        assert then == [len(fed)]  # right after its own event
        return order

    order = asyncio.run(main())
    assert fed == [("steps", 1), ("steps", 9), ("steps", 17), ("steps", 25), ("steps", 33),
                   ("tick", -1), ("checkpoint", -1)]
    assert order and order[0] != f"other after {len(fed)}"  # another callback ran mid-way
    assert woken and woken[-1] == len(fed)


def test_drain_feeds_what_waits_before_an_event_that_needs_an_answer() -> None:
    fed: list[int] = []

    async def main() -> None:
        inbox = Inbox(lambda e: fed.append(len(e.rows)), lambda: None,  # type: ignore[union-attr]
                      rows_per_event=4)
        inbox.put(_steps("a", 0, _rows(1, 10)))
        assert fed == [4] and len(inbox) == 2
        inbox.drain()  # what the controller does before a submission or a request
        assert fed == [4, 4, 2] and len(inbox) == 0

    asyncio.run(main())


def test_the_machine_decides_the_same_on_split_batches() -> None:
    """40-step batches whole, or split by the inbox: the same status, the same published
    events (straggler verdicts included: rank 1 is three times slower)."""
    whole, split = Harness(2), Harness(2)
    for h in (whole, split):
        h.submit("a")
    for batch in range(6):
        for rank in (0, 1):
            event = _steps("a", rank, _rows(1 + 40 * batch, 40, slow_rank=rank == 1),
                           t=100.0 + batch)
            whole.out += whole.m.handle(event)
            for part in split_rows(event, 8):
                split.out += split.m.handle(part)
                split.m.validate()
    published = [[dict(c.event) for c in h.of(Publish) if c.job_id == "a"]
                 for h in (whole, split)]
    verdicts = [[e for e in p if e["kind"] != "mitigation"] for p in published]
    assert verdicts[0] == verdicts[1]
    assert any(e["kind"] == "straggler" and e["state"] == "confirmed" for e in verdicts[0])
    # The policy acts at the same moment on the same verdict; the step it names is rank 0's
    # newest, which a split batch reaches in smaller strides (the verdict's own step is 70).
    acted = [[e for e in p if e["kind"] == "mitigation"] for p in published]
    assert acted[0] and len(acted[0]) == len(acted[1])
    for w, s in zip(*acted, strict=True):
        assert {**w, "step": 0} == {**s, "step": 0}
        assert 70 <= s["step"] <= w["step"]
    assert whole.m.status("a") == split.m.status("a")
    assert whole.m.status("a").state == "RUNNING"
