"""One train-stage attempt on EKS: apply the Job and Service, watch Pods and Nodes, follow the
rank-0 pod's log, classify the history, clean up.

The deadline is enforced here (Prefect cannot interrupt blocking code). A failed Job is kept for
forensics by default; a completed one, and one that lost a node (the stage retry relaunches it
as the next attempt), are deleted.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tasks.backends.eks.classify import History, classify_history, observe_job, observe_node
from tasks.backends.eks.classify import observe_pod as _observe_pod
from tasks.backends.eks.kube import JOB_NAME_LABEL, Kube, iter_queue
from tasks.backends.eks.params import EksParams
from tasks.backends.eks.render import job_name, render_all
from tasks.classify import EndKind, Outcome
from trainer.config import TrainConfig

# Failures whose Job is kept for forensics (when its pods have ended), and how long to wait
# for the other pods to end after the first failure decided the outcome.
KEEPABLE = (EndKind.DO_NOT_REQUEUE, EndKind.INJOB_EXHAUSTED, EndKind.BUG)
SETTLE_S = 30.0


@dataclass
class EksAttemptReport:
    attempt: int
    job: str
    outcome: Outcome
    wall_s: float
    kept_job: bool = False


class _RankZeroLog:
    """Follows the log of the newest rank-0 pod (a relaunched pod gets a new stream)."""

    def __init__(self, kube: Kube, ns: str, on_line: Callable[[str], None]) -> None:
        self.kube, self.ns, self.on_line = kube, ns, on_line
        self.pod: str | None = None
        self._stop: threading.Event | None = None
        self._thread: threading.Thread | None = None

    def follow(self, pod: str | None) -> None:
        if pod is None or pod == self.pod:
            return
        self.close(grace_s=0.0)
        self.pod, self._stop = pod, threading.Event()
        self._thread = threading.Thread(
            target=self.kube.follow_log,
            args=(self.ns, pod, self.on_line, self._stop),
            daemon=True,
            name=f"log-{pod}",
        )
        self._thread.start()

    def close(self, grace_s: float) -> None:
        """Give the stream ``grace_s`` to deliver the last lines of an ended container."""
        if self._thread is not None and self._stop is not None:
            self._thread.join(grace_s)
            self._stop.set()


def run_eks_attempt(
    kube: Kube,
    *,
    cfg: TrainConfig,
    run_id: str,
    attempt: int,
    nodes: int,
    eks: EksParams,
    deadline_s: float,
    on_log: Callable[[str], None] = lambda line: None,
    on_poll: Callable[[], None] = lambda: None,
    poll_s: float = 1.0,
) -> EksAttemptReport:
    """``on_log`` gets the rank-0 pod's log lines (from a follower thread); ``on_poll`` runs
    once per watch loop iteration, in this thread (the caller reads its progress there)."""
    ns = eks.namespace
    name = job_name(run_id, attempt)
    docs = render_all(
        cfg, run_id=run_id, attempt=attempt, nodes=nodes, eks=eks, deadline_s=deadline_s
    )
    for doc in docs:
        kube.apply(doc)
    history = History(completions=nodes)
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
    log = _RankZeroLog(kube, ns, on_log)
    started = time.monotonic()
    outcome: Outcome | None = None

    def drain(now: float) -> None:
        for what, kind, obj in iter_queue(q):
            if what == "pod":
                if (obj.get("metadata", {}).get("labels") or {}).get(JOB_NAME_LABEL) == name:
                    history.pods.append(_observe_pod(obj, now, deleted=kind == "DELETED"))
            else:
                history.nodes.append(observe_node(obj, now, deleted=kind == "DELETED"))

    def settled() -> bool:
        latest = {p.name: p for p in history.pods}
        return all(p.phase in ("Succeeded", "Failed") or p.deleted for p in latest.values())

    done = False  # the watch reached an outcome (not cancelled, interrupted or crashed)
    try:
        while outcome is None:
            now = time.time()
            drain(now)
            job = kube.read_job(ns, name)
            if job is not None:
                history.jobs.append(observe_job(job, now))
            log.follow(
                next((p.name for p in reversed(history.pods) if p.index == 0 and p.node), None)
            )
            on_poll()
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
        ended = any(p.phase == "Failed" for p in history.pods)
        if outcome.kind in KEEPABLE and eks.keep_failed_job and ended:
            # The first failed pod decides the outcome; the Job controller then stops the others
            # (backoffLimit 0). Give them a moment to end, so the Job can be kept with every
            # pod's final state instead of being deleted while some still run.
            settle_until = time.monotonic() + SETTLE_S
            while not settled() and time.monotonic() < settle_until:
                time.sleep(poll_s)
                drain(time.time())
        done = True
    finally:
        stop.set()
        log.close(grace_s=2.0)
        # Keep a failed Job whose pods have all ended (its objects and logs are the forensics);
        # never keep one that still holds nodes (deadline, unschedulable, image pulls retrying),
        # nor anything of an attempt whose watch was cancelled or crashed.
        keep = (
            done
            and outcome is not None
            and outcome.kind in KEEPABLE
            and eks.keep_failed_job
            and settled()
        )
        if not keep:
            if done:
                kube.delete_job(ns, name)
            else:  # unwinding: a failure to delete must not hide why
                with contextlib.suppress(Exception):
                    kube.delete_job(ns, name)
    assert outcome is not None
    return EksAttemptReport(attempt, name, outcome, time.monotonic() - started, keep)
