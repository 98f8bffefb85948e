"""Every Kubernetes and AWS API call the EKS backend makes, and what it needs to be allowed
(``where``: relative to ``tasks/backends/eks``). The deployment's table: the product never
imports it.

One table, three readers: deploy/eks/rbac.yaml and deploy/eks/iam-flow-runner-policy.json grant
exactly these (tests/test_deploy_assets.py fails on a grant missing *or* extra), the same test
greps the sources for client calls and fails on one this table does not list, and
deploy/eks/README.md shows it to people. Add a call here when the code gains one.

Only the flow runner (ServiceAccount ``nvrx-pipeline``) calls APIs. The training and hydration
pods (``nvrx-trainer``) call neither Kubernetes nor AWS: no RBAC binding, no IAM role.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KubeCall:
    method: str  # the kubernetes client's method (CoreV1Api, BatchV1Api, ...)
    group: str  # API group ("" = core)
    resource: str  # plural; "pods/log" for a subresource
    verb: str  # the RBAC verb the API server checks
    where: str
    cluster: bool = False  # a cluster-scoped resource, or all namespaces: the ClusterRole
    default: bool = False  # allowed to every authenticated user by Kubernetes' own defaults


@dataclass(frozen=True)
class AwsCall:
    method: str  # "<service>.<boto3 method>"
    actions: tuple[str, ...]  # the IAM actions it needs
    where: str


# The attempt's objects (render.render_all: the training Job, its Service, ConfigMap and
# NetworkPolicy; and the hydration Job): kube.Kube.apply creates each, patching on 409, and
# kube.Kube.delete_job deletes them together.
_APPLIED = (
    ("job", "batch", "jobs"),
    ("service", "", "services"),
    ("config_map", "", "configmaps"),
    ("network_policy", "networking.k8s.io", "networkpolicies"),
)
_APPLY = (
    ("create", "kube.Kube.apply"),
    ("patch", "kube.Kube.apply (on 409)"),
    ("delete", "kube.Kube.delete_job"),
)

KUBE_CALLS: tuple[KubeCall, ...] = (
    *(
        KubeCall(f"{verb}_namespaced_{kind}", group, resource, verb, where)
        for kind, group, resource in _APPLIED
        for verb, where in _APPLY
    ),
    KubeCall("read_namespaced_job", "batch", "jobs", "get", "kube.Kube.read_job"),
    KubeCall("list_namespaced_job", "batch", "jobs", "list", "kube.Kube.jobs_labelled"),
    # watching the attempt
    KubeCall("list_namespaced_pod", "", "pods", "list", "kube.Kube.job_pods"),
    KubeCall("list_namespaced_pod", "", "pods", "watch", "kube.Kube.watch('pod')"),
    KubeCall("delete_namespaced_pod", "", "pods", "delete", "kube.Kube.delete_pod (drill)"),
    KubeCall("read_namespaced_pod_log", "", "pods/log", "get", "kube.Kube.follow_log"),
    KubeCall("list_node", "", "nodes", "list", "kube.Kube.nodes", cluster=True),
    KubeCall("list_node", "", "nodes", "watch", "kube.Kube.watch('node')", cluster=True),
    # straggler policy replace: a node confirmed slow is cordoned before its pod is taken away
    KubeCall("patch_node", "", "nodes", "patch", "kube.Kube.cordon (stragglers)", cluster=True),
    # preflight (tasks/preflight/eks.py gather_eks)
    KubeCall(
        "list_daemon_set_for_all_namespaces",
        "apps",
        "daemonsets",
        "list",
        "preflight.eks.gather_eks (device plugins)",
        cluster=True,
    ),
    KubeCall(
        "read_namespaced_persistent_volume_claim",
        "",
        "persistentvolumeclaims",
        "get",
        "preflight.eks.gather_eks (FSx claim Bound)",
    ),
    KubeCall(
        "list_csi_driver",
        "storage.k8s.io",
        "csidrivers",
        "list",
        "preflight.eks.gather_eks (fsx.csi.aws.com)",
        cluster=True,
    ),
    # Every authenticated user may ask what it may do (ClusterRole system:basic-user).
    KubeCall(
        "create_self_subject_access_review",
        "authorization.k8s.io",
        "selfsubjectaccessreviews",
        "create",
        "preflight.eks.gather_eks (permissions)",
        cluster=True,
        default=True,
    ),
)

# The flow runner's AWS calls on backend=eks. FSx: the hydrate stage and the preflight; S3: the
# preflight's S3 snapshot (tasks/preflight/local.py gather_s3, shared by both backends) and the
# export (tasks/export.py).
AWS_CALLS: tuple[AwsCall, ...] = (
    AwsCall("fsx.describe_file_systems", ("fsx:DescribeFileSystems",), "preflight.eks.gather_eks"),
    AwsCall(
        "fsx.describe_data_repository_associations",
        ("fsx:DescribeDataRepositoryAssociations",),
        "preflight.eks.gather_eks; fsx.ensure_association",
    ),
    AwsCall(
        "fsx.create_data_repository_association",
        ("fsx:CreateDataRepositoryAssociation",),
        "fsx.ensure_association (only when missing)",
    ),
    AwsCall(
        "fsx.create_data_repository_task",
        ("fsx:CreateDataRepositoryTask",),
        "fsx.import_metadata",
    ),
    AwsCall(
        "fsx.describe_data_repository_tasks",
        ("fsx:DescribeDataRepositoryTasks",),
        "fsx.import_metadata (polling)",
    ),
    AwsCall("s3.list_buckets", ("s3:ListAllMyBuckets",), "preflight.local.gather_s3"),
    AwsCall("s3.head_bucket", ("s3:ListBucket",), "preflight.local.gather_s3; export"),
    AwsCall(
        "s3.get_object",
        ("s3:GetObject",),
        "preflight.local.gather_s3 (dataset.json); export (read-back check)",
    ),
    AwsCall("s3.head_object", ("s3:GetObject",), "storage.verified_upload.head_object (export)"),
    AwsCall("s3.put_object", ("s3:PutObject",), "export (an object up to one part)"),
    AwsCall("s3.create_multipart_upload", ("s3:PutObject",), "export (a larger object)"),
    AwsCall("s3.upload_part", ("s3:PutObject",), "export"),
    AwsCall("s3.complete_multipart_upload", ("s3:PutObject",), "export"),
    AwsCall(
        "s3.abort_multipart_upload",
        ("s3:AbortMultipartUpload",),
        "export (a part or the digest did not match)",
    ),
    AwsCall(
        "s3.delete_object",
        ("s3:DeleteObject",),
        "export (withdraws an old manifest before objects under it change)",
    ),
)

# Not calls the code makes, but what FSx checks on the caller of CreateDataRepositoryAssociation:
# it creates (once per account) and updates the service-linked role through which FSx reaches
# the bucket (AWS: "Linking your file system to an Amazon S3 bucket", IAM permissions).
AWS_IMPLIED: tuple[str, ...] = (
    "iam:CreateServiceLinkedRole",
    "iam:AttachRolePolicy",
    "iam:PutRolePolicy",
)
