"""Our Prefect events and the shipped automations, against the Prefect test server."""

from __future__ import annotations

import http.server
import json
import threading
import time
from pathlib import Path
from typing import Any, ClassVar

import pytest

from flows.automations import AutomationConfigError, load, resolve
from tests.conftest import UI_URL

NIL = "00000000-0000-0000-0000-000000000000"


NAMES = [
    "nvrx-notify-stage-retry",
    "nvrx-notify-run-failed",
    "nvrx-notify-run-crashed",
    "nvrx-notify-no-checkpoint",
    "nvrx-resume-on-capacity-restored",
]


def test_shipped_automations_resolve_and_validate():
    from flows.automations import NOT_RESUMED, resume_parameters, stall_ids
    from flows.models import PipelineParams

    items = load()
    assert [a["name"] for a in items] == NAMES
    stall = stall_ids(30)
    partial = resolve(items, {"{notify_block}": NIL, **stall})
    assert [a["name"] for a in partial.automations] == NAMES[:4]
    assert partial.skipped == {"nvrx-resume-on-capacity-restored": "needs --deployment"}
    full = resolve(
        items,
        {"{notify_block}": NIL, "{deployment}": NIL, "{resume_parameters}": resume_parameters()}
        | stall,
    )
    assert [a["name"] for a in full.automations] == NAMES and not full.skipped
    by_name = {a["name"]: a for a in full.automations}
    assert by_name["nvrx-notify-no-checkpoint"]["trigger"]["within"] == 1800
    resume = by_name["nvrx-resume-on-capacity-restored"]
    action = resume["actions"][0]
    assert action["deployment_id"] == NIL
    # Every flow parameter of the failed run is carried over but its drills (NOT_RESUMED: a
    # resume injects none), none left to the defaults; each is validated again by the flow.
    assert set(action["parameters"]) == set(PipelineParams.model_fields) - NOT_RESUMED
    assert {"drills"} == NOT_RESUMED
    first = resume["trigger"]["triggers"][0]
    assert first["match_related"] == {"prefect.resource.id": f"prefect.deployment.{NIL}"}
    with pytest.raises(AutomationConfigError, match="checkpoint-stall-minutes"):
        stall_ids(0.1)


# Event text as a hostile run could shape it: (name, text, what bounded_text makes of it; None:
# checked by length only).
HOSTILE = [
    ("markdown", "*bold* `code` [click](http://evil)", "*bold* `code` [click](http://evil)"),
    ("html", "<script>alert(1)</script>", "<script>alert(1)</script>"),
    ("slack mention", "<!channel> <http://evil|click>", "<!channel> <http://evil|click>"),
    ("jinja", "{{ 7*7 }} {% if 1 %}x{% endif %}", "{{ 7*7 }} {% if 1 %}x{% endif %}"),
    ("forged line", "ok\r\nRe-run: http://evil", "ok Re-run: http://evil"),
    ("terminal escape", "\x1b[31mred\x07", " [31mred "),
    ("bidi override", "abc\u202edcba\u2066x", "abc dcba x"),
    ("1 MB", "x" * (1 << 20), None),
]


@pytest.mark.parametrize(("text", "want"), [h[1:] for h in HOSTILE], ids=[h[0] for h in HOSTILE])
def test_event_text_is_bounded_and_one_line(text: str, want: str | None):
    from flows.events import TEXT_LIMIT, bounded_text

    got = bounded_text(text)
    if want is not None:
        assert got == want
    else:
        assert got == "x" * TEXT_LIMIT + f"… ({len(text) - TEXT_LIMIT} more characters)"


@pytest.mark.parametrize("text", [h[1] for h in HOSTILE], ids=[h[0] for h in HOSTILE])
def test_notifications_render_hostile_text_as_bounded_inert_text(text: str):
    """Every shipped notification, rendered by Prefect's own template renderer from an event
    whose free text is hostile (ours as emitted, Prefect's state message as it comes), then
    converted for Slack by Apprise as the notification block sends it."""
    import apprise
    from prefect.server.utilities.user_templates import render_user_template_sync

    from flows.events import bounded_text

    slack = apprise.Apprise.instantiate("slack://T1ABCDEFG/A1BRTD4JD/TIiajkdnlazkcOXrIdevi7FQ/")

    def context(cause: str) -> dict[str, Any]:
        payload = {"cause": bounded_text(cause), "stage": "train", "step": 7, "attempt": 2}
        event = {"resource": {"name": "r1"}, "payload": payload, "occurred": "t", "event": "e"}
        state = {"name": "Crashed", "message": cause}  # Prefect's own: not bounded by us
        return {"event": event, "flow_run": {"name": "fr", "state": state}}

    for automation in load():
        for action in automation["actions"]:
            if action["type"] != "send-notification":
                continue
            # ui_url is a filter of Prefect's action renderer only: not what is tested here.
            body = action["body"].replace("{{ flow_run|ui_url }}", "URL")
            benign = render_user_template_sync(body, context("a cause"))
            got = render_user_template_sync(body, context(text))
            assert len(got) <= len(benign) + 1100, automation["name"]
            assert got.count("\n") == benign.count("\n"), automation["name"]  # no forged line
            assert "49" not in got  # the payload's template syntax is not evaluated
            assert not any(c in got for c in "\x1b\x07\u202e")
            assert "<!channel>" not in slack.dialect_convert(got, apprise.NotifyFormat.TEXT)


def test_bad_automation_file_names_the_problem(tmp_path: Path):
    bad = tmp_path / "a.yaml"
    bad.write_text(
        "automations:\n  - name: x\n    trigger: {type: event, expect: [a]}\n"
        "    actions: [{type: send-notification}]\n"
    )
    with pytest.raises(AutomationConfigError, match="automation 'x' is invalid"):
        resolve(load(bad), {})
    bad.write_text("automations: {}\n")
    with pytest.raises(AutomationConfigError, match="expected `automations:` as a list"):
        load(bad)


class Hook(http.server.BaseHTTPRequestHandler):
    received: ClassVar[list[dict[str, Any]]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        Hook.received.append(json.loads(body))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


STALL_MINUTES = 0.25  # the proactive window: 15 s, so the test waits little


@pytest.fixture(scope="module")
def automations(prefect_server, s3_settings, tmp_path_factory):
    """Every shipped automation applied to the test server, notifying a custom-webhook block
    that posts to a local HTTP endpoint, resuming runs of a real deployment of the pipeline."""
    from prefect.blocks.notifications import CustomWebhookNotificationBlock

    from flows.automations import apply
    from flows.deployments import default_parameters
    from flows.pipeline import training_pipeline
    from tests.pipeline_helpers import make_params

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    CustomWebhookNotificationBlock(
        name="nvrx-test",
        url=f"http://127.0.0.1:{server.server_address[1]}/hook",
        json_data={"subject": "{{subject}}", "body": "{{body}}"},
    ).save("nvrx-test", overwrite=True)
    state = tmp_path_factory.mktemp("automations")
    # The capacity test's failed run drills a node loss: a deployment's runs inject only the
    # drills their deployment allows (tasks.deployment_policy).
    allow = pytest.MonkeyPatch()
    allow.setenv("NVRX_ALLOWED_DRILLS", "node-loss")
    dep_id = training_pipeline.to_deployment(
        name="resume-test", parameters=default_parameters(make_params(state, s3_settings))
    ).apply()
    kw = {
        "notify_block": "custom-webhook/nvrx-test",
        "deployment": "nvrx-training-pipeline/resume-test",
        "checkpoint_stall_minutes": STALL_MINUTES,
    }
    applied, skipped = apply(**kw)
    assert list(applied) == NAMES and not skipped
    again, _ = apply(**kw)  # idempotent: replaced, not doubled
    assert set(again.values()).isdisjoint(applied.values())
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        assert len(client.read_automations_by_name("nvrx-notify-stage-retry")) == 1
    time.sleep(2)  # the triggers service loads new automations periodically
    yield {"deployment_id": str(dep_id), "state": state}
    server.shutdown()
    allow.undo()


def _message(where: str, timeout: float = 60) -> dict[str, Any]:
    deadline = time.time() + timeout
    while time.time() < deadline:
        for msg in Hook.received:
            if where in msg["subject"]:
                return msg
        time.sleep(0.5)
    raise AssertionError(f"no notification about {where!r} within {timeout} s: {Hook.received}")


def _emit_in_a_flow(*events: tuple[str, str, dict[str, Any]]) -> str:
    from prefect import flow
    from prefect.runtime import flow_run

    from flows.events import emit

    @flow(name="emit-nvrx-events")
    def emitter() -> str:
        for name, run_id, payload in events:
            emit(name, run_id, **payload)
        return str(flow_run.get_id())

    return emitter()


def test_stage_retry_notifies_with_a_link_to_the_run(automations):
    flow_run_id = _emit_in_a_flow(
        ("stage.retried", "auto-test", {"stage": "train", "attempt": 2, "cause": "node loss: n2"})
    )
    msg = _message("auto-test: train stage retried")
    assert "train attempt 2" in msg["body"] and "node loss: n2" in msg["body"]
    assert f"{UI_URL}/runs/flow-run/{flow_run_id}" in msg["body"]  # the run's page in the UI


def test_a_crashed_flow_run_notifies_from_prefects_own_state_event(automations):
    """The flow's process died (OOM): it could emit nothing. The runner (here: the test, through
    the same API call) sets the Crashed state, and Prefect's state event notifies."""
    from prefect.client.orchestration import get_client
    from prefect.states import Crashed, Running

    from flows.pipeline import training_pipeline

    with get_client(sync_client=True) as client:
        fr = client.create_flow_run(training_pipeline, name="crash-test", parameters={})
        client.set_flow_run_state(fr.id, Running(), force=True)
        client.set_flow_run_state(fr.id, Crashed(message="process exited -9 (OOM)"), force=True)
    msg = _message("crash-test Crashed")
    assert "process exited -9 (OOM)" in msg["body"]
    assert f"{UI_URL}/runs/flow-run/{fr.id}" in msg["body"]


def test_no_checkpoint_for_n_minutes_notifies(automations):
    """A run that started training and commits nothing is reported after the window; one whose
    attempt ended is not."""
    _emit_in_a_flow(
        ("train.started", "stalled-run", {"attempt": 1}),
        ("train.started", "ended-run", {"attempt": 1}),
        ("train.ended", "ended-run", {"attempt": 1, "outcome": "completed"}),
    )
    msg = _message("stalled-run: no checkpoint", timeout=STALL_MINUTES * 60 + 45)
    assert "nvrx.train.started" in msg["body"] and "/runs/flow-run/" in msg["body"]
    time.sleep(5)  # the same window for the other run has passed by now
    assert not [m for m in Hook.received if "ended-run" in m["subject"]]


@pytest.mark.slow
def test_capacity_restored_resumes_the_failed_run(automations, s3_settings):
    """A run of the deployment fails for want of nodes (a node lost, no attempts left). When
    capacity comes back, the automation runs the deployment with that run's own parameters:
    the same run id, resumed from its newest valid checkpoint, to the end."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
    from prefect.flow_engine import run_flow

    from flows.context import RunContext
    from flows.pipeline import training_pipeline
    from tests.helpers import read_events
    from tests.pipeline_helpers import make_params

    dep_id = automations["deployment_id"]
    custom = {  # a custom run: its own steps and drill, not the deployment's defaults
        "run_id": "capacity-test",
        "steps": 15,
        "max_train_attempts": 1,
        "drills": {"faults": ["node-loss@step=12,node=1"]},
    }
    with get_client(sync_client=True) as client:
        failed = client.create_flow_run_from_deployment(dep_id, parameters=custom)
    state = run_flow(
        training_pipeline, flow_run=failed, parameters=failed.parameters, return_type="state"
    )
    assert state.is_failed() and "NodeLost" in str(state.message), state.message

    from prefect import flow
    from prefect.events import emit_event

    @flow(name="node-group-watcher")
    def capacity_back() -> None:  # what watches the node group emits this (about the cluster)
        emit_event(
            event="nvrx.capacity.restored", resource={"prefect.resource.id": "nvrx.cluster.test"}
        )

    capacity_back()
    deadline = time.time() + 60
    resumed = None
    while resumed is None and time.time() < deadline:
        with get_client(sync_client=True) as client:
            runs = client.read_flow_runs(
                deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[dep_id]))
            )
        resumed = next((r for r in runs if r.id != failed.id), None)
        time.sleep(1)
    assert resumed is not None, "the automation created no flow run within 60 s"
    # The run's own values, but no drill: the resume copies none (automations.NOT_RESUMED),
    # so the run has its deployment's own (none here).
    assert resumed.parameters["drills"] == {"faults": []}
    own = {k: v for k, v in custom.items() if k != "drills"}
    assert {k: resumed.parameters[k] for k in own} == own
    state = run_flow(
        training_pipeline, flow_run=resumed, parameters=resumed.parameters, return_type="state"
    )
    assert state.is_completed(), state.message
    result = state.result()
    assert result.run_id == "capacity-test" and result.final_step == 15
    params = make_params(automations["state"], s3_settings, **custom)
    events = read_events(RunContext.create(params).run_root)
    loaded = [
        i for i, e in enumerate(events) if e["kind"] == "resume" and e.get("action") == "loaded"
    ]
    assert loaded, "the resumed run loaded a checkpoint"
    # The newest commit before the loss, not a fixed step: the loss at step 12 may come before
    # step 10's async save has committed (it commits once step 15's save starts; one full run
    # here resumed from step 5).
    committed = [e["step"] for e in events[: loaded[-1]] if e["kind"] == "checkpoint"]
    assert committed and events[loaded[-1]]["step"] == max(committed) >= 5
