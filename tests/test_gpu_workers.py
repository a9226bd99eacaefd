"""A GPU worker's side: reading NVML, the labels it reports, one embedded worker per GPU.

NVML is read through ``tests/nvml_replay.py`` (nvidia-ml-py's calls answered from the
recordings in ``tests/data/gpu``): there is no GPU here. The embedded cluster test starts
real worker processes with per-GPU environments (CUDA ignores ids it does not have).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from distributed import Client

from nbtrain.core.gpu_topology import gpus_from_nvml, nvlink_domains, worker_gpu_labels
from nbtrain.engine.embedded import EmbeddedCluster
from nbtrain.engine.gpus import embedded_gpus, parse_visible_devices
from nbtrain.runtime.nvml import DeviceMonitor, read_health, read_nvml
from tests.nvml_replay import RecordedNvml

DATA = Path(__file__).parent / "data" / "gpu"


def recorded(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((DATA / name).read_text())
    return data


def hosts() -> list[dict[str, Any]]:
    out = [recorded(f) for f in ("hgx_h100_nvml.json", "pcie_l40s_nvml.json",
                                 "a6000_pairs_nvml.json")]
    return out + recorded("gb200_nvl72_nvml.json")["hosts"]


@pytest.mark.parametrize("host", hosts(), ids=lambda h: h["host"])
def test_the_nvml_reader_records_what_the_topology_reads(host: dict[str, Any]) -> None:
    nvml = RecordedNvml(host)
    readings = read_nvml(nvml)
    assert readings is not None and nvml.inits == 0  # every nvmlInit has its shutdown
    assert readings["driver"] == host["driver"]
    # The reader's output gives the same NVLink domains as the recording itself.
    assert nvlink_domains(gpus_from_nvml(host["host"], readings)) == nvlink_domains(
        gpus_from_nvml(host["host"], host))
    for got, want in zip(readings["gpus"], host["gpus"], strict=True):
        assert got["uuid"] == want["uuid"]
        assert got["pci_bus_id"] == want["pci_bus_id"].lower()
        assert len(got["nvlinks"]) == len(want["nvlinks"])
        assert got["fabric"] == want["fabric"]


def test_a_gpu_workers_labels() -> None:
    h100 = gpus_from_nvml("dgx-a07", recorded("hgx_h100_nvml.json"))
    third = sorted(h100.gpus, key=lambda g: g.index)[3]
    labels = worker_gpu_labels(h100, "3", "")
    assert labels == {"gpu": third.uuid, "pci_bus_id": "00000000:5d:00.0",
                      "gpu_name": "NVIDIA H100 80GB HBM3", "nvlink": "dgx-a07/nvl0",
                      "nvlink_source": "nvml"}
    declared = worker_gpu_labels(h100, third.uuid, "rack7-nvl")
    assert declared["nvlink"] == "rack7-nvl" and declared["nvlink_source"] == "declared"
    tray = recorded("gb200_nvl72_nvml.json")["hosts"][0]
    gb = worker_gpu_labels(gpus_from_nvml(tray["host"], tray), None, "")
    assert gb["nvlink"].startswith("clique:") and gb["nvlink_source"] == "nvml-fabric"
    assert worker_gpu_labels(h100, "", "") == {}  # CUDA_VISIBLE_DEVICES="": a CPU worker
    assert worker_gpu_labels(None, None, "") == {}  # no GPU on this host
    assert "MIG" in worker_gpu_labels(h100, "MIG-0a1b2c3d-0000-1111-2222-333344445555",
                                      "")["gpu_note"]


HEALTHY = {"sm_clock_mhz": 1980.0, "sm_clock_max_mhz": 1980.0, "clocks_event_reasons": 0.0,
           "temperature_c": 61.0, "power_w": 612.5, "power_limit_w": 700.0,
           "ecc_uncorrected": 0.0}


def test_health_readings_leave_out_what_nvml_cannot_answer() -> None:
    host = recorded("hgx_h100_nvml.json")
    nvml = RecordedNvml(host, health={0: HEALTHY, 1: {"temperature_c": 40.0}})
    assert read_health(nvml, 0) == HEALTHY
    assert read_health(nvml, 1) == {"temperature_c": 40.0}


def test_the_monitor_reports_the_last_critical_xid() -> None:
    host = recorded("hgx_h100_nvml.json")
    nvml = RecordedNvml(host, health={5: HEALTHY}, xids=[48, 79])
    bus = host["gpus"][5]["pci_bus_id"]
    monitor = DeviceMonitor(bus, emit=lambda r: None, nvml=nvml)
    handle = nvml.nvmlDeviceGetHandleByPciBusId(bus)
    assert monitor.sample(nvml, handle, "event-set") == {**HEALTHY, "xid": 79.0}
    assert monitor.sample(nvml, handle, "event-set")["xid"] == 79.0  # kept once seen
    assert "xid" not in DeviceMonitor(bus, emit=lambda r: None).sample(nvml, handle, None)


def test_the_monitor_samples_on_its_thread_until_stopped() -> None:
    import threading

    host = recorded("pcie_l40s_nvml.json")
    nvml = RecordedNvml(host, health={2: HEALTHY})
    got: list[dict[str, float]] = []
    first = threading.Event()

    def emit(readings: dict[str, float]) -> None:
        got.append(readings)
        first.set()

    monitor = DeviceMonitor(host["gpus"][2]["uuid"], emit, interval_s=3600, nvml=nvml)
    assert monitor.start()
    assert first.wait(30)
    monitor.stop()
    assert got == [HEALTHY] and nvml.inits == 0
    assert not DeviceMonitor("00000000:ff:00.0", emit, nvml=nvml).start()  # no such GPU


def test_cuda_visible_devices_reads_like_cuda() -> None:
    assert parse_visible_devices("0,1, 2") == ["0", "1", "2"]
    assert parse_visible_devices("2,-1,3") == ["2"]  # -1 hides the rest
    assert parse_visible_devices("GPU-8a1f,1") == ["GPU-8a1f", "1"]
    assert parse_visible_devices("") == []


def test_embedded_gpu_choice() -> None:
    assert embedded_gpus(False, None) == []
    assert embedded_gpus(["GPU-a", "GPU-b", "GPU-c"], 2) == ["GPU-a", "GPU-b"]
    with pytest.raises(ValueError, match="one worker per GPU"):
        embedded_gpus(["0", "1"], 3)
    with pytest.raises(ValueError, match="twice"):
        embedded_gpus(["0", "0"], None)


def test_embedded_cluster_gives_each_worker_its_own_gpu() -> None:
    ids = ["GPU-00000000-1111-2222-3333-444444444444", "GPU-55555555-6666-7777-8888-999999999999"]
    cluster = EmbeddedCluster(n_workers=0, gpus=ids, threads_per_worker=1, processes=True,
                              host="127.0.0.1", dashboard_address=None)
    try:
        cluster.scale(2)
        with Client(cluster, set_as_default=False) as client:
            client.wait_for_workers(2, timeout=120)
            seen = client.run(lambda: (os.environ.get("CUDA_VISIBLE_DEVICES"),
                                       os.environ.get("CUDA_DEVICE_ORDER")))
            info = client.scheduler_info()["workers"]
        assert sorted(seen.values()) == [(i, "PCI_BUS_ID") for i in ids]
        assert sorted(w["name"] for w in info.values()) == ids  # a restart keeps its GPU
        assert all(w["resources"] == {"GPU": 1} for w in info.values())
        with pytest.raises(ValueError, match="one worker per GPU"):
            cluster.new_worker_spec()
    finally:
        cluster.close()
