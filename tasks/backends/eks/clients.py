"""The clients the EKS stages talk to, built once per stage from the environment.

In production: the in-cluster (or kubeconfig) Kubernetes client and a boto3 FSx client whose
credentials come from the pod's IRSA role and whose region is ``eks.region``, else the standard
chain (:mod:`tasks.aws`). ``_override``, when set, is returned instead: the tests set it
(``tests.eks_cluster.use_clients``) to a :class:`~tasks.backends.eks.kube.Kube` on kmock's
emulator and an FSx client under ``botocore.stub.Stubber``; everything downstream is the same code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tasks.backends.eks.fsx import Backoff
from tasks.backends.eks.kube import Kube


@dataclass
class EksClients:
    kube: Kube
    fsx: Any  # a boto3 FSx client
    fsx_backoff: Backoff = field(default_factory=Backoff)
    poll_s: float = 5.0  # Kubernetes status polls (Jobs, nodes)


_override: EksClients | None = None


def connect(region: str | None) -> EksClients:
    """``region``: ``eks.region`` (None: the flow runner's standard AWS chain, :mod:`tasks.aws`)."""
    if _override is not None:
        return _override
    from tasks import aws

    return EksClients(kube=Kube.from_environment(), fsx=aws.client("fsx", region=region))
