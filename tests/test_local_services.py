"""`nvrx-pipeline up`/`down` (issue 27): after a run's own process has exited, its flow runs and
report are in a kept Prefect server's UI (read through the API, and opened in headless
Chromium: the report rendered, the timeline plot an image) and its export is pulled from the
kept S3 server, as the README says; `down` leaves no process of either."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests.helpers import REPO, free_port, free_s3_port

pytestmark = pytest.mark.slow

CLI = [sys.executable, "-m", "flows.cli"]


def _cli(args: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


def test_a_finished_run_stays_in_the_ui_and_its_export_in_s3(tmp_path: Path):
    state, port, s3 = tmp_path / "state", free_port(), f"http://127.0.0.1:{free_s3_port()}"
    # A user's shell: none of the test harness's Prefect settings.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    up = _cli(["up", "--state-dir", str(state), "--port", str(port), "--s3-endpoint", s3], env, 240)
    pids = []
    try:
        assert up.returncode == 0, up.stderr[-2000:]
        assert f"Prefect UI: http://127.0.0.1:{port}" in up.stdout and f"S3: {s3}" in up.stdout
        records = (state / "prefect" / "server.json", state / "s3" / "server.json")
        pids = [json.loads(p.read_text())["pid"] for p in records]
        password = _assert_kept_services_need_their_credentials(state, port, s3, up.stdout)
        run = _cli(
            [  # no --s3-endpoint: the kept server is found from the state directory
                *("run", "--state-dir", str(state), "--run-id", "kept"),
                *("--set", "steps=6", "--set", "nodes=1", "--json"),
            ],
            env,
            300,
        )
        assert run.returncode == 0, run.stderr[-3000:]
        assert f"Prefect server: http://127.0.0.1:{port}" in run.stderr  # found without a flag
        # The run's process has exited: what it made is still served.
        api = {
            **env,
            "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
            "PREFECT_API_AUTH_STRING": password,  # as `up` prints it
        }
        probe = subprocess.run(
            [sys.executable, "-c", _READ_BACK],
            env=api,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert probe.returncode == 0, probe.stderr[-2000:]
        seen = json.loads(probe.stdout.strip().splitlines()[-1])
        assert {"kept", "kept: train attempt 1", "kept: export"} <= set(seen["runs"])
        assert seen["report"].startswith("# Run `kept`: completed")
        _open_in_the_ui(f"http://127.0.0.1:{port}", seen["ids"]["kept"], password, tmp_path)
        pulled = _cli(
            [
                *("pull", "s3://nvrx-checkpoints/exports/kept/step_6/", str(tmp_path / "pulled")),
                *("--s3-endpoint", s3, "--state-dir", str(state), "--json"),
            ],
            env,
            120,
        )
        assert pulled.returncode == 0, pulled.stderr[-2000:]
        assert json.loads(pulled.stdout.strip().splitlines()[-1])["verified"] is True
        assert (state / "fsx" / "runs" / "kept" / "report.md").read_text().startswith("# Run")
    finally:
        down = _cli(["down", "--state-dir", str(state)], env, 120)
    assert down.returncode == 0, down.stderr
    assert "Prefect server: stopped" in down.stdout and "S3 server: stopped" in down.stdout
    assert pids and not any(psutil.pid_exists(p) for p in pids), "a kept server outlived down"


def _assert_kept_services_need_their_credentials(
    state: Path, port: int, s3: str, printed: str
) -> str:
    """Neither kept server serves a request without its credentials, which only this user can
    read, and `up` says where they are. The Prefect password, as a client reads it."""
    import httpx

    from tasks.local_services import auth_file
    from tasks.storage.local_keys import keys_of

    password_file, keys = auth_file(state), keys_of(state / "s3").credentials
    assert str(password_file) in printed and str(keys) in printed
    for secret in (password_file, keys, state / "prefect", state / "s3"):
        assert os.stat(secret).st_mode & 0o077 == 0, secret
    api = f"http://127.0.0.1:{port}/api"
    assert httpx.get(f"{api}/health", timeout=10).status_code == 200  # probes stay open
    assert httpx.post(f"{api}/flow_runs/filter", json={}, timeout=10).status_code == 401
    wrong = httpx.post(f"{api}/flow_runs/filter", json={}, auth=("x", "y"), timeout=10)
    assert wrong.status_code == 401
    assert httpx.get(f"{s3}/", timeout=10).status_code == 403  # an unsigned ListBuckets
    password = password_file.read_text().strip()
    basic = {"Authorization": "Basic " + base64.b64encode(password.encode()).decode()}
    assert httpx.post(f"{api}/flow_runs/filter", json={}, headers=basic).status_code == 200
    return password


def _open_in_the_ui(base: str, flow_run_id: str, password: str, tmp: Path) -> None:
    """Headless Chromium on the kept server's UI, the run's own process gone: the link asks
    for the password, then the run's page lists its report and timeline; the report renders
    with its outcome and the timeline is a real image."""
    from playwright.sync_api import expect, sync_playwright

    from tests.test_ui_browser import chromium_path, open_run_report, open_run_timeline

    expect.set_options(timeout=60_000)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium_path(), headless=True)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(60_000)
            page.goto(base)  # the link `up` prints: Prefect's own login page
            login = page.get_by_placeholder("admin:pass")
            login.fill(password)
            page.get_by_role("button", name="Login").click()
            expect(login).to_be_hidden()
            page.goto(f"{base}/runs/flow-run/{flow_run_id}")
            # on a port other than 4200 too: the UI calls its own server's API
            open_run_report(page, r"Run .*kept.*: completed")
            page.screenshot(path=str(tmp / "kept-report.png"), full_page=True)
            open_run_timeline(page)
        finally:
            browser.close()


_READ_BACK = """
import json
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
with get_client(sync_client=True) as c:
    done = [r for r in c.read_flow_runs() if r.state and r.state.is_completed()]
    key = ArtifactFilterKey(any_=["run-report"])
    arts = c.read_artifacts(artifact_filter=ArtifactFilter(key=key))
print(json.dumps({
    "runs": [r.name for r in done],
    "ids": {r.name: str(r.id) for r in done},
    "report": str(arts[0].data) if arts else "",
}))
"""
