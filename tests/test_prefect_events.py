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

NIL = "00000000-0000-0000-0000-000000000000"


def test_shipped_automations_resolve_and_validate():
    items = load()
    assert {a["name"] for a in items} == {
        "nvrx-notify-stage-retry",
        "nvrx-notify-run-failed",
        "nvrx-rerun-on-capacity-restored",
    }
    partial = resolve(items, {"{notify_block}": NIL})
    assert [a["name"] for a in partial.automations] == [
        "nvrx-notify-stage-retry",
        "nvrx-notify-run-failed",
    ]
    assert partial.skipped == {"nvrx-rerun-on-capacity-restored": "needs --deployment"}
    full = resolve(items, {"{notify_block}": NIL, "{deployment}": NIL})
    assert len(full.automations) == 3 and not full.skipped
    assert full.automations[2]["actions"][0]["deployment_id"] == NIL


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


def test_stage_retry_event_fires_the_shipped_automation(prefect_server):
    """The shipped stage-retry automation, applied with a custom-webhook notification block that
    points at a local HTTP endpoint, posts when our event arrives."""
    from prefect import flow
    from prefect.blocks.notifications import CustomWebhookNotificationBlock

    from flows.automations import apply
    from flows.events import emit

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    CustomWebhookNotificationBlock(
        name="nvrx-test",
        url=f"http://127.0.0.1:{server.server_address[1]}/hook",
        json_data={"subject": "{{subject}}", "body": "{{body}}"},
    ).save("nvrx-test", overwrite=True)
    applied, skipped = apply(notify_block="custom-webhook/nvrx-test")
    assert set(applied) == {"nvrx-notify-stage-retry", "nvrx-notify-run-failed"}
    assert skipped == {"nvrx-rerun-on-capacity-restored": "needs --deployment"}
    again, _ = apply(notify_block="custom-webhook/nvrx-test")  # idempotent: replaced, not doubled
    assert set(again) == set(applied) and set(again.values()).isdisjoint(applied.values())
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        assert len(client.read_automations_by_name("nvrx-notify-stage-retry")) == 1
    time.sleep(2)  # the triggers service loads new automations periodically

    @flow(name="emit-stage-retry")
    def emitter() -> None:
        emit("stage.retried", "auto-test", stage="train", attempt=2, cause="node loss: ip-10-0-1-2")

    emitter()
    deadline = time.time() + 60
    while not Hook.received and time.time() < deadline:
        time.sleep(0.5)
    server.shutdown()
    assert Hook.received, "the automation did not fire within 60 s"
    msg = Hook.received[0]
    assert msg["subject"] == "nvrx run auto-test: train stage retried"
    assert "train attempt 2" in msg["body"] and "node loss: ip-10-0-1-2" in msg["body"]
