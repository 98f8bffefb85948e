"""Kubernetes objects as a real EKS control plane would show them, and a cluster seeded into
kmock's emulator for the EKS tests (kmock stores what it is given; it runs no controllers)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from kubernetes.client import ApiException

from tasks.backends.eks import clients as eks_clients
from tasks.backends.eks.clients import EksClients

NS = "nvrx"
NODES = ("ip-10-0-1-1", "ip-10-0-1-2")


def p5(
    name: str,
    *,
    gpus: str = "8",
    efa: str = "32",
    ready: str = "True",
    taints=(),
    itype: str = "p5.48xlarge",
    cpu: str = "191450m",
    memory: str = "2051314436Ki",
) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {
                "node.kubernetes.io/instance-type": itype,
                "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
            },
        },
        "spec": {"taints": [dict(t) for t in taints]},
        "status": {
            "capacity": {"nvidia.com/gpu": "8", "vpc.amazonaws.com/efa": "32"},
            # What a p5.48xlarge's kubelet reports (192 vCPUs, 2 TiB less its reservations).
            "allocatable": {
                "nvidia.com/gpu": gpus,
                "vpc.amazonaws.com/efa": efa,
                "cpu": cpu,
                "memory": memory,
            },
            "conditions": [{"type": "Ready", "status": ready}],
        },
    }


def node_obj(name: str, ready: str = "True", reason: str = "KubeletReady") -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name},
        "status": {"conditions": [{"type": "Ready", "status": ready, "reason": reason}]},
    }


def pod_obj(job: str, index: int, node: str | None, suffix: str = "x") -> dict[str, Any]:
    """``suffix``: another one for a lost index's replacement (the Job controller's new pod)."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"{job}-{index}-{suffix}",
            "namespace": NS,
            "labels": {
                "batch.kubernetes.io/job-name": job,
                "batch.kubernetes.io/job-completion-index": str(index),
            },
        },
        "spec": {"nodeName": node, "containers": [{"name": "trainer", "image": "img"}]},
        "status": {
            "phase": "Running",
            "containerStatuses": [{"name": "trainer", "ready": True, "state": {"running": {}}}],
        },
    }


def terminated(code: int, reason: str = "Error", phase: str = "Failed") -> dict[str, Any]:
    return {
        "status": {
            "phase": phase,
            "containerStatuses": [
                {
                    "name": "trainer",
                    "ready": False,
                    "state": {"terminated": {"exitCode": code, "reason": reason}},
                }
            ],
        }
    }


def mark_disrupted(kube: Any, pod: str, reason: str = "DeletionByTaintManager") -> None:
    """What the node lifecycle controller does to a pod on an unreachable node."""
    kube.core.patch_namespaced_pod_status(
        pod,
        NS,
        {
            "status": {
                "conditions": [{"type": "DisruptionTarget", "status": "True", "reason": reason}]
            }
        },
        _preload_content=False,
    )


def seed_cluster(kube: Any) -> None:
    """Two p5 nodes, the NVIDIA and EFA device plugins ready, the FSx CSI driver and a Bound
    claim: a cluster the EKS preflight passes."""
    for n in kube.nodes():
        kube.core.delete_node(n["metadata"]["name"], _preload_content=False)
    for name in NODES:
        kube.core.create_node(p5(name), _preload_content=False)
    for ds in ("nvidia-device-plugin-daemonset", "aws-efa-k8s-device-plugin-daemonset"):
        kube.apps.create_namespaced_daemon_set(
            "kube-system",
            {
                "apiVersion": "apps/v1",
                "kind": "DaemonSet",
                "metadata": {"name": ds, "namespace": "kube-system"},
                "spec": {
                    "selector": {"matchLabels": {"a": ds}},
                    "template": {
                        "metadata": {"labels": {"a": ds}},
                        "spec": {"containers": [{"name": "c", "image": "i"}]},
                    },
                },
                "status": {"numberReady": 2, "desiredNumberScheduled": 2},
            },
            _preload_content=False,
        )
    kube.core.create_namespaced_persistent_volume_claim(
        "nvrx",
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": "fsx-claim", "namespace": "nvrx"},
            "spec": {
                "accessModes": ["ReadWriteMany"],
                "resources": {"requests": {"storage": "1200Gi"}},
            },
            "status": {"phase": "Bound"},
        },
        _preload_content=False,
    )
    kube.storage.create_csi_driver(
        {
            "apiVersion": "storage.k8s.io/v1",
            "kind": "CSIDriver",
            "metadata": {"name": "fsx.csi.aws.com"},
            "spec": {},
        },
        _preload_content=False,
    )


@contextlib.contextmanager
def use_clients(clients: EksClients) -> Iterator[EksClients]:
    """The EKS stages talk to ``clients`` (kmock's Kube, a stubbed FSx client) within the block:
    what ``tasks.backends.eks.clients.connect`` returns instead of building real ones."""
    previous, eks_clients._override = eks_clients._override, clients
    try:
        yield clients
    finally:
        eks_clients._override = previous


def exists(read: Callable[..., Any], name: str) -> bool:
    """Whether ``read`` (a namespaced read of the Kubernetes client) finds ``name`` in NS."""
    try:
        read(name, NS, _preload_content=False)
    except ApiException as e:
        if e.status == 404:
            return False
        raise
    return True
