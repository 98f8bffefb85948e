"""One train-stage attempt on EKS: apply the Job and Service, watch Pods and Nodes, follow the
rank-0 pod's log for progress, classify the history, clean up.

The deadline is enforced here (Prefect cannot interrupt blocking code). A failed Job is kept for
forensics by default; a completed one, and one that lost a node (the stage retry relaunches it
as the next attempt), are deleted.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tasks.backends.eks.classify import History, classify_history, observe_job, observe_node
from tasks.backends.eks.classify import observe_pod as _observe_pod
from tasks.backends.eks.kube import JOB_NAME_LABEL, Kube, iter_queue
from tasks.backends.eks.render import job_name, render_all
from tasks.classify import EndKind, Outcome
from trainer.config import TrainConfig
from trainer.events import parse_stdout_line


@dataclass
class EksAttemptReport:
    attempt: int
    job: str
    outcome: Outcome
    wall_s: float
    events: list[dict[str, Any]] = field(default_factory=list)
    kept_job: bool = False


class _LogFollower:
    """New event lines of the rank-0 pod's log (re-read and diffed: simple and restart-safe)."""

    def __init__(self) -> None:
        self.pod: str | None = None
        self.seen = 0

    def poll(self, kube: Kube, ns: str, pod: str | None) -> list[dict[str, Any]]:
        if pod is None:
            return []
        if pod != self.pod:
            self.pod, self.seen = pod, 0
        lines = kube.pod_log(ns, pod).splitlines()
        new, self.seen = lines[self.seen :], len(lines)
        return [e for e in map(parse_stdout_line, new) if e is not None]


def run_eks_attempt(
    kube: Kube,
    *,
    cfg: TrainConfig,
    run_id: str,
    attempt: int,
    nodes: int,
    eks: Any,
    deadline_s: float,
    on_event: Callable[[dict[str, Any]], None] = lambda e: None,
    poll_s: float = 1.0,
) -> EksAttemptReport:
    ns = eks.namespace
    name = job_name(run_id, attempt)
    for doc in render_all(cfg, run_id=run_id, attempt=attempt, nodes=nodes, eks=eks):
        kube.apply(doc)
    history = History(completions=nodes)
    events: list[dict[str, Any]] = []
    q: queue.Queue[tuple[str, str, dict[str, Any]]] = queue.Queue()
    stop = threading.Event()
    watchers = [
        threading.Thread(
            target=kube.watch, args=(what, ns, q, stop), daemon=True, name=f"watch-{what}"
        )
        for what in ("pod", "node")
    ]
    for w in watchers:
        w.start()
    follower = _LogFollower()
    started = time.monotonic()
    outcome: Outcome | None = None
    try:
        while outcome is None:
            now = time.time()
            for what, kind, obj in iter_queue(q):
                if what == "pod":
                    if (obj.get("metadata", {}).get("labels") or {}).get(JOB_NAME_LABEL) == name:
                        history.pods.append(_observe_pod(obj, now, deleted=kind == "DELETED"))
                else:
                    history.nodes.append(observe_node(obj, now, deleted=kind == "DELETED"))
            job = kube.read_job(ns, name)
            if job is not None:
                history.jobs.append(observe_job(job, now))
            rank0 = next((p.name for p in reversed(history.pods) if p.index == 0 and p.node), None)
            for e in follower.poll(kube, ns, rank0):
                events.append(e)
                on_event(e)
            outcome = classify_history(
                history, now=now, unschedulable_timeout_s=eks.unschedulable_timeout_s
            )
            if outcome is None and time.monotonic() - started > deadline_s:
                outcome = Outcome(
                    EndKind.TIMEOUT,
                    f"train attempt passed its deadline ({deadline_s:.0f} s); "
                    f"Job {ns}/{name} stopped",
                )
            if outcome is None:
                time.sleep(poll_s)
    finally:
        stop.set()
    for e in follower.poll(kube, ns, follower.pod):  # the last lines
        events.append(e)
        on_event(e)
    latest = {p.name: p for p in history.pods}
    settled = all(p.phase in ("Succeeded", "Failed") or p.deleted for p in latest.values())
    # Keep a failed Job whose pods have all ended (its objects and logs are the forensics); never
    # keep one that still holds nodes (deadline, unschedulable, image pulls retrying).
    keep = (
        eks.keep_failed_job
        and settled
        and outcome.kind in (EndKind.DO_NOT_REQUEUE, EndKind.INJOB_EXHAUSTED, EndKind.BUG)
    )
    if not keep:
        kube.delete_job(ns, name)
    return EksAttemptReport(attempt, name, outcome, time.monotonic() - started, events, keep)
