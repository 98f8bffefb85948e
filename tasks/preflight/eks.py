"""EKS preflight: gather one snapshot (Kubernetes API + FSx + S3), then pure checks.

The checks are declared like the local ones (:class:`tasks.preflight.checks.Check`): a check
whose source could not be read is SKIPPED with the source's error, never PASSED, and the gate
fails it when the check is required.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tasks.backends.eks.params import cpu_millicores
from tasks.checks import Check, CheckResult, Snapshot, Source, Verdict, failed, passed, run_all

# What the flow runner needs to be allowed to do (SelfSubjectAccessReview each).
PERMISSIONS: tuple[tuple[str, str, str, str], ...] = (
    # (group, resource, subresource, verb)
    ("batch", "jobs", "", "create"),
    ("batch", "jobs", "", "delete"),
    ("", "pods", "", "list"),
    ("", "pods", "", "watch"),
    ("", "pods", "log", "get"),
    ("", "services", "", "create"),
    ("", "nodes", "", "list"),
)
DEVICE_PLUGINS = ("nvidia-device-plugin", "aws-efa-k8s-device-plugin")


@dataclass(frozen=True, kw_only=True)
class EksRequirements:
    nodes: int
    gpus_per_node: int
    efa_per_node: int
    instance_type: str
    namespace: str
    fsx_claim: str
    file_system_id: str | None
    tolerated_taints: tuple[str, ...] = ("nvidia.com/gpu", "vpc.amazonaws.com/efa")
    # The training pod's Guaranteed request (= limit): a node must have it allocatable, or the
    # pod stays Pending until eks.unschedulable_timeout_s. 0: not checked.
    cpu_m: int = 0
    memory_mib: int = 0


_MEMORY_UNITS = {
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
}


def memory_mib(quantity: str) -> int:
    """A Kubernetes memory quantity (``2051314436Ki``, ``1934Gi``, bytes) in MiB."""
    for unit, factor in _MEMORY_UNITS.items():
        if quantity.endswith(unit):
            return int(float(quantity[: -len(unit)]) * factor) // 2**20
    return int(float(quantity)) // 2**20


# -- gathering ---------------------------------------------------------------------------------
def _raw(resp: Any) -> Any:
    return json.loads(resp.data)


def gather_eks(kube: Any, fsx: Any | None, req: EksRequirements) -> Snapshot:
    """``kube``: :class:`tasks.backends.eks.kube.Kube`; ``fsx``: a boto3 FSx client (or None)."""
    snap = Snapshot()
    f, err = snap.facts, snap.errors
    try:
        f["nodes"] = kube.nodes()
    except Exception as e:
        err["nodes"] = f"cannot list nodes: {e}"
    try:
        found = {}
        for ds in _raw(kube.apps.list_daemon_set_for_all_namespaces(_preload_content=False))[
            "items"
        ]:
            found[ds["metadata"]["name"]] = ds.get("status") or {}
        f["daemonsets"] = found
    except Exception as e:
        err["daemonsets"] = f"cannot list DaemonSets: {e}"
    try:
        pvc = _raw(
            kube.core.read_namespaced_persistent_volume_claim(
                req.fsx_claim, req.namespace, _preload_content=False
            )
        )
        f["pvc_phase"] = (pvc.get("status") or {}).get("phase", "Unknown")
        f["csi_driver"] = [
            d["metadata"]["name"]
            for d in _raw(kube.storage.list_csi_driver(_preload_content=False))["items"]
        ]
    except Exception as e:
        err["storage"] = f"cannot read PVC {req.namespace}/{req.fsx_claim} or CSI drivers: {e}"
    try:
        f["access"] = {}
        for group, resource, sub, verb in PERMISSIONS:
            review = {
                "apiVersion": "authorization.k8s.io/v1",
                "kind": "SelfSubjectAccessReview",
                "spec": {
                    "resourceAttributes": {
                        "group": group,
                        "resource": resource,
                        "subresource": sub,
                        "verb": verb,
                        "namespace": req.namespace,
                    }
                },
            }
            out = _raw(kube.authz.create_self_subject_access_review(review, _preload_content=False))
            allowed = (out.get("status") or {}).get("allowed")
            if allowed is None:
                raise RuntimeError("the API server did not answer the access review")
            f["access"][f"{verb} {resource}{'/' + sub if sub else ''}"] = bool(allowed)
    except Exception as e:
        err["access"] = f"cannot review permissions: {e}"
    if not req.file_system_id:
        # A configuration error, not a blind source: check_fsx fails it.
        f["fsx_lifecycle"], f["fsx_associations"] = None, []
    elif fsx is None:
        err["fsx"] = "no FSx client"
    else:
        try:
            fs = fsx.describe_file_systems(FileSystemIds=[req.file_system_id])["FileSystems"][0]
            f["fsx_lifecycle"] = fs.get("Lifecycle")
            assocs = fsx.describe_data_repository_associations(
                Filters=[{"Name": "file-system-id", "Values": [req.file_system_id]}]
            )["Associations"]
            f["fsx_associations"] = [a.get("DataRepositoryPath") for a in assocs]
        except Exception as e:
            # A file system in another region is "not found": name the region that was asked.
            region = getattr(getattr(fsx, "meta", None), "region_name", None)
            err["fsx"] = f"cannot describe FSx {req.file_system_id} in region {region}: {e}"
    return snap


# -- sources (what gather_eks reads) ----------------------------------------------------------
NODES = Source(
    "nodes",
    "let the flow runner list nodes (deploy/eks/rbac.yaml) and check its kubeconfig and the API "
    "endpoint",
)
DAEMONSETS = Source(
    "daemonsets", "let the flow runner list DaemonSets in all namespaces (deploy/eks/rbac.yaml)"
)
STORAGE = Source(
    "storage",
    "let the flow runner read PersistentVolumeClaims in the namespace and CSIDrivers "
    "(deploy/eks/rbac.yaml)",
    ("pvc_phase", "csi_driver"),
)
ACCESS = Source("access", "let the flow runner create SelfSubjectAccessReviews")
FSX = Source(
    "fsx",
    "give the flow runner fsx:DescribeFileSystems and fsx:DescribeDataRepositoryAssociations "
    "(IAM) and check the region: eks.region, or when empty the flow runner's AWS_REGION / "
    "AWS_DEFAULT_REGION / AWS_PROFILE's region",
    ("fsx_lifecycle", "fsx_associations"),
)


# -- checks (pure) -----------------------------------------------------------------------------
def _ready(node: dict[str, Any]) -> bool:
    conds = {c["type"]: c for c in (node.get("status") or {}).get("conditions") or []}
    return conds.get("Ready", {}).get("status") == "True" and not (node.get("spec") or {}).get(
        "unschedulable", False
    )


def usable_nodes(snap: Snapshot, req: EksRequirements) -> tuple[list[str], list[str]]:
    """(usable node names, reasons others are not): Ready, right type, enough *allocatable*
    GPUs, EFA, cpu and memory for the Guaranteed pod, and no NoSchedule/NoExecute taint our pods
    do not tolerate."""
    usable, why = [], []
    for n in snap.facts.get("nodes", []):
        name = n["metadata"]["name"]
        labels = n["metadata"].get("labels") or {}
        alloc = (n.get("status") or {}).get("allocatable") or {}
        taints = [
            t
            for t in (n.get("spec") or {}).get("taints") or []
            if t.get("effect") in ("NoSchedule", "NoExecute")
            and t.get("key") not in req.tolerated_taints
        ]
        problems = []
        if not _ready(n):
            problems.append("not Ready")
        if labels.get("node.kubernetes.io/instance-type") != req.instance_type:
            problems.append(f"type {labels.get('node.kubernetes.io/instance-type')}")
        if int(alloc.get("nvidia.com/gpu", "0")) < req.gpus_per_node:
            problems.append(f"allocatable GPUs {alloc.get('nvidia.com/gpu', '0')}")
        if req.efa_per_node and int(alloc.get("vpc.amazonaws.com/efa", "0")) < req.efa_per_node:
            problems.append(f"allocatable EFA {alloc.get('vpc.amazonaws.com/efa', '0')}")
        if req.cpu_m and "cpu" in alloc and cpu_millicores(str(alloc["cpu"])) < req.cpu_m:
            problems.append(f"allocatable cpu {alloc['cpu']} < the pod's {req.cpu_m}m (eks.cpu)")
        if (
            req.memory_mib
            and "memory" in alloc
            and memory_mib(str(alloc["memory"])) < req.memory_mib
        ):
            problems.append(
                f"allocatable memory {alloc['memory']} < the pod's {req.memory_mib}Mi "
                "(eks.memory_gi)"
            )
        if taints:
            problems.append("untolerated taints " + ",".join(t["key"] for t in taints))
        (why.append(f"{name}: {'; '.join(problems)}") if problems else usable.append(name))
    return usable, why


def nodes(snap: Snapshot, req: EksRequirements) -> Verdict:
    usable, why = usable_nodes(snap, req)
    if len(usable) < req.nodes:
        return failed(
            f"{len(usable)} usable node(s), need {req.nodes}"
            + (f" ({'; '.join(why[:5])}" if why else "")
            + (f"; and {len(why) - 5} more" if len(why) > 5 else "")
            + (")" if why else ""),
            "scale the GPU node group or lower nodes",
        )
    return passed(f"{len(usable)} usable {req.instance_type} node(s)")


def device_plugins(snap: Snapshot, req: EksRequirements) -> Verdict:
    bad = []
    for plugin in DEVICE_PLUGINS:
        status = next(
            (v for k, v in snap.facts["daemonsets"].items() if k.startswith(plugin)), None
        )
        if status is None:
            bad.append(f"{plugin} missing")
        elif status.get("numberReady", 0) < status.get("desiredNumberScheduled", 0):
            bad.append(
                f"{plugin} {status.get('numberReady', 0)}/"
                f"{status.get('desiredNumberScheduled', 0)} ready"
            )
    if bad:
        return failed(
            "; ".join(bad), "install or repair the device plugin DaemonSets (deploy/eks/README.md)"
        )
    return passed("ready")


def storage(snap: Snapshot, req: EksRequirements) -> Verdict:
    problems = []
    if "fsx.csi.aws.com" not in snap.facts["csi_driver"]:
        problems.append("CSI driver fsx.csi.aws.com not installed")
    if snap.facts["pvc_phase"] != "Bound":
        problems.append(f"PVC {req.fsx_claim} is {snap.facts['pvc_phase']}, not Bound")
    if problems:
        return failed("; ".join(problems), "apply deploy/eks/fsx.yaml")
    return passed(f"{req.fsx_claim} Bound")


def permissions(snap: Snapshot, req: EksRequirements) -> Verdict:
    denied = [k for k, ok in snap.facts["access"].items() if not ok]
    if denied:
        return failed(
            f"not allowed: {denied}", "apply deploy/eks/rbac.yaml and run as its ServiceAccount"
        )
    return passed(f"{len(snap.facts['access'])} actions allowed")


def fsx(snap: Snapshot, req: EksRequirements) -> Verdict:
    if not req.file_system_id:
        return failed(
            "no FSx file system id configured",
            "set eks.file_system_id to the fs-... id behind the fsx_claim PVC",
        )
    if snap.facts["fsx_lifecycle"] != "AVAILABLE":
        return failed(
            f"{req.file_system_id} is {snap.facts['fsx_lifecycle']}",
            "wait for it or fix it in the console",
        )
    if not snap.facts["fsx_associations"]:
        return failed(
            f"{req.file_system_id} has no data repository association",
            "the hydrate stage creates it; check IAM if it fails",
        )
    return passed(f"AVAILABLE, linked to {snap.facts['fsx_associations']}")


# -- the checks, declared once ----------------------------------------------------------------
NODES_CHECK = Check(name="GPU/EFA nodes", requires=(NODES,), fn=nodes)
EKS_CHECKS: tuple[Check, ...] = (
    NODES_CHECK,
    Check(name="NVIDIA and EFA device plugins", requires=(DAEMONSETS,), fn=device_plugins),
    Check(name="FSx CSI driver and claim", requires=(STORAGE,), fn=storage),
    Check(
        name="permissions",
        requires=(ACCESS,),
        fn=permissions,
        # Advisory: an API server without an authorizer (or one that refuses the review) cannot
        # answer it, while a real missing permission still fails loudly with a 403 at the
        # Job's create, before any training starts.
        required=False,
    ),
    Check(name="FSx file system", requires=(FSX,), fn=fsx),
)


def check_nodes(snap: Snapshot, req: EksRequirements) -> CheckResult:
    """The node check alone (the capacity wait re-runs it on a fresh node list)."""
    return NODES_CHECK(snap, req)


def run_eks_checks(snap: Snapshot, req: EksRequirements) -> list[CheckResult]:
    return run_all(EKS_CHECKS, snap, req)
