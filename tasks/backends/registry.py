"""The backends by name: the one place that knows which exist (the flows and the parameter form
ask here, never compare names). What the form needs of a backend before any is built (how many
ranks a node runs, which parameters it refuses) is a :class:`BackendType`; :func:`create` builds
the backend itself."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tasks.backends.base import Backend, RunParams

if TYPE_CHECKING:
    from tasks.ownership.lease import RunLease


@dataclass(frozen=True)
class BackendType:
    name: str
    description: str
    ranks_per_node: Callable[[RunParams], int]
    # The embedded local S3 server makes sense here (a cluster uses the endpoint it is given).
    embedded_s3: bool
    # s3:// initial weights are copied to the shared filesystem by the flow runner.
    hydrates_s3_weights: bool
    # Builds the backend (imported on first use: the form needs no Kubernetes client).
    factory: Callable[..., Backend]
    # Refuse what this backend's deployment does not allow (raises ValueError naming the field).
    check: Callable[[RunParams], None] = lambda params: None
    # The node drills (trainer.faults.NODE_KINDS) its jobs can carry out (the watcher asks the
    # job through tasks.backends.base's capability protocols); the form refuses the others.
    drills: frozenset[str] = frozenset()


def _eks_check(params: RunParams) -> None:
    params.eks.check_deployment_allows()
    if params.metrics_port == params.eks.rdzv_port:
        # Rank 0's pod serves both: the rendezvous store would not start.
        raise ValueError(
            f"metrics_port: {params.metrics_port} is also eks.rdzv_port; pick another port for "
            "the metrics (or set metrics_port empty to turn them off)"
        )


def _local(params: RunParams, *, lease: RunLease | None, log: Callable[[str], None]) -> Backend:
    from tasks.backends.local import LocalBackend

    return LocalBackend(params.state_dir, lease=lease, log=log)


def _eks(params: RunParams, *, lease: RunLease | None, log: Callable[[str], None]) -> Backend:
    from tasks.backends.eks.backend import EksBackend

    # No lease handed over: its lease lives on FSx, and its Jobs are found by label. Every pod
    # of an attempt needs a node to start on, the spares' too.
    return EksBackend(params.eks, nodes=params.launched_nodes, log=log)


TYPES: dict[str, BackendType] = {
    "local": BackendType(
        "local",
        "simulated nodes on this machine (the embedded default)",
        ranks_per_node=lambda p: p.nproc_per_node,
        embedded_s3=True,
        hydrates_s3_weights=True,
        factory=_local,
        drills=frozenset({"node-loss", "node-return", "node-freeze", "node-evict"}),
    ),
    "eks": BackendType(
        "eks",
        "an Indexed Job on Amazon EKS",
        ranks_per_node=lambda p: p.eks.gpus_per_node,
        embedded_s3=False,
        hydrates_s3_weights=False,
        factory=_eks,
        check=_eks_check,
        # A lost pod's replacement is the Job controller's to start, and the API cannot stop
        # a pod's processes without ending them: a freeze is its own agent's
        # (trainer.node_beat); an eviction deletes the pod with its grace.
        drills=frozenset({"node-loss", "node-freeze", "node-evict"}),
    ),
}


def backend_type(name: str) -> BackendType:
    try:
        return TYPES[name]
    except KeyError:
        raise ValueError(f"backend: {name!r} is not one of {', '.join(TYPES)}") from None


def create(
    name: str,
    params: RunParams,
    *,
    lease: RunLease | None = None,
    log: Callable[[str], None] = lambda msg: None,
) -> Backend:
    """The backend ``name`` for a run (cheap: clients connect on first use)."""
    return backend_type(name).factory(params, lease=lease, log=log)
