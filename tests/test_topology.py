"""Topology model: declared clusters, clusters from Dask hosts, nesting and pair levels."""

from __future__ import annotations

import numpy as np
import pytest

from nbtrain.core.topology import LEVELS, Topology


def test_declare_counts_and_contiguous_domains() -> None:
    topo = Topology.declare(64, 8, hosts_per_leaf=8, leaves_per_pod=4)
    assert topo.n_slots == 512
    assert topo.n_domains == {"nvlink": 64, "host": 64, "leaf": 8, "pod": 2, "cluster": 1}
    assert len(set(topo.slot_ids)) == 512
    assert topo.slot_ids[9] == "h0001:1"
    # One NVSwitch per host: the two partitions are one tree level.
    assert topo.tree == ("nvlink", "leaf", "pod", "cluster")
    assert topo.rep["host"] == "nvlink"
    for name in LEVELS:
        b = topo.bounds[name]
        assert b[0] == 0 and b[-1] == 512 and (np.diff(b) > 0).all()


def test_nvlink_pairs_nest_inside_hosts() -> None:
    topo = Topology.declare(4, 8, nvlink_gpus=2, hosts_per_leaf=2)
    assert topo.max_nvlink == 2
    assert topo.tree == ("nvlink", "host", "leaf", "pod")  # one pod: pod == cluster
    assert topo.n_domains["nvlink"] == 16


def test_nvl72_domain_spans_hosts() -> None:
    topo = Topology.declare(36, 4, nvlink_hosts=18, hosts_per_leaf=18)
    assert topo.max_nvlink == 72
    assert topo.tree[0] == "host" and topo.tree[1] == "nvlink"
    assert topo.dom["nvlink"][0] == topo.dom["nvlink"][71] != topo.dom["nvlink"][72]


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"nvlink_gpus": 3}, "must divide gpus_per_host"),
        ({"nvlink_hosts": 3, "hosts_per_leaf": 4}, "must divide hosts_per_leaf"),
        ({"nvlink_hosts": 2, "nvlink_gpus": 4, "hosts_per_leaf": 4}, "cannot be combined"),
        ({"hosts_per_leaf": 0}, "hosts_per_leaf must be a positive integer"),
    ],
)
def test_declare_rejects_impossible_shapes(kwargs: dict[str, int], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        Topology.declare(8, 8, **kwargs)


def test_from_hosts_orders_by_leaf_and_keeps_ids() -> None:
    hosts = {"10.0.0.3": ["c1", "c2"], "10.0.0.1": ["a1"], "10.0.0.2": ["b1", "b2", "b3"]}
    topo = Topology.from_hosts(hosts, leaf_of={"10.0.0.3": "rackA", "10.0.0.1": "rackB",
                                               "10.0.0.2": "rackA"})
    assert topo.host_names == ("10.0.0.3", "10.0.0.2", "10.0.0.1")
    assert topo.slot_ids == ("c1", "c2", "b1", "b2", "b3", "a1")
    assert topo.n_domains["leaf"] == 2
    assert topo.hosts()["10.0.0.2"] == ["b1", "b2", "b3"]
    # each host is its own NVLink domain
    assert topo.max_nvlink == 3


def test_from_hosts_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match="appear more than once"):
        Topology.from_hosts({"a": ["x", "y"], "b": ["x"]})
    with pytest.raises(ValueError, match="no slots"):
        Topology.from_hosts({"a": []})
    topo = Topology.from_hosts({"a": ["x"]})
    with pytest.raises(KeyError, match="'nope' is not in this topology"):
        topo.indices(["nope"])


def test_with_hosts_extends_only_host_built_topologies() -> None:
    topo = Topology.from_hosts({"a": ["x", "y"]})
    bigger = topo.with_hosts({"b": ["z"], "a": ["w"]})
    assert bigger.hosts() == {"a": ["x", "y", "w"], "b": ["z"]}
    with pytest.raises(ValueError, match="declared topology is fixed"):
        Topology.declare(2, 2).with_hosts({"c": ["q"]})


def test_pair_level_finds_the_tightest_shared_level() -> None:
    topo = Topology.declare(8, 4, nvlink_gpus=2, hosts_per_leaf=2, leaves_per_pod=2)
    a = np.array([0, 0, 0, 0, 0])
    b = np.array([1, 2, 4, 8, 16])  # same pair, same host, same leaf, same pod, other pod
    got = [LEVELS[i] for i in topo.pair_level(a, b)]
    assert got == ["nvlink", "host", "leaf", "pod", "cluster"]
