"""NVLink domains from recorded NVML readings and nvidia-smi outputs of real machine types.

``tests/data/gpu`` holds what ``nbtrain.runtime.nvml.read_nvml`` records (raw NVML values:
link states, remote device types and PCI bus ids, fabric info) and the text of
``nvidia-smi -q`` / ``nvidia-smi topo -m`` for: an 8-GPU NVSwitch host (HGX H100), a PCIe-only
host (4x L40S), NVLink-bridged pairs (8x RTX A6000) and GB200 NVL72 compute trays (a
multi-node NVLink clique, a second clique, and a tray with one unregistered GPU).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from nbtrain.core.gpu_topology import (
    FabricInfo,
    GpuInfo,
    HostGpus,
    gpus_from_nvidia_smi,
    gpus_from_nvml,
    normalize_bus_id,
    nvlink_domains,
    parse_nvidia_smi_query,
    parse_topo_matrix,
    visible_gpu,
)
from nbtrain.core.topology import Topology

DATA = Path(__file__).parent / "data" / "gpu"


def load(name: str) -> Any:
    return json.loads((DATA / name).read_text())


def text(name: str) -> str:
    return (DATA / name).read_text()


def nvml_host(name: str) -> HostGpus:
    raw = load(name)
    return gpus_from_nvml(raw["host"], raw)


def smi_host(prefix: str, host: str) -> HostGpus:
    return gpus_from_nvidia_smi(host, text(f"{prefix}_query.txt"), text(f"{prefix}_topo.txt"))


def by_index(host: HostGpus, labels: dict[str, str]) -> list[str]:
    return [labels[g.uuid] for g in sorted(host.gpus, key=lambda g: g.index)]


# ------------------------------------------------------------------------------- NVML
def test_nvswitch_host_is_one_domain_and_a_zero_cluster_uuid_is_no_clique() -> None:
    host = nvml_host("hgx_h100_nvml.json")
    assert [g.nvswitch_links for g in host.gpus] == [18] * 8
    # Hopper HGX reports a "completed" fabric state with an error status and a zero UUID.
    assert all(g.fabric is not None and not g.fabric.registered for g in host.gpus)
    assert by_index(host, nvlink_domains(host)) == ["dgx-a07/nvl0"] * 8


def test_pcie_only_host_has_one_domain_per_gpu() -> None:
    host = nvml_host("pcie_l40s_nvml.json")
    assert by_index(host, nvlink_domains(host)) == [f"gpu-l40s-03/gpu{i}" for i in range(4)]


def test_nvlink_bridged_pairs_are_pairs() -> None:
    host = nvml_host("a6000_pairs_nvml.json")
    assert by_index(host, nvlink_domains(host)) == [
        f"ws-a6000/nvl{i // 2}" for i in range(8)]


def test_multi_node_clique_is_one_domain_across_hosts() -> None:
    hosts = [gpus_from_nvml(h["host"], h) for h in load("gb200_nvl72_nvml.json")["hosts"]]
    labels = [set(nvlink_domains(h).values()) for h in hosts]
    t01, t02, t03, t04 = labels
    assert t01 == t02 == {"clique:7c1e0a2b-3f4d-4e8a-9b61-2d5f0c9e4a17/32766"}
    assert t03 == {"clique:7c1e0a2b-3f4d-4e8a-9b61-2d5f0c9e4a17/32767"}  # another partition
    # One GPU of t04 did not register with the fabric: the tray falls back to its own
    # NVSwitch domain, since a multi-host domain must hold whole hosts.
    assert t04 == {"nvl72-r3-t04/nvl0"}


def test_clique_labels_build_a_topology_with_a_multi_host_domain() -> None:
    hosts = [gpus_from_nvml(h["host"], h) for h in load("gb200_nvl72_nvml.json")["hosts"]]
    slots: dict[str, list[str]] = {}
    nvlink_of: dict[object, str] = {}
    for h in hosts:
        for uuid, label in nvlink_domains(h).items():
            slots.setdefault(h.host, []).append(uuid)
            nvlink_of[uuid] = label
    topo = Topology.from_hosts(slots, nvlink_of=nvlink_of)
    assert topo.n_domains["nvlink"] == 3 and topo.n_domains["host"] == 4
    assert topo.max_nvlink == 8  # t01 + t02


# ------------------------------------------------------------------------------- nvidia-smi
@pytest.mark.parametrize(("prefix", "host", "expected"), [
    ("hgx_h100", "dgx-a07", ["dgx-a07/nvl0"] * 8),
    ("pcie_l40s", "gpu-l40s-03", [f"gpu-l40s-03/gpu{i}" for i in range(4)]),
    ("a6000_pairs", "ws-a6000", [f"ws-a6000/nvl{i // 2}" for i in range(8)]),
    ("gb200_t01", "nvl72-r3-t01",
     ["clique:7c1e0a2b-3f4d-4e8a-9b61-2d5f0c9e4a17/32766"] * 4),
])
def test_nvidia_smi_fallback_gives_what_nvml_gives(prefix: str, host: str,
                                                   expected: list[str]) -> None:
    smi = smi_host(prefix, host)
    assert by_index(smi, nvlink_domains(smi)) == expected
    assert smi.source == "nvidia-smi" and not smi.notes


@pytest.mark.parametrize("prefix", ["hgx_h100", "pcie_l40s", "a6000_pairs"])
def test_nvidia_smi_and_nvml_agree_on_uuids_and_bus_ids(prefix: str) -> None:
    nvml = nvml_host(f"{prefix}_nvml.json")
    smi = smi_host(prefix, nvml.host)
    assert [(g.uuid, g.pci_bus_id) for g in smi.gpus] == [
        (g.uuid, g.pci_bus_id) for g in nvml.gpus]
    assert nvlink_domains(smi) == nvlink_domains(nvml)


def test_topo_matrix_parsing_keeps_gpu_columns_and_strips_escapes() -> None:
    m = parse_topo_matrix(text("hgx_h100_topo.txt"))  # its header is underlined (escapes)
    assert sorted(m) == list(range(8)) and m[0][7] == "NV18" and 0 not in m[0]
    pairs = parse_topo_matrix(text("a6000_pairs_topo.txt"))
    assert pairs[2] == {0: "NODE", 1: "NODE", 3: "NV4", 4: "SYS", 5: "SYS", 6: "SYS", 7: "SYS"}
    pcie = parse_topo_matrix(text("pcie_l40s_topo.txt"))
    assert pcie[0] == {1: "NODE", 2: "SYS", 3: "SYS"}


def test_query_parsing_reads_uuid_bus_id_and_fabric() -> None:
    gpus = parse_nvidia_smi_query(text("gb200_t01_query.txt"))
    assert [g["pci_bus_id"] for g in gpus] == [
        "00000008:01:00.0", "00000009:01:00.0", "00000018:01:00.0", "00000019:01:00.0"]
    assert gpus[0]["fabric"] == {"state": 3, "status": 0, "clique_id": 32766,
                                 "cluster_uuid": "7c1e0a2b-3f4d-4e8a-9b61-2d5f0c9e4a17"}
    assert gpus[0]["uuid"].startswith("GPU-") and gpus[0]["name"] == "NVIDIA GB200"
    assert all(g["fabric"] is None for g in parse_nvidia_smi_query(text("pcie_l40s_query.txt")))


def test_parsers_name_what_they_expected() -> None:
    with pytest.raises(ValueError, match="nvidia-smi topo -m"):
        parse_topo_matrix("No devices were found\n")
    with pytest.raises(ValueError, match="nvidia-smi -q"):
        parse_nvidia_smi_query("No devices were found\n")


# ------------------------------------------------------------------------------- helpers
def test_visible_gpu_follows_cuda_visible_devices() -> None:
    host = nvml_host("hgx_h100_nvml.json")
    gpus = list(host.gpus)
    assert visible_gpu(None, gpus) is gpus[0]
    assert visible_gpu("3,0,1,2", gpus) is gpus[3]  # dask-cuda rotates the list per worker
    assert visible_gpu(gpus[5].uuid, gpus) is gpus[5]
    assert visible_gpu(gpus[6].uuid[:12], gpus) is gpus[6]  # a unique prefix, as CUDA takes
    assert visible_gpu("", gpus) is None and visible_gpu("-1", gpus) is None
    with pytest.raises(ValueError, match="not 9"):
        visible_gpu("9", gpus)
    with pytest.raises(ValueError, match="MIG"):
        visible_gpu("MIG-1f2e3d4c-aaaa-bbbb-cccc-000011112222", gpus)


def test_bus_ids_compare_across_formats() -> None:
    assert normalize_bus_id("0000:1B:00.0") == normalize_bus_id("00000000:1b:00.0")
    assert normalize_bus_id("00000008:01:00.0") == "00000008:01:00.0"


def test_a_failed_registration_anywhere_on_a_host_keeps_the_host_local_rules() -> None:
    ok = FabricInfo(cluster_uuid="11111111-2222-3333-4444-555555555555", clique_id=7, state=3)
    bad = FabricInfo(cluster_uuid=ok.cluster_uuid, clique_id=7, state=2)  # still registering
    gpus = (GpuInfo(0, "GPU-a", "00000000:01:00.0", fabric=ok),
            GpuInfo(1, "GPU-b", "00000000:02:00.0", fabric=bad))
    assert set(nvlink_domains(HostGpus("n1", gpus, "nvml")).values()) == {"n1/gpu0", "n1/gpu1"}
    both = (gpus[0], GpuInfo(1, "GPU-b", "00000000:02:00.0", fabric=ok))
    assert set(nvlink_domains(HostGpus("n1", both, "nvml")).values()) == {ok.label}
