"""``connect(n_workers=N, hosts=H)``: an embedded cluster's CPU workers declared as H hosts."""

from __future__ import annotations

import collections
from pathlib import Path

import pytest

import nbtrain
from nbtrain.engine.cluster import declared_host_size
from tests.conftest import wait_for


def hosts_of(cluster: nbtrain.Cluster) -> dict[str, str]:
    return {s["address"]: s["host"] for s in cluster.snapshot()["slots"]
            if s["address"] and s["state"] == "free"}


def test_workers_are_hosts_of_equal_size_and_a_restarted_one_keeps_its_host(
        tmp_path: Path) -> None:
    settings = nbtrain.Settings.load(checkpoint_root=str(tmp_path), token_file="")
    with nbtrain.connect(n_workers=4, hosts=2, gpus=False, settings=settings) as cluster:
        before = hosts_of(cluster)
        assert sorted(collections.Counter(before.values()).items()) == [("node0", 2),
                                                                         ("node1", 2)]
        described = cluster.topology.describe()
        assert "4 CPU slots on 2 host(s); 2 NVLink domain(s)" in described

        address = sorted(before)[0]
        cluster.client.restart_workers([address])
        wait_for(lambda: len(hosts_of(cluster)) == 4 and address not in hosts_of(cluster),
                 60, "the restarted worker's slot")
        after = hosts_of(cluster)
        # the nanny brought the worker back with its spec's environment: the same host
        assert sorted(collections.Counter(after.values()).items()) == [("node0", 2),
                                                                        ("node1", 2)]


def test_hosts_must_split_the_workers_evenly_and_only_on_an_embedded_cluster() -> None:
    assert declared_host_size(None, 4, gpus=False) == 0
    assert declared_host_size(2, 4, gpus=False) == 2
    with pytest.raises(ValueError, match=r"hosts=3 must split n_workers=4 .* a divisor of 4"):
        declared_host_size(3, 4, gpus=False)
    with pytest.raises(ValueError, match=r"hosts=0 must split"):
        declared_host_size(0, 4, gpus=False)
    with pytest.raises(ValueError, match=r"GPU workers' hosts .* are discovered"):
        declared_host_size(2, 4, gpus=True)
    with pytest.raises(ValueError, match="NBTRAIN_WORKER_HOST in its environment"):
        nbtrain.connect("tcp://127.0.0.1:1", hosts=2)  # refused before connecting
