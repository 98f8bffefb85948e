"""The EKS backend: an Indexed Job per train attempt, watched through the API.

:class:`EksBackend` implements :class:`tasks.backends.base.Backend`; :class:`EksJob` is one
attempt's Job, watched by :func:`tasks.train_stage.run_attempt` like every backend's. The flow
runner mounts the same FSx claim at the same path as the pods, so ``cfg.run_root`` names the same
directory in both: progress comes from the trainer's own ``events.jsonl`` (every rank, nothing
lost to log rotation), the result from its ``result.json``.

A failed Job is kept for forensics by default; a completed one, one that lost a node (the stage
retry relaunches it as the next attempt) and one whose watch was cancelled or crashed are
deleted, so an abandoned Job never holds the GPU nodes (its ``activeDeadlineSeconds`` is the
last resort when the flow runner itself is gone).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tasks import aws
from tasks.backends.base import (
    Hydrated,
    HydrateRequest,
    LaunchRequest,
)
from tasks.backends.eks.classify import (
    History,
    end_of,
    finished,
    lost_indexes,
    node_loss_evidence,
    not_ready_since,
)
from tasks.backends.eks.clients import EksClients, connect
from tasks.backends.eks.hydrate import hydrate_fsx
from tasks.backends.eks.kube import JOB_NAME_LABEL, Kube, iter_queue
from tasks.backends.eks.objects import JobObs, healthy, observe_job, observe_node, observe_pod
from tasks.backends.eks.params import EksParams, cpu_millicores
from tasks.backends.eks.placement import placement
from tasks.backends.eks.render import LABEL_ATTEMPT, LABEL_RUN, job_name, render_all, run_label
from tasks.checks import CheckResult, Status
from tasks.classify import EndKind, Observation, Outcome
from tasks.errors import CapacityNotRestored
from tasks.preflight.checks import S3_CHECKS, Snapshot, check_node_memory
from tasks.preflight.eks import EksRequirements, check_nodes, gather_eks, run_eks_checks
from tasks.preflight.local import gather_s3
from tasks.preflight.memory import node_memory_need_of
from trainer.config import save_config
from trainer.event_types import Event, StaleJobsDeleted
from trainer.events import STDOUT_PREFIX, EventLog
from trainer.rundir import Layout

# Failures whose Job is kept for forensics (when its pods have ended), and how long to wait
# for the other pods to end after the first failure decided the outcome.
KEEPABLE = (EndKind.DO_NOT_REQUEUE, EndKind.INJOB_EXHAUSTED, EndKind.BUG)
SETTLE_S = 30.0


def _attempt_job_name(request: LaunchRequest) -> str:
    """The attempt's Job (and Service, ConfigMap, NetworkPolicy) name: the invocation's tag
    in it, so a later invocation's attempt of the same number is another Job."""
    return job_name(request.run_id, request.attempt, request.invocation[:6])


def delete_run_jobs(kube: Kube, namespace: str, run_id: str) -> list[str]:
    """Delete every Job of run ``run_id`` (with its Service and NetworkPolicy); their names."""
    stale = kube.jobs_labelled(namespace, LABEL_RUN, run_label(run_id))
    for name in stale:
        kube.delete_job(namespace, name)
    return stale


def wait_for_nodes(
    kube: Kube,
    req: EksRequirements,
    *,
    timeout_s: float,
    poll_s: float,
    log: Callable[[str], None] = lambda msg: None,
) -> CheckResult:
    """Before a train attempt that follows a node loss: wait, bounded, until the cluster again
    has enough healthy GPU/EFA nodes. The decision is the preflight's own pure node check on a
    fresh node list each poll, so "healthy" means the same before the first attempt and after
    a loss."""
    started = time.monotonic()
    while True:
        snap = Snapshot()
        try:
            snap.facts["nodes"] = kube.nodes()
        except Exception as e:
            snap.errors["nodes"] = f"cannot list nodes: {e}"
        result = check_nodes(snap, req)
        if result.status == Status.PASSED:
            return result
        waited = time.monotonic() - started
        if waited >= timeout_s:
            raise CapacityNotRestored(
                f"after {waited:.0f} s (eks.node_wait_s={timeout_s:.0f}) still too few healthy "
                f"nodes: {result.detail}; {result.fix or 'check the node group'}, then re-run "
                "with the same run_id to resume from the newest valid checkpoint"
            )
        log(f"waiting for healthy nodes ({waited:.0f} s): {result.detail}")
        time.sleep(poll_s)


class _RankZeroLog:
    """Follows the log of the newest rank-0 pod (a relaunched pod gets a new stream) into
    ``log``, less its events (those arrive from events.jsonl)."""

    def __init__(self, kube: Kube, ns: str, log: Callable[[str], None]) -> None:
        self.kube, self.ns, self.log = kube, ns, log
        self.pod: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def follow(self, pod: str | None) -> None:
        if pod is None or pod == self.pod:
            return
        self.close(grace_s=0.0)
        self.pod, self._stop = pod, threading.Event()
        self._thread = threading.Thread(
            target=self.kube.follow_log,
            args=(self.ns, pod, self._line, self._stop),
            daemon=True,
            name=f"log-{pod}",
        )
        self._thread.start()

    def _line(self, line: str) -> None:
        if not line.startswith(STDOUT_PREFIX):
            self.log(f"[rank 0] {line}")

    def close(self, grace_s: float) -> None:
        """Give the stream ``grace_s`` to deliver the last lines of an ended container."""
        if self._thread is not None:
            self._thread.join(grace_s)
        self._stop.set()


class EksJob:
    """One attempt's Indexed Job: Pods and Nodes watched (threads feeding a queue), the history
    read on every poll until it ends (:func:`end_of`), the rank-0 pod's log followed."""

    def __init__(
        self,
        kube: Kube,
        *,
        eks: EksParams,
        name: str,
        attempt: int,
        nodes: int,
        poll_s: float,
        log: Callable[[str], None],
    ) -> None:
        self.kube, self.eks, self.name, self.attempt = kube, eks, name, attempt
        self.ns = eks.namespace
        self.poll_s = poll_s
        # The deleted pod's end and conditions reach the watch asynchronously.
        self.loss_grace_s = 2.0
        self.history = History(completions=nodes, not_ready_s=float(eks.unreachable_toleration_s))
        self.observed: Observation | None = None
        self._reported: set[str] = set()  # pods whose loss losses() reported
        self._deleted = False
        self._q: queue.Queue[tuple[str, str, dict[str, Any]]] = queue.Queue()
        self._stop = threading.Event()
        for what in ("pod", "node"):
            args, thread = (what, self.ns, self._q, self._stop), f"watch-{what}"
            threading.Thread(target=kube.watch, args=args, daemon=True, name=thread).start()
        self._log = _RankZeroLog(kube, self.ns, log)

    def _drain(self, now: float) -> None:
        for what, kind, obj in iter_queue(self._q):
            if what == "pod":
                if (obj.get("metadata", {}).get("labels") or {}).get(JOB_NAME_LABEL) == self.name:
                    self.history.pods.append(observe_pod(obj, now, deleted=kind == "DELETED"))
            else:
                self.history.nodes.append(observe_node(obj, now, deleted=kind == "DELETED"))

    def _settled(self) -> bool:
        pods = self.history.latest().values()
        return all(p.phase in ("Succeeded", "Failed") or p.deleted for p in pods)

    # -- the Job protocol --------------------------------------------------------------------
    def running(self) -> bool:
        now = time.time()
        self._drain(now)
        job = self.kube.read_job(self.ns, self.name)
        if job is not None:
            self.history.jobs.append(observe_job(job, now))
        elif self.history.jobs and not self._deleted and not self.history.jobs[-1].gone:
            # Seen, now gone, and not by our stop(): deleted outside the pipeline.
            self.history.jobs.append(JobObs(t=now, gone=True))
        pods = reversed(self.history.pods)
        self._log.follow(next((p.name for p in pods if p.index == 0 and p.node), None))
        self.observed = end_of(
            self.history, now=now, unschedulable_timeout_s=self.eks.unschedulable_timeout_s
        )
        return self.observed is None

    # The index-0 pod hosts the rendezvous store ($JOB-0.$SVC): it cannot be replaced in-job.
    store_host: int | None = 0

    def observe(self, event: Event) -> None:
        return None

    def alive_nodes(self) -> frozenset[int]:
        self._drain(time.time())
        gone = node_loss_evidence(self.history, now=time.time())
        return frozenset(
            p.index
            for p in self.history.latest().values()
            if p.index is not None
            and not p.deleted
            and p.phase not in ("Succeeded", "Failed")
            and p.name not in gone
        )

    def losses(self) -> frozenset[int]:
        """Indexes whose pod the control plane shows lost with its node, each reported once;
        the watcher decides them (tasks.loss_policy) and absorbs those the in-job layer can."""
        now = time.time()
        self._drain(now)
        new = {n: i for n, i in lost_indexes(self.history, now).items() if n not in self._reported}
        self._reported |= new.keys()
        # A pod on a node NotReady past the bound may still run (its kubelet is alive, and
        # Kubernetes has not evicted it): it is taken away, so that the survivors re-form
        # without it and a writer of it is not left training beside them.
        not_ready = not_ready_since(self.history, now)
        latest = self.history.latest()
        for name in new:
            pod = latest.get(name)
            if pod is not None and pod.node in not_ready and not pod.deleted:
                self.history.deleted_by_us.add(name)
                with contextlib.suppress(Exception):  # decided either way; fenced if it lives
                    self.kube.delete_pod(self.ns, name)
        return frozenset(new.values())

    def absorb(self, node: int) -> None:
        """Index ``node``'s pods so far (the drill's, before it deletes them) decide nothing
        more: the in-job layer re-forms without them, the Job controller replaces them (the
        elastic Job's pod failure policy ignores the disruption)."""
        self._drain(time.time())
        names = {p.name for p in self.history.pods if p.index == node}
        self.history.absorbed |= names
        self._reported |= names

    def lose_node(self, node: int) -> None:
        """Delete the pod of index ``node`` through the API (a node-loss drill, or a node the
        watcher found silent), as a lost node's pods go (grace period 0: a dead node runs no
        SIGTERM handler; on an unreachable node the pod may live on until the node returns,
        and its writers are fenced then)."""
        self._delete_index(node, grace_s=0)

    def evict_node(self, node: int, grace_s: float) -> None:
        """The node-evict drill: delete the pod of index ``node`` with the grace an eviction
        gives it (a drain's Eviction API call does the same delete once its disruption budget
        allows), so its kubelet sends the launcher SIGTERM and SIGKILL ``grace_s`` later. The
        delete permission the pipeline holds already; the Eviction API would be one more."""
        self._delete_index(node, grace_s=int(grace_s))

    def _delete_index(self, node: int, *, grace_s: int) -> None:
        pods = [
            p
            for p in self.kube.job_pods(self.ns, self.name)
            if observe_pod(p, 0.0).index == node and not p["metadata"].get("deletionTimestamp")
        ]
        if not pods:
            raise ValueError(f"drill: Job {self.name} has no pod of index {node}")
        for p in pods:
            self.history.deleted_by_us.add(p["metadata"]["name"])
            self.kube.delete_pod(self.ns, p["metadata"]["name"], grace_s=grace_s)

    def cordon_node(self, node: int) -> str | None:
        """Cordon the Kubernetes Node under the pod of index ``node`` (a node confirmed slow,
        tasks.straggler) before the watcher takes the pod away, so that the pod replacing it
        is scheduled elsewhere; returns the Node's name (None: the pod was not placed)."""
        for p in self.kube.job_pods(self.ns, self.name):
            pod = observe_pod(p, 0.0)
            if pod.index == node and pod.node and not p["metadata"].get("deletionTimestamp"):
                self.kube.cordon(pod.node)
                return pod.node
        return None

    def stop(self) -> None:
        self._close_watch()
        if not self._deleted:
            self._deleted = True
            self.kube.delete_job(self.ns, self.name)

    def observation(self) -> Observation:
        return finished(self.observed, job=f"{self.ns}/{self.name}", fsx_mount=self.eks.fsx_mount)

    def finish(self, outcome: Outcome) -> dict[str, Any]:
        ended = any(p.phase == "Failed" for p in self.history.pods)
        keep = not self._deleted and outcome.kind in KEEPABLE and self.eks.keep_failed_job and ended
        if keep:
            # The first failed pod decides the outcome; the Job controller then stops the others
            # (backoffLimit 0). Give them a moment to end, so the Job is kept with every pod's
            # final state; one that still holds nodes is never kept.
            settle_until = time.monotonic() + SETTLE_S
            while not self._settled() and time.monotonic() < settle_until:
                time.sleep(self.poll_s)
                self._drain(time.time())
            keep = self._settled()
        if not keep:
            self.stop()
        self._close_watch()
        return {"job": self.name, "kept_job": keep}

    def _close_watch(self) -> None:
        self._stop.set()
        self._log.close(grace_s=2.0)


class EksBackend:
    name = "eks"

    def __init__(
        self,
        eks: EksParams,
        *,
        nodes: int,
        log: Callable[[str], None] = lambda msg: None,
        clients: EksClients | None = None,
    ) -> None:
        self.eks = eks
        self.nodes = nodes
        self.placement = placement(self.eks)
        self.log = log
        self._clients = clients

    @property
    def clients(self) -> EksClients:
        if self._clients is None:
            self._clients = connect(self.eks.region)
            # Which region answered is the first question when FSx or a bucket is "not found".
            region = aws.resolve_region(self.eks.region, setting="eks.region")
            self.log(f"AWS region of FSx and S3: {region}")
        return self._clients

    @property
    def requirements(self) -> EksRequirements:
        eks = self.eks
        return EksRequirements(
            nodes=self.nodes,
            gpus_per_node=eks.gpus_per_node,
            efa_per_node=eks.pod_efa(),
            instance_type=eks.instance_type,
            namespace=eks.namespace,
            fsx_claim=eks.fsx_claim,
            file_system_id=eks.file_system_id,
            cpu_m=cpu_millicores(eks.pod_cpu()),
            memory_mib=eks.pod_memory_gi() * 1024,
        )

    def preflight(self, req: Any, s3: dict[str, Any]) -> list[CheckResult]:
        clients = self.clients
        snap = gather_eks(clients.kube, clients.fsx, self.requirements)
        gather_s3(snap, **s3)
        # A pod's node memory is its memory-backed /dev/shm, as large as the form sizes it.
        shm = self.eks.pod_shm_gi(req.node_memory_gb)
        sized = (
            "eks.shm_gi" if self.eks.shm_gi is not None else "sized from the model, at most half"
        )
        snap.facts["node_memory_free_gb"] = shm * 2**30 / 1e9
        snap.facts["node_memory_where"] = f"the pod's /dev/shm ({shm} GiB, {sized})"
        checks = (*S3_CHECKS, check_node_memory)
        return run_eks_checks(snap, self.requirements) + [check(snap, req) for check in checks]

    def hydrate(
        self, request: HydrateRequest, progress: Callable[[int, int, str], None]
    ) -> Hydrated:
        return hydrate_fsx(self.clients, self.eks, request, progress=self.log)

    def _job(self, name: str, attempt: int, nodes: int) -> EksJob:
        kube, poll_s = self.clients.kube, self.clients.poll_s
        return EksJob(
            kube, eks=self.eks, name=name, attempt=attempt, nodes=nodes, poll_s=poll_s, log=self.log
        )

    def reattach(self, request: LaunchRequest) -> EksJob | None:
        """A Job of this run that is running and healthy (its flow runner was replaced) is
        watched to its end: the GPUs keep training. Anything else of the run is left for
        :meth:`launch` to delete."""
        kube = self.clients.kube
        names = kube.jobs_labelled(self.eks.namespace, LABEL_RUN, run_label(request.run_id))
        if not names:
            return None
        nodes = kube.nodes()
        for name in names:
            job = kube.read_job(self.eks.namespace, name)
            if job is None:
                continue
            ok, why = healthy(job, kube.job_pods(self.eks.namespace, name), nodes, t=time.time())
            if not ok:
                self.log(f"not reattaching: {why}; it is deleted and the attempt relaunched")
                continue
            attempt = int(job["metadata"].get("labels", {}).get(LABEL_ATTEMPT, request.attempt))
            completions = int(job["spec"].get("completions") or request.launched)
            self.log(f"reattaching to the running Job {name}: {why}")
            return self._job(name, attempt, completions)
        return None

    def bundle(self, request: LaunchRequest) -> list[dict[str, Any]]:
        """The attempt's objects, in the order they are applied (the NetworkPolicy first, the
        Job last): what :meth:`launch` creates and what ``render-k8s`` prints (one code path;
        ``kubectl apply -f`` of that output makes the same objects)."""
        tag = request.invocation[:6]
        name = _attempt_job_name(request)
        return render_all(
            request.cfg,
            run_id=request.run_id,
            attempt=request.attempt,
            nodes=request.nodes,
            eks=self.eks,
            deadline_s=request.deadline_s,
            rdzv_id=name,  # unique per invocation too (the tag)
            tag=tag,
            min_nodes=request.min_nodes,
            spares=request.spares,
            epoch=request.epoch,
            secrets=request.secrets,
            node_memory_gb=self._node_memory_gb(request),
        )

    def _node_memory_gb(self, request: LaunchRequest) -> float:
        """What the memory saves keep per pod, for /dev/shm's size (eks.shm_gi empty); 0 when
        the workload's model cannot be counted (its saves then have the rest of /dev/shm)."""
        if self.eks.shm_gi is not None:
            return 0.0
        try:
            need = node_memory_need_of(
                request.cfg,
                nodes=request.min_nodes or request.nodes,
                peers=request.nodes > 1,
            )
        except Exception as e:  # a script's workload, a model that cannot be built on meta
            self.log(f"/dev/shm sized without the memory saves' need: {type(e).__name__}: {e}")
            return 0.0
        return 0.0 if need is None else need.gb

    def launch(self, request: LaunchRequest) -> EksJob:
        kube, eks, cfg = self.clients.kube, self.eks, request.cfg
        # A run never has two Jobs (arch §6). This invocation holds the run's lease, so any
        # Job of this run still there is an earlier attempt's or a dead flow runner's, holding
        # the nodes (and the checkpoints directory) the new one needs: delete it first.
        stale = delete_run_jobs(kube, eks.namespace, request.run_id)
        if stale:
            EventLog(cfg.run_root).emit(StaleJobsDeleted(jobs=stale, attempt=request.attempt))
        if request.attempt > 1 or stale:
            poll_s = self.clients.poll_s
            wait_for_nodes(
                kube, self.requirements, timeout_s=eks.node_wait_s, poll_s=poll_s, log=self.log
            )
        cfg.run_root.mkdir(parents=True, exist_ok=True)
        # The record of what the attempt ran (the pods read the bundle's ConfigMap).
        save_config(cfg, cfg.run_root / Layout.train_config(request.attempt))
        docs = self.bundle(request)
        name = _attempt_job_name(request)
        job = self._job(name, request.attempt, request.launched)
        try:
            for doc in docs:
                kube.apply(doc)
        except BaseException:
            with contextlib.suppress(Exception):
                job.stop()
            raise
        self.log(
            f"train attempt {request.attempt} on EKS: Job {eks.namespace}/{name}, "
            f"{request.node_range} node(s)"
            + (f" + {request.spares} spare(s)" if request.spares else "")
            + f" x {eks.gpus_per_node} GPU(s)"
        )
        return job

    def cleanup(self, run_id: str, run_root: Path) -> list[str]:
        return delete_run_jobs(self.clients.kube, self.eks.namespace, run_id)
