"""How a train attempt on EKS ended, from the Pod/Node/Job objects the watcher observed.

Pure: over the snapshots of :mod:`tasks.backends.eks.objects`, :func:`end_of` reads the whole
observed history into the backend's :class:`~tasks.classify.Observation` once the attempt ended (a
node seen unreachable once stays a lost node, even after it is deleted). The verdict is the one
judge's, :func:`tasks.classify.judge`.

Node loss, as a watcher sees it (PLATFORM_NOTES): the Node's ``Ready`` goes ``Unknown`` with reason
``NodeStatusUnknown`` (taint ``node.kubernetes.io/unreachable``); its pods get a
``DisruptionTarget=True`` condition with reason ``DeletionByTaintManager`` (or ``DeletionByPodGC``
once the Node is deleted, ``EvictionByEvictionAPI`` on a drain / spot reclaim,
``TerminationByKubelet``/``PreemptionByScheduler``); or a pod simply vanishes together with its
node. ``NodeLost`` is not relied on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from tasks.backends.eks.objects import JobObs, NodeObs, PodObs
from tasks.classify import EXIT_DO_NOT_REQUEUE, Blocked, Blocker, Observation

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

    def latest(self) -> dict[str, PodObs]:
        """Each pod's latest observation, by name."""
        return {p.name: p for p in sorted(self.pods, key=lambda p: p.t)}


# A pod deleted by none of ours decides the attempt this long after its deletion was seen, so
# that a Job condition saying the Job controller did it (the deletion and the condition come
# as separate watch events) is seen first.
DELETED_GRACE_S = 5.0


# -- judgement ---------------------------------------------------------------------------------
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
    for p in (h.latest() if pods is None else pods).values():
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
    pods = {name: p for name, p in h.latest().items() if name not in h.absorbed}
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


def end_of(h: History, *, now: float, unschedulable_timeout_s: float) -> Observation | None:
    """What the pods, nodes and Job showed once the attempt ended, or None while it still runs
    normally: the EKS backend's observation for the one judge (:func:`tasks.classify.judge`)."""
    every = h.latest()
    pods = {name: p for name, p in every.items() if name not in h.absorbed}
    job = max(h.jobs, key=lambda j: j.t) if h.jobs else None
    codes = _exit_codes(pods)
    # The workload asked not to be requeued (the judge reads any index's 93), or completed.
    if EXIT_DO_NOT_REQUEUE in codes.values():
        return Observation(exit_codes=codes)
    succeeded = [p for p in pods.values() if p.phase == "Succeeded"]
    if (job is not None and job.complete) or (
        len(succeeded) >= h.completions and all(p.phase == "Succeeded" for p in pods.values())
    ):
        return Observation(exit_codes=codes, succeeded=True)
    # The Job deleted outside the pipeline: its pods go with it, which must not read as a node
    # loss (a stage retry would recreate what an operator removed), nor be watched until the
    # deadline.
    if job is not None and job.gone:
        return Observation(exit_codes=codes, blocker=Blocker(Blocked.REMOVED, JOB_REMOVED))
    evidence = node_loss_evidence(h, pods, now)
    if evidence:
        # Nodes of disrupted pods count as lost too (the Node object may still look Ready).
        hosts = lost_nodes(h, now) | {
            p.node for p in pods.values() if p.node and p.disruption_reason in NODE_LOSS_REASONS
        }
        return Observation(
            exit_codes=codes, lost_hosts=tuple(sorted(hosts)), loss="; ".join(evidence.values())
        )
    # Indexes of absorbed losses: their replacements may wait for a node (the world grows back).
    waiting_for_node = {every[name].index for name in h.absorbed if name in every}
    blocker = _blocker(h, pods, job, now, waiting_for_node, unschedulable_timeout_s)
    if blocker is not None:
        return Observation(exit_codes=codes, blocker=blocker)
    if any(p.phase == "Failed" and p.exit_code == 1 for p in pods.values()):
        return Observation(exit_codes=codes)  # ft_launcher exhausted its in-job restarts
    failed = [p for p in pods.values() if p.phase == "Failed"]
    if failed:
        p = failed[0]
        why = p.terminated_reason or p.status_reason or "no reason"
        said = f"pod {p.name} failed (exit {p.exit_code}, {why})"
        return Observation(exit_codes=codes, blocker=Blocker(Blocked.FAILED, said))
    if job is not None and job.failed:
        said = f"Job failed: {job.failed_reason} {job.failed_message}".strip()
        return Observation(exit_codes=codes, blocker=Blocker(Blocked.FAILED, said))
    return None


def finished(observed: Observation | None, *, job: str, fsx_mount: str) -> Observation:
    """The observation handed to the judge at the end: what :func:`end_of` last read (None:
    the watcher stopped the Job before its pods showed an end), naming the Job and why a
    result.json could be missing though the pods succeeded."""
    return replace(
        observed or Observation(ended=False),
        where=f"Job {job}",
        result_hint=f"does this flow runner mount the same FSx file system at {fsx_mount} as "
        "the pods (deploy/eks/work-pool-template.json)?",
    )


JOB_REMOVED = (
    "the training Job was deleted outside the pipeline (kubectl delete, or another controller) "
    "while it ran; the attempt ends with no retry. Run again with the same run id to resume "
    "from its newest checkpoint"
)


def _exit_codes(pods: dict[str, PodObs]) -> dict[int, int | None]:
    """Each index's launcher exit code, from its latest pod (None: not ended)."""
    codes: dict[int, int | None] = {}
    for p in sorted(pods.values(), key=lambda p: p.t):
        if p.index is not None:
            codes[p.index] = p.exit_code
    return codes


def _blocker(
    h: History,
    pods: dict[str, PodObs],
    job: JobObs | None,
    now: float,
    waiting_for_node: set[int | None],
    unschedulable_timeout_s: float,
) -> Blocker | None:
    """A reason of Kubernetes' own that the pods stopped or can never run, or None."""
    # A pod deleted outside the pipeline on a healthy node: its ranks are gone and nothing of
    # ours brings them back (the Job controller's replacement cannot join a fixed world), and,
    # like the Job deleted outside, it must not read as a node loss a stage retry would undo.
    gone = deleted_outside(h, pods, job, now)
    if gone:
        return Blocker(
            Blocked.REMOVED,
            f"pod {gone} was deleted outside the pipeline (kubectl delete pod, or another "
            "controller) while it ran, on a node that is not lost; the attempt ends with no "
            "retry. Run again with the same run id to resume from its newest checkpoint",
        )
    for p in pods.values():
        if p.waiting_reason in IMAGE_PULL_REASONS:
            return Blocker(
                Blocked.CANNOT_START,
                f"image pull failure for pod {p.name}: image {p.image!r}: {p.waiting_reason} "
                f"{p.waiting_message}".strip()
                + "; check eks.image (a pushed image that NVRX_ALLOWED_IMAGES allows) and the "
                "nodes' pull access to its registry",
            )
    for p in pods.values():
        if p.waiting_reason in CONFIG_REASONS:
            return Blocker(
                Blocked.CANNOT_START,
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
            return Blocker(
                Blocked.UNSCHEDULABLE,
                f"pod {pending[0].name} unschedulable for {now - first_seen:.0f} s: "
                f"{pending[0].unschedulable_message}",
            )
    for p in pods.values():
        if p.phase == "Failed" and p.terminated_reason == "OOMKilled":
            return Blocker(
                Blocked.OOM_KILLED,
                f"pod {p.name} was OOMKilled and ft_launcher could not "
                "recover it: lower the per-GPU batch or raise the memory limit",
            )
    return None
