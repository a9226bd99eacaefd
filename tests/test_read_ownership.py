"""Reads have owners (the shared-cluster issue): what another client of the cluster may read
of a job, by the cluster's ``visibility``; the operator token reaches no rank and no journal;
rank events, the rendezvous and the control flags are the generation's own.

Three kinds of client, as in a class: the cluster's operator (the embedded cluster's own
client), the job's owner ("alice", another client without the operator token) and a stranger
("bob", the same).
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from distributed import Client
from IPython.core.interactiveshell import InteractiveShell

import nbtrain
from nbtrain import JobState, Settings
from nbtrain.runtime.events import RANK_TOPIC
from tests.conftest import wait_for
from tests.recipes import Regression, launch_secrets_train, regression_train
from tests.test_pages import model, page

OPERATOR_TOKEN = "operator-token-0f3c9a7e5b"


def client_of(address: str) -> nbtrain.Cluster:
    """Another user's client: no operator token, no shared token file."""
    return nbtrain.connect(address, settings=Settings.load(token_file=""), operator_token="")


@pytest.fixture(scope="module")
def owner_only() -> Iterator[nbtrain.Cluster]:
    """A cluster whose controller shows each job's details to its owner only; its operator
    token comes from the environment, as a cluster operator's often does."""
    os.environ["NBTRAIN_OPERATOR_TOKEN"] = OPERATOR_TOKEN
    try:
        cluster = nbtrain.connect(n_workers=2, settings=Settings.load(visibility="owner"))
    finally:
        del os.environ["NBTRAIN_OPERATOR_TOKEN"]
    with cluster as c:
        yield c


def controller(client: Client, attribute: str, *path: str) -> Any:
    """A value held by the controller in the scheduler (for the assertions only)."""
    def read(dask_scheduler: Any) -> Any:
        value = getattr(dask_scheduler.plugins["nbtrain"], attribute)
        for key in path:
            value = value[key] if isinstance(value, dict) else getattr(value, key)
        return value
    return client.run_on_scheduler(read)


def test_a_stranger_sees_only_the_scheduling_facts_of_an_owner_only_job(
        owner_only: nbtrain.Cluster, capsys: pytest.CaptureFixture[str]) -> None:
    with client_of(owner_only.address) as alice, client_of(owner_only.address) as bob:
        job = alice.submit(regression_train, world_size=2, steps=40, name="alice-run",
                           config={"step_sleep": 0.01})
        assert job.wait(180) is JobState.SUCCEEDED, job.reason
        assert len(job.metrics) == 80 and job.result()["steps"] == 40  # the owner reads all
        assert job.hidden == "" and job.checkpoints

        theirs = bob.job("alice-run")
        assert theirs.status is JobState.SUCCEEDED and theirs.owner == job.owner
        assert "only to its owner" in theirs.hidden and "(hidden)" in repr(theirs)
        for read in (lambda h: h.metrics, lambda h: h.events, lambda h: h.logs(),
                     lambda h: h.result(), lambda h: h.checkpoint_dir,
                     lambda h: h.checkpoints):
            with pytest.raises(PermissionError) as refused:
                read(theirs)
            text = str(refused.value)
            assert "alice-run" in text and job.id in text and "token=" in text, text
        listed = {j["name"]: j for j in bob.snapshot()["jobs"]}["alice-run"]
        assert listed["state"] == "SUCCEEDED" and listed["world_size"] == 2
        assert not {"step", "goodput", "faults", "error"} & set(listed), listed
        assert "(hidden)" in repr(next(j for j in bob.jobs if j.name == "alice-run"))

        # the magics say the same in one line each
        shell = InteractiveShell.instance()
        shell.run_line_magic("load_ext", "nbtrain")
        shell.user_ns["bob"] = bob
        try:
            capsys.readouterr()
            shell.run_line_magic("nbtrain", "status alice-run --cluster bob")
            assert "alice-run: SUCCEEDED, owner" in capsys.readouterr().out
            shell.run_line_magic("nbtrain", "jobs --cluster bob")
            assert "(hidden)" in capsys.readouterr().out
            shell.run_line_magic("nbtrain", "stop alice-run --cluster bob")
            assert capsys.readouterr().out.startswith("%nbtrain: job alice-run")
        finally:
            shell.user_ns.pop("bob", None)

        # the page: refused without the owner's ticket, full with it
        with page(theirs.page().url) as doc:
            assert "owner" in model(doc, "nbtrain-refused").text
        with page(job.page().url) as doc:
            assert model(doc, "nbtrain-refused") is None
            assert "alice-run" in model(doc, "nbtrain-header").text
        with page(bob.page().url) as doc:  # the class view: scheduling facts for all
            jobs = model(doc, "cluster-jobs").data
            row = list(jobs["state"]).index("SUCCEEDED")
            assert jobs["progress"][row] == "(hidden)" and jobs["goodput"][row] == ""

        # the token opens it (on a new handle, and on the one that watched without it)
        handed = bob.job("alice-run", token=job.token)
        assert len(handed.metrics) == 80 and handed.checkpoint_dir == job.checkpoint_dir
        theirs.steer_with(job.token)
        assert len(theirs.metrics) == 80 and theirs.checkpoint_dir == job.checkpoint_dir
        assert theirs.hidden == "" and theirs.logs() == job.logs()  # no refusal now
        # ... so does the operator's
        ours = owner_only.job("alice-run")
        assert len(ours.metrics) == 80 and ours.result() == job.result()
    assert len(owner_only.free_slots) == 2


def test_logs_results_and_checkpoints_stay_the_owners_when_all_see_metrics(
        free_cluster: nbtrain.Cluster) -> None:
    with client_of(free_cluster.address) as alice, client_of(free_cluster.address) as bob:
        job = alice.submit(regression_train, world_size=1, steps=20, name="shared-curves")
        assert job.wait(180) is JobState.SUCCEEDED, job.reason
        theirs = bob.job(job.id)
        assert theirs.hidden == "" and len(theirs.metrics) == 20  # visibility="all"
        assert theirs.step == 20
        committed = [e for e in job.events if e.get("phase") == "committed"]
        assert committed and all("url" in e for e in committed)  # the owner sees where
        seen = [e for e in theirs.events if e.get("phase") == "committed"]
        assert len(seen) == len(committed) and not [e for e in seen if "url" in e]
        for read in (lambda h: h.logs(), lambda h: h.result(), lambda h: h.checkpoint_dir):
            with pytest.raises(PermissionError, match="belongs to"):
                read(theirs)
        assert job.result()["steps"] == 20


def test_the_operator_token_reaches_no_rank_no_job_and_no_journal(
        owner_only: nbtrain.Cluster) -> None:
    job = owner_only.submit(launch_secrets_train, world_size=2, steps=5, name="secrets")
    assert job.wait(180) is JobState.SUCCEEDED, job.reason
    found = job.result(trust=True)
    assert found["launches"] >= 1 and set(found["launch_tokens"]) == {""}
    assert not [k for k, v in found["environ"].items() if OPERATOR_TOKEN in v]
    assert OPERATOR_TOKEN not in repr(job.events) + "".join(job.logs())
    client = owner_only.client
    assert controller(client, "settings", "operator_token") == ""
    assert controller(client, "assets", job.id, "settings", "operator_token") == ""
    assert OPERATOR_TOKEN not in repr(owner_only.settings)
    state_dir = Path(controller(client, "store", "dir"))
    with sqlite3.connect(state_dir / "controller.sqlite") as db:  # what the journal holds
        dump = "\n".join(db.iterdump())
    assert "secrets" in dump and OPERATOR_TOKEN not in dump
    assert not [p for p in state_dir.rglob("*") if p.is_file()
                and OPERATOR_TOKEN.encode() in p.read_bytes()]


def test_forged_rank_events_rendezvous_and_control_are_refused(
        free_cluster: nbtrain.Cluster) -> None:
    job = free_cluster.submit(Regression(step_sleep=0.02), world_size=2, steps=10**6,
                              name="forged-to", checkpoint=None)
    stranger = Client(free_cluster.address, set_as_default=False)
    try:
        wait_for(lambda: job.step >= 10, 120, "training")
        gen = job.generation
        fake = {"job": job.id, "generation": gen, "rank": 1, "time": 0.0}
        stranger.log_event(RANK_TOPIC, {**fake, "kind": "failed", "error": "forged failure",
                                        "traceback": "", "step": 1})
        stranger.log_event(RANK_TOPIC, {**fake, "kind": "steps", "rows": [[1] * 12],
                                        "seq": 10**6, "seal": "0" * 32})
        real = next(m for _, m in stranger.get_events(RANK_TOPIC)
                    if m.get("job") == job.id and m.get("kind") == "steps")
        stranger.log_event(RANK_TOPIC, dict(real))  # a replay: its number is spent
        stranger.log_event(RANK_TOPIC, {"job": job.id, "generation": "x", "rank": None})  # junk
        wait_for(lambda: controller(free_cluster.client, "refused_events").get(job.id, 0) >= 4,
                 60, "the forged events to be refused")
        log = free_cluster.snapshot()["log"]
        assert any(e.get("kind") == "refused" and e.get("job") == job.id for e in log)

        rdzv = stranger.sync(stranger.scheduler.nbtrain_rendezvous, job_id=job.id,
                             generation=gen, rank=0, host="10.6.6.6", port=1, timeout=1)
        assert not rdzv["ok"] and "secret" in rdzv["message"], rdzv
        flags = stranger.sync(stranger.scheduler.nbtrain_control, job_id=job.id,
                              generation=gen, version=0, timeout=0.1, secret="guess")
        assert not flags["ok"] and "ranks only" in flags["message"], flags

        step = job.step
        wait_for(lambda: job.step >= step + 10, 120, "training to go on")
        assert job.status is JobState.RUNNING and job.generation == gen and not job.faults
        assert "forged" not in repr(job.events)
    finally:
        stranger.close()
        job.stop()
        assert job.wait(120) is JobState.CANCELLED
    assert len(free_cluster.free_slots) == 2
