"""Prometheus metrics (trainer.metrics: rank 0; tasks.metrics: the flow): the event -> metric
mapping on a recorded history, real scrapes over HTTP of both endpoints, a port bound again by
a new process (an in-job restart), the parameters' checks, the EKS scrape path (container
port, NetworkPolicy, PodMonitor) and the Grafana dashboard's metric names.

The scrape during a real pipeline run with a drill is in tests/test_workload_pipeline.py
(``test_a_workload_from_outside_the_repository``)."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from tasks.metrics import RunMetrics, serving
from tests.helpers import REPO, free_port, sample, scrape, worker_env
from trainer.config import ConfigError, TrainConfig
from trainer.event_types import Checkpoint, Fault, Restart, StageAttempt, Step, decode_obj
from trainer.events import EventLog
from trainer.history import RunHistory
from trainer.metrics import MetricsServer, Rank0Metrics, build_versions

# A run with all three layers, as the files record it: an exception (in-process), a SIGKILL
# (in-job), a lost node (stage retry); steps 3-4 run twice (replayed after the SIGKILL).
HISTORY: list[dict[str, Any]] = [
    {"t": 100.0, "kind": "stage_attempt", "stage": "train", "attempt": 1, "backend": "local"},
    {
        "t": 101.0,
        "kind": "step",
        "step": 1,
        "loss": 6.2,
        "step_s": 0.5,
        "tokens_per_s": 900.0,
        "tokens": 450,
    },
    {
        "t": 101.5,
        "kind": "step",
        "step": 2,
        "loss": 6.0,
        "step_s": 0.5,
        "tokens_per_s": 950.0,
        "tokens": 475,
    },
    {"t": 101.6, "kind": "checkpoint", "step": 2, "blocking_s": 0.02, "total_s": 1.5},
    {"t": 102.0, "kind": "fault", "fault": "exception@step=3", "fault_kind": "exception"},
    {"t": 102.5, "kind": "restart", "layer": "inprocess", "iteration": 1},
    {"t": 104.0, "kind": "step", "step": 3, "loss": 5.9, "step_s": 0.5},
    {"t": 104.0, "kind": "recovered", "layer": "inprocess", "recovery_s": 2.0, "step": 3},
    {"t": 104.5, "kind": "step", "step": 4, "loss": 5.8, "step_s": 0.5},
    {"t": 105.0, "kind": "fault", "fault": "sigkill@step=5", "fault_kind": "sigkill"},
    {"t": 109.0, "kind": "restart", "layer": "injob", "restart_count": 1},
    {"t": 110.0, "kind": "step", "step": 3, "loss": 5.9, "step_s": 0.25},
    {"t": 110.0, "kind": "recovered", "layer": "injob", "recovery_s": 5.0, "step": 3},
    {"t": 110.5, "kind": "step", "step": 4, "loss": 5.8, "step_s": 0.25},
    {"t": 110.6, "kind": "checkpoint", "step": 4, "blocking_s": 0.03, "total_s": 2.0},
    {"t": 111.0, "kind": "fault", "fault": "node-loss@step=5", "fault_kind": "node-loss"},
    {
        "t": 112.0,
        "kind": "stage_attempt_end",
        "stage": "train",
        "attempt": 1,
        "wall_s": 12.0,
        "outcome": "node-loss",
    },
    {"t": 113.0, "kind": "stage_attempt", "stage": "train", "attempt": 2, "backend": "local"},
    {
        "t": 120.0,
        "kind": "step",
        "step": 5,
        "loss": 5.7,
        "step_s": 0.5,
        "tokens_per_s": 990.0,
        "tokens": 495,
    },
    {"t": 120.0, "kind": "recovered", "layer": "stage-retry", "recovery_s": 9.0, "step": 5},
    {"t": 120.5, "kind": "checkpoint", "step": 5, "blocking_s": 0.01, "total_s": 1.0},
    {
        "t": 121.0,
        "kind": "stage_attempt_end",
        "stage": "train",
        "attempt": 2,
        "wall_s": 8.0,
        "outcome": "completed",
    },
]


def _samples(registry: Any) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in registry.collect()
        for s in fam.samples
    }


def test_run_metrics_map_a_recorded_history_and_count_each_event_once() -> None:
    m = RunMetrics("r1", clock=lambda: 121.0)
    # before any event every layer's and fault kind's series is there at 0, so increase()
    # sees the first restart and the first fault (a series born at 1 hides its first event)
    s = _samples(m.registry)
    assert sample(s, "nvrx_restarts_total", run_id="r1", layer="spare") == 0
    assert sample(s, "nvrx_recovery_seconds_count", run_id="r1", layer="injob") == 0
    assert sample(s, "nvrx_faults_detected_total", run_id="r1", kind="node-loss") == 0
    for _ in range(2):  # the file read again from the start: nothing counts twice
        for e in HISTORY:
            m.observe(decode_obj(e))
    s = _samples(m.registry)
    for layer in ("inprocess", "injob", "stage-retry"):
        assert sample(s, "nvrx_restarts_total", run_id="r1", layer=layer) == 1, layer
        assert sample(s, "nvrx_recovery_seconds_count", run_id="r1", layer=layer) == 1, layer
    assert sample(s, "nvrx_recovery_seconds_sum", layer="stage-retry") == 9.0
    assert {
        kind: sample(s, "nvrx_faults_detected_total", kind=kind)
        for kind in ("exception", "sigkill", "node-loss")
    } == {"exception": 1, "sigkill": 1, "node-loss": 1}
    assert sample(s, "nvrx_checkpoints_committed_total", run_id="r1") == 3
    assert sample(s, "nvrx_checkpoint_last_committed_step", run_id="r1") == 5

    assert sample(s, "nvrx_checkpoint_blocking_seconds_count", run_id="r1") == 3
    assert sample(s, "nvrx_checkpoint_commit_latency_seconds_sum", run_id="r1") == 4.5
    assert sample(s, "nvrx_train_stage_attempts_total", run_id="r1") == 2
    assert sample(s, "nvrx_train_step", run_id="r1") == 5
    assert sample(s, "nvrx_train_steps_total", run_id="r1") == 7  # two replayed
    assert sample(s, "nvrx_train_loss", run_id="r1") == 5.7
    assert sample(s, "nvrx_train_tokens_per_second", run_id="r1") == 990.0
    # A counter for rate(): each step's tokens once, however often the file is read.
    assert sample(s, "nvrx_train_tokens_total", run_id="r1") == 450 + 475 + 495
    # ETTR: the run report's number (a replayed step counts its last run), 2.0 s / 20 s.
    assert m.ettr() == RunHistory.of(decode_obj(e) for e in HISTORY).ettr() == 0.1
    assert sample(s, "nvrx_ettr_ratio", run_id="r1") == 0.1


def test_checkpoint_loads_are_counted_by_their_tier() -> None:
    """Issue 29: each resume's load, by the tier it read (its seconds and bytes); a load
    recorded before loads named their tier was the durable one."""
    m = RunMetrics("r1")
    assert sample(_samples(m.registry), "nvrx_checkpoint_load_bytes_total", source="durable") == 0
    loads = [
        {"t": 1.0, "kind": "resume", "action": "loaded", "step": 5, "load_s": 0.4,
         "source": "durable", "bytes": 2_000_000},
        {"t": 2.0, "kind": "resume", "action": "loaded", "step": 10, "load_s": 0.6},
        {"t": 3.0, "kind": "resume", "action": "skipped", "step": 15, "reason": "bad"},
    ]  # fmt: skip
    for e in loads * 2:  # read twice: counted once
        m.observe(decode_obj(e))
    s = _samples(m.registry)
    assert sample(s, "nvrx_checkpoint_load_seconds_count", source="durable") == 2
    assert sample(s, "nvrx_checkpoint_load_seconds_sum", source="durable") == 1.0
    assert sample(s, "nvrx_checkpoint_load_bytes_total", source="durable") == 2_000_000


def test_ettr_counts_the_running_attempts_wall_time_so_far() -> None:
    now = {"t": 110.0}
    m = RunMetrics("r1", clock=lambda: now["t"])
    for e in HISTORY[:9]:  # attempt 1 still running at t=110: steps 1-4, 2.0 s productive
        m.observe(decode_obj(e))
    assert m.ettr() == 0.2
    now["t"] = 120.0
    assert m.ettr() == 0.1


def test_a_zombie_of_a_replaced_attempt_counts_nothing() -> None:
    """Epoch 2 replaced epoch 1; a worker of epoch 1 that wakes and appends (its appends are not
    fenced) moves no step, fault or checkpoint series."""
    m = RunMetrics("r1")
    for e in [
        StageAttempt(t=1.0, stage="train", attempt=1, epoch=1),
        StageAttempt(t=2.0, stage="train", attempt=2, epoch=2),
        Step(t=3.0, step=3, loss=0.5, epoch=2),
        Step(t=4.0, step=9, loss=0.1, epoch=1),
        Fault(t=4.1, fault="exception@step=9", fault_kind="exception", step=9, epoch=1),
        Checkpoint(t=4.2, step=9, blocking_s=0.1, epoch=1),
    ]:
        m.observe(e)
    s = _samples(m.registry)
    assert sample(s, "nvrx_train_step", run_id="r1") == 3
    assert sample(s, "nvrx_faults_detected_total", kind="exception") == 0
    assert sample(s, "nvrx_checkpoints_committed_total", run_id="r1") == 0
    assert sample(s, "nvrx_train_stage_attempts_total") == 2


def test_an_adopted_attempt_is_not_a_stage_retry() -> None:
    m = RunMetrics("r1")
    m.observe(StageAttempt(t=1.0, stage="train", attempt=2, adopted=True))
    s = _samples(m.registry)
    assert sample(s, "nvrx_restarts_total", layer="stage-retry") == 0
    assert sample(s, "nvrx_train_stage_attempts_total") == 1


def test_rank0_metrics_follow_the_event_log_in_process(tmp_path: Path) -> None:
    """What rank 0's loop reports reaches the metrics through the event log's observers, the
    buffered step events included (before they reach the file)."""
    events = EventLog(tmp_path)
    m = Rank0Metrics("r1")
    events.observers.append(m.observe)
    for step in (1, 2, 3):
        time.sleep(0.001)  # distinct times, as a real loop's steps have
        events.buffer(Step(step=step, loss=1.0 / step, step_s=0.1, tokens_per_s=500.0))
    events.emit(Restart(layer="inprocess", iteration=1))
    events.emit(Restart(layer="injob", restart_count=1))  # a new process's: not counted here
    events.emit(Checkpoint(step=3, blocking_s=0.2, total_s=3.0, commit_s=0.1))
    s = _samples(m.registry)
    assert sample(s, "nvrx_train_step", run_id="r1") == 3
    assert sample(s, "nvrx_train_steps_total", run_id="r1") == 3
    assert sample(s, "nvrx_train_loss") == pytest.approx(1 / 3)
    assert sample(s, "nvrx_train_inprocess_restarts_total") == 1
    assert sample(s, "nvrx_checkpoint_blocking_seconds_sum") == 0.2
    assert sample(s, "nvrx_checkpoint_commit_latency_seconds_count") == 1
    # Only our series: the registry is not the global one (no process_/python_ collectors).
    assert all(name.startswith("nvrx_") for name, _ in s)


def test_a_failing_observer_never_stops_the_event_log(tmp_path: Path) -> None:
    events = EventLog(tmp_path)
    events.observers.append(lambda e: 1 / 0)  # type: ignore[func-returns-value]
    events.emit(Step(step=1))
    assert json.loads((tmp_path / "events.jsonl").read_text())["step"] == 1


def test_flow_endpoint_serves_the_events_file_as_it_grows(tmp_path: Path) -> None:
    events = EventLog(tmp_path)
    events.emit(StageAttempt(stage="train", attempt=1))
    events.emit(Step(step=1, loss=2.0, step_s=0.1))
    port = free_port()
    with serving(tmp_path, "r1", port=port, addr="127.0.0.1", poll_s=0.05):
        url = f"http://127.0.0.1:{port}/metrics"
        first = sample(scrape(url), "nvrx_train_step", run_id="r1")
        events.emit(Step(step=2, loss=1.9, step_s=0.1))
        events.emit(Restart(layer="inprocess", iteration=1))
        deadline = time.monotonic() + 5
        while (later := scrape(url)) and sample(later, "nvrx_train_step") != 2:
            assert time.monotonic() < deadline, later
            time.sleep(0.05)
        time.sleep(0.2)  # the restart came in the same poll, or the next
        later = scrape(url)
    assert first == 1
    # Issue 27: the conventional build-info series, with the versions this process runs.
    from trainer.metrics import build_versions

    versions = build_versions()
    assert versions["version"] != "not installed" and versions["torch"].startswith("2.")
    assert sample(later, "nvrx_build_info", run_id="r1", **versions) == 1
    assert sample(later, "nvrx_restarts_total", run_id="r1", layer="inprocess") == 1
    assert sample(later, "nvrx_restarts_total", run_id="r1", layer="injob") == 0
    # The endpoint is gone with the block, its port free again (for the next pipeline run).
    from prometheus_client import CollectorRegistry

    again = MetricsServer(CollectorRegistry(), port=port, addr="127.0.0.1", retry_s=0)
    assert again.serving
    again.close()


@pytest.mark.parametrize(
    ("rank", "local_rank", "every_node", "serves"),
    [
        (0, 0, False, "rank0"),
        (0, 0, True, "rank0"),
        (3, 0, True, "node"),  # another pod's first worker on EKS
        (3, 0, False, None),  # locally: the simulated nodes share one host and port
        (1, 1, True, None),  # not a node's first worker
    ],
)
def test_which_workers_serve_metrics(
    dataset: Path, tmp_path: Path, rank: int, local_rank: int, every_node: bool, serves: str | None
) -> None:
    """Rank 0 serves the training series; on EKS (metrics_every_node) every other pod's first
    worker serves its rank and versions, so no scraped training pod is `up == 0`
    (kube-prometheus-stack's TargetDown), and `nvrx_train_rank == 0` names rank 0's pod."""
    from trainer.config import TrainConfig
    from trainer.metrics import start_endpoint

    port = free_port()
    cfg = TrainConfig(
        run_root=tmp_path / "r1",
        data_dir=dataset,
        metrics_port=port,
        metrics_every_node=every_node,
    )
    events = EventLog(tmp_path)
    server = start_endpoint(cfg, rank, local_rank, events)
    try:
        if serves is None:
            assert server is None and events.observers == []
            return
        assert server is not None and server.serving
        events.emit(Step(step=4, loss=1.0, step_s=0.1))
        s = scrape(f"http://127.0.0.1:{port}/metrics")
        assert sample(s, "nvrx_train_rank", run_id="r1") == rank
        assert sample(s, "nvrx_build_info", run_id="r1", **build_versions()) == 1
        # the training series are rank 0's alone: nothing for a dashboard to count twice
        assert sample(s, "nvrx_train_step", run_id="r1") == (4 if serves == "rank0" else None)
    finally:
        if server is not None:
            server.close()


def test_no_port_serves_nothing(tmp_path: Path) -> None:
    with serving(tmp_path, "r1", port=None, addr="127.0.0.1") as m:
        assert m is None


_RANK0 = """
import sys, time
from trainer.event_types import Step
from trainer.metrics import MetricsServer, Rank0Metrics
metrics = Rank0Metrics("r1")
server = MetricsServer(metrics.registry, port=int(sys.argv[1]), addr="127.0.0.1")
metrics.observe(Step(step=int(sys.argv[2]), loss=1.0, step_s=0.1))
print("serving" if server.serving else "waiting", flush=True)
time.sleep(120)
"""


def _rank0_process(port: int, step: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", _RANK0, str(port), str(step)],
        stdout=subprocess.PIPE,
        text=True,
        env=worker_env(),
        cwd=REPO,
    )


def test_a_new_rank0_process_binds_the_port_again() -> None:
    """An in-job restart: the killed worker's endpoint is gone, its replacement (a new process,
    same port) serves at once, with a scrape showing the new process's step."""
    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    first = _rank0_process(port, 7)
    second = None
    try:
        assert first.stdout is not None and first.stdout.readline().strip() == "serving"
        assert sample(scrape(url), "nvrx_train_step", run_id="r1") == 7
        first.kill()  # SIGKILL: what ft_launcher's restart leaves of the old worker
        first.wait(10)
        second = _rank0_process(port, 5)
        assert second.stdout is not None and second.stdout.readline().strip() == "serving"
        s = scrape(url)
        assert sample(s, "nvrx_train_step", run_id="r1") == 5
        assert sample(s, "nvrx_train_steps_total", run_id="r1") == 1
    finally:
        for p in (first, second):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(10)


def test_a_port_in_use_is_retried_until_it_is_free() -> None:
    from prometheus_client import CollectorRegistry

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    server = MetricsServer(CollectorRegistry(), port=port, addr="127.0.0.1", retry_s=10)
    try:
        assert not server.serving
        holder.close()
        deadline = time.monotonic() + 5
        while not server.serving:
            assert time.monotonic() < deadline, "never bound once the port was free"
            time.sleep(0.05)
        assert scrape(f"http://127.0.0.1:{port}/metrics") == {}
    finally:
        holder.close()
        server.close()
        server.close()  # idempotent


# -- parameters ------------------------------------------------------------------------------


def test_train_config_metrics_port_is_checked(dataset: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="metrics_port: must be a TCP port"):
        TrainConfig(run_root=tmp_path, data_dir=dataset, metrics_port=70000)
    cfg = TrainConfig(run_root=tmp_path, data_dir=dataset, metrics_port=9465)
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg
    assert TrainConfig(run_root=tmp_path, data_dir=dataset).metrics_port is None  # off


def test_pipeline_params_metrics_port(tmp_path: Path) -> None:
    from pydantic import ValidationError

    from flows.context import train_config
    from flows.models import PipelineParams
    from tasks.backends.base import Placement

    with pytest.raises(ValidationError, match="metrics_port"):
        PipelineParams(metrics_port=80)
    with pytest.raises(ValidationError, match="metrics_port: 29500 is also eks.rdzv_port"):
        PipelineParams(backend="eks", metrics_port=29500, global_batch=16, nodes=2)
    local = PipelineParams(state_dir=str(tmp_path), metrics_port=20000)
    cfg = train_config(
        local, Placement(shared_root=tmp_path, local_paths=False), tmp_path, tmp_path
    )
    assert (cfg.metrics_port, cfg.metrics_addr) == (20001, "127.0.0.1")
    off = PipelineParams(state_dir=str(tmp_path), metrics_port=None)
    where = Placement(shared_root=tmp_path)
    assert train_config(off, where, tmp_path, tmp_path).metrics_port is None


# -- EKS -------------------------------------------------------------------------------------


def _eks_docs(**kw: Any) -> list[dict[str, Any]]:
    from flows.context import eks_train_config
    from flows.models import PipelineParams
    from tasks.backends.eks.render import render_all

    p = PipelineParams(backend="eks", nodes=2, global_batch=16, run_id="m1", **kw)
    return render_all(eks_train_config(p, "m1"), run_id="m1", attempt=1, nodes=2, eks=p.eks)


def test_training_pods_expose_rank0s_port_and_admit_the_scrape() -> None:
    policy, _svc, _config, job = _eks_docs()
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "metrics", "containerPort": 9464} in container["ports"]
    assert "--config=" in " ".join(container["args"])  # the port travels in the config file
    [scrape_rule] = [r for r in policy["spec"]["ingress"] if "ports" in r]
    assert scrape_rule == {
        "from": [
            {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
        ],
        "ports": [{"protocol": "TCP", "port": 9464}],
    }
    policy, _svc, _config, job = _eks_docs(metrics_port=None)
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert [p["name"] for p in container["ports"]] == ["rdzv"]
    assert all("ports" not in r for r in policy["spec"]["ingress"])


def _podmonitors() -> list[dict[str, Any]]:
    path = REPO / "deploy" / "eks" / "podmonitor.yaml"
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


# The PodMonitor is a CRD (prometheus-operator), which kubernetes-validate has no schema for:
# the part of monitoring.coreos.com/v1 PodMonitor that these documents use, strict.
_PODMONITOR_SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "PodMonitor"},
        "metadata": {
            "type": "object",
            "required": ["name", "namespace"],
            "properties": {
                "name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
                "namespace": {"type": "string"},
                "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            },
            "additionalProperties": False,
        },
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector", "podMetricsEndpoints"],
            "properties": {
                "jobLabel": {"type": "string"},
                "podTargetLabels": {"type": "array", "items": {"type": "string"}},
                "namespaceSelector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "matchNames": {"type": "array", "items": {"type": "string"}},
                        "any": {"type": "boolean"},
                    },
                },
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "matchLabels": {
                            "type": "object",
                            "additionalProperties": {"type": "string"},
                        }
                    },
                },
                "podMetricsEndpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["port"],
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string"},
                            "interval": {"type": "string", "pattern": r"^\d+[smh]$"},
                            "scrapeTimeout": {"type": "string", "pattern": r"^\d+[smh]$"},
                            "honorLabels": {"type": "boolean"},
                        },
                    },
                },
            },
        },
    },
}


def test_podmonitors_select_the_pods_that_serve_metrics() -> None:
    import jsonschema

    from flows.models import PipelineParams
    from tasks.backends.eks.pod import METRICS_PORT_NAME
    from tasks.backends.eks.render import labels

    docs = {d["metadata"]["name"]: d for d in _podmonitors()}
    for doc in docs.values():
        jsonschema.validate(doc, _PODMONITOR_SCHEMA)
        assert doc["spec"]["namespaceSelector"] == {"matchNames": ["nvrx"]}
        assert [e["port"] for e in doc["spec"]["podMetricsEndpoints"]] == [METRICS_PORT_NAME]
    _policy, _svc, _config, job = _eks_docs()
    pod_labels = job["spec"]["template"]["metadata"]["labels"]
    trainer = docs["nvrx-trainer"]["spec"]["selector"]["matchLabels"]
    assert trainer.items() <= pod_labels.items() and trainer.items() <= labels("x", 9).items()
    # The flow-run pods (the work pool's template) serve the run-level metrics on the same port.
    pool = json.loads((REPO / "deploy" / "eks" / "work-pool-template.json").read_text())
    pod = pool["job_configuration"]["job_manifest"]["spec"]["template"]
    flow = docs["nvrx-flow-run"]["spec"]["selector"]["matchLabels"]
    assert flow.items() <= pod["metadata"]["labels"].items()
    [port] = pod["spec"]["containers"][0]["ports"]
    assert port == {"name": METRICS_PORT_NAME, "containerPort": PipelineParams().metrics_port}
    bad = json.loads(json.dumps(docs["nvrx-trainer"]))
    bad["spec"]["podMetricsEndpoint"] = bad["spec"].pop("podMetricsEndpoints")  # typo
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, _PODMONITOR_SCHEMA)


# -- the dashboard ---------------------------------------------------------------------------

DASHBOARD = REPO / "deploy" / "grafana" / "nvrx-dashboard.json"


def _exported_names() -> set[str]:
    """Every sample name the two registries serve, from the families' types: a labelled series
    that saw no event yet (faults by kind) has no sample to read the name from."""
    suffixes = {
        "counter": ("_total",),
        "gauge": ("",),
        "histogram": ("_bucket", "_sum", "_count"),
        "info": ("_info",),
    }
    return {
        fam.name + sfx
        for registry in (Rank0Metrics("x").registry, RunMetrics("x").registry)
        for fam in registry.collect()
        for sfx in suffixes[fam.type]
    }


def _panels(dash: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for p in dash["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))
    return out


def dashboard_queries(dash: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel or annotation title, PromQL) for every query the dashboard runs."""
    out = [(p["title"], t["expr"]) for p in _panels(dash) for t in p.get("targets", [])]
    out += [(a["name"], a["expr"]) for a in dash["annotations"]["list"] if "expr" in a]
    return out


def _unexported(dash: dict[str, Any]) -> dict[str, set[str]]:
    """Per panel or annotation, the metric names its expressions use that no registry exports."""
    exported = _exported_names()
    out = {}
    for title, expr in dashboard_queries(dash):
        names = set(re.findall(r"\bnvrx_[a-z0-9_]+", expr))
        assert names, (title, expr)
        if names - exported:
            out[title] = names - exported
    return out


def test_dashboard_uses_only_metrics_the_code_exports() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["schemaVersion"] >= 36
    [ds] = [v for v in dash["templating"]["list"] if v["type"] == "datasource"]
    assert ds["query"] == "prometheus"
    assert _unexported(dash) == {}
    exprs = [expr for _title, expr in dashboard_queries(dash)]
    for p in _panels(dash):
        for t in p.get("targets", []):
            assert t["datasource"]["uid"] == "${" + ds["name"] + "}", p["title"]
    # faults and restarts are marked on every panel's time axis (Grafana annotations)
    marks = {a["name"]: a for a in dash["annotations"]["list"]}
    assert marks["Faults"]["enable"] and marks["Restarts"]["enable"]
    assert all(a["datasource"]["uid"] == "${" + ds["name"] + "}" for a in marks.values())
    used = {n for e in exprs for n in re.findall(r"\bnvrx_[a-z0-9_]+", e)}
    for needed in (
        "nvrx_train_steps_total",
        "nvrx_train_loss",
        "nvrx_train_tokens_total",
        "nvrx_restarts_total",
        "nvrx_recovery_seconds_bucket",
        "nvrx_checkpoint_blocking_seconds_bucket",
        "nvrx_checkpoint_commit_latency_seconds_bucket",
        "nvrx_ettr_ratio",
    ):
        assert needed in used, needed
    assert any("rate(nvrx_train_steps_total" in e for e in exprs)  # the step rate
    # Issue 27: counters are plotted as rates or increases, never raw.
    raw = [
        e
        for e in exprs
        for name in re.findall(r"\bnvrx_[a-z0-9_]+_total\b", e)
        if not re.search(rf"(rate|increase)\({name}\b", e)
    ]
    assert raw == []


def test_dashboard_check_catches_a_name_the_code_does_not_export() -> None:
    dash = json.loads(DASHBOARD.read_text())
    target = dash["panels"][1]["targets"][0]
    target["expr"] = target["expr"].replace("nvrx_train_steps_total", "nvrx_train_step_total")
    assert _unexported(dash) == {dash["panels"][1]["title"]: {"nvrx_train_step_total"}}
    mark = dash["annotations"]["list"][0]
    mark["expr"] = mark["expr"].replace("nvrx_faults_detected_total", "nvrx_fault_total")
    assert _unexported(dash)[mark["name"]] == {"nvrx_fault_total"}


# -- alert rules (issue 27) -----------------------------------------------------------------------
RULES = REPO / "deploy" / "prometheus" / "nvrx-alerts.yaml"


def _promtool() -> str:
    import shutil

    found = shutil.which("promtool")
    assert found, "promtool not found: `make test` installs Debian's prometheus (make promtool)"
    return found


def test_shipped_alert_rules_pass_promtool_and_fire_as_their_unit_tests_say() -> None:
    """`promtool check rules` on the shipped rules, and `promtool test rules` over recorded
    series of stalled, storming, uncommitted and retried runs (each alert fires when it must,
    with its labels and text, and stays silent otherwise)."""
    checked = subprocess.run(
        [_promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 5 rules found" in checked.stdout
    tested = subprocess.run(
        [_promtool(), "test", "rules", "nvrx-alerts.test.yaml"],
        cwd=REPO / "tests" / "prometheus",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_alert_rules_use_only_exported_metrics_and_ship_as_a_prometheusrule() -> None:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    exported = _exported_names()
    used = {
        name
        for g in groups
        for r in g["rules"]
        for name in re.findall(r"\b(nvrx_[a-z_]+)", r["expr"])
    }
    assert used and used <= exported, used - exported
    docs = list(yaml.safe_load_all((REPO / "deploy" / "eks" / "prometheus-rule.yaml").read_text()))
    [rule] = [d for d in docs if d and d["kind"] == "PrometheusRule"]
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["spec"]["groups"] == groups  # the same rules promtool checked


def test_grafana_gets_the_dashboard_on_eks_and_locally() -> None:
    """kube-prometheus-stack: the ConfigMap its Grafana sidecar loads holds this very dashboard
    (regenerated by deploy/grafana/render_configmap.py); locally: provisioning that points a
    Grafana at the `make monitor` Prometheus and at the dashboard file."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "render_configmap", REPO / "deploy" / "grafana" / "render_configmap.py"
    )
    assert spec and spec.loader
    render = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(render)
    shipped = (REPO / "deploy" / "eks" / "grafana-dashboard.yaml").read_text()
    assert shipped == render.render(), "run: python deploy/grafana/render_configmap.py"
    cm = yaml.safe_load(shipped)
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["nvrx-dashboard.json"]) == json.loads(DASHBOARD.read_text())

    prov = REPO / "deploy" / "grafana" / "provisioning"
    [source] = yaml.safe_load((prov / "datasources" / "nvrx-local.yaml").read_text())["datasources"]
    local = yaml.safe_load((REPO / "deploy" / "prometheus" / "prometheus-local.yml").read_text())
    make = (REPO / "Makefile").read_text()
    assert source["type"] == "prometheus"
    assert f"--web.listen-address={source['url'].removeprefix('http://')}" in make
    assert source["jsonData"]["timeInterval"] == local["global"]["scrape_interval"]
    [provider] = yaml.safe_load((prov / "dashboards" / "nvrx.yaml").read_text())["providers"]
    where = provider["options"]["path"].replace("$NVRX_REPO", str(REPO))
    assert (Path(where) / DASHBOARD.name).is_file()
