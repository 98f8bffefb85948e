"""Pods, Nodes and Jobs as the EKS watcher keeps them: pure conversions of API objects (dicts as
the API serialises them) into small frozen snapshots, read by :mod:`tasks.backends.eks.classify`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class PodObs:
    name: str
    t: float
    index: int | None = None
    phase: str = "Pending"
    node: str | None = None
    exit_code: int | None = None
    terminated_reason: str | None = None  # e.g. OOMKilled, Error, Completed
    waiting_reason: str | None = None  # e.g. ImagePullBackOff
    waiting_message: str = ""
    image: str | None = None  # the container's image (what an image pull failure names)
    disruption_reason: str | None = None  # DisruptionTarget=True: its reason
    unschedulable_message: str | None = None  # PodScheduled=False/Unschedulable
    status_reason: str | None = None  # Evicted, Terminated
    deleted: bool = False


@dataclass(frozen=True)
class NodeObs:
    name: str
    t: float
    ready: str = "True"  # True / False / Unknown
    reason: str = ""
    deleted: bool = False


@dataclass(frozen=True)
class JobObs:
    t: float
    # The Job was there and is gone, deleted by none of ours (kubectl, another controller).
    gone: bool = False
    complete: bool = False
    failed: bool = False
    failed_reason: str = ""
    failed_message: str = ""
    # The Job controller is ending it (SuccessCriteriaMet or FailureTarget): the pods it
    # deletes now are its own doing.
    terminating: bool = False


def _conditions(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in (obj.get("status") or {}).get("conditions") or []}


def observe_pod(pod: dict[str, Any], t: float, *, deleted: bool = False) -> PodObs:
    meta, spec, status = pod.get("metadata", {}), pod.get("spec", {}), pod.get("status") or {}
    conds = _conditions(pod)
    annotations = meta.get("annotations") or {}
    labels = meta.get("labels") or {}
    raw_index = labels.get("batch.kubernetes.io/job-completion-index") or annotations.get(
        "batch.kubernetes.io/job-completion-index"
    )
    exit_code = terminated_reason = waiting_reason = None
    waiting_message = ""
    image = next((c.get("image") for c in spec.get("containers") or []), None)
    for cs in status.get("containerStatuses") or []:
        image = cs.get("image") or image
        state = cs.get("state") or {}
        if "terminated" in state:
            exit_code = state["terminated"].get("exitCode")
            terminated_reason = state["terminated"].get("reason")
        if "waiting" in state:
            waiting_reason = state["waiting"].get("reason")
            waiting_message = state["waiting"].get("message", "")
    disruption = conds.get("DisruptionTarget")
    scheduled = conds.get("PodScheduled")
    return PodObs(
        name=meta.get("name", "?"),
        t=t,
        index=int(raw_index) if raw_index is not None else None,
        phase=status.get("phase", "Pending"),
        node=spec.get("nodeName"),
        exit_code=exit_code,
        terminated_reason=terminated_reason,
        waiting_reason=waiting_reason,
        waiting_message=waiting_message,
        image=image,
        disruption_reason=(disruption.get("reason") or "DisruptionTarget")
        if disruption and disruption.get("status") == "True"
        else None,
        unschedulable_message=scheduled.get("message", "")
        if scheduled
        and scheduled.get("status") == "False"
        and scheduled.get("reason") == "Unschedulable"
        else None,
        status_reason=status.get("reason"),
        deleted=deleted,
    )


def observe_node(node: dict[str, Any], t: float, *, deleted: bool = False) -> NodeObs:
    ready = _conditions(node).get("Ready", {})
    return NodeObs(
        name=node.get("metadata", {}).get("name", "?"),
        t=t,
        ready=ready.get("status", "Unknown"),
        reason=ready.get("reason", ""),
        deleted=deleted,
    )


def observe_job(job: dict[str, Any], t: float, *, deleted: bool = False) -> JobObs:
    conds = _conditions(job)
    failed = conds.get("Failed", {})
    return JobObs(
        t=t,
        gone=deleted,
        complete=conds.get("Complete", {}).get("status") == "True",
        failed=failed.get("status") == "True",
        failed_reason=failed.get("reason", ""),
        failed_message=failed.get("message", ""),
        terminating=any(
            conds.get(c, {}).get("status") == "True"
            for c in ("SuccessCriteriaMet", "FailureTarget")
        ),
    )


def healthy(
    job: dict[str, Any], pods: list[dict[str, Any]], nodes: list[dict[str, Any]], *, t: float
) -> tuple[bool, str]:
    """Is a Job found (a replaced flow runner's) fit to be watched to its end rather than
    relaunched? One that completed while nobody watched (its result stands), or one still
    running where every index has a running pod, none terminated or disrupted, each on a Ready
    node. Returns the verdict and why."""
    j = observe_job(job, t)
    name = job.get("metadata", {}).get("name", "?")
    if j.complete:
        return True, f"Job {name} completed while no flow runner watched it: its result stands"
    if j.failed:
        return False, f"Job {name} has failed ({j.failed_reason or 'Failed'})"
    completions = int((job.get("spec") or {}).get("completions") or 1)
    latest = {p.index: p for p in (observe_pod(raw, t) for raw in pods) if p.index is not None}
    missing = sorted(set(range(completions)) - set(latest))
    if missing:
        return False, f"Job {name}: no pod for index(es) {missing}"
    ready = {n.name: n.ready for n in (observe_node(n, t) for n in nodes)}
    for i, p in sorted(latest.items()):
        if p.phase != "Running" or p.exit_code is not None or p.waiting_reason is not None:
            return False, f"Job {name}: pod {p.name} (index {i}) is {p.phase}"
        if p.disruption_reason is not None:
            return False, f"Job {name}: pod {p.name} is being disrupted ({p.disruption_reason})"
        if ready.get(p.node or "") != "True":
            return False, f"Job {name}: pod {p.name}'s node {p.node} is not Ready"
    return True, f"Job {name}: all {completions} pod(s) running on Ready nodes"
