"""How a train attempt on EKS ended, from the Pod/Node/Job objects the watcher observed.

Pure: :func:`observe_pod` / :func:`observe_node` / :func:`observe_job` turn API objects (dicts as
the API serialises them) into small snapshots; :func:`classify_history` judges the whole observed
history (a node seen unreachable once stays a lost node, even after it is deleted).

Node loss, as a watcher sees it (PLATFORM_NOTES): the Node's ``Ready`` goes ``Unknown`` with reason
``NodeStatusUnknown`` (taint ``node.kubernetes.io/unreachable``); its pods get a
``DisruptionTarget=True`` condition with reason ``DeletionByTaintManager`` (or ``DeletionByPodGC``
once the Node is deleted, ``EvictionByEvictionAPI`` on a drain / spot reclaim,
``TerminationByKubelet``/``PreemptionByScheduler``); or a pod simply vanishes together with its
node. ``NodeLost`` is not relied on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from tasks.backends.base import Evidence
from tasks.classify import EXIT_DO_NOT_REQUEUE, EndKind, Outcome

NODE_LOSS_REASONS = frozenset(
    {
        "DeletionByTaintManager",
        "DeletionByPodGC",
        "EvictionByEvictionAPI",
        "TerminationByKubelet",
        "PreemptionByScheduler",
    }
)
IMAGE_PULL_REASONS = frozenset({"ErrImagePull", "ImagePullBackOff", "InvalidImageName"})
# The kubelet cannot build the container's configuration: a Secret or ConfigMap the pod names
# is missing (a declared secret not created in the namespace). It retries forever.
CONFIG_REASONS = frozenset({"CreateContainerConfigError"})


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
    disruption_reason: str | None = None  # DisruptionTarget=True reason
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


@dataclass
class History:
    pods: list[PodObs] = field(default_factory=list)
    nodes: list[NodeObs] = field(default_factory=list)
    jobs: list[JobObs] = field(default_factory=list)
    completions: int = 1
    # Pods whose node loss the in-job layer absorbs (an elastic Job's, tasks.loss_policy):
    # they decide nothing, and a replacement of their index may wait for a node.
    absorbed: set[str] = field(default_factory=set)
    # Pods the pipeline deleted itself (a node-loss drill, a silent node): never "outside".
    deleted_by_us: set[str] = field(default_factory=set)
    # A node its kubelet reports NotReady (Ready=False) this long, with pods of ours on it, is
    # lost: the pods tolerate not-ready that long (eks.unreachable_toleration_s) before
    # Kubernetes itself would evict them, and the pipeline does not wait on an eviction that a
    # cluster may never make (taint-based eviction off, the controller behind). Shorter flaps
    # (a runtime or CNI hiccup) decide nothing.
    not_ready_s: float = 60.0


# A pod deleted by none of ours decides the attempt this long after its deletion was seen, so
# that a Job condition saying the Job controller did it (the deletion and the condition come
# as separate watch events) is seen first.
DELETED_GRACE_S = 5.0


# -- observation (pure conversions of API objects) -------------------------------------------
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
        disruption_reason=disruption.get("reason")
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


# -- judgement ---------------------------------------------------------------------------------
def _latest(pods: Iterable[PodObs]) -> dict[str, PodObs]:
    out: dict[str, PodObs] = {}
    for p in sorted(pods, key=lambda p: p.t):
        out[p.name] = p
    return out


def lost_nodes(h: History, now: float | None = None) -> set[str]:
    """Kubernetes nodes seen unreachable or deleted, ever, or NotReady past the bound now."""
    out = {n.name for n in h.nodes if n.deleted or (n.ready == "Unknown")}
    return out | set(not_ready_since(h, now))


def not_ready_since(h: History, now: float | None) -> dict[str, float]:
    """Nodes whose kubelet has reported NotReady without a break for ``h.not_ready_s`` at
    ``now`` (None: no clock, none), and since when."""
    if now is None:
        return {}
    since: dict[str, float] = {}
    for n in sorted(h.nodes, key=lambda n: n.t):
        if n.ready == "False" and not n.deleted:
            since.setdefault(n.name, n.t)
        else:
            since.pop(n.name, None)
    return {name: t for name, t in since.items() if now - t >= h.not_ready_s}


def _lost_under(h: History, not_ready: dict[str, float]) -> Callable[[PodObs], bool]:
    """Whether a pod's node was lost under it: the node is lost now (its latest observation
    unreachable or deleted, or NotReady past the bound), or was seen lost once the pod existed.
    A pod that first appeared after its node came back (an elastic Job's replacement on a node
    that recovered) was not: the node's earlier loss is its predecessor's. ``not_ready``:
    :func:`not_ready_since`, read once per judgement."""
    last_lost: dict[str, float] = {}
    latest: dict[str, NodeObs] = {}
    for n in sorted(h.nodes, key=lambda n: n.t):
        latest[n.name] = n
        if n.deleted or n.ready == "Unknown":
            last_lost[n.name] = n.t
    first_seen: dict[str, float] = {}
    for p in h.pods:
        first_seen[p.name] = min(p.t, first_seen.get(p.name, p.t))

    def lost(p: PodObs) -> bool:
        if p.node is None:
            return False
        if p.node in not_ready:
            return True
        if p.node not in last_lost:
            return False
        now = latest[p.node]
        return now.deleted or now.ready == "Unknown" or last_lost[p.node] >= first_seen[p.name]

    return lost


def node_loss_evidence(
    h: History, pods: dict[str, PodObs] | None = None, now: float | None = None
) -> dict[str, str]:
    """Pods (by name) that went with their node, in any of its guises, and how each showed it
    (``now``: the clock the NotReady bound is read against; None leaves it out)."""
    not_ready = not_ready_since(h, now)
    lost_under = _lost_under(h, not_ready)
    out: dict[str, str] = {}
    for p in (_latest(h.pods) if pods is None else pods).values():
        if p.disruption_reason in NODE_LOSS_REASONS:
            out[p.name] = f"pod {p.name}: DisruptionTarget {p.disruption_reason}"
        elif now is not None and p.node in not_ready and p.phase != "Succeeded":
            out[p.name] = (
                f"pod {p.name} on node {p.node}, NotReady for {now - not_ready[p.node]:.0f} s "
                f"(bound {h.not_ready_s:.0f} s)"
            )
        elif lost_under(p) and p.phase not in ("Succeeded",):
            out[p.name] = f"pod {p.name} on lost node {p.node}"
        elif p.deleted and lost_under(p):
            out[p.name] = f"pod {p.name} vanished with node {p.node}"
        elif p.status_reason in ("Evicted", "Terminated") and p.phase == "Failed":
            out[p.name] = f"pod {p.name}: {p.status_reason} by the kubelet"
    return out


def lost_indexes(h: History, now: float | None = None) -> dict[str, int]:
    """Pods (by name) lost with their node, not absorbed yet, and their index: what the watcher
    decides, one loss at a time (tasks.loss_policy)."""
    pods = {name: p for name, p in _latest(h.pods).items() if name not in h.absorbed}
    return {
        name: index
        for name in node_loss_evidence(h, pods, now)
        if (index := pods[name].index) is not None
    }


def deleted_outside(h: History, pods: dict[str, PodObs], job: JobObs | None, now: float) -> str:
    """A pod of the attempt deleted by none of ours while it ran, on a node not lost (``kubectl
    delete pod --force``, a descheduler), once ``DELETED_GRACE_S`` has passed without the Job
    controller claiming it; its name, or ''."""
    if job is not None and (job.terminating or job.complete or job.failed):
        return ""
    for p in pods.values():
        if (
            p.deleted
            and p.phase not in ("Succeeded", "Failed")
            and p.name not in h.deleted_by_us
            and now - p.t >= DELETED_GRACE_S
        ):
            return p.name
    return ""


def classify_history(h: History, *, now: float, unschedulable_timeout_s: float) -> Outcome | None:
    """The attempt's outcome, or None while it is still running normally."""
    every = _latest(h.pods)
    pods = {name: p for name, p in every.items() if name not in h.absorbed}
    # An absorbed loss's index: its replacement may wait for a node (the world grows back then).
    waiting_for_node = {every[name].index for name in h.absorbed if name in every}
    job = max(h.jobs, key=lambda j: j.t) if h.jobs else None

    # 1. The workload asked not to be requeued.
    for p in pods.values():
        if p.exit_code == EXIT_DO_NOT_REQUEUE:
            return Outcome(
                EndKind.DO_NOT_REQUEUE,
                f"pod {p.name} exited {EXIT_DO_NOT_REQUEUE}: the workload asked not to "
                "be requeued (see its log)",
            )
    # 2. Completed.
    succeeded = [p for p in pods.values() if p.phase == "Succeeded"]
    if (job is not None and job.complete) or (
        len(succeeded) >= h.completions and all(p.phase == "Succeeded" for p in pods.values())
    ):
        return Outcome(EndKind.COMPLETED, f"all {h.completions} pods succeeded")
    # 3. The Job deleted outside the pipeline: its pods go with it, which must not read as a
    # node loss (a stage retry would recreate what an operator removed), nor be watched until
    # the deadline.
    if job is not None and job.gone:
        return Outcome(
            EndKind.BUG,
            "the training Job was deleted outside the pipeline (kubectl delete, or another "
            "controller) while it ran; the attempt ends with no retry. Run again with the same "
            "run id to resume from its newest checkpoint",
        )
    # 4. Node loss, in any of its guises.
    evidence = node_loss_evidence(h, pods, now)
    if evidence:
        # Nodes of disrupted pods count as lost too (the Node object may still look Ready).
        nodes = sorted(
            lost_nodes(h, now)
            | {p.node for p in pods.values() if p.node and p.disruption_reason in NODE_LOSS_REASONS}
        )
        return Outcome(
            EndKind.NODE_LOSS,
            "node loss: "
            + "; ".join(evidence.values())
            + (f" (nodes {nodes} unreachable or gone)" if nodes else ""),
            {"lost_nodes": nodes},
        )
    # 4b. A pod deleted outside the pipeline on a healthy node: its ranks are gone and nothing
    # of ours brings them back (the Job controller's replacement cannot join a fixed world),
    # and, like the Job deleted outside, it must not read as a node loss that a stage retry
    # would undo.
    gone = deleted_outside(h, pods, job, now)
    if gone:
        return Outcome(
            EndKind.BUG,
            f"pod {gone} was deleted outside the pipeline (kubectl delete pod, or another "
            "controller) while it ran, on a node that is not lost; the attempt ends with no "
            "retry. Run again with the same run id to resume from its newest checkpoint",
        )
    # 5. Could never have run.
    for p in pods.values():
        if p.waiting_reason in IMAGE_PULL_REASONS:
            return Outcome(
                EndKind.BUG,
                f"image pull failure for pod {p.name}: image {p.image!r}: {p.waiting_reason} "
                f"{p.waiting_message}".strip()
                + "; check eks.image (a pushed image that NVRX_ALLOWED_IMAGES allows) and the "
                "nodes' pull access to its registry",
            )
    for p in pods.values():
        if p.waiting_reason in CONFIG_REASONS:
            return Outcome(
                EndKind.BUG,
                f"pod {p.name} cannot start: {p.waiting_reason} {p.waiting_message}".strip()
                + "; a Secret named in the run's secrets (key 'value') or the attempt's "
                "ConfigMap is missing from the namespace: create it, then run again",
            )
    pending = [
        p
        for p in pods.values()
        if p.unschedulable_message is not None and p.index not in waiting_for_node
    ]
    if pending:
        first_seen = min(
            o.t for o in h.pods if o.name == pending[0].name and o.unschedulable_message is not None
        )
        if now - first_seen > unschedulable_timeout_s:
            return Outcome(
                EndKind.TIMEOUT,
                f"pod {pending[0].name} unschedulable for {now - first_seen:.0f} s: "
                f"{pending[0].unschedulable_message}",
            )
    # 6. Failed pods.
    failed = [p for p in pods.values() if p.phase == "Failed"]
    for p in failed:
        if p.terminated_reason == "OOMKilled":
            return Outcome(
                EndKind.BUG,
                f"pod {p.name} was OOMKilled and ft_launcher could not "
                "recover it: lower the per-GPU batch or raise the memory limit",
            )
    for p in failed:
        if p.exit_code == 1:
            return Outcome(
                EndKind.INJOB_EXHAUSTED,
                f"pod {p.name}: ft_launcher exhausted its in-job restarts (exit 1)",
            )
    if failed:
        p = failed[0]
        return Outcome(
            EndKind.BUG,
            f"pod {p.name} failed (exit {p.exit_code}, "
            f"{p.terminated_reason or p.status_reason or 'no reason'})",
        )
    if job is not None and job.failed:
        return Outcome(EndKind.BUG, f"Job failed: {job.failed_reason} {job.failed_message}".strip())
    return None


def judge(observed: Outcome | None, ev: Evidence, *, job: str, fsx_mount: str) -> Outcome:
    """The attempt's outcome: what the pods showed (``observed``, None when the watcher stopped
    the Job first) together with what every backend's watcher gathered. Any pod's exit 93 or the
    verdict file decides before anything else: the teardown a 93 starts can make the other pods'
    codes look like a node loss or an exhausted launcher (NVRX_NOTES)."""
    causes = [c for c in (ev.fatal, ev.no_restart) if c]
    if observed is not None and observed.kind == EndKind.DO_NOT_REQUEUE:
        causes.append(observed.message)
    if causes:
        return Outcome(
            EndKind.DO_NOT_REQUEUE,
            f"training cannot continue: {'; '.join(dict.fromkeys(causes))} (Job {job})",
            {"no_restart": ev.no_restart},
        )
    if ev.timed_out:
        return Outcome(
            EndKind.TIMEOUT, f"train attempt passed its deadline; Job {job} stopped and deleted"
        )
    nodes = sorted(ev.lost_nodes)
    if nodes and (observed is None or observed.kind != EndKind.COMPLETED):
        # An elastic Job that carried on without them completes instead (below). What the
        # control plane showed (a disruption, a node NotReady past its bound) says why.
        seen = (
            observed.message if observed is not None and observed.kind == EndKind.NODE_LOSS else ""
        )
        return Outcome(
            EndKind.NODE_LOSS,
            f"node loss: the pod(s) of node index(es) {nodes} were lost (Job {job})"
            + (f": {seen.removeprefix('node loss: ')}" if seen else ""),
            {"lost_nodes": nodes},
        )
    if observed is None:
        return Outcome(EndKind.BUG, f"the watch of Job {job} ended with no outcome")
    if observed.kind != EndKind.COMPLETED:
        return observed
    r = ev.result
    if r is None:
        return Outcome(
            EndKind.BUG,
            f"Job {job} completed but its result.json is missing: does this flow runner mount "
            f"the same FSx file system at {fsx_mount} as the pods "
            "(deploy/eks/work-pool-template.json)?",
        )
    if r.get("status") != "completed" or r.get("final_step") != ev.target_steps:
        return Outcome(
            EndKind.BUG,
            f"Job {job} completed but its result says {r.get('status')} at step "
            f"{r.get('final_step')} of {ev.target_steps}",
        )
    if nodes:
        return Outcome(
            EndKind.COMPLETED,
            f"{observed.message}; node index(es) {nodes} lost and recovered in-job",
            {"result": r, "lost_nodes": nodes},
        )
    return Outcome(EndKind.COMPLETED, observed.message, {"result": r})


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
    latest: dict[int, PodObs] = {}
    disrupted: set[str] = set()
    for raw in pods:
        p = observe_pod(raw, t)
        if p.index is not None:
            latest[p.index] = p
        if _conditions(raw).get("DisruptionTarget", {}).get("status") == "True":
            disrupted.add(p.name)
    missing = sorted(set(range(completions)) - set(latest))
    if missing:
        return False, f"Job {name}: no pod for index(es) {missing}"
    ready = {n.name: n.ready for n in (observe_node(n, t) for n in nodes)}
    for i, p in sorted(latest.items()):
        if p.phase != "Running" or p.exit_code is not None or p.waiting_reason is not None:
            return False, f"Job {name}: pod {p.name} (index {i}) is {p.phase}"
        if p.name in disrupted:
            why = p.disruption_reason or "DisruptionTarget"
            return False, f"Job {name}: pod {p.name} is being disrupted ({why})"
        if ready.get(p.node or "") != "True":
            return False, f"Job {name}: pod {p.name}'s node {p.node} is not Ready"
    return True, f"Job {name}: all {completions} pod(s) running on Ready nodes"
