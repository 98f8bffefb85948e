"""The typed parameters of the EKS backend (the ``eks`` section of the run form): validated at
construction, passed whole to every EKS function."""

from __future__ import annotations

import math
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tasks.deployment_policy import STRICT, check_eks

# Which image runs, as which ServiceAccount, in which namespace, on which instance types, FSx
# claims and mounts, priority classes and queues is the deployment's decision, not the run
# form's: tasks.deployment_policy. (ALLOWED_ENV: the lists whose unset value allows only the
# field's default.)
ALLOWED_ENV = STRICT


# DNS-1123 names: a PriorityClass is a subdomain (<= 253), a Kueue LocalQueue's name travels as a
# label value (<= 63), so a label.
DNS1123_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS1123_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
# A Kubernetes CPU quantity as people write it: whole cores, up to 3 decimals, or millicores.
CPU_QUANTITY = r"^([1-9][0-9]{0,3}|[0-9]{1,4}\.[0-9]{1,3}|[1-9][0-9]{0,6}m)$"


# -- what one training pod may use on a node of each instance type ---------------------------------
@dataclass(frozen=True)
class InstanceType:
    vcpus: int
    memory_gib: int  # as EC2 lists it
    gpus: int
    efa: int  # EFA interfaces (vpc.amazonaws.com/efa the EFA device plugin advertises); 0: none
    gpudirect_rdma: bool  # EFA with GPUDirect RDMA (FI_EFA_USE_DEVICE_RDMA=1); g-types have none


# EC2's published sizes (vCPUs, GiB, GPUs) and EFA interfaces (the network cards of an
# EFA-capable size: "Supported instance types" in the EFA user guide) of the GPU instance types a
# training pod targets; deploy/eks/cluster.yaml's GPU node group (p5.48xlarge) is one of them.
# One table: the pod's GPUs, EFA, CPU and memory all render from it (EksParams' defaults).
INSTANCE_TYPES: dict[str, InstanceType] = {
    "p5.48xlarge": InstanceType(192, 2048, 8, 32, True),  # H100
    "p5e.48xlarge": InstanceType(192, 2048, 8, 32, True),  # H200
    "p5en.48xlarge": InstanceType(192, 2048, 8, 16, True),  # H200, EFAv3 (16 x 200 Gbps)
    "p4d.24xlarge": InstanceType(96, 1152, 8, 4, True),  # A100 40 GB
    "p4de.24xlarge": InstanceType(96, 1152, 8, 4, True),  # A100 80 GB
    "g5.12xlarge": InstanceType(48, 192, 4, 1, False),  # A10G
    "g5.24xlarge": InstanceType(96, 384, 4, 1, False),
    "g5.48xlarge": InstanceType(192, 768, 8, 1, False),
    "g6.12xlarge": InstanceType(48, 192, 4, 1, False),  # L4
    "g6.24xlarge": InstanceType(96, 384, 4, 1, False),
    "g6.48xlarge": InstanceType(192, 768, 8, 1, False),
    "g6e.12xlarge": InstanceType(48, 384, 4, 1, False),  # L40S
    "g6e.24xlarge": InstanceType(96, 768, 4, 2, False),
    "g6e.48xlarge": InstanceType(192, 1536, 8, 4, False),
}

# The reserve a pod cannot have, so that requests == limits (Guaranteed QoS) still schedule:
# - kube-reserved as the EKS AMIs compute it (bootstrap.sh / nodeadm): CPU 6% of the first core,
#   1% of the second, 0.5% of the next two, 0.25% of every core above four; memory 255 MiB +
#   11 MiB per pod the node may run (MAX_PODS: the max-pods calculator's ceiling for nodes
#   with 30+ vCPUs, the largest the AMI may configure, so the reserve is never underestimated);
# - the kubelet's hard eviction threshold (memory.available < 100Mi);
# - the node's daemonsets (VPC CNI and its network policy agent, kube-proxy, the FSx CSI node
#   driver, the NVIDIA and EFA device plugins, monitoring agents): DAEMONSET_* is a generous
#   allowance for their requests, so an added agent does not leave the pod Pending;
# - memory the kernel and firmware keep: a node's capacity is below EC2's nominal size
#   (KERNEL_MEMORY_FRACTION, not measured on these types: hence eks.cpu / eks.memory_gi).
# The CPU is rounded down to whole cores: with the kubelet's static CPU manager a Guaranteed
# pod with an integer CPU count gets exclusive cores.
MAX_PODS = 250
EVICTION_HARD_MIB = 100
DAEMONSET_CPU_M = 2000
DAEMONSET_MEMORY_MIB = 8 * 1024
KERNEL_MEMORY_FRACTION = 0.05


def kube_reserved_cpu_m(vcpus: int) -> float:
    """EKS AMI's kube-reserved CPU in millicores for a node with ``vcpus`` cores."""
    steps = ((1, 60.0), (1, 10.0), (2, 5.0))
    reserved, left = 0.0, vcpus
    for cores, per_core in steps:
        take = min(cores, left)
        reserved, left = reserved + take * per_core, left - take
    return reserved + left * 2.5


def kube_reserved_memory_mib(max_pods: int = MAX_PODS) -> int:
    """EKS AMI's kube-reserved memory in MiB."""
    return 255 + 11 * max_pods


def pod_cpu_for(itype: InstanceType) -> int:
    """Whole cores one pod may request (= limit) on a node of this type."""
    return math.floor(
        (itype.vcpus * 1000 - kube_reserved_cpu_m(itype.vcpus) - DAEMONSET_CPU_M) / 1000
    )


# /dev/shm beside the memory saves: NCCL's shared-memory transport between the node's GPUs and
# the data loader workers' batches.
SHM_BESIDE_GI = 16


def pod_memory_gi_for(itype: InstanceType) -> int:
    """Whole GiB one pod may request (= limit) on a node of this type."""
    capacity_mib = itype.memory_gib * 1024 * (1 - KERNEL_MEMORY_FRACTION)
    reserve_mib = kube_reserved_memory_mib() + EVICTION_HARD_MIB + DAEMONSET_MEMORY_MIB
    return math.floor((capacity_mib - reserve_mib) / 1024)


def cpu_millicores(quantity: str) -> int:
    """``CPU_QUANTITY`` text -> millicores."""
    if quantity.endswith("m"):
        return int(quantity[:-1])
    return round(float(quantity) * 1000)


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
    efa_per_node: int | None = Field(
        None,
        ge=0,
        le=64,
        description="vpc.amazonaws.com/efa per pod; empty: every EFA interface of the instance "
        "type (32 on p5, 4 on p4d, 1 on g5.48xlarge; 0 where it has none)",
    )
    fsx_claim: str = Field("fsx-claim", description="PVC of the FSx for Lustre file system")
    fsx_mount: str = Field("/fsx", description="where pods mount the FSx volume")
    shm_gi: int | None = Field(
        None,
        ge=1,
        le=2048,
        description="/dev/shm size (memory emptyDir), GiB; counted against the pod's memory; "
        f"empty: sized from the model, the memory saves' need per node + {SHM_BESIDE_GI} "
        "(at most half the pod's memory)",
    )
    cpu: str | None = Field(
        None,
        pattern=CPU_QUANTITY,
        description="CPU of a training pod (requests = limits: Guaranteed QoS), e.g. 180 or "
        "1500m; empty: the instance type's vCPUs less the node's reserve",
    )
    memory_gi: int | None = Field(
        None,
        ge=1,
        le=32768,
        description="memory of a training pod in GiB (requests = limits), /dev/shm included; "
        "empty: the instance type's memory less the node's reserve",
    )
    priority_class: str | None = Field(
        None,
        pattern=DNS1123_SUBDOMAIN,
        max_length=253,
        description="PriorityClass of the training and hydration pods (priorityClassName); "
        "empty: the cluster's default",
    )
    queue: str | None = Field(
        None,
        pattern=DNS1123_LABEL,
        max_length=63,
        description="Kueue LocalQueue of the training Job (label kueue.x-k8s.io/queue-name); "
        "empty: not queued by Kueue",
    )
    rdzv_port: int = Field(29500, ge=1024, le=65535, description="c10d rendezvous port")
    monitoring_namespace: str = Field(
        "monitoring",
        pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
        max_length=63,
        description="namespace of the Prometheus that scrapes the training pods (the Job's "
        "NetworkPolicy admits it to the metrics port)",
    )
    unreachable_toleration_s: int = Field(
        60,
        ge=0,
        le=3600,
        description="evict pods this long after their node goes unreachable or not-ready; a "
        "node NotReady this long with pods of the attempt on it is a node loss",
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
    region: str | None = Field(
        None,
        pattern=r"^[a-z]{2}(-[a-z]+)+-\d$",
        description="AWS region of the FSx file system and the buckets (e.g. us-west-2); empty: "
        "the flow runner's standard AWS chain (AWS_REGION, AWS_DEFAULT_REGION, AWS_PROFILE's "
        "region in ~/.aws/config; IRSA sets AWS_REGION to the cluster's), else us-east-1",
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

    @model_validator(mode="after")
    def _resources(self) -> EksParams:
        if self.priority_class and self.priority_class.startswith("system-"):
            raise ValueError(
                f"eks.priority_class: {self.priority_class!r} is reserved for the cluster's own "
                "components (a training pod must not preempt DNS or the CNI); name a "
                "PriorityClass made for training jobs"
            )
        itype = INSTANCE_TYPES.get(self.instance_type)
        if itype is None and (self.cpu is None or self.memory_gi is None):
            missing = " and ".join(
                f"eks.{f}" for f in ("cpu", "memory_gi") if getattr(self, f) is None
            )
            raise ValueError(
                f"eks.instance_type: {self.instance_type!r} is not one whose size is known "
                f"({', '.join(INSTANCE_TYPES)}); set {missing} for it (what one training pod "
                "may use: the node's allocatable less its daemonsets' requests)"
            )
        if itype is not None:
            cpu = cpu_millicores(self.cpu) / 1000 if self.cpu is not None else None
            for field, asked, has, unit, empty in (
                ("gpus_per_node", self.gpus_per_node, itype.gpus, "GPUs", None),
                ("efa_per_node", self.efa_per_node, itype.efa, "EFA interface(s)", itype.efa),
                ("cpu", cpu, itype.vcpus, "vCPUs", pod_cpu_for(itype)),
                ("memory_gi", self.memory_gi, itype.memory_gib, "GiB", pod_memory_gi_for(itype)),
            ):
                if asked is not None and asked > has:
                    raise ValueError(
                        f"eks.{field}: {getattr(self, field)} but {self.instance_type} has {has} "
                        f"{unit}; the pods would never schedule"
                        + (f" (empty: {empty})" if empty is not None else "")
                    )
        if self.cpu is not None and cpu_millicores(self.cpu) == 0:
            raise ValueError("eks.cpu: must be more than 0")
        memory = self.pod_memory_gi()
        if self.shm_gi is not None and self.shm_gi >= memory:
            raise ValueError(
                f"eks.shm_gi: {self.shm_gi} GiB of /dev/shm is memory, counted against the "
                f"training pod's memory limit of {memory} GiB, which leaves nothing for the "
                "ranks; lower eks.shm_gi or raise eks.memory_gi"
            )
        return self

    def pod_efa(self) -> int:
        """EFA interfaces of a training pod: the field, else every one the instance type has
        (an unknown type: none unless given)."""
        if self.efa_per_node is not None:
            return self.efa_per_node
        itype = INSTANCE_TYPES.get(self.instance_type)
        return itype.efa if itype is not None else 0

    def gpudirect_rdma(self) -> bool:
        """Whether the pod's EFA does GPUDirect RDMA (p4d, p5): an unknown type, not assumed."""
        itype = INSTANCE_TYPES.get(self.instance_type)
        return self.pod_efa() > 0 and itype is not None and itype.gpudirect_rdma

    def pod_cpu(self) -> str:
        """The training pod's CPU quantity (requests = limits)."""
        if self.cpu is not None:
            return self.cpu
        return str(pod_cpu_for(INSTANCE_TYPES[self.instance_type]))

    def pod_shm_gi(self, node_memory_gb: float = 0.0) -> int:
        """The training pod's /dev/shm in GiB: the field, else sized from what the memory saves
        keep in it per node (``node_memory_gb``, tasks.preflight.memory.node_memory_need) plus
        what else uses it, at most half the pod's memory (the ranks need the rest; preflight
        then refuses a need that does not fit, with both numbers)."""
        if self.shm_gi is not None:
            return self.shm_gi
        sized = math.ceil(node_memory_gb * 1e9 / 2**30) + SHM_BESIDE_GI
        return max(1, min(sized, self.pod_memory_gi() // 2))

    def pod_memory_gi(self) -> int:
        """The training pod's memory in GiB (requests = limits), /dev/shm included."""
        if self.memory_gi is not None:
            return self.memory_gi
        return pod_memory_gi_for(INSTANCE_TYPES[self.instance_type])

    def check_deployment_allows(self) -> None:
        """Refuse a value the deployment does not allow (tasks.deployment_policy)."""
        check_eks(self)
