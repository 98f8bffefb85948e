from __future__ import annotations

import os
from pathlib import Path

import pytest

from trainer.data import write_synthetic_dataset


@pytest.fixture(scope="session")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("data")
    write_synthetic_dataset(path, shards=4, tokens_per_shard=65536, vocab_size=512, seed=0)
    return path


@pytest.fixture(scope="session")
def small_checkpoint(dataset: Path, tmp_path_factory: pytest.TempPathFactory):
    """One real 1-process run of 5 steps, trained once per session: its committed step-5
    checkpoint and the run's ``params_sha256`` (export and pull tests share it; copy the
    directory before changing it)."""
    from tests.helpers import SmallCheckpoint, make_config, run_single
    from trainer import checkpointing

    cfg = make_config(tmp_path_factory.mktemp("exp") / "run", dataset, steps=5)
    out = run_single(cfg)
    assert out.returncode == 0, out.log[-2000:]
    assert out.result is not None and out.result["params_sha256"]
    return SmallCheckpoint(
        checkpointing.committed_path(cfg.run_root, 5), out.result["params_sha256"]
    )


@pytest.fixture(scope="session")
def s3_settings(tmp_path_factory: pytest.TempPathFactory):
    """A real SeaweedFS S3 server over HTTP on 127.0.0.1, for the whole session."""
    from tasks.storage.local_s3 import LocalS3Server
    from tasks.storage.s3 import S3Settings
    from tests.helpers import free_s3_port

    port = free_s3_port()
    endpoint = f"http://127.0.0.1:{port}"
    server = LocalS3Server(endpoint, tmp_path_factory.mktemp("seaweed"))
    server.start()
    yield S3Settings(endpoint_url=endpoint)
    server.stop()


UI_URL = "http://prefect-ui.test"


@pytest.fixture(scope="session")
def prefect_server():
    """One Prefect test server (real API over HTTP, SQLite) for the session."""
    import os

    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_FLOWS_HEARTBEAT_FREQUENCY,
        PREFECT_UI_URL,
        temporary_settings,
    )
    from prefect.testing.utilities import prefect_test_harness

    # The server renders notifications' links to the UI from PREFECT_UI_URL (set on a real
    # server); the harness's server gets it from these settings. The harness waits 30 s for its
    # server by default: a fresh clone's CI on a loaded 2-core machine once took longer (its
    # migrations on a new SQLite file), and every test using the server errored at setup.
    with (
        temporary_settings({PREFECT_UI_URL: UI_URL}),
        prefect_test_harness(server_startup_timeout=180),
        temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}),
    ):
        yield PREFECT_API_URL.value()


@pytest.fixture
def kube():
    """kmock's Kubernetes emulator over real HTTP, driven by the official client (no real API
    server can run here); two Ready nodes to start with."""
    import asyncio
    import threading

    from tasks.backends.eks.kube import Kube

    kmock = pytest.importorskip("kmock")
    from kubernetes import client

    ready, state = threading.Event(), {}

    def serve() -> None:
        async def main() -> None:
            async with kmock.KubernetesEmulator() as emu, kmock.Server(emu) as srv:
                # kmock answers a list of a resource it holds no object of with 404; a real API
                # server lists an empty collection. The attempt's pod watch lists before the
                # Job's pods exist: each 404 counted as a failure grew its backoff (up to 30 s)
                # until its first list came after a pod was created and deleted (never seen,
                # so never classified) or after the deadline.
                for builtin in ("v1/pods", "batch/v1/jobs"):
                    emu.resources[builtin] = {}
                state["url"] = str(srv.url).rstrip("/")
                ready.set()
                while not state.get("stop"):
                    await asyncio.sleep(0.05)

        asyncio.run(main())

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    assert ready.wait(15)
    cfg = client.Configuration()
    cfg.host = state["url"]
    k = Kube(client.ApiClient(cfg))
    for n in ("ip-10-0-1-1", "ip-10-0-1-2"):
        k.core.create_node(
            {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {"name": n},
                "status": {"conditions": [{"type": "Ready", "status": "True"}]},
            },
            _preload_content=False,
        )
    yield k
    state["stop"] = True
    t.join(0.5)  # daemon thread: open watch streams may keep it a little longer


# Set in the orchestrator's environment during the baseline run: none may reach a worker.
ORCHESTRATOR_SECRETS = {
    "HF_TOKEN": "hf_orchestrator-3f9c1e7a",
    "PREFECT_API_KEY": "pnu_orchestrator-8d2b4c6e",
    "NVRX_TEST_PASSWORD": "orchestrator-pw-5a7e9d1b",
}
BASELINE_SECRETS = {"declared": "declared-secret-2c4e6a8f", **ORCHESTRATOR_SECRETS}


def assert_no_secret_leaked(state_dir, params, s3_settings) -> None:
    """Every worker got the declared secret's name and none of the orchestrator's; no value of
    either is in any file under the run's state directory or in any object in S3."""
    from flows.context import RunContext
    from tasks.storage.s3 import boto3_client
    from tests.helpers import read_events

    starts = [e for e in read_events(RunContext.create(params).run_root)
              if e["kind"] == "worker_start"]  # fmt: skip
    assert starts
    for e in starts:
        assert "DEMO_TOKEN" in e["secret_env"], e["secret_env"]
        assert not set(ORCHESTRATOR_SECRETS) & set(e["secret_env"]), e["secret_env"]
    values = [v.encode() for v in BASELINE_SECRETS.values()]
    for path in state_dir.rglob("*"):
        if path.is_file() and not path.is_symlink():
            data = path.read_bytes()
            assert not any(v in data for v in values), path
    client = boto3_client(s3_settings)
    for bucket in (params.dataset.bucket, params.export.bucket):
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            for obj in page.get("Contents", []):
                body = client.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read()
                assert not any(v in body for v in values), (bucket, obj["Key"])


@pytest.fixture(scope="session")
def baseline(prefect_server, s3_settings, tmp_path_factory):
    """A fault-free pipeline run on the embedded default: what every drill must equal."""
    from prefect.blocks.system import Secret

    from tests.pipeline_helpers import assert_exported, make_params, run_pipeline

    # The orchestrator holds credentials of its own, and the run declares one secret for its
    # workers (issue 28, item 7): what reaches which process is checked after the run.
    Secret(value=BASELINE_SECRETS["declared"]).save("nvrx-baseline-token", overwrite=True)
    state_dir = tmp_path_factory.mktemp("pipe")
    params = make_params(
        state_dir,
        s3_settings,
        run_id="baseline",
        secrets={"DEMO_TOKEN": "nvrx-baseline-token"},
    )
    saved = {k: os.environ.get(k) for k in ORCHESTRATOR_SECRETS}
    os.environ.update(ORCHESTRATOR_SECRETS)
    try:
        state, result = run_pipeline(params)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    assert state.is_completed(), state.message
    assert_no_secret_leaked(state_dir, params, s3_settings)
    assert result is not None
    assert result.status == "completed" and result.final_step == 20
    assert result.stage_attempts["train"] == 1 and result.faults == []
    assert result.checkpoint.validated and result.checkpoint.step == 20
    assert 0 < (result.ettr or 0) <= 1
    assert_exported(result, s3_settings)
    # The recovery timeline: a PNG beside the run, and the same image as an artifact of the run.
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from flows.context import RunContext

    ctx = RunContext.create(params)
    png = ctx.run_root / "timeline.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Hydration verified every shard; the workers were told which manifest that was, so their
    # start-up checks the manifest and sizes only (the attempt's config says so).
    from tests.helpers import read_events
    from trainer.config import load_config
    from trainer.data import load_manifest

    attempt = load_config(ctx.run_root / "config" / "train-attempt1.json")
    assert attempt.data_manifest_sha256 == load_manifest(ctx.data_dir).digest()
    data_s = [e["data_s"] for e in read_events(ctx.run_root) if e["kind"] == "worker_start"]
    assert data_s, "worker_start records the dataset check's seconds"
    with get_client(sync_client=True) as client:
        arts = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["recovery-timeline"]))
        )
    assert any(str(a.data).startswith("data:image/png;base64,") for a in arts)
    return result
