"""A cluster secured with Dask's TLS: the controller's own client, the ranks' calls and the
client's all go over mutually authenticated TLS."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from distributed import Security

import nbtrain
from nbtrain import JobState
from tests.conftest import wait_for
from tests.recipes import Regression

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")


def _certificates(tmp: Path) -> Security:
    """A throwaway CA and one certificate it signed, for every role."""
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=tmp)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=test-ca",
        "-keyout", "ca.key", "-out", "ca.pem")
    run("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=dask", "-keyout", "dask.key",
        "-out", "dask.csr")
    (tmp / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    run("x509", "-req", "-in", "dask.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
        "-CAcreateserial", "-days", "1", "-extfile", "ext.cnf", "-out", "dask.pem")
    cert, key, ca = (str(tmp / n) for n in ("dask.pem", "dask.key", "ca.pem"))
    return Security(tls_ca_file=ca, tls_client_cert=cert, tls_client_key=key,
                    tls_scheduler_cert=cert, tls_scheduler_key=key, tls_worker_cert=cert,
                    tls_worker_key=key, require_encryption=True)


def test_job_runs_on_a_tls_cluster(tmp_path: Path) -> None:
    security = _certificates(tmp_path)
    with nbtrain.connect(n_workers=2, security=security, protocol="tls://") as c:
        assert c.address.startswith("tls://127.0.0.1:")
        job = c.submit(Regression(step_sleep=0.01), world_size=2, steps=10**6)
        wait_for(lambda: job.step >= 5, 120, "training over TLS")
        job.stop()  # a request over TLS
        assert job.wait(120) is JobState.CANCELLED
        assert len(job.metrics) >= 10
        assert [j.id for j in c.jobs] == [job.id]
