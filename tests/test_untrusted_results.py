"""Another user's result is read as data, never run: a job whose training function returns
an object that runs a shell command when unpickled, read by a client that did not submit it
(with the operator's token, the kernel a hostile user would most like to reach)."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch

import nbtrain
from nbtrain import JobState, Settings
from nbtrain import UntrustedResultError as Public
from nbtrain.engine.safeload import UntrustedResultError, data_loads
from tests import recipes


def test_data_loads_reads_data_and_refuses_everything_else(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    value = recipes.data_train(None, {})  # type: ignore[arg-type]
    back = data_loads(pickle.dumps(value))
    assert data_loads(pickle.dumps(value, protocol=5))["array"].tolist() == [0, 1, 2]
    assert back["steps"] == [1, 2, 3] and back["tags"] == {"a", "b"}
    assert torch.equal(back["state"]["w"], value["state"]["w"])
    assert back["array"].tolist() == [0, 1, 2] and back["pair"] == (1.5, None)
    for bad in (recipes.Payload(str(marker)), recipes.Regression(), print, Path("/x")):
        with pytest.raises(UntrustedResultError):
            data_loads(pickle.dumps(bad))
    assert not marker.exists()
    assert Public is UntrustedResultError


def test_a_strangers_result_is_not_run_in_the_operators_kernel(
        free_cluster: nbtrain.Cluster, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    evil = free_cluster.submit(recipes.payload_train, world_size=1, name="evil",
                               config={"marker": str(marker)})
    plain = free_cluster.submit(recipes.data_train, world_size=1, name="plain-data")
    assert evil.wait(120) is JobState.SUCCEEDED and plain.wait(120) is JobState.SUCCEEDED
    operator_token = free_cluster._remote.operator_token
    assert operator_token
    with nbtrain.connect(free_cluster.address, settings=Settings.load(token_file=""),
                         operator_token=operator_token) as operator:
        theirs = operator.job(evil.id)
        assert theirs.token == ""
        with pytest.raises(UntrustedResultError, match=r"posix\.system|os\.system") as err:
            theirs.result(60)
        assert "belongs to" in str(err.value) and "trust=True" in str(err.value)
        assert not marker.exists(), "another user's result ran code in this kernel"
        value = operator.job(plain.id).result(60)  # plain data comes through
        assert value["loss"] == 0.25 and torch.equal(
            value["state"]["w"], torch.arange(4.0, dtype=torch.float64))
        # the operator still steers (the controller is serving) and may opt in explicitly
        assert operator.job(plain.id).status is JobState.SUCCEEDED
    # The owner's own handle loads its own code's result in full.
    owner_value = evil.result(60)
    assert marker.exists() and owner_value["loss"] == 0.5
