"""The whole pipeline on the embedded default, against real parts: the Prefect test server,
SeaweedFS over HTTP, real ft_launcher agents as simulated nodes."""

from __future__ import annotations

import itertools
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from flows.context import RunContext
from flows.models import PipelineResult
from tasks.storage.s3 import boto3_client
from tests.helpers import free_port_pair
from tests.pipeline_helpers import (
    Scraper,
    assert_exported,
    make_params,
    nvrx_events,
    run_pipeline,
)
from trainer import manifest
from trainer.events import read_events
from trainer.faults import flip_bytes

pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class Scenario:
    name: str
    faults: tuple[str, ...]
    train_attempts: int
    recovered_by: str | None


# The stage retry, with the events, report, status and metrics it produces. The other layers'
# pipeline runs are tests/test_workload_pipeline.py's (llama-tiny: exception, SIGKILL and node
# loss; script mode: SIGKILL and node loss; all bitwise); a hang and a late SIGKILL are
# recovered by the same in-job layer, and their own drills (tests/test_fault_drills.py) check
# them bitwise. The CI budget has no room for more pipeline runs here.
SCENARIOS = [
    # Node 0: rank 0 and the rendezvous store, which NVRx cannot replace in-job. Node 1's loss
    # goes through the same pipeline in tests/test_workload_pipeline.py.
    Scenario("node-loss", ("node-loss@step=12,node=0",), 2, "stage-retry"),
]


def assert_report_and_status(result: PipelineResult, params: Any, state: Path, capsys) -> None:
    """The run report artifact and `nvrx-pipeline status` agree with the events file."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from flows.cli import main
    from tasks import run_summary

    events = read_events(RunContext.create(params).run_root)
    ettr = run_summary.ettr(events)
    assert ettr is not None and result.ettr == ettr
    with get_client(sync_client=True) as client:
        arts = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["run-report"]))
        )
    [report] = [a for a in arts if f"# Run `{result.run_id}`: completed" in str(a.data)]
    text = str(report.data)
    assert text.index("completed") < text.index("## Stage timeline") < text.index("## Faults")
    assert f"**{ettr:.3f}**" in text
    for f in run_summary.faults_with_recovery(events):
        assert f"| {f['kind']} | {f['step']} |" in text and f"| {f['recovered_by']} |" in text
    capsys.readouterr()
    assert main(["status", result.run_id, "--state-dir", str(state), "--json"]) == 0
    st = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert st["state"] == "completed" and st["step"] == 20 and st["ettr"] == ettr
    assert [f["recovered_by"] for f in st["faults"]] == [f.recovered_by for f in result.faults]


@pytest.mark.parametrize("sc", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_pipeline_recovers(
    sc: Scenario, baseline: PipelineResult, s3_settings, tmp_path: Path, capsys
):
    port = free_port_pair()
    params = make_params(
        tmp_path,
        s3_settings,
        run_id=f"drill-{sc.name}",
        drills={"faults": list(sc.faults)},
        metrics_port=port,
    )
    flow, rank0 = (f"http://127.0.0.1:{p}/metrics" for p in (port, port + 1))
    with Scraper(flow, rank0) as scraped:
        state, result = run_pipeline(params)
    assert state.is_completed(), state.message
    assert result is not None
    assert result.final_step == result.target_steps == 20
    assert result.params_sha256 == baseline.params_sha256
    assert result.stage_attempts["train"] == sc.train_attempts
    assert [(f.kind, f.recovered_by) for f in result.faults] == [
        (sc.faults[0].split("@")[0], sc.recovered_by)
    ]
    assert result.faults[0].recovery_s and result.faults[0].recovery_s > 0
    if sc.faults[0].startswith("node-loss"):
        # nodes=2 is 2:2: one node left is fewer than the minimum, and node 0 hosted the
        # rendezvous store: the watcher chose the stage retry at the loss (tasks.loss_policy).
        assert result.faults[0].path == "stage-retry" and result.faults[0].detail
    run_events = read_events(RunContext.create(params).run_root)
    assert [e["fault"] for e in run_events if e["kind"] == "fault"] == list(sc.faults)  # once
    loaded = [e for e in run_events if e["kind"] == "resume" and e.get("action") == "loaded"]
    fault_step = int(sc.faults[0].split("step=")[1].split(",")[0])
    assert loaded and 5 <= loaded[-1]["step"] < fault_step, "resume from a committed checkpoint"
    assert_exported(result, s3_settings)
    # What operators' automations see: Prefect events about the run, tied to its flow runs.
    events = nvrx_events(params.run_id or "", expect="nvrx.run.completed")
    by_name: dict[str, list[Any]] = {}
    for e in events:
        by_name.setdefault(e.event, []).append(e)
    [fault] = by_name["nvrx.fault.detected"]
    assert fault.payload["kind"] == sc.faults[0].split("@")[0] and fault.payload["step"]
    [recovery] = by_name["nvrx.recovery.completed"]
    assert recovery.payload["layer"] == sc.recovered_by and recovery.payload["seconds"] > 0
    assert len(by_name.get("nvrx.stage.retried", [])) == sc.train_attempts - 1
    if sc.train_attempts == 2:
        retried = by_name["nvrx.stage.retried"][0].payload
        assert retried["attempt"] == 2 and "node" in retried["cause"]
    assert [e.payload["step"] for e in by_name["nvrx.checkpoint.committed"]][-1] == 20
    [export] = by_name["nvrx.export.completed"]
    assert export.payload["uri"] == result.export.uri
    assert export.payload["bytes"] == result.export.bytes
    assert all(any(r.get("prefect.resource.role") == "flow-run" for r in e.related) for e in events)
    assert_report_and_status(result, params, tmp_path, capsys)
    # Prometheus: the restart under its layer on the flow's endpoint; rank 0's endpoint served
    # by the process that replaced the killed one (its step counter starts over).
    run_id = params.run_id or ""
    restarts = {
        layer: scraped.series(flow, "nvrx_restarts_total", run_id=run_id, layer=layer)[-1]
        for layer in ("inprocess", "injob", "stage-retry")
    }
    assert restarts == {layer: int(layer == sc.recovered_by) for layer in restarts}
    steps = scraped.series(rank0, "nvrx_train_steps_total", run_id=run_id)
    assert any(b < a for a, b in itertools.pairwise(steps)), steps


def test_bad_dataset_fails_fast_without_retry(prefect_server, s3_settings, tmp_path: Path):
    from tasks.hydrate import upload_dataset
    from trainer.data import write_synthetic_dataset

    local = tmp_path / "bad"
    write_synthetic_dataset(local, shards=2, tokens_per_shard=4096)
    flip_bytes(local / "shard_00001.bin")  # the manifest no longer matches this shard
    client = boto3_client(s3_settings)
    for b in ("nvrx-datasets", "nvrx-checkpoints"):
        try:
            client.head_bucket(Bucket=b)
        except Exception:
            client.create_bucket(Bucket=b)
    upload_dataset(client, local, "nvrx-datasets", "corrupt/v1")
    params = make_params(
        tmp_path / "state",
        s3_settings,
        run_id="bad-data",
        dataset={"bucket": "nvrx-datasets", "prefix": "corrupt/v1"},
    )
    state, _ = run_pipeline(params)
    assert state.is_failed()
    assert "HydrationError" in state.message and "shard_00001.bin" in state.message
    [failed] = [
        e for e in nvrx_events("bad-data", expect="nvrx.run.failed") if e.event == "nvrx.run.failed"
    ]
    assert failed.payload["stage"] == "hydrate" and "shard_00001.bin" in failed.payload["cause"]
    events = RunContext.create(params).run_root / "events.jsonl"
    assert not events.exists() or "stage_attempt" not in events.read_text()


def test_unrecoverable_training_failure_is_not_retried(baseline, tmp_path: Path):
    """Checkpoints exist but none is valid: the trainer refuses to start over, and the train
    stage's attempt (the watcher, the local backend, real workers) ends do-not-requeue, which
    the retry policy never retries (only node loss is). The baseline's checkpoints, corrupted,
    stand in for a first pipeline run."""
    from dataclasses import replace

    from tasks.backends.base import LaunchRequest
    from tasks.backends.local import LocalBackend
    from tasks.classify import EndKind
    from tasks.retry_policy import stage_retry_allowed
    from tasks.train_stage import run_attempt
    from trainer.config import load_config

    source = Path(baseline.checkpoint.uri).parents[1]
    run_root = tmp_path / "no-valid-ckpt"
    shutil.copytree(manifest.checkpoints_dir(source), manifest.checkpoints_dir(run_root))
    for step in manifest.committed_steps(run_root):
        flip_bytes(sorted(manifest.committed_path(run_root, step).glob("*.distcp"))[0])
    cfg = replace(load_config(source / "config" / "train-attempt1.json"), run_root=run_root)
    request = LaunchRequest(
        run_id="no-valid-ckpt", attempt=1, cfg=cfg, nodes=2, nproc_per_node=1, deadline_s=180
    )
    report = run_attempt(LocalBackend(), request)
    assert report.outcome.kind == EndKind.DO_NOT_REQUEUE, report.outcome.message
    assert "none is valid" in report.outcome.message
    error = report.outcome.error()
    assert error is not None and not stage_retry_allowed(error)
    events = read_events(run_root)
    ends = [e for e in events if e["kind"] == "stage_attempt_end"]
    assert [e["outcome"] for e in ends] == ["do-not-requeue"]
    # Every worker refused to train from scratch (exit 3, terminal), named why, and left a
    # failed result.
    assert [e for e in events if e["kind"] == "fatal"] and not [
        e for e in events if e["kind"] == "step"
    ], "must not train from scratch"
    result = json.loads((run_root / "result.json").read_text())
    assert result["status"] == "failed"
