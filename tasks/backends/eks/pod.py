"""The training pod of an attempt's Job: one node's ``ft_launcher`` agent, with its environment,
placement, resources and volumes (pure: parameters in, the pod template out)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tasks.backends.eks.params import EksParams
from tasks.backends.eks.security import (
    container_security_context,
    pod_security_context,
    scratch_volumes,
)
from tasks.secrets import kubernetes_env
from trainer.checkpointing.layout import NODE_MEMORY_ENV
from trainer.fence import EPOCH_ENV
from trainer.launch import worker_env

CONTAINER = "trainer"
METRICS_PORT_NAME = "metrics"
TMP_GI = 32  # /tmp: torch.compile/Triton caches and tempfiles (ephemeral storage)
NODE_MEMORY_DIR = "/dev/shm/nvrx-node-memory"  # on the pod's shm emptyDir (medium Memory)
# Where a training pod finds its attempt's config: the ConfigMap of the Job's name.
CONFIG_MOUNT = Path("/etc/nvrx-pipeline/attempt")


def pod_template(
    eks: EksParams,
    *,
    name: str,
    labels: Mapping[str, str],
    same_attempt: Mapping[str, str],
    argv: list[str],
    env: list[dict[str, Any]],
    metrics_port: int | None,
    node_memory_gb: float,
    grace_s: float,
) -> dict[str, Any]:
    """``name``: the Job's (its headless Service's and its ConfigMap's too); ``same_attempt``:
    the labels that select this attempt's pods, kept one per node."""
    # Node memory's size: the memory saves' need per node (node_memory_gb) and the rest.
    shm_gi = eks.pod_shm_gi(node_memory_gb)
    scratch, scratch_mounts = scratch_volumes(tmp_gi=TMP_GI)
    return {
        "metadata": {"labels": dict(labels)},
        "spec": {
            "restartPolicy": "Never",
            "subdomain": name,  # <job>-<index>.<service> resolves through the headless Service
            "serviceAccountName": eks.service_account,
            # Training pods never call the Kubernetes API (rbac.yaml's nvrx-trainer says so too).
            "automountServiceAccountToken": False,
            **({"priorityClassName": eks.priority_class} if eks.priority_class else {}),
            "securityContext": pod_security_context(),
            # An eviction's notice (injob.evict_grace_s): the launcher ends its workers and
            # leaves the rendezvous within it (--term-timeout).
            "terminationGracePeriodSeconds": int(grace_s),
            **_placement(eks, same_attempt),
            "containers": [
                {
                    "name": CONTAINER,
                    "image": eks.image,
                    "imagePullPolicy": "IfNotPresent",
                    "command": argv[:1],
                    "args": argv[1:],
                    "env": env,
                    "ports": [
                        {"name": "rdzv", "containerPort": eks.rdzv_port},
                        # Rank 0's Prometheus endpoint (trainer.metrics), whichever pod has it:
                        # what deploy/eks/podmonitor.yaml scrapes, by this name.
                        *(
                            [{"name": METRICS_PORT_NAME, "containerPort": metrics_port}]
                            if metrics_port is not None
                            else []
                        ),
                    ],
                    "securityContext": container_security_context(),
                    "resources": guaranteed(pod_resources(eks)),
                    "volumeMounts": [
                        {"name": "fsx", "mountPath": eks.fsx_mount},
                        {"name": "shm", "mountPath": "/dev/shm"},
                        {"name": "config", "mountPath": str(CONFIG_MOUNT), "readOnly": True},
                        *scratch_mounts,
                    ],
                }
            ],
            "volumes": [
                {"name": "fsx", "persistentVolumeClaim": {"claimName": eks.fsx_claim}},
                {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{shm_gi}Gi"}},
                {"name": "config", "configMap": {"name": name}},
                *scratch,
            ],
        },
    }


def pod_env(
    eks: EksParams,
    *,
    attempt: int,
    epoch: int | None,
    config: Path,
    secrets: Mapping[str, str] | None,
) -> list[dict[str, Any]]:
    """The trainer container's environment: the attempt, its fencing epoch, the workers' own
    variables, the fabric's, and the run's declared secrets (references, never values)."""
    return [
        {"name": "NVRX_STAGE_ATTEMPT", "value": str(attempt)},
        # The attempt's epoch (trainer.fence): a pod that outlives its attempt changes nothing.
        *([{"name": EPOCH_ENV, "value": str(epoch)}] if epoch is not None else []),
        *({"name": k, "value": v} for k, v in worker_env(config).items()),
        {"name": "NVRX_EVENTS_STDOUT", "value": "1"},  # structured progress in `kubectl logs`
        {"name": "TORCH_CPP_LOG_LEVEL", "value": "ERROR"},
        # libfabric's EFA provider only where the pod has EFA interfaces (else NCCL would fail
        # to find the provider it was told to use), and device RDMA only where EFA does it.
        *([{"name": "FI_PROVIDER", "value": "efa"}] if eks.pod_efa() else []),
        *([{"name": "FI_EFA_USE_DEVICE_RDMA", "value": "1"}] if eks.gpudirect_rdma() else []),
        # Node memory (trainer.checkpointing.node_copy) in the pod's memory-backed /dev/shm: it
        # outlives a worker respawn in the pod, and goes with the pod (a lost node's memory).
        {"name": NODE_MEMORY_ENV, "value": NODE_MEMORY_DIR},
        {"name": "NCCL_DEBUG", "value": "WARN"},
        {"name": "NCCL_SOCKET_IFNAME", "value": "^lo,docker"},
        # Workloads load Hugging Face layouts from directories on FSx; the NetworkPolicy gives
        # the pods no route to the Hub, so fail fast instead of retrying downloads.
        {"name": "HF_HUB_OFFLINE", "value": "1"},
        # No AWS_REGION (nor any AWS_*): the pods call no AWS API (no IAM role, no egress but to
        # each other and DNS); the dataset and weights reach them through FSx, hydrated by the
        # flow runner, whose clients resolve the region (tasks.aws).
        # The run's declared secrets: references to Kubernetes Secrets the kubelet resolves,
        # never values in the manifest (tasks.secrets).
        *kubernetes_env(secrets or {}),
    ]


def _placement(eks: EksParams, same_attempt: Mapping[str, str]) -> dict[str, Any]:
    """Where a pod may run: the instance type, one pod per node, and the taints it tolerates."""
    return {
        "nodeSelector": {"node.kubernetes.io/instance-type": eks.instance_type},
        "affinity": {
            "podAntiAffinity": {  # one pod (= one ft_launcher agent) per node
                "requiredDuringSchedulingIgnoredDuringExecution": [
                    {
                        "labelSelector": {"matchLabels": dict(same_attempt)},
                        "topologyKey": "kubernetes.io/hostname",
                    }
                ]
            }
        },
        "tolerations": [
            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
            *(
                [{"key": "vpc.amazonaws.com/efa", "operator": "Exists", "effect": "NoSchedule"}]
                if eks.pod_efa()
                else []
            ),
            # Evict sooner than the default 300 s when a node is lost: the stage retry
            # (not a wait) is what recovers a node loss.
            *(
                {
                    "key": f"node.kubernetes.io/{taint}",
                    "operator": "Exists",
                    "effect": "NoExecute",
                    "tolerationSeconds": eks.unreachable_toleration_s,
                }
                for taint in ("unreachable", "not-ready")
            ),
        ],
    }


def pod_resources(eks: EksParams) -> dict[str, str]:
    """What one training pod requests, all of it also its limit. cpu and memory come from the
    instance type less the node's reserve (:mod:`tasks.backends.eks.params`) unless eks.cpu /
    eks.memory_gi say otherwise; the /dev/shm emptyDir (medium Memory) is charged to the
    memory limit, which is why EksParams refuses shm_gi >= memory (and sizes it at most half)."""
    resources = {
        "cpu": eks.pod_cpu(),
        "memory": f"{eks.pod_memory_gi()}Gi",
        "nvidia.com/gpu": str(eks.gpus_per_node),
    }
    if eks.pod_efa():
        resources["vpc.amazonaws.com/efa"] = str(eks.pod_efa())
    return resources


def guaranteed(resources: dict[str, str]) -> dict[str, dict[str, str]]:
    """A container's ``resources`` with requests == limits for every resource: with cpu and
    memory among them the pod is Guaranteed QoS, the last the kubelet evicts under node
    pressure and the only class the static CPU manager gives exclusive cores. (Extended
    resources such as GPUs and EFA must have requests == limits anyway.)"""
    return {"limits": dict(resources), "requests": dict(resources)}
