"""The ranks' control agreement over a real two-process gloo group: a request offered at one
step boundary is acted on at the next one, on every rank at the same step; the interval is
the smallest wish; a knob change reaches every rank with it; a loop that ends with an
agreement in flight drains it and the group's next collective still pairs up."""

from __future__ import annotations

import multiprocessing
from typing import Any

import torch

from nbtrain.engine.standalone import free_port

#: Steps each rank walks through; rank 0 is asked to stop before its boundary at STOP_AT.
STEPS = 12
STOP_AT = 5


def _rank(rank: int, port: int, out: Any) -> None:
    import torch.distributed as dist

    from nbtrain.runtime.control import ControlChannel

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    # No controller here: rank 0's follower thread finds no client and keeps retrying, and
    # the flags are set the way it would set them.
    channel = ControlChannel("job", rank, 0, None, 0.05, torch.device("cpu"))  # type: ignore[arg-type]
    if rank == 0:
        channel.set_knobs([{"seq": 1, "knob": "lr", "value": 0.5}])
    seen: list[tuple[int, dict[str, int], int, list[Any]]] = []
    next_offer = 1
    for step in range(1, STEPS + 1):
        if channel.in_flight:
            requests, interval = channel.agreed()
            seen.append((step, requests, interval, channel.agreed_knobs))
            next_offer = step + interval - 1
        if rank == 0 and step == STOP_AT:
            channel._set({"stop": 1})  # what the controller's long-poll reply would do
        if step >= next_offer and step < STEPS:
            # Rank 0 wishes for 3 steps between agreements, rank 1 for 2: 2 is agreed.
            channel.offer(3 if rank == 0 else 2)
    assert not channel.in_flight  # the last boundary offered nothing
    channel.offer(1)  # an offer the loop never acts on (it ended)
    channel.drain()
    total = torch.tensor([rank + 1])
    dist.all_reduce(total)  # pairs with the peer's: nothing was left in flight
    channel.close()
    dist.destroy_process_group()
    out.put((rank, seen, int(total.item())))


def test_requests_are_acted_on_one_step_after_the_offer_on_every_rank() -> None:
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, out), daemon=True) for r in (0, 1)]
    for p in procs:
        p.start()
    got = dict((rank, (seen, total)) for rank, seen, total in (out.get(timeout=120)
                                                                 for _ in procs))
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert got[0][0] == got[1][0]  # the same steps, requests, intervals and knobs on both
    seen = got[0][0]
    assert got[0][1] == got[1][1] == 3
    steps = [step for step, *_ in seen]
    # Offered at step 1 and acted on at 2, then every 2 steps (the smaller wish).
    assert steps == [2, 4, 6, 8, 10, 12]
    assert all(interval == 2 for _, _, interval, _ in seen)
    stops = [step for step, requests, _, _ in seen if requests["stop"]]
    # Set before the offer at step 5: acted on at step 6, the next agreed boundary.
    assert stops and stops[0] == STOP_AT + 1
    # The knob change rank 0 knew of reaches both ranks at the first agreement, once.
    knobs = [k for *_, k in seen]
    assert knobs[0] == [{"seq": 1, "knob": "lr", "value": 0.5}]
    assert all(k == [] for k in knobs[1:])
