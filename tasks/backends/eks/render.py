"""Render the train stage's Kubernetes objects (pure: parameters in, manifests out).

An Indexed ``batch/v1`` Job (``completions = parallelism = nodes``, one pod per node,
``restartPolicy: Never``, ``backoffLimit: 0``, a pod failure policy), a headless Service that
gives the index-0 pod a stable DNS name for the c10d rendezvous, and a NetworkPolicy that lets
only the Job's own pods reach each other. Each pod runs ``ft_launcher`` with
``--nproc-per-node`` = GPUs per node, as the image's non-root user
(:mod:`tasks.backends.eks.security`). Names derive from (run id, attempt) only, so applying the
same attempt twice is idempotent; the three objects share name and labels and are applied and
deleted together (:class:`tasks.backends.eks.kube.Kube`).

An elastic Job (``nodes`` ``MIN:MAX``, or hot spares; arch §7) launches ``MAX + spares`` pods
whose agents admit any count in the range. Its pod failure policy *ignores* a node's
disruption: the in-job layer carries on without the lost pod, and the Job controller starts the
index's replacement, which joins the rendezvous when a node can take it (the world grows back,
or a spare waits again). Its success policy ends the Job when index 0 (the rendezvous host,
always in the world) succeeds: a replacement still pending then, or a spare still waiting, is
stopped by the controller instead of holding the Job open.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from typing import Any

from tasks.backends.eks.kube import JOB_NAME_LABEL  # set on every pod by the Job controller
from tasks.backends.eks.params import EksParams
from tasks.backends.eks.pod import CONFIG_MOUNT, CONTAINER, pod_env, pod_template
from tasks.classify import EXIT_DO_NOT_REQUEUE
from trainer.config import TrainConfig, config_text
from trainer.launch import LaunchSpec, ft_launcher_argv, trainer_args
from trainer.rundir import Layout

LABEL_RUN = "nvrx.io/run-id"
LABEL_ATTEMPT = "nvrx.io/attempt"
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
# Beyond the flow's own deadline for the attempt: the flow stops the Job first; the API server's
# deadline is what still ends it when the flow runner is gone (crashed, evicted, cancelled hard).
JOB_DEADLINE_MARGIN_S = 600


def job_name(run_id: str, attempt: int, tag: str = "") -> str:
    """DNS-1123 label, <= 52 chars (pod hostnames append '-<index>'), stable per attempt of one
    invocation. ``tag`` (from the invocation) keeps a later invocation's attempt 1 apart from an
    earlier one's: the pods of a deleted Job may still be terminating, with the same job-name
    label, when the new Job starts, and its watcher must not take them for its own."""
    base = re.sub(r"[^a-z0-9-]", "-", run_id.lower()).strip("-")
    tag = re.sub(r"[^a-z0-9]", "", tag.lower())[:6]
    suffix = f"-a{attempt}" + (f"-{tag}" if tag else "")
    if len(base) + len(suffix) + 5 > 52:
        digest = hashlib.sha256(run_id.encode()).hexdigest()[:6]
        base = f"{base[: 52 - len(suffix) - 5 - 7]}-{digest}"
    return f"nvrx-{base}{suffix}"


def run_label(run_id: str) -> str:
    """The value of ``nvrx.io/run-id`` on every object of the run (a valid label value)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "-", run_id)[:63]


def _metadata(run_id: str, attempt: int, tag: str, namespace: str) -> dict[str, Any]:
    """The name and labels every object of the attempt shares."""
    name = job_name(run_id, attempt, tag)
    return {"name": name, "namespace": namespace, "labels": labels(run_id, attempt)}


def labels(run_id: str, attempt: int) -> dict[str, str]:
    """Kubernetes' recommended labels (app.kubernetes.io/*: the instance is the run) and ours."""
    return {
        "app.kubernetes.io/name": "nvrx-pipeline",
        "app.kubernetes.io/instance": run_label(run_id),
        "app.kubernetes.io/component": "trainer",
        "app.kubernetes.io/part-of": "nvrx-pipeline",
        "app.kubernetes.io/managed-by": "nvrx-pipeline",
        LABEL_RUN: run_label(run_id),
        LABEL_ATTEMPT: str(attempt),
    }


def render_job(
    cfg: TrainConfig,
    *,
    run_id: str,
    attempt: int,
    nodes: int,
    eks: EksParams,
    deadline_s: float | None = None,
    rdzv_id: str | None = None,
    tag: str = "",
    min_nodes: int | None = None,
    spares: int = 0,
    epoch: int | None = None,
    secrets: Mapping[str, str] | None = None,
    node_memory_gb: float = 0.0,
) -> dict[str, Any]:
    """``nodes``: the most the job trains on; ``min_nodes`` (elastic) the fewest; ``spares``:
    pods beyond ``nodes`` waiting in the rendezvous. ``rdzv_id`` (default: the Job's name) is
    unique per invocation (a later one starts its attempts at 1 again; the workers tell an
    in-job respawn by their rendezvous id in the events). ``deadline_s``: the attempt's
    (``activeDeadlineSeconds`` adds a margin); ``node_memory_gb``: the memory saves' need per
    node, sizing /dev/shm where ``eks.shm_gi`` is empty. ``tag``: :func:`job_name`'s."""
    meta = _metadata(run_id, attempt, tag, eks.namespace)
    name = meta["name"]
    rdzv = f"{name}-0.{name}.{eks.namespace}.svc.cluster.local:{eks.rdzv_port}"
    spec = LaunchSpec(
        nnodes=nodes,
        min_nodes=min_nodes,
        spares=spares,
        nproc_per_node=eks.gpus_per_node,
        rdzv_endpoint=rdzv,
        rdzv_id=rdzv_id or name,
        cpu_only=False,
    )
    # The attempt's config travels in the bundle, as the ConfigMap of the Job's name
    # (render_all), mounted read-only: `kubectl apply` of a rendered bundle needs nothing
    # the flow would have written first. (The flow keeps its copy on FSx, for the record.)
    config = CONFIG_MOUNT / Layout.train_config(attempt).name
    argv = ft_launcher_argv(cfg, spec, trainer_args(cfg, config), portable=True)  # the image's
    template = pod_template(
        eks,
        name=name,
        labels=labels(run_id, attempt),
        same_attempt={LABEL_RUN: run_label(run_id), LABEL_ATTEMPT: str(attempt)},
        argv=argv,
        env=pod_env(eks, attempt=attempt, epoch=epoch, config=config, secrets=secrets),
        metrics_port=cfg.metrics_port,
        node_memory_gb=node_memory_gb,
        grace_s=cfg.injob.evict_grace_s,
    )
    if eks.queue:
        # Kueue admits the Job from this LocalQueue. The Job is not created suspended: Kueue's
        # webhook suspends it on creation and resumes it once admitted ("Run A Kubernetes
        # Job", kueue.sigs.k8s.io: "you do not need to create the Job in a suspended state").
        meta["labels"][KUEUE_QUEUE_LABEL] = eks.queue
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": meta,
        "spec": {
            "completionMode": "Indexed",
            "completions": spec.launched,
            "parallelism": spec.launched,
            "backoffLimit": 0,  # restarts belong to ft_launcher (in-job) and the stage retry
            **(
                {}
                if deadline_s is None
                else {"activeDeadlineSeconds": int(deadline_s) + JOB_DEADLINE_MARGIN_S}
            ),
            "podFailurePolicy": _pod_failure_policy(elastic=spec.elastic),
            # Elastic: done when the rendezvous host's agent is (the job's world completed).
            **(
                {"successPolicy": {"rules": [{"succeededIndexes": "0", "succeededCount": 1}]}}
                if spec.elastic
                else {}
            ),
            "ttlSecondsAfterFinished": 7 * 24 * 3600,
            "template": template,
        },
    }


def _pod_failure_policy(*, elastic: bool) -> dict[str, Any]:
    """Which pod failures end the Job at once: restarts belong to ft_launcher (in-job) and the
    stage retry, never to the Job controller."""
    return {
        "rules": [
            {  # the workload asked not to be requeued
                "action": "FailJob",
                "onExitCodes": {
                    "containerName": CONTAINER,
                    "operator": "In",
                    "values": [EXIT_DO_NOT_REQUEUE],
                },
            },
            # A node went away. Fixed size: end the Job now, the watcher classifies
            # node loss and the stage retry relaunches. Elastic: not counted against
            # backoffLimit; the in-job layer re-forms without the pod (the watcher
            # decides whether it can, tasks.loss_policy) and the controller starts
            # the index's replacement.
            {
                "action": "Ignore" if elastic else "FailJob",
                "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
            },
        ]
    }


def _network_policy(
    meta: dict[str, Any], eks: EksParams, metrics_port: int | None
) -> dict[str, Any]:
    """Only this Job's pods reach this Job's pods; they reach only each other and DNS.

    No port list, on purpose: besides the c10d rendezvous store on ``eks.rdzv_port`` (hosted by
    the index-0 agent), the workers' TCPStore (``MASTER_PORT``: torch elastic shares the
    rendezvous store or has the group's rank-0 agent pick a free port; the trainer's process
    groups and NVRx's in-process restart share it) and NCCL's bootstrap and socket connections
    all use ports chosen at run time, on whichever pod holds rank 0. What the policy pins is
    who: pods of this Job, by the job-name label (the API server sets it from the Job's own
    name and refuses a Job template that claims another; a bare pod carrying it needs
    ``pods/create`` in the namespace, which no pipeline identity has). EFA traffic (SRD on the
    EFA device) and the Lustre client (the node's kernel mounts FSx) do not pass through the
    pod network, so they need no rule; the training pods call no AWS or Prefect API, so they
    get no other egress.

    With ``metrics_port``, Prometheus in ``eks.monitoring_namespace`` may reach that one port
    (rank 0's metrics endpoint); the namespace's default-deny policy would refuse the scrape.
    """
    own_pods = [{"podSelector": {"matchLabels": {JOB_NAME_LABEL: meta["name"]}}}]
    ingress: list[dict[str, Any]] = [{"from": own_pods}]
    if metrics_port is not None:
        ingress.append(
            {
                "from": [
                    {
                        "namespaceSelector": {
                            "matchLabels": {"kubernetes.io/metadata.name": eks.monitoring_namespace}
                        }
                    }
                ],
                "ports": [{"protocol": "TCP", "port": metrics_port}],
            }
        )
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": meta,
        "spec": {
            "podSelector": own_pods[0]["podSelector"],
            "policyTypes": ["Ingress", "Egress"],
            "ingress": ingress,
            "egress": [
                {"to": own_pods},
                {  # the rendezvous host's name (<job>-0.<service>) resolves through cluster DNS
                    "to": [
                        {
                            "namespaceSelector": {
                                "matchLabels": {"kubernetes.io/metadata.name": "kube-system"}
                            },
                            "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}},
                        }
                    ],
                    "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}],
                },
            ],
        },
    }


def render_all(
    cfg: TrainConfig, *, run_id: str, attempt: int, eks: EksParams, tag: str = "", **job: Any
) -> list[dict[str, Any]]:
    """The attempt's objects, the NetworkPolicy first: the pods never run unprotected, not even
    for the first seconds. ``tag``: the invocation's, in every name (:func:`job_name`);
    ``job``: :func:`render_job`'s other arguments."""
    name, port = job_name(run_id, attempt, tag), eks.rdzv_port
    return [
        _network_policy(_metadata(run_id, attempt, tag, eks.namespace), eks, cfg.metrics_port),
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": _metadata(run_id, attempt, tag, eks.namespace),
            "spec": {
                "clusterIP": "None",  # headless: DNS names for the pods, no load balancing
                # Resolvable before the pods are ready: ranks rendezvous while starting up.
                "publishNotReadyAddresses": True,
                "selector": {JOB_NAME_LABEL: name},
                "ports": [{"name": "rdzv", "port": port, "targetPort": port, "protocol": "TCP"}],
            },
        },
        {  # the attempt's config, the JSON workers read
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": _metadata(run_id, attempt, tag, eks.namespace),
            "data": {Layout.train_config(attempt).name: config_text(cfg)},
        },
        render_job(cfg, run_id=run_id, attempt=attempt, eks=eks, tag=tag, **job),
    ]
