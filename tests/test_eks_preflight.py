"""EKS preflight: pure checks over realistic snapshots, and one gather against kmock (Kubernetes
API over HTTP) plus Stubber (FSx service model)."""

from __future__ import annotations

import boto3
from botocore.stub import Stubber

from tasks.checks import Snapshot, Status, failures
from tasks.preflight.eks import EksRequirements, gather_eks, run_eks_checks, usable_nodes
from tests.eks_cluster import p5, seed_cluster

REQ = EksRequirements(
    nodes=2,
    gpus_per_node=8,
    efa_per_node=32,
    instance_type="p5.48xlarge",
    namespace="nvrx",
    fsx_claim="fsx-claim",
    file_system_id="fs-0123456789abcdef0",
    cpu_m=189_000,  # the Guaranteed pod of eks defaults on p5.48xlarge
    memory_mib=1934 * 1024,
)


def healthy() -> Snapshot:
    return Snapshot(
        facts={
            "nodes": [p5("a", taints=[{"key": "nvidia.com/gpu", "effect": "NoSchedule"}]), p5("b")],
            "daemonsets": {
                "nvidia-device-plugin-daemonset": {"numberReady": 2, "desiredNumberScheduled": 2},
                "aws-efa-k8s-device-plugin-daemonset": {
                    "numberReady": 2,
                    "desiredNumberScheduled": 2,
                },
            },
            "pvc_phase": "Bound",
            "csi_driver": ["fsx.csi.aws.com", "ebs.csi.aws.com"],
            "access": {"create jobs": True, "list pods": True},
            "fsx_lifecycle": "AVAILABLE",
            "fsx_associations": ["s3://nvrx-datasets"],
        }
    )


def statuses(snap: Snapshot) -> dict[str, Status]:
    return {r.name: r.status for r in run_eks_checks(snap, REQ)}


def test_healthy_cluster_passes():
    assert set(statuses(healthy()).values()) == {Status.PASSED}


def test_allocatable_not_capacity_and_taints_and_readiness():
    snap = healthy()
    snap.facts["nodes"] = [
        p5("gpu-reserved", gpus="7"),  # capacity 8, one GPU held back: not usable
        p5("no-efa", efa="0"),
        p5("tainted", taints=[{"key": "maintenance", "effect": "NoSchedule"}]),
        p5("down", ready="Unknown"),
        p5("small", itype="g5.xlarge"),
        p5("daemonset-heavy", cpu="150", memory="1800Gi"),  # the Guaranteed pod does not fit
        p5("good"),
    ]
    r = {x.name: x for x in run_eks_checks(snap, REQ)}["GPU/EFA nodes"]
    assert r.status == Status.FAILED and "1 usable node(s), need 2" in r.detail
    assert r.detail.endswith("; and 1 more)")  # five reasons, then a count
    reasons = "; ".join(usable_nodes(snap, REQ)[1])
    for why in (
        "allocatable GPUs 7",
        "allocatable EFA 0",
        "untolerated taints maintenance",
        "not Ready",
        "type g5.xlarge",
        "allocatable cpu 150 < the pod's 189000m (eks.cpu)",
        "allocatable memory 1800Gi < the pod's 1980416Mi (eks.memory_gi)",
    ):
        assert why in reasons


def test_each_failure_is_reported_with_a_fix():
    snap = healthy()
    snap.facts["daemonsets"].pop("aws-efa-k8s-device-plugin-daemonset")
    snap.facts.update(pvc_phase="Pending", access={"create jobs": False}, fsx_lifecycle="CREATING")
    results = [r for r in run_eks_checks(snap, REQ) if r.status == Status.FAILED]
    assert {r.name for r in results} == {
        "NVIDIA and EFA device plugins",
        "FSx CSI driver and claim",
        "permissions",
        "FSx file system",
    }
    assert all(r.fix for r in results)


def test_blind_sources_are_skipped():
    snap = healthy()
    snap.errors.update(nodes="cannot list nodes: 403", fsx="no FSx file system id configured")
    s = statuses(snap)
    assert s["GPU/EFA nodes"] == s["FSx file system"] == Status.SKIPPED


def test_failed_nodes_source_fails_the_gate_naming_the_check_and_the_error():
    snap = healthy()
    del snap.facts["nodes"]
    snap.errors["nodes"] = "cannot list nodes: (403) Forbidden"
    failed = failures(run_eks_checks(snap, REQ))
    assert [f.name for f in failed] == ["GPU/EFA nodes"]
    (f,) = failed
    assert f.status == Status.SKIPPED
    assert "source 'nodes' failed: cannot list nodes: (403) Forbidden" in f.detail
    assert "list nodes" in f.fix and "rbac.yaml" in f.fix


def test_unanswered_access_review_is_advisory():
    snap = healthy()
    del snap.facts["access"]
    snap.errors["access"] = "cannot review permissions: no answer"
    results = run_eks_checks(snap, REQ)
    assert {r.name: r.status for r in results}["permissions"] == Status.SKIPPED
    assert failures(results) == []


def test_gather_against_emulator_and_stubbed_fsx(kube):
    seed_cluster(kube)
    fsx = boto3.client(
        "fsx", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x"
    )
    with Stubber(fsx) as stub:
        stub.add_response(
            "describe_file_systems",
            {
                "FileSystems": [
                    {
                        "FileSystemId": "fs-0123456789abcdef0",
                        "Lifecycle": "AVAILABLE",
                        "FileSystemType": "LUSTRE",
                        "StorageCapacity": 1200,
                    }
                ]
            },
            {"FileSystemIds": ["fs-0123456789abcdef0"]},
        )
        stub.add_response(
            "describe_data_repository_associations",
            {
                "Associations": [
                    {
                        "AssociationId": "dra-0123456789abcdef0",
                        "DataRepositoryPath": "s3://nvrx-datasets",
                    }
                ]
            },
            {"Filters": [{"Name": "file-system-id", "Values": ["fs-0123456789abcdef0"]}]},
        )
        snap = gather_eks(kube, fsx, REQ)
    s = statuses(snap)
    assert s["GPU/EFA nodes"] == Status.PASSED
    assert s["NVIDIA and EFA device plugins"] == Status.PASSED
    assert s["FSx CSI driver and claim"] == Status.PASSED
    assert s["FSx file system"] == Status.PASSED
    # kmock stores the access review but, having no authorizer, never answers it: SKIPPED.
    assert s["permissions"] == Status.SKIPPED
    assert "did not answer" in snap.errors["access"]
    assert failures(run_eks_checks(snap, REQ)) == []  # the gate passes a healthy cluster


def test_missing_file_system_id_fails_with_the_fix():
    import dataclasses

    snap = healthy()
    r = {x.name: x for x in run_eks_checks(snap, dataclasses.replace(REQ, file_system_id=None))}[
        "FSx file system"
    ]
    assert r.status == Status.FAILED and "eks.file_system_id" in r.fix
