"""The typed parameters of the EKS backend (the ``eks`` section of the run form): validated at
construction, passed whole to every EKS function."""

from __future__ import annotations

import os

from pydantic import BaseModel, ConfigDict, Field

# Which image runs, as which ServiceAccount, in which namespace is the deployment's decision, not
# the run form's: the EKS work pool's base job template fixes these in the flow-run pod's
# environment (deploy/eks/work-pool-template.json), comma-separated, and a backend=eks run
# naming anything else is refused before anything launches. Unset (the CLI, tests), only the
# field's default is allowed; a backend=local run is never checked, so it never needs EKS values.
ALLOWED_ENV = {
    "image": "NVRX_ALLOWED_IMAGES",
    "service_account": "NVRX_ALLOWED_SERVICE_ACCOUNTS",
    "namespace": "NVRX_ALLOWED_NAMESPACES",
}


def deployment_allowed(field: str, default: str) -> tuple[str, ...]:
    """The values the deployment allows for an EKS field (read when a run is validated)."""
    raw = os.environ.get(ALLOWED_ENV[field], "")
    values = tuple(v.strip() for v in raw.split(",") if v.strip())
    return values or (default,)


class EksParams(BaseModel):
    """Where and how the train stage runs on Amazon EKS (backend=eks)."""

    model_config = ConfigDict(extra="forbid")
    namespace: str = Field(
        "nvrx",
        pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
        max_length=63,
        description="Kubernetes namespace of the training Job; one the deployment allows "
        "(NVRX_ALLOWED_NAMESPACES)",
    )
    image: str = Field(
        "REGISTRY/nvrx-pipeline:latest",
        min_length=1,
        description="training image (deploy/eks/Dockerfile); one the deployment allows "
        "(NVRX_ALLOWED_IMAGES)",
    )
    service_account: str = Field(
        "nvrx-trainer",
        description="ServiceAccount of training pods; one the deployment allows "
        "(NVRX_ALLOWED_SERVICE_ACCOUNTS)",
    )
    instance_type: str = Field("p5.48xlarge", description="node instance type (node affinity)")
    gpus_per_node: int = Field(8, ge=1, le=16, description="nvidia.com/gpu per pod (= ranks)")
    efa_per_node: int = Field(32, ge=0, le=64, description="vpc.amazonaws.com/efa per pod")
    fsx_claim: str = Field("fsx-claim", description="PVC of the FSx for Lustre file system")
    fsx_mount: str = Field("/fsx", description="where pods mount the FSx volume")
    shm_gi: int = Field(64, ge=1, le=2048, description="/dev/shm size (memory emptyDir), GiB")
    rdzv_port: int = Field(29500, ge=1024, le=65535, description="c10d rendezvous port")
    unreachable_toleration_s: int = Field(
        60, ge=0, le=3600, description="evict pods this long after their node goes unreachable"
    )
    unschedulable_timeout_s: float = Field(
        900, ge=30, description="fail the stage when pods stay unschedulable this long"
    )
    keep_failed_job: bool = Field(True, description="keep a failed Job for forensics")
    file_system_id: str | None = Field(
        None,
        pattern=r"^fs-[0-9a-f]{8,21}$",
        description="FSx for Lustre file system id (fs-...) mounted by the fsx_claim PVC",
    )
    region: str = Field(
        "us-east-1",
        pattern=r"^[a-z]{2}(-[a-z]+)+-\d$",
        description="AWS region of the cluster, the FSx file system and the buckets",
    )
    node_wait_s: float = Field(
        900,
        ge=0,
        le=24 * 3600,
        description="after a node loss, wait this long for enough healthy nodes before the "
        "next train attempt",
    )
    hydrate_timeout_s: float = Field(
        6 * 3600,
        ge=60,
        description="deadline for the FSx import task plus the hydration Job",
    )

    def check_deployment_allows(self) -> None:
        """Refuse an image, service account or namespace the deployment does not allow (the
        defaults included: a run that replaces ``params`` falls back to them)."""
        for field in ALLOWED_ENV:
            value = getattr(self, field)
            allowed = deployment_allowed(field, str(type(self).model_fields[field].default))
            if value not in allowed:
                raise ValueError(
                    f"eks.{field}: {value!r} is not allowed by this deployment; allowed: "
                    f"{', '.join(allowed)} (the deployment sets {ALLOWED_ENV[field]})"
                )
