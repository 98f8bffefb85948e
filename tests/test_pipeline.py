"""The whole pipeline on the embedded default, against real parts: the Prefect test server,
SeaweedFS over HTTP, real ft_launcher agents as simulated nodes: the failures that must not be
retried. The fault layers' pipeline runs, with the events, report, status and metrics they
produce, are tests/test_workload_pipeline.py's (llama-tiny: an exception, a SIGKILL and the
loss of node 0, which hosts the rendezvous store, in one run; script mode: a SIGKILL and a node
loss); a hang is recovered by the same in-job layer as a SIGKILL, and its own drill
(tests/test_fault_drills.py) checks it bitwise."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from flows.context import RunContext
from tasks.storage.s3 import boto3_client
from tests.helpers import read_events
from tests.pipeline_helpers import make_params, nvrx_events, run_pipeline
from trainer import checkpointing
from trainer.faults import flip_bytes

pytestmark = pytest.mark.slow


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


def test_empty_prefix_other_than_the_demos_is_not_seeded(prefect_server, s3_settings, tmp_path):
    """Seeding on (the default) and a mistyped prefix: no synthetic tokens written into it, and
    the run fails before anything trains, naming the fix (issue 27: it trained "successfully"
    on random data)."""
    params = make_params(
        tmp_path / "state",
        s3_settings,
        run_id="typo-prefix",
        dataset={"bucket": "nvrx-datasets", "prefix": "synthetc/v1"},
    )
    assert params.seed_demo_dataset
    state, _ = run_pipeline(params)
    assert state.is_failed()
    assert "did you mean s3://nvrx-datasets/synthetic/v1?" in state.message
    for fix in ("dataset.prefix", "seed_demo_dataset", "prepare-dataset", "synthetic/v1"):
        assert fix in state.message, fix
    listed = boto3_client(s3_settings).list_objects_v2(Bucket="nvrx-datasets", Prefix="synthetc/")
    assert listed.get("KeyCount", 0) == 0
    assert not (RunContext.create(params).run_root / "events.jsonl").exists()


def test_an_8b_workload_on_this_machine_fails_in_preflight(prefect_server, s3_settings, tmp_path):
    """Issue 27: the local backend puts every rank on this machine; an 8B workload needs ~226 GB
    there, and the run fails in preflight, naming the fix, before anything trains."""
    params = make_params(tmp_path / "state", s3_settings, run_id="too-big", workload="llama3-8b")
    state, _ = run_pipeline(params)
    assert state.is_failed()
    assert "PreflightFailed" in state.message or "preflight check" in state.message
    for fix in ("memory", "llama3-8b", "8.03 B parameters", "eks backend"):
        assert fix in state.message, fix
    assert not (RunContext.create(params).run_root / "events.jsonl").exists()


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
    shutil.copytree(checkpointing.checkpoints_dir(source), checkpointing.checkpoints_dir(run_root))
    for step in checkpointing.committed_steps(run_root):
        flip_bytes(sorted(checkpointing.committed_path(run_root, step).glob("*.distcp"))[0])
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
