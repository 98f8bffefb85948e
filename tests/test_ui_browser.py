"""The Prefect UI path, in a real browser: a real ``prefect server`` (SQLite) and
``nvrx-pipeline serve`` on 127.0.0.1, headless Chromium (Debian's ``chromium``, driven by
Playwright against that binary). The test opens the deployment's custom-run form, changes one
parameter, submits, and checks that the flow run completes with that parameter and that its page
shows our artifacts. The same server also rejects bad parameters through the API the Run button
calls, naming the field.

Screenshots of the form and of the finished run's artifacts land in the test's tmp dir; set
``NVRX_SCREENSHOT_DIR=docs/img`` to refresh the ones the README shows.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from flows.deployments import NIGHTLY, NIGHTLY_CRON, ON_DEMAND
from flows.models import PipelineResult
from flows.pipeline import run_id_of_flow_run
from tests.helpers import REPO

pytestmark = pytest.mark.slow
FLOW = "nvrx-training-pipeline"
DEFAULT_STEPS = 20  # the served deployments' default; the form changes it
FORM_STEPS = 10
FAULT = "exception@step=4,rank=1"
FLOW_RUN_ARTIFACTS = ("run-report", "recovery-timeline")
STAGE_ARTIFACTS = [
    "preflight",
    "hydrate-progress",
    "train-progress",
    "validation",
    *(f"{stage}-result" for stage in ("preflight", "hydrate", "train", "validate", "export")),
    "export",  # the link to the exported prefix
]


def chromium_path() -> str:
    path = os.environ.get("NVRX_CHROMIUM") or shutil.which("chromium")
    if not path:
        pytest.fail(
            "no chromium on PATH: `make browser` installs Debian's chromium "
            "(or point NVRX_CHROMIUM at a Chromium binary)"
        )
    return path


def _stop(proc: subprocess.Popen[bytes], grace_s: float) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _spawn(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as f:
        return subprocess.Popen(
            args, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )


@pytest.fixture(scope="module")
def ui_stack(s3_settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """``prefect server start`` (its own SQLite home, the UI included) plus the served
    deployments, whose defaults point at this test's state dir and S3 server."""
    from tasks.backends.local_nodes import free_port

    tmp = tmp_path_factory.mktemp("ui")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    # Nothing of the test harness's Prefect settings: this stack has its own server and home.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(
        PREFECT_HOME=str(tmp / "prefect-home"),
        PREFECT_API_URL=f"{base}/api",
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_RUNNER_POLL_FREQUENCY="1",  # the submitted run picked up within a second
        PYTHONPATH=str(REPO),
        TORCH_CPP_LOG_LEVEL="ERROR",
    )
    bin_dir = Path(sys.executable).parent
    server = _spawn(
        [str(bin_dir / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env,
        tmp / "server.log",
    )
    serve = None
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base}/api/health", timeout=2).status_code == 200:
                    break
            assert server.poll() is None, (tmp / "server.log").read_text()[-3000:]
            time.sleep(0.5)
        else:
            raise AssertionError("prefect server did not come up in 120 s")
        state = tmp / "state"
        # The served defaults: this test's state dir and S3 server, plus one fault drill so the
        # finished run's report has a fault and its recovery layer to show.
        defaults = tmp / "defaults.yaml"
        defaults.write_text(
            yaml.safe_dump(
                {
                    "state_dir": str(state),
                    "s3_endpoint": s3_settings.endpoint_url,
                    "drills": {"faults": [FAULT]},
                }
            )
        )
        serve = _spawn(
            [
                sys.executable,
                "-m",
                "flows.cli",
                "serve",
                "--config",
                str(defaults),
                "--set",
                f"steps={DEFAULT_STEPS}",
            ],
            env,
            tmp / "serve.log",
        )
        yield {"base": base, "state": state, "tmp": tmp}
    finally:
        # The runner goes before the server (else its shutdown hangs on the missing API).
        if serve is not None:
            _stop(serve, 20)
        _stop(server, 30)


def form_field(page: Any, label: str) -> Any:
    """One field of Prefect's run form. Its <label for> does not name the input, so the field is
    the innermost ``.p-label`` whose label is exactly ``label`` (outer ones are whole objects)."""
    text = re.compile(rf"^{re.escape(label)}$")
    return page.locator(".p-label").filter(has=page.locator(".p-label__label", has_text=text)).last


def open_run_report(page: Any, heading: str, shot: Path | None = None) -> None:
    """On a finished flow run's page: its Artifacts tab lists the report and the timeline
    (``shot``: a screenshot of that list), and the report opens, rendered, with ``heading``."""
    from playwright.sync_api import expect

    page.get_by_text("Artifacts", exact=True).first.click()
    for key in FLOW_RUN_ARTIFACTS:
        expect(page.get_by_text(key, exact=True).first).to_be_visible()
    if shot is not None:
        page.screenshot(path=str(shot))
    page.get_by_text("run-report", exact=True).first.click()
    page.wait_for_url("**/artifacts/artifact/*")
    expect(page.get_by_role("heading", name=re.compile(heading))).to_be_visible()


def open_run_timeline(page: Any) -> None:
    """Back from the report: the recovery-timeline artifact is the PNG itself, a real image."""
    from playwright.sync_api import expect

    page.go_back()
    page.get_by_text("Artifacts", exact=True).first.click()
    page.get_by_text("recovery-timeline", exact=True).first.click()
    page.wait_for_url("**/artifacts/artifact/*")
    img = page.locator("img[src^='data:image/png']")
    expect(img).to_be_visible()
    assert img.evaluate("e => e.naturalWidth") > 200


def _deployment(api: httpx.Client, name: str, deadline: float) -> dict[str, Any]:
    while time.time() < deadline:
        r = api.get(f"/deployments/name/{FLOW}/{name}")
        if r.status_code == 200:
            return dict(r.json())
        time.sleep(1)
    raise AssertionError(f"deployment {FLOW}/{name} never appeared")


def _wait_final(api: httpx.Client, flow_run_id: str, deadline: float) -> dict[str, Any]:
    while time.time() < deadline:
        run = api.get(f"/flow_runs/{flow_run_id}").json()
        if run["state"]["type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
            return dict(run)
        time.sleep(0.5)  # a read of one flow run: cheap, and the test waits on nothing else
    raise AssertionError("flow run did not finish in time")


def _runs_of(api: httpx.Client, deployment_id: str) -> list[dict[str, Any]]:
    body = {"deployments": {"id": {"any_": [deployment_id]}}}
    r = api.post("/flow_runs/filter", json=body)
    r.raise_for_status()
    return list(r.json())


def _submit(page: Any, api: httpx.Client, deployment_id: str, shot: Path) -> None:
    """Press the form's Submit as a person would: once, and once more only if, a minute later,
    the UI is still on the form and the server has no run of the deployment (CI saw a press on
    a loaded 2-core machine go nowhere: no run, no navigation). Never two runs."""
    button = page.get_by_role("button", name="Submit")
    button.click()
    deadline = time.time() + 60
    while time.time() < deadline:
        on_form = page.url.split("?")[0].rstrip("/").endswith("/run")
        if not on_form or _runs_of(api, deployment_id):
            return
        time.sleep(1)
    page.screenshot(path=str(shot), full_page=True)  # what the form showed, for the record
    assert not _runs_of(api, deployment_id)
    button.click()


def test_custom_run_from_the_ui(ui_stack: dict[str, Any], s3_settings) -> None:
    from playwright.sync_api import expect, sync_playwright

    base, tmp = ui_stack["base"], ui_stack["tmp"]
    shots = Path(os.environ.get("NVRX_SCREENSHOT_DIR") or tmp)
    shots.mkdir(parents=True, exist_ok=True)
    deadline = time.time() + 420
    with httpx.Client(base_url=f"{base}/api", timeout=30) as api:
        dep = _deployment(api, ON_DEMAND, deadline)
        nightly = _deployment(api, NIGHTLY, deadline)
        assert any(s["schedule"].get("cron") == NIGHTLY_CRON for s in nightly["schedules"])
        assert dep["parameters"]["steps"] == DEFAULT_STEPS

        # What the Run button's endpoint does with a bad value: rejected, naming the field.
        bad = api.post(
            f"/deployments/{dep['id']}/create_flow_run",
            json={"parameters": {"steps": 0}},
        )
        assert bad.status_code in (409, 422), bad.text
        assert "steps" in bad.text

        # Assertions wait as long as actions do: a loaded 2-core CI machine renders slowly.
        expect.set_options(timeout=60_000)
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium_path(), headless=True)
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                page.set_default_timeout(60_000)
                page.goto(f"{base}/deployments/deployment/{dep['id']}/run")
                # A top-level flow parameter: Prefect labels it by its name.
                steps = form_field(page, "steps (Optional)").get_by_role("spinbutton")
                expect(steps).to_have_value(str(DEFAULT_STEPS))  # the form shows served defaults
                steps.fill(str(FORM_STEPS))
                page.screenshot(path=str(shots / "ui-custom-run-form.png"))
                run_name = form_field(page, "Run Name").locator("input").input_value()
                assert run_name
                _submit(page, api, dep["id"], shots / "ui-after-submit.png")
                # The UI goes back to the deployment; its run list links the new run by name:
                # the form's name until the runner starts it, then the run id it was renamed to
                # (the only run this server has seen, so either name is this run).
                page.wait_for_url("**/deployments/deployment/*")
                either = re.compile(rf"^({re.escape(run_name)}|run-[0-9a-f]{{12}})$")
                page.get_by_role("link", name=either).first.click()
                page.wait_for_url("**/runs/flow-run/*")
                flow_run_id = page.url.rstrip("/").split("/")[-1].split("?")[0]

                run = _wait_final(api, flow_run_id, deadline)
                serve_log = (tmp / "serve.log").read_text()
                assert run["state"]["type"] == "COMPLETED", (run["state"], serve_log[-4000:])
                assert run["deployment_id"] == dep["id"]
                assert run["parameters"]["steps"] == FORM_STEPS
                # No run id in the form: the run id is derived from the flow run, which bears it.
                assert run["name"] == run_id_of_flow_run(flow_run_id), run["name"]

                # The finished run's Artifacts tab shows the report and the timeline image;
                # the report, rendered: the outcome first, then the fault and its layer.
                page.reload()
                open_run_report(page, r"Run .*: completed", shots / "ui-run-artifacts.png")
                row = page.get_by_role("row").filter(has_text="exception")
                expect(row).to_contain_text("inprocess")
                expect(row).to_contain_text("4")
                page.screenshot(path=str(shots / "ui-run-report.png"), full_page=True)
                open_run_timeline(page)
                # What the export stage returned, on its own flow run's page, and the link.
                (exported,) = api.post(
                    "/artifacts/filter", json={"artifacts": {"key": {"any_": ["export-result"]}}}
                ).json()
                page.goto(f"{base}/runs/flow-run/{exported['flow_run_id']}")
                page.get_by_text("Artifacts", exact=True).first.click()
                for key in ("export-result", "export"):
                    expect(page.get_by_text(key, exact=True).first).to_be_visible()
                page.get_by_text("export-result", exact=True).first.click()
                page.wait_for_url("**/artifacts/artifact/*")
                expect(page.get_by_text('"verified": true').first).to_be_visible()
            finally:
                browser.close()

        # The stages' artifacts, on their subflow runs (the only run this server has seen).
        arts = api.post("/artifacts/filter", json={"artifacts": {"key": {"any_": STAGE_ARTIFACTS}}})
        assert sorted({a["key"] for a in arts.json()}) == sorted(STAGE_ARTIFACTS), arts.text

    # The run itself: the state dir and S3 server the served defaults named, the form's steps.
    results = list((ui_stack["state"] / "fsx" / "runs").glob("*/pipeline_result.json"))
    assert len(results) == 1, results
    result = PipelineResult.model_validate_json(results[0].read_text())
    assert result.status == "completed" and result.final_step == FORM_STEPS
    assert result.run_id == run_id_of_flow_run(flow_run_id)
    assert [(f.kind, f.step, f.recovered_by) for f in result.faults] == [
        ("exception", 4, "inprocess")
    ]
    assert result.export.verified
