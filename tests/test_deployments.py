"""Deployments: ``nvrx-pipeline serve`` against a real Prefect server; a run created through the
endpoint the UI's Run button calls completes with the overridden parameter; bad parameters are
rejected naming the field. Plus the static ``deploy/prefect.yaml``."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from flows.deployments import NIGHTLY, NIGHTLY_CRON, ON_DEMAND
from flows.models import PipelineParams, PipelineResult
from tests.helpers import REPO

pytestmark = pytest.mark.slow
FLOW = "nvrx-training-pipeline"


def test_prefect_yaml_matches_served_deployments():
    spec = yaml.safe_load((REPO / "deploy" / "prefect.yaml").read_text())
    deps = {d["name"]: d for d in spec["deployments"]}
    assert set(deps) == {ON_DEMAND, NIGHTLY}
    for d in deps.values():
        module, _, func = d["entrypoint"].partition(":")
        assert (REPO / module).is_file() and func == "training_pipeline"
        PipelineParams(**d["parameters"]["params"])  # defaults are valid parameters
        assert d["work_pool"]["name"] == "nvrx-local"
    assert deps[NIGHTLY]["schedules"][0]["cron"] == NIGHTLY_CRON


@pytest.fixture
def served(prefect_server: str, tmp_path: Path):
    env = dict(os.environ)
    env.update(
        PREFECT_API_URL=prefect_server,
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_RUNNER_POLL_FREQUENCY="2",
        PYTHONPATH=str(REPO),
        TORCH_CPP_LOG_LEVEL="ERROR",
    )
    log = open(tmp_path / "serve.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "flows.cli", "serve"],
        cwd=REPO,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        yield proc
    finally:
        # Stop the runner before the server goes away (else it hangs on shutdown).
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def _deployment_id(api: httpx.Client, name: str, deadline: float) -> str:
    while time.time() < deadline:
        r = api.get(f"/deployments/name/{FLOW}/{name}")
        if r.status_code == 200:
            return str(r.json()["id"])
        time.sleep(1)
    raise AssertionError(f"deployment {FLOW}/{name} never appeared")


def _wait_final(api: httpx.Client, flow_run_id: str, deadline: float) -> dict[str, Any]:
    while time.time() < deadline:
        run = api.get(f"/flow_runs/{flow_run_id}").json()
        if run["state"]["type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
            return dict(run)
        time.sleep(2)
    raise AssertionError("flow run did not finish in time")


def test_run_button_endpoint(served, prefect_server: str, s3_settings, tmp_path: Path):
    deadline = time.time() + 420
    with httpx.Client(base_url=prefect_server, timeout=30) as api:
        dep_id = _deployment_id(api, ON_DEMAND, deadline)
        assert _deployment_id(api, NIGHTLY, deadline)
        nightly = api.get(f"/deployments/name/{FLOW}/{NIGHTLY}").json()
        assert any(s["schedule"].get("cron") == NIGHTLY_CRON for s in nightly["schedules"])

        # Bad parameters: rejected by the server, naming the field.
        bad = api.post(
            f"/deployments/{dep_id}/create_flow_run", json={"parameters": {"params": {"steps": 0}}}
        )
        assert bad.status_code in (409, 422), bad.text
        assert "steps" in bad.text

        override = {
            "run_id": "via-run-button",
            "steps": 10,
            "state_dir": str(tmp_path / "state"),
            "s3_endpoint": s3_settings.endpoint_url,
        }
        r = api.post(
            f"/deployments/{dep_id}/create_flow_run", json={"parameters": {"params": override}}
        )
        assert r.status_code == 201, r.text
        run = _wait_final(api, r.json()["id"], deadline)
    log = (tmp_path / "serve.log").read_text()
    assert run["state"]["type"] == "COMPLETED", (run["state"], log[-4000:])
    assert run["parameters"]["params"]["steps"] == 10
    result_file = tmp_path / "state" / "fsx" / "runs" / "via-run-button" / "pipeline_result.json"
    result = PipelineResult.model_validate_json(result_file.read_text())
    assert result.status == "completed" and result.final_step == 10 and result.export.verified
