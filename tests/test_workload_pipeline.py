"""Workloads other than the built-in GPT through the whole pipeline, against real parts (Prefect
test server, SeaweedFS, ft_launcher agents as simulated nodes): the Hugging Face Llama, an existing
training script in script mode, and a workload from a module outside the repository.

Each drill case runs its drill table through the pipeline (every fault in one run, so the suite
pays for one pipeline run per workload, not one per fault), then the same training config
without faults through the train stage's attempt alone (the fault-free reference, without the
stages around it); the parameters must be bitwise equal."""

from __future__ import annotations

import contextlib
import itertools
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from flows.context import RunContext
from flows.models import PipelineResult
from tasks.storage.s3 import boto3_client
from tests.helpers import OUTSIDE_WORKLOAD, REPO, free_port_pair, read_events, scrape
from tests.pipeline_helpers import (
    LocalPrometheus,
    Scraper,
    assert_exported,
    assert_report_and_status,
    clean_rerun,
    make_params,
    nvrx_events,
    run_pipeline,
)
from trainer.faults import parse_faults

pytestmark = pytest.mark.slow

SCRIPT = REPO / "examples" / "fsdp_script" / "train.py"


@dataclass(frozen=True)
class Case:
    name: str
    params: dict[str, Any]
    faults: tuple[str, ...]
    recovered_by: tuple[str, ...]
    train_attempts: int
    # Steps are ~30 ms here: the node loss must come several steps before the end, or the run
    # may finish before the watcher (polling every 0.2 s) takes the node away.
    steps: int = 15
    extra: dict[str, Any] = field(default_factory=dict)
    # Also what operators see of every layer's recovery: the Prefect events, the run report,
    # `status` and both metrics endpoints, scraped during the run.
    observed: bool = False


CASES = [
    Case(
        "llama-tiny",
        {
            "workload": "llama-tiny",
            # Initial weights from S3, hydrated beside the dataset (seeded by _seed_weights).
            "workload_options": {"init_weights": "s3://nvrx-weights/llama-tiny/init"},
            "export": {"consolidated": True},
        },
        # Node 0: rank 0 and the rendezvous store, which NVRx cannot replace in-job (node 1's
        # loss is the script case's).
        ("exception@step=3,rank=1", "sigkill@step=6,rank=0", "node-loss@step=9,node=0"),
        ("inprocess", "injob", "stage-retry"),
        2,
        observed=True,
    ),
    Case(
        "script",
        {
            "workload": f"script:{SCRIPT.relative_to(REPO)}",
            "script_args": ["--data-dir", "{data_dir}", "--steps", "{steps}"],
        },
        # The example passes its model to the step check: a NaN in rank 1's gradient is
        # rejected and the step replayed in place (no layer recovers it: "none").
        ("corrupt-grad@step=2,rank=1", "sigkill@step=5,rank=0", "node-loss@step=9,node=1"),
        ("none", "injob", "stage-retry"),
        2,
    ),
]


def _run(
    tmp: Path, s3, case: Case, run_id: str, faults: tuple[str, ...], **extra: Any
) -> PipelineResult:
    params = make_params(
        tmp,
        s3,
        run_id=run_id,
        steps=case.steps,
        ckpt_interval=3,
        drills={"faults": list(faults)},
        **case.params,
        **extra,
    )
    state, result = run_pipeline(params)
    assert state.is_completed(), state.message
    assert result is not None and result.final_step == case.steps
    assert result.checkpoint.validated and result.checkpoint.step == case.steps
    assert_exported(result, s3)
    return result


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_workload_recovers_bitwise(
    case: Case, prefect_server, s3_settings, tmp_path: Path, monkeypatch, capsys
):
    monkeypatch.chdir(REPO)  # the script is named relative to the repository
    port = free_port_pair()
    flow, rank0 = (f"http://127.0.0.1:{p}/metrics" for p in (port, port + 1))
    extra: dict[str, Any] = {"metrics_port": port} if case.observed else {}
    if "init_weights" in case.params.get("workload_options", {}):
        # Pinned, as a demanding user runs: hydration checks them against this digest.
        extra["initial_weights"] = {"sha256": _seed_weights(s3_settings, tmp_path / "hf-init")}
    prometheus = LocalPrometheus(
        tmp_path / "prometheus", flow=f"127.0.0.1:{port}", rank0=f"127.0.0.1:{port + 1}"
    )
    with contextlib.ExitStack() as stack:
        if case.observed:
            stack.enter_context(prometheus)
        scraped = stack.enter_context(Scraper(*((flow, rank0) if case.observed else ())))
        t0 = time.time()
        drilled = _run(
            tmp_path / "drill", s3_settings, case, f"{case.name}-drill", case.faults, **extra
        )
        if case.observed:
            _assert_every_dashboard_query_answers(prometheus, drilled.run_id, t0, time.time())
    assert [f.recovered_by for f in drilled.faults] == list(case.recovered_by)
    assert drilled.stage_attempts["train"] == case.train_attempts
    params = make_params(tmp_path / "drill", s3_settings, run_id=drilled.run_id, steps=case.steps)
    run_root = RunContext.create(params).run_root
    events = read_events(run_root)
    assert [e["fault"] for e in events if e["kind"] == "fault"] == list(case.faults)  # once each
    checks = [(e["step"], e["verdict"]) for e in events if e["kind"] == "step_check"]
    # Each corrupted step (none in the llama case) rejected once, then its replay passed: the
    # script calls the check itself and computes the step again.
    corrupted = [f.step for f in parse_faults(case.faults) if f.kind == "corrupt-grad"]
    assert checks == [(s, v) for s in corrupted for v in ("rejected", "transient")], checks
    loaded = [e["step"] for e in events if e["kind"] == "resume" and e.get("action") == "loaded"]
    assert loaded and loaded[-1] >= 3, "the stage retry resumed from a committed checkpoint"
    # Issue 29: a respawn reads the rank's shard from node memory; a stage retry runs on new
    # nodes, with none: the durable tier.
    sources = {f.kind: f.resume_source for f in drilled.faults}
    assert sources.get("sigkill", "node") == "node" and sources["node-loss"] == "durable", sources
    assert drilled.params_sha256 == clean_rerun(run_root, tmp_path / "clean" / "run")
    if case.params.get("export", {}).get("consolidated"):
        _assert_hf_export_matches_checkpoint(drilled, s3_settings, tmp_path, run_root)
    if case.observed:
        _assert_operators_see_each_recovery(drilled, case, scraped, flow, rank0)
        assert_report_and_status(drilled, params, tmp_path / "drill", capsys)
    if case.train_attempts > 1:
        _assert_the_lost_attempt_reads_as_a_drill(drilled.run_id)


def _assert_every_dashboard_query_answers(
    prometheus: LocalPrometheus, run_id: str, start: float, end: float
) -> None:
    """Issue 27: a real Prometheus, run from the shipped local recipe, scraped the drilled run;
    every query of the shipped dashboard (panels and annotations, with Grafana's variables
    filled in as it would) answers with data of that run, and the fault and restart
    annotations mark each of the run's faults and restarts."""
    from tests.test_metrics import DASHBOARD, dashboard_queries

    dash = json.loads(DASHBOARD.read_text())
    empty = []
    for title, expr in dashboard_queries(dash):
        q = (
            expr.replace("$run_id", run_id)
            .replace("$__rate_interval", "10s")
            .replace("$__interval", "3s")
        )
        series = prometheus.query_range(q, start, end + 5)
        ours = [s for s in series if s["metric"].get("run_id", run_id) == run_id and s["values"]]
        if not ours:
            empty.append((title, q))
    assert empty == [], empty
    marks = {a["name"]: a["expr"] for a in dash["annotations"]["list"]}
    faults = prometheus.query_range(
        marks["Faults"].replace("$run_id", run_id).replace("$__interval", "3s"), start, end + 5
    )
    assert {s["metric"]["kind"] for s in faults} == {"exception", "sigkill", "node-loss"}
    restarts = prometheus.query_range(
        marks["Restarts"].replace("$run_id", run_id).replace("$__interval", "3s"), start, end + 5
    )
    assert {s["metric"]["layer"] for s in restarts} == {"inprocess", "injob", "stage-retry"}


def _assert_the_lost_attempt_reads_as_a_drill(run_id: str) -> None:
    """Issue 27: the attempt that lost a node is a named flow run that failed with NodeLost as
    its state, and the planned loss logged no ERROR (no traceback) on any train attempt."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterName,
        LogFilter,
        LogFilterFlowRunId,
        LogFilterLevel,
    )

    with get_client(sync_client=True) as client:
        names = [f"{run_id}: train attempt {n}" for n in (1, 2)]
        runs = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=names))
        )
        by_name = {r.name: r for r in runs}
        lost, retried = by_name[names[0]].state, by_name[names[1]].state
        assert lost is not None and lost.is_failed() and str(lost.message).startswith("NodeLost")
        assert retried is not None and retried.is_completed()
        errors = client.read_logs(
            log_filter=LogFilter(
                flow_run_id=LogFilterFlowRunId(any_=[r.id for r in runs]),
                level=LogFilterLevel(ge_=40),
            )
        )
    assert errors == [], [e.message[:200] for e in errors]


def _assert_operators_see_each_recovery(
    result: PipelineResult, case: Case, scraped: Scraper, flow: str, rank0: str
) -> None:
    """The Prefect events about the run (tied to its flow runs), and the restarts under their
    layers on the flow's metrics endpoint; rank 0's endpoint served by the process that
    replaced the killed one (its step counter starts over)."""
    assert all(f.recovery_s and f.recovery_s > 0 for f in result.faults)
    node_loss = result.faults[-1]
    # nodes=2 is 2:2, and node 0 hosted the rendezvous store: the watcher chose the stage
    # retry at the loss (tasks.loss_policy).
    assert node_loss.path == "stage-retry" and node_loss.detail
    run_id = result.run_id
    events = nvrx_events(run_id, expect="nvrx.run.completed")
    by_name: dict[str, list[Any]] = {}
    for e in events:
        by_name.setdefault(e.event, []).append(e)
    kinds = [f.split("@")[0] for f in case.faults]
    assert [e.payload["kind"] for e in by_name["nvrx.fault.detected"]] == kinds
    assert all(e.payload["step"] for e in by_name["nvrx.fault.detected"])
    recoveries = by_name["nvrx.recovery.completed"]
    assert [e.payload["layer"] for e in recoveries] == list(case.recovered_by)
    assert all(e.payload["seconds"] > 0 for e in recoveries)
    [retried] = by_name["nvrx.stage.retried"]
    assert retried.payload["attempt"] == 2 and "node" in retried.payload["cause"]
    assert [e.payload["step"] for e in by_name["nvrx.checkpoint.committed"]][-1] == case.steps
    [export] = by_name["nvrx.export.completed"]
    assert export.payload["uri"] == result.export.uri
    assert export.payload["bytes"] == result.export.bytes
    assert all(any(r.get("prefect.resource.role") == "flow-run" for r in e.related) for e in events)
    restarts = {
        layer: scraped.series(flow, "nvrx_restarts_total", run_id=run_id, layer=layer)[-1]
        for layer in ("inprocess", "injob", "stage-retry")
    }
    assert restarts == {layer: 1 for layer in case.recovered_by}
    steps = scraped.series(rank0, "nvrx_train_steps_total", run_id=run_id)
    assert any(b < a for a, b in itertools.pairwise(steps)), steps


def _seed_weights(s3, local: Path) -> str:
    """An HF directory in S3 (seeded differently from the trainer) as the run's initial weights;
    their digest (initial_weights.sha256)."""
    from tasks.weights_pin import local_listing
    from trainer.workload import load_workload

    torch.manual_seed(7)
    load_workload("llama-tiny").build_model("cpu").save_pretrained(str(local))  # type: ignore[operator]
    client = boto3_client(s3)
    try:
        client.head_bucket(Bucket="nvrx-weights")
    except Exception:
        client.create_bucket(Bucket="nvrx-weights")
    for f in local.iterdir():
        client.upload_file(str(f), "nvrx-weights", f"llama-tiny/init/{f.name}")
    return local_listing(local).digest()


def _assert_hf_export_matches_checkpoint(
    result: PipelineResult, s3, tmp_path: Path, run_root: Path
) -> None:
    """The consolidated export is an HF directory that ``from_pretrained`` loads, and it gives
    the logits of the committed checkpoint (loaded with DCP) on a fixed batch."""
    import torch.distributed.checkpoint as dcp
    from transformers import LlamaForCausalLM

    from trainer.workload import load_workload

    bucket, _, base = (result.export.uri or "").removeprefix("s3://").partition("/")
    client = boto3_client(s3)
    remote = json.loads(client.get_object(Bucket=bucket, Key=f"{base}manifest.json")["Body"].read())
    hf_files = remote["consolidated"]["hf"]["files"]
    assert {f["name"] for f in hf_files} >= {"config.json", "model.safetensors"}
    local = tmp_path / "hf"
    local.mkdir()
    for f in hf_files:
        client.download_file(bucket, f"{base}hf/{f['name']}", str(local / f["name"]))
    exported = LlamaForCausalLM.from_pretrained(str(local)).eval()

    wl = load_workload("llama-tiny")
    from_ckpt = wl.build_model("cpu").eval()
    state = {"model": from_ckpt.state_dict()}
    dcp.load(state, checkpoint_id=str(result.checkpoint.uri))
    from_ckpt.load_state_dict(state["model"])
    batch = torch.arange(64).remainder(wl.vocab_size).reshape(2, 32)
    with torch.no_grad():
        a = exported(input_ids=batch).logits
        b = from_ckpt(input_ids=batch).logits
    assert torch.equal(a, b)


@pytest.fixture
def outside_module(tmp_path: Path, monkeypatch) -> str:
    """A package in a temporary directory, on the path of this process and of the workers."""
    pkg = tmp_path / "site" / "team_workloads"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "mlp.py").write_text(OUTSIDE_WORKLOAD)
    monkeypatch.syspath_prepend(str(pkg.parent))
    monkeypatch.setenv("PYTHONPATH", str(pkg.parent))
    return "team_workloads.mlp:spec"


def test_a_workload_from_outside_the_repository(
    outside_module: str, prefect_server, s3_settings, tmp_path: Path
):
    """Also the metrics' run: both endpoints scraped during it (tests/test_metrics.py has
    the rest of them)."""
    case = Case("outside", {"workload": outside_module}, (), (), 1, steps=9)
    port = free_port_pair()
    flow, rank0 = (f"http://127.0.0.1:{p}/metrics" for p in (port, port + 1))
    with Scraper(flow, rank0) as scraped:
        result = _run(
            tmp_path,
            s3_settings,
            case,
            "outside-clean",
            ("exception@step=5,rank=0",),
            metrics_port=port,
        )
    assert [f.recovered_by for f in result.faults] == ["inprocess"]
    _assert_scraped_during_the_run(scraped, flow, rank0, run_id="outside-clean")
    events = read_events(
        RunContext.create(make_params(tmp_path, s3_settings, run_id="outside-clean")).run_root
    )
    assert {e.get("workload") for e in events if e["kind"] == "train_start"} == {outside_module}


def _assert_scraped_during_the_run(scraped: Scraper, flow: str, rank0: str, *, run_id: str) -> None:
    """The step rose between scrapes on both endpoints, and the drill's in-process restart was
    counted, under its layer, once."""
    for url in (flow, rank0):
        steps = scraped.series(url, "nvrx_train_step", run_id=run_id)
        assert any(b > a for a, b in itertools.pairwise(steps)), (url, steps)
    restarts = {
        layer: scraped.series(flow, "nvrx_restarts_total", run_id=run_id, layer=layer)[-1]
        for layer in ("inprocess", "injob", "stage-retry")
    }
    assert restarts == {"inprocess": 1, "injob": 0, "stage-retry": 0}
    assert scraped.series(flow, "nvrx_faults_detected_total", kind="exception")[-1] == 1
    assert scraped.series(rank0, "nvrx_train_inprocess_restarts_total", run_id=run_id)[-1] == 1
    assert scraped.series(flow, "nvrx_train_stage_attempts_total", run_id=run_id)[-1] == 1
    # Served while the train stage ran, gone with it (the next run may take the port).
    with pytest.raises(OSError):
        scrape(flow)


def test_data_vocabulary_larger_than_the_model_fails_preflight(
    outside_module: str, prefect_server, s3_settings, tmp_path: Path
):
    """The demo dataset has 512 token ids; a 64-token model cannot embed them: refused at
    preflight with both numbers, before any stage after it runs."""
    params = make_params(
        tmp_path,
        s3_settings,
        run_id="vocab-mismatch",
        workload=outside_module,
        workload_options={"vocab": 64},
    )
    state, _ = run_pipeline(params)
    assert state.is_failed()
    assert "vocab_size 512" in state.message and "vocabulary 64" in state.message
    assert not (RunContext.create(params).run_root / "events.jsonl").exists()
