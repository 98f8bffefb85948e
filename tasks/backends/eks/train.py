"""One train-stage attempt on EKS as the pipeline runs it: after a node loss, remove the old Job
and wait (bounded) for healthy nodes; record the attempt in the run's ``events.jsonl`` on FSx;
run the Job (:func:`run_eks_attempt`); record a lost node as a fault so the next attempt's
``recovered`` event (the trainer emits it) closes it with layer ``stage-retry``.

The flow runner mounts the same FSx claim at the same path as the pods, so ``cfg.run_root``
names the same directory in both: progress comes from the trainer's own ``events.jsonl``
(every rank, nothing lost to log rotation), the result from its ``result.json``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from tasks.backends.eks.capacity import wait_for_nodes
from tasks.backends.eks.clients import EksClients
from tasks.backends.eks.kube import Kube
from tasks.backends.eks.params import EksParams
from tasks.backends.eks.render import LABEL_RUN, job_name, labels
from tasks.backends.eks.stage import run_eks_attempt
from tasks.checks import CheckResult
from tasks.classify import EndKind, Outcome
from tasks.preflight.eks import EksRequirements
from tasks.train_stage import AttemptReport, EventTail
from trainer.config import TrainConfig, config_file, save_config
from trainer.events import EventLog
from trainer.resilience import clear_no_restart, read_no_restart


def delete_run_jobs(kube: Kube, namespace: str, run_id: str) -> list[str]:
    """Delete every Job of run ``run_id`` (with its Service and NetworkPolicy); their names."""
    stale = kube.jobs_labelled(namespace, LABEL_RUN, labels(run_id, 1)[LABEL_RUN])
    for name in stale:
        kube.delete_job(namespace, name)
    return stale


def eks_train_attempt(
    clients: EksClients,
    *,
    cfg: TrainConfig,
    run_id: str,
    attempt: int,
    nodes: int,
    eks: EksParams,
    requirements: EksRequirements,
    deadline_s: float,
    on_event: Callable[[dict[str, Any]], None] = lambda e: None,
    on_log: Callable[[str], None] = lambda line: None,
    on_wait: Callable[[CheckResult, float], None] = lambda r, waited: None,
) -> AttemptReport:
    """Returns when the Job ended (or was stopped);
    the outcome's ``details["result"]`` holds the trainer's result when it completed."""
    kube = clients.kube
    # A run never has two Jobs (DESIGN §8). This invocation holds the run's lease, so any Job of
    # this run still there is an earlier attempt's or a dead flow runner's, holding the nodes
    # (and the checkpoints directory) the new one needs: delete it first.
    stale = delete_run_jobs(kube, eks.namespace, run_id)
    if stale:
        EventLog(cfg.run_root).emit("stale_jobs_deleted", jobs=stale, attempt=attempt)
    if attempt > 1 or stale:
        wait_for_nodes(
            kube, requirements, timeout_s=eks.node_wait_s, poll_s=clients.poll_s, on_wait=on_wait
        )
    run_root = cfg.run_root
    run_root.mkdir(parents=True, exist_ok=True)
    result_path = run_root / "result.json"
    result_path.unlink(missing_ok=True)  # only this attempt's result counts
    clear_no_restart(run_root)  # nor an earlier attempt's verdict (the config was fixed)
    save_config(cfg, config_file(run_root, attempt))  # what every pod's workers read
    events = EventLog(run_root)
    tail = EventTail(events.path)
    seen: list[dict[str, Any]] = []

    def pump() -> None:
        for e in tail.read_new():
            seen.append(e)
            on_event(e)

    events.emit(
        "stage_attempt",
        stage="train",
        attempt=attempt,
        nodes=nodes,
        nproc_per_node=eks.gpus_per_node,
        backend="eks",
        job=job_name(run_id, attempt),
    )
    pump()
    report = run_eks_attempt(
        kube,
        cfg=cfg,
        run_id=run_id,
        attempt=attempt,
        nodes=nodes,
        eks=eks,
        deadline_s=deadline_s,
        on_log=on_log,
        on_poll=pump,
        poll_s=clients.poll_s,
    )
    pump()
    outcome = report.outcome
    no_restart = read_no_restart(run_root)
    if no_restart is not None and outcome.kind != EndKind.COMPLETED:
        # A worker said its configuration or data is bad: whatever the pods' exit codes look
        # like after the teardown it started, no retry can fix it.
        outcome = Outcome(
            EndKind.DO_NOT_REQUEUE, f"training cannot continue: {no_restart} (Job {report.job})"
        )
    if outcome.kind == EndKind.NODE_LOSS:
        step = max((e["step"] for e in seen if e["kind"] == "step"), default=None)
        events.emit(  # reaches on_event through the tail (pump), like every other event
            "fault",
            fault=f"node-loss@step={step}" if step is not None else "node-loss",
            fault_kind="node-loss",
            step=step,
            node=None,
            rank=None,
            nodes=outcome.details.get("lost_nodes", []),
            detail=outcome.message,
        )
    elif outcome.kind == EndKind.COMPLETED:
        if result_path.exists():
            outcome.details["result"] = json.loads(result_path.read_text())
        else:
            outcome = Outcome(
                EndKind.BUG,
                f"Job {report.job} completed but {result_path} is missing: does this flow "
                f"runner mount the same FSx file system at {eks.fsx_mount} as the pods "
                "(deploy/eks/work-pool-template.json)?",
            )
    events.emit(
        "stage_attempt_end",
        stage="train",
        attempt=attempt,
        outcome=outcome.kind.value,
        message=outcome.message,
        wall_s=round(report.wall_s, 3),
        job=report.job,
        kept_job=report.kept_job,
    )
    pump()
    return AttemptReport(attempt, outcome, report.wall_s, seen)
