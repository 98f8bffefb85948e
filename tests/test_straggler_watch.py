"""Stragglers through the real watcher (tasks.train_stage.run_attempt): a scripted job appends
what rank 0 would write (a world, step events with per-node busy times, the result), poll by
poll; the watcher, the judge, the loss policy, the event log, the fold and the report are all
real. Table-driven: each row a recorded history and what the run must show for it."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from flows.models import PipelineResult
from flows.report import render_report
from tasks.backends.base import LaunchRequest
from tasks.classify import EndKind
from tasks.metrics import RunMetrics
from tasks.train_stage import run_attempt
from tests.helpers import make_config, read_events
from tests.test_watcher_hostile import STEPS, Action, ScriptedJob, epoch_of, result
from trainer.history import RunHistory
from trainer.straggler_config import StragglerConfig, StragglerPolicy

STEP_S = 0.1  # a healthy step (the writer's clock is synthetic: the judge reads event times)
CFG = StragglerConfig(window=5, confirm_windows=3, confirm_s=2.0, warmup_steps=3)


class Writer:
    """Rank 0's events, each on a poll, with this attempt's epoch and a synthetic clock."""

    def __init__(self) -> None:
        self.t, self.step = time.time(), 0

    def line(self, run_root: Path, event: dict[str, Any]) -> None:
        with open(run_root / "events.jsonl", "a") as f:
            f.write(json.dumps({**event, "epoch": epoch_of(run_root)}) + "\n")

    def world(self, nodes: list[int]) -> Action:
        def act(root: Path) -> None:
            event = {"t": self.t, "kind": "train_start", "world_size": len(nodes), "nodes": nodes}
            self.line(root, event)

        return act

    def steps(self, factors: dict[int, float], n: int) -> list[Action]:
        def act(root: Path) -> None:
            step_s = STEP_S * max(factors.values())
            self.t += step_s
            self.step += 1
            nodes = [{"node": k, "busy_s": STEP_S * f} for k, f in factors.items()]
            event = {"t": self.t, "kind": "step", "step": self.step, "loss": 1.0,
                     "step_s": step_s, "nodes": nodes}  # fmt: skip
            self.line(root, event)

        return [act] * n


@dataclass
class ClusterJob(ScriptedJob):
    """Two nodes (and a hot spare, node 2, if launched): the losses and cordons the watcher
    decides are recorded; the scripted world goes on as the in-job layer's would."""

    nodes: frozenset[int] = frozenset({0, 1, 2})
    lost: list[int] = field(default_factory=list)
    cordoned: list[int] = field(default_factory=list)

    def alive_nodes(self) -> frozenset[int]:
        return self.nodes - set(self.lost)

    def absorb(self, node: int) -> None:
        pass

    def lose_node(self, node: int) -> None:  # type: ignore[override]
        self.lost.append(node)

    def cordon_node(self, node: int) -> str:
        self.cordoned.append(node)
        return f"machine-{node}"


@dataclass
class ClusterBackend:
    script: list[Action]
    name: str = "scripted"
    job: ClusterJob | None = None

    def reattach(self, request: LaunchRequest) -> None:
        return None

    def launch(self, request: LaunchRequest) -> ClusterJob:
        nodes = frozenset(range(request.launched))
        self.job = ClusterJob(request.cfg.run_root, list(self.script), nodes=nodes)
        return self.job


def slow_node_1(w: Writer, *, after: list[int]) -> list[Action]:
    """Node 1 is 3x slow from the first step on, for 8 windows; then the world ``after``
    (a spare in node 1's place) trains 10 healthy steps."""
    return [
        w.world([0, 1]),
        *w.steps({0: 1.0, 1: 3.0}, CFG.warmup_steps + 8 * CFG.window),
        w.world(after),
        *w.steps({n: 1.0 for n in after}, CFG.warmup_steps + 10),
        result(),
    ]


def healthy(w: Writer) -> list[Action]:
    jitter = [{0: 1.0, 1: 1.04}, {0: 1.03, 1: 1.0}, {0: 1.0, 1: 0.98}]
    body = [a for i in range(60) for a in w.steps(jitter[i % 3], 1)]
    return [w.world([0, 1]), *body, result()]


@dataclass(frozen=True)
class Case:
    name: str
    policy: StragglerPolicy
    spares: int
    history: Any  # Writer -> list[Action]
    verdicts: list[tuple[int, str]]  # (node, verdict) in order
    lost: list[int]  # nodes the watcher took away
    outcome: EndKind
    path: str | None = None  # the slow node's loss path


CASES = [
    Case("replace-with-a-spare", StragglerPolicy.REPLACE, 1,
         lambda w: slow_node_1(w, after=[0, 2]), [(1, "suspect"), (1, "replaced")], [1],
         EndKind.COMPLETED, "spare"),
    Case("report-trains-on", StragglerPolicy.REPORT, 1,
         lambda w: slow_node_1(w, after=[0, 1]), [(1, "suspect"), (1, "confirmed")], [],
         EndKind.COMPLETED),
    # A fixed-size job with no spare: the replacement is a stage retry.
    Case("replace-without-a-spare", StragglerPolicy.REPLACE, 0,
         lambda w: slow_node_1(w, after=[0, 1]), [(1, "suspect"), (1, "replaced")], [1],
         EndKind.NODE_LOSS, "stage-retry"),
    Case("fault-free-evicts-nothing", StragglerPolicy.REPLACE, 1, healthy, [], [],
         EndKind.COMPLETED),
]  # fmt: skip


@pytest.mark.parametrize("c", CASES, ids=[c.name for c in CASES])
def test_the_watcher_judges_reports_and_replaces(c: Case, tmp_path: Path, dataset: Path):
    cfg = make_config(
        tmp_path / "run", dataset, steps=STEPS, straggler=StragglerConfig(
            **{**CFG.__dict__, "policy": c.policy}
        ),
    )  # fmt: skip
    request = LaunchRequest(
        run_id="slow", attempt=1, cfg=cfg, nodes=2, nproc_per_node=1, spares=c.spares,
        deadline_s=60,
    )  # fmt: skip
    backend = ClusterBackend(c.history(Writer()))
    report = run_attempt(backend, request)
    assert report.outcome.kind == c.outcome, report.outcome.message
    job = backend.job
    assert job is not None and job.lost == c.lost and job.cordoned == c.lost
    events = read_events(cfg.run_root)
    said = [e for e in events if e["kind"] == "straggler"]
    assert [(e["node"], e["verdict"]) for e in said] == c.verdicts
    faults = [e for e in events if e["kind"] == "fault"]
    if c.lost:
        [fault] = faults
        assert fault["fault_kind"] == "slow" and fault["node"] == 1 and fault["path"] == c.path
        assert (
            fault["fault"].startswith("slow@step=") and "took 1.50x the median" in fault["detail"]
        )
        assert said[-1]["score"] == 1.5  # 3x against a 2-node median (the mean): 1.5
    else:
        assert faults == []
    # The fold, the report and the metrics name it too.
    history = RunHistory.read(cfg.run_root)
    records = history.straggler_records()
    assert [(r.node, r.verdict) for r in records] == c.verdicts[1:]
    md = render_report(
        PipelineResult(status="completed", run_id="slow", target_steps=1, stragglers=records)
    )
    metrics = RunMetrics("slow")
    for e in decoded_events(cfg.run_root):
        metrics.observe(e)
    evictions = metrics.straggler_evictions._value.get()
    assert evictions == len(c.lost)
    if records:
        assert "## Slow nodes" in md and "| 1 | 1.50x |" in md and "3 window(s)" in md
        score = metrics.straggler_score.labels("slow", "1")._value.get()
        assert score == 1.5
    else:
        assert "Slow nodes" not in md


def test_a_stage_retry_keeps_the_eviction_budget(tmp_path: Path, dataset: Path):
    """Two nodes: one eviction per hour. Attempt 1 replaces slow node 1 (a stage retry, no
    spare); the retry's watcher starts from that eviction on record, so node 1, slow again, is
    only reported rate-limited and the attempt trains to its end."""
    straggler = StragglerConfig(**{**CFG.__dict__, "policy": StragglerPolicy.REPLACE})
    cfg = make_config(tmp_path / "run", dataset, steps=STEPS, straggler=straggler)
    outcomes, lost = [], []
    for attempt in (1, 2):
        request = LaunchRequest(
            run_id="slow", attempt=attempt, cfg=cfg, nodes=2, nproc_per_node=1, spares=0,
            deadline_s=60,
        )  # fmt: skip
        backend = ClusterBackend(slow_node_1(Writer(), after=[0, 1]))
        outcomes.append(run_attempt(backend, request).outcome.kind)
        assert backend.job is not None
        lost.append(backend.job.lost)
    assert outcomes == [EndKind.NODE_LOSS, EndKind.COMPLETED] and lost == [[1], []]
    said = [
        (e["node"], e["verdict"]) for e in read_events(cfg.run_root) if e["kind"] == "straggler"
    ]
    assert said == [(1, "suspect"), (1, "replaced"), (1, "suspect"), (1, "rate-limited")]


def decoded_events(root: Path) -> list[Any]:
    from trainer.rundir import RunDir

    return list(RunDir(root).event_reader().iter_new())


def test_on_eks_a_slow_node_is_cordoned_and_its_pod_taken_away(kube: Any, tmp_path: Path):
    """The EKS backend against kmock's API server: under ``replace`` the watcher cordons the
    Kubernetes Node under the slow index's pod (spec.unschedulable, the one Node verb the RBAC
    adds) and deletes the pod; a fixed-size Job's replacement is the stage retry. The other
    Node is left schedulable."""
    from flows.models import PipelineParams
    from tasks.backends.eks.render import job_name
    from tests.eks_cluster import NS
    from tests.test_eks_backend import TAG, ControlPlane, attempt_on
    from trainer import fence
    from trainer.event_types import NodeTime, Step, TrainStart
    from trainer.events import EventLog
    from trainer.rundir import RunDir

    params = PipelineParams(
        backend="eks", nodes=2, global_batch=16, run_id="k-slow",
        eks={"fsx_mount": str(tmp_path)},
        straggler={"policy": "replace", "window": 5, "confirm_s": 0, "warmup_steps": 2},
    )  # fmt: skip
    name = job_name("k-slow", 1, TAG)
    root = tmp_path / "runs" / "k-slow"

    def pods_train(k: Any, job: str) -> None:
        """What rank 0 writes on FSx: the world, then steps in which node 1 is 3x slow."""
        now = fence.current(RunDir(root))
        log = EventLog(root, epoch=now.epoch if now else None)
        log.emit(TrainStart(world_size=16, nodes=[0, 1]))
        for step in range(1, 40):
            times = [NodeTime(node=0, busy_s=0.1), NodeTime(node=1, busy_s=0.3)]
            log.emit(Step(step=step, step_s=0.3, nodes=times))

    driver = ControlPlane(kube, name, pods_train)
    driver.start()
    report = attempt_on(kube, params, deadline_s=30)
    driver.join(5)
    assert report.outcome.kind == EndKind.NODE_LOSS, report.outcome.message
    events = read_events(root)
    [fault] = [e for e in events if e["kind"] == "fault"]
    assert fault["fault_kind"] == "slow" and fault["node"] == 1
    assert fault["path"] == "stage-retry"
    assert [e["verdict"] for e in events if e["kind"] == "straggler"] == ["suspect", "replaced"]
    nodes = {n["metadata"]["name"]: n.get("spec") or {} for n in kube.nodes()}
    assert nodes["ip-10-0-1-2"].get("unschedulable") is True
    assert not nodes["ip-10-0-1-1"].get("unschedulable")
    left = {p["metadata"]["name"] for p in kube.job_pods(NS, name)}
    assert f"{name}-1-x" not in left and f"{name}-0-x" in left
