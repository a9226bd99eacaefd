"""Goodput sizing on a real cluster (four LocalCluster worker processes, gloo): two
goodput-sized jobs, one whose step time halves with twice the ranks and one whose step time
does not move, end with the scaling one holding more slots; rank 0 of a job at two ranks or
more sends its gradient noise scale. Every resize says why, and both
jobs' committed steps consume each sample once per epoch, with parameters equal to plain
single-process SGD over the same global batches (the resizes resume exactly)."""

from __future__ import annotations

from pathlib import Path

import nbtrain
from nbtrain import Settings
from nbtrain.accounting import account
from tests.conftest import wait_for
from tests.recipes import assert_params_equal, elastic_train, single_process_params
from tests.test_elastic_live import _resizes, _stopped_at

N, BATCH = 256, 16


def test_the_job_that_scales_gets_the_slots_and_both_resume_exactly(tmp_path: Path) -> None:
    # Sizes are reconsidered every 4 s (300 s by default), so the test sees two rounds.
    settings = Settings.load(goodput_interval_s=4, resize_interval_s=4)
    with nbtrain.connect(n_workers=4, gpus=False, settings=settings) as cluster:
        jobs = {}
        for name, shared, sleep in (("flat", False, 0.12), ("scales", True, 0.24)):
            out = tmp_path / name
            out.mkdir()
            config = {"n": N, "batch": BATCH, "out_dir": str(out), "step_sleep": sleep,
                      "sleep_shared": shared}
            jobs[name] = cluster.submit(elastic_train, world_size=1, min_size=1, max_size=3,
                                        sizing="goodput", steps=10**6, config=config,
                                        checkpoint=None, name=name)
            # The flat job is measured at one rank before the other arrives, so it is tried
            # at two while slots are free (its exploration) and its curve is measured there.
            wait_for(lambda job=jobs[name]: 1 in _measured(job), 120,  # type: ignore[misc]
                     f"{name} measured at one rank")
        scales, flat = jobs["scales"], jobs["flat"]
        wait_for(lambda: (scales.snapshot().size, flat.snapshot().size) == (3, 1)
                 and {1, 2} <= _measured(scales) and {1, 2} <= _measured(flat), 300,
                 "the scaling job at 3 ranks and the flat one at 1, both measured at 1 and 2")
        # Rank 0 of a job at two ranks or more estimates its gradient noise scale.
        wait_for(lambda: scales.snapshot().noise_scale is not None, 120,
                 "the scaling job's gradient noise scale")
        assert scales.snapshot().noise_scale >= 0  # type: ignore[operator]
        curve = {int(p["size"]): p for p in scales.snapshot().speedup}
        flat_curve = {int(p["size"]): p for p in flat.snapshot().speedup}
        # The scaling job's speedup at 2 is well above the flat one's.
        assert curve[2]["speedup"] > 1.5 > 1.2 > flat_curve[2]["speedup"], (curve, flat_curve)
        sizes = {name: job.snapshot().size for name, job in jobs.items()}
        finals = {name: _stopped_at(job) for name, job in jobs.items()}
    for name, job in jobs.items():
        moves = _resizes(job, "requested")
        assert moves and all(e["reason"].startswith(("goodput:", "shrunk for"))
                             for e in moves), moves
        assert job.restarts == 0
        ledger = account(tmp_path / name, finals[name], n=N, global_batch_size=BATCH)
        assert (ledger.duplicates, ledger.missing) == (0, 0), (name, ledger)
        # every rank of the last generation (earlier ones' files hold where they stopped)
        assert_params_equal(tmp_path / name,
                            single_process_params(finals[name], batch=BATCH, n=N),
                            ranks=tuple(range(sizes[name])))
    assert [e["new"] for e in _resizes(scales, "requested")][-1] == 3
    assert [e["new"] for e in _resizes(flat, "requested")][-1] == 1


def _measured(job: nbtrain.Job) -> set[int]:
    """The sizes a goodput-sized job's fitted curve holds measurements at."""
    return {int(p["size"]) for p in job.snapshot().speedup if "step_s" in p}
