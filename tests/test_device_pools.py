"""GPU and CPU slots in one cluster: GPU jobs only on GPU slots (the job machine, pure)."""

from __future__ import annotations

from nbtrain.core.job import JobSpec
from nbtrain.core.lifecycle_types import (
    AbortCollectives,
    JobSubmission,
    Launch,
    Publish,
    Rejected,
    RestartWorkers,
    Submitted,
    WorkerJoined,
    WorkerLeft,
)
from nbtrain.core.pools import DevicePools
from nbtrain.core.sched_types import (
    Cancelled,
    JobRequest,
    Resume,
    SchedulerConfig,
    StartJob,
    Submit,
    Suspend,
    WorkersAdded,
)
from tests.test_lifecycle import POLICY, Harness


class MixedHarness(Harness):
    def join_gpu(self, host: str, gpu: str, nvlink: str = "") -> str:
        addr = f"tcp://{host}:{self.next_port}"
        self.next_port += 1
        self.feed(WorkerJoined, addr, host, gpu, nvlink, "", gpu)
        return addr

    def submit_on(self, job_id: str, device: str, world_size: int = 2,
                  queue: bool = True) -> list[object]:
        spec = JobSpec(job_id=job_id, name=f"job-{job_id}", world_size=world_size, steps=1000,
                       queue=queue, device=device)
        return list(self.feed(Submitted, JobSubmission(spec=spec, policy=POLICY)))

    def slot_device(self) -> dict[str, str]:
        return {str(s["address"]): str(s["device"]) for s in self.m.slots() if s["address"]}


def mixed() -> MixedHarness:
    h = MixedHarness(workers=2, hosts=1)  # two CPU workers on h0
    for i in range(2):
        h.join_gpu("g0", f"GPU-{i:08d}-aaaa-bbbb-cccc-dddddddddddd", nvlink="g0/nvl0")
    return h


def test_gpu_jobs_get_gpu_slots_and_cpu_jobs_cpu_slots() -> None:
    h = mixed()
    kinds = h.slot_device()
    h.submit_on("c", "cpu")
    h.submit_on("g", "gpu")
    [cpu_launch] = h.launches("c")
    [gpu_launch] = h.launches("g")
    assert {kinds[a] for a in cpu_launch.addresses} == {"cpu"} and cpu_launch.device == "cpu"
    assert {kinds[a] for a in gpu_launch.addresses} == {"gpu"} and gpu_launch.device == "gpu"


def test_auto_means_gpu_slots_when_the_cluster_has_any() -> None:
    h = mixed()
    h.submit_on("a", "auto")
    [launch] = h.launches("a")
    assert launch.device == "gpu"
    # Both GPU slots are taken: another GPU job waits, though CPU slots are free.
    h.submit_on("b", "gpu")
    assert h.launches("b") == []
    assert h.reason("b") == "needs 2 GPU slots at once; 0 of 2 free"
    assert h.launches("c") == [] and h.submit_on("c", "cpu") and h.launches("c")


def test_a_cpu_only_cluster_runs_auto_jobs_on_cpu_and_words_reasons_as_before() -> None:
    h = MixedHarness(workers=3)
    h.submit_on("a", "auto", world_size=4)
    assert h.reason("a") == ("needs 4 slots at once; the cluster has 3: waiting for workers "
                             "to join")
    h.join()
    [launch] = h.launches("a")
    assert launch.device == "cpu"


def test_a_gpu_job_waits_for_gpu_workers_on_a_cpu_cluster() -> None:
    h = MixedHarness(workers=2)
    h.submit_on("g", "gpu")
    assert h.launches("g") == []
    assert h.reason("g") == ("needs 2 GPU slots at once; the cluster has 0: waiting for "
                             "workers to join")
    out = h.submit_on("r", "gpu", queue=False)
    [rejected] = [c for c in out if isinstance(c, Rejected)]
    assert rejected.reason.startswith("job job-r needs 2 GPU slots at once but only 0 of the "
                                      "cluster's 0 are free")
    h.join_gpu("g1", "GPU-11111111-0000-0000-0000-000000000000")
    assert h.launches("g") == []
    h.join_gpu("g1", "GPU-22222222-0000-0000-0000-000000000000")
    [launch] = h.launches("g")
    assert launch.device == "gpu" and set(h.slot_device()[a] for a in launch.addresses) == {
        "gpu"}


def test_two_workers_on_one_gpu_are_refused() -> None:
    h = MixedHarness(workers=0)
    first = h.join_gpu("g0", "GPU-0a0a0a0a-0000-0000-0000-000000000000")
    second = h.join_gpu("g0", "GPU-0a0a0a0a-0000-0000-0000-000000000000")
    assert [s["address"] for s in h.m.slots()] == [first]
    [refused] = [c.event for c in h.of(Publish)
                 if c.job_id is None and c.event.get("what") == "refused"]
    assert refused["address"] == second and first in refused["reason"]
    assert "CUDA_VISIBLE_DEVICES" in refused["reason"]
    h.feed(WorkerLeft, second)  # the refused worker leaving changes nothing
    assert [s["state"] for s in h.m.slots()] == ["free"]


def test_a_restarted_gpu_worker_takes_back_its_gpus_slot() -> None:
    h = MixedHarness(workers=0)
    gpus = ["GPU-aaaaaaaa-0000-0000-0000-000000000000", "GPU-bbbbbbbb-0000-0000-0000-000000000000"]
    addrs = [h.join_gpu("g0", g) for g in gpus]
    slots = {s["gpu"]: s["slot"] for s in h.m.slots()}
    h.feed(WorkerLeft, addrs[0])
    h.feed(WorkerLeft, addrs[1])
    h.join_gpu("g0", gpus[1])  # back in the other order, under new addresses
    h.join_gpu("g0", gpus[0])
    assert {s["gpu"]: s["slot"] for s in h.m.slots()} == slots


def test_pools_route_events_and_hold_jobs_until_their_kind_has_slots() -> None:
    kinds = {"c0": "cpu", "c1": "cpu", "g0": "gpu", "g1": "gpu"}
    jobs = {"x": "gpu", "y": "gpu", "z": "cpu"}
    pools = DevicePools(SchedulerConfig(can_grow=True), slot_kind=lambda s: kinds[str(s)],
                        job_kind=lambda j: jobs[j])
    assert pools.handle(WorkersAdded(1.0, {"h": ("c0", "c1")})) == []
    assert pools.handle(Submit(2.0, JobRequest(job_id="x", size=2))) == []
    assert pools.handle(Submit(3.0, JobRequest(job_id="y", size=1))) == []
    pools.handle(Suspend(4.0, "y"))
    assert pools.queued() == ["x"] and pools.kinds() == ["cpu"]
    [start] = pools.handle(WorkersAdded(5.0, {"h": ("g0", "g1")}))
    assert isinstance(start, StartJob) and start.job_id == "x"
    assert set(start.placement.slots) == {"g0", "g1"}
    assert pools.handle(Resume(6.0, "y")) == [] and pools.queued() == ["y"]
    [z] = pools.handle(Submit(7.0, JobRequest(job_id="z", size=2)))
    assert isinstance(z, StartJob) and set(z.placement.slots) == {"c0", "c1"}
    assert pools.free_of("gpu") == 0 and pools.free_of("cpu") == 0 and pools.n_online == 4
    pools.handle(Cancelled(8.0, "x"))
    assert pools.free_slot_ids("gpu") and not pools.free_slot_ids("cpu")
    assert pools.kinds() == ["gpu", "cpu"]


def test_the_launch_of_a_cpu_cluster_job_names_cpu() -> None:
    h = MixedHarness(workers=2)
    h.submit("a")
    [launch] = h.of(Launch)
    assert launch.device == "cpu"


def gpu_cluster(n: int = 3) -> MixedHarness:
    h = MixedHarness(workers=0)
    for i in range(n):
        h.join_gpu("g0", f"GPU-{i:08d}-0000-0000-0000-000000000000", nvlink="g0/nvl0")
    return h


def test_nccl_peers_are_aborted_not_restarted_and_the_job_recovers() -> None:
    h = gpu_cluster()
    h.submit_on("a", "gpu")
    [launch] = h.launches("a")
    h.steps("a", 0, 12)
    h.committed("a", 0, 10)
    h.fail("a", 0, 1, step=12)
    assert h.of(AbortCollectives, h.advance(0.1)) == []
    out = h.advance(0.3)
    [abort] = h.of(AbortCollectives, out)
    assert abort == AbortCollectives("a", 0, (launch.addresses[0],),
                                     "free the peers of job job-a's failed rank")
    assert h.of(RestartWorkers, out) == []  # the processes and their CUDA contexts stay
    h.fail("a", 0, 0, peer=True, step=12, error="DistBackendError: NCCL communicator was "
                                                "aborted on rank 0")
    [fault] = h.m.status("a").faults
    assert fault["rank"] == 1 and fault["resume_step"] == 10
    relaunch = h.launches("a")[-1]
    assert relaunch.generation == 1 and relaunch.device == "gpu"
    assert h.of(RestartWorkers) == []


def test_a_lost_gpu_worker_gets_its_peers_aborted() -> None:
    h = gpu_cluster()
    h.submit_on("a", "gpu")
    [launch] = h.launches("a")
    h.steps("a", 0, 5)
    h.feed(WorkerLeft, launch.addresses[0])
    [abort] = h.of(AbortCollectives, h.advance(0.4))
    assert abort.addresses == (launch.addresses[1],)


def test_peers_still_running_after_the_grace_are_restarted_on_gpus_too() -> None:
    h = gpu_cluster()
    h.submit_on("a", "gpu")
    [launch] = h.launches("a")
    h.steps("a", 0, 5)
    h.fail("a", 0, 1, step=5)
    h.advance(0.4)  # the abort did not free rank 0 (stuck outside the collective)
    [restart] = h.of(RestartWorkers, h.advance(10.0))
    assert restart.addresses == (launch.addresses[0],)


def test_device_readings_reach_straggler_verdicts_and_stay_out_of_the_log() -> None:
    from nbtrain.core.machine_events import rank_from_wire
    from tests.test_gpu_health import HOT, rows

    h = gpu_cluster()
    h.submit_on("a", "gpu")
    h.feed(rank_from_wire, "a", {"kind": "device", "rank": 1, "generation": 0, "readings": HOT})
    h.feed(rank_from_wire, "a",  # stale
           {"kind": "device", "rank": 0, "generation": -1, "readings": {}})
    for start in range(1, 60, 10):
        batch = rows({"compute": 2.0}, start, 10)
        for rank in (0, 1):
            h.feed(rank_from_wire, "a", {"kind": "steps", "rank": rank, "generation": 0,
                                         "rows": batch[rank]})
    assert h.events("a", "device") == []
    [suspect, *_] = h.events("a", "straggler")
    assert suspect["rank"] == 1 and suspect["nvml"] == HOT
    assert suspect["hint"].startswith("GPU throttling: SM clock 1.20 GHz of 1.98 GHz max")


def test_cluster_topology_shows_hosts_domains_and_gpus() -> None:
    import json
    from pathlib import Path

    from nbtrain.core.gpu_topology import gpus_from_nvml, worker_gpu_labels
    from nbtrain.engine.topoview import TopologyView

    raw = json.loads((Path(__file__).parent / "data/gpu/a6000_pairs_nvml.json").read_text())
    host = gpus_from_nvml("ws-a6000", raw)
    h = MixedHarness(workers=1, hosts=1)  # one CPU worker on h0
    for i in range(4):
        labels = worker_gpu_labels(host, str(i), "")
        h.join_gpu("ws-a6000", labels["gpu"], nvlink=labels["nvlink"])
    view = TopologyView(h.m.slots())
    assert view.domains() == {"h0": ["h0#0"], "ws-a6000/nvl0": ["ws-a6000#0", "ws-a6000#1"],
                              "ws-a6000/nvl1": ["ws-a6000#2", "ws-a6000#3"]}
    lines = view.describe().splitlines()
    assert lines[0] == "4 GPU slots, 1 CPU slots on 2 host(s); 3 NVLink domain(s)"
    assert "    NVLink domain ws-a6000/nvl1 (declared): 2 slot(s)" in lines
    assert any(line.strip().startswith("ws-a6000#0  free  GPU-") for line in lines)
    assert "<table>" in view._repr_html_()


def test_labels_that_make_no_topology_keep_the_worker_out() -> None:
    clique = "clique:7c1e0a2b-3f4d-4e8a-9b61-2d5f0c9e4a17/32766"
    h = MixedHarness(workers=0)
    first = f"tcp://t01:{h.next_port}"
    h.feed(WorkerJoined, first, "t01", "", clique, "leaf-a", "GPU-aaaaaaaa-0000-0000-0000-0")
    # The same NVLink clique under another leaf switch: no topology can hold both.
    second = f"tcp://t02:{h.next_port + 1}"
    h.feed(WorkerJoined, second, "t02", "", clique, "leaf-b", "GPU-bbbbbbbb-0000-0000-0000-0")
    [refused] = [c.event for c in h.of(Publish)
                 if c.job_id is None and c.event.get("what") == "refused"]
    assert refused["address"] == second and "spans leaf switches" in refused["reason"]
    assert [s["address"] for s in h.m.slots() if s["state"] == "free"] == [first]
    h.submit_on("a", "gpu", world_size=1)
    [launch] = h.launches("a")
    assert launch.addresses == (first,)
