"""The security context every pod the EKS backend renders runs under (pure).

The image (deploy/eks/Dockerfile) creates the user ``nvrx`` with a fixed UID/GID and HOME; the
pods run as that user, never root, with no privilege escalation, a read-only root filesystem,
the runtime's default seccomp profile and no capabilities (Pod Security "restricted"). What must
be writable is an ``emptyDir``: ``/tmp`` (ft_launcher's rank-monitor sockets, torch/Triton compile
caches, tempfiles) and HOME (CUDA and Triton caches); ``/dev/shm`` and the FSx mount are volumes
already. tests/test_deploy_assets.py checks the Dockerfile uses the same numbers.
"""

from __future__ import annotations

from typing import Any

UID = 10001
GID = 10001
HOME = "/home/nvrx"
TMP = "/tmp"


def pod_security_context() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": UID,
        "runAsGroup": GID,
        # emptyDirs become group-writable for GID. The kubelet does not chown the FSx volume
        # (RWX, no fsType: the default fsGroupPolicy skips it), so /fsx/runs is chown'ed to
        # UID:GID once at setup (deploy/eks/README.md, step 8).
        "fsGroup": GID,
        "fsGroupChangePolicy": "OnRootMismatch",  # no recursive chown walk on every start
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security_context() -> dict[str, Any]:
    # No capability is added, EFA's included. AWS's EFA pod examples add IPC_LOCK, because
    # libfabric's efa provider pins the buffers it registers (ibv_reg_mr), which counts against
    # RLIMIT_MEMLOCK unless the process holds CAP_IPC_LOCK. But a non-root process loses an
    # added capability at exec (the CRI sets no ambient capabilities:
    # kubernetes/kubernetes#56374), so for this image's user IPC_LOCK would only fail the
    # namespace's Pod Security level (baseline forbids it) while granting nothing. What
    # registration relies on is the memlock limit containers inherit from the node's runtime,
    # which the EKS accelerated AMIs set up for EFA as unlimited (not verified here: check that
    # `ulimit -l` says unlimited in a trainer pod). The device nodes the device plugins pass in
    # keep the host's mode: 0666 for /dev/nvidia* and, by rdma-core's udev rule,
    # /dev/infiniband/uverbs* (verify on a node).
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }


def scratch_volumes(*, tmp_gi: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, volumeMounts) for the writable paths a read-only root filesystem needs."""
    volumes = [
        {"name": "tmp", "emptyDir": {"sizeLimit": f"{tmp_gi}Gi"}},
        {"name": "home", "emptyDir": {"sizeLimit": "1Gi"}},
    ]
    mounts = [{"name": "tmp", "mountPath": TMP}, {"name": "home", "mountPath": HOME}]
    return volumes, mounts
