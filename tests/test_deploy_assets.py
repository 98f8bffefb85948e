"""Static EKS deployment assets (``deploy/eks/``), checked offline: no cluster, no Docker, no AWS.

- ``fsx.yaml``, ``rbac.yaml`` and ``network-policy.yaml``: every document validated in strict
  mode (unknown fields and wrong types fail) against the Kubernetes schema of ``K8S_VERSION``
  with kubernetes-validate, plus the facts the pipeline relies on (claim binding, IRSA only).
- RBAC and IAM: ``rbac.yaml`` and ``iam-flow-runner-policy.json`` grant exactly the calls in
  ``deploy/eks/permissions.py``, and the sources make no Kubernetes or AWS call that
  table does not list (a grep of the client calls).
- ``work-pool-template.json``: a Prefect Kubernetes base job template; its Job manifest, rendered
  as the worker renders it, validated the same way.
- ``cluster.yaml`` (eksctl, not a Kubernetes resource), ``Dockerfile`` and ``prefect.yaml``:
  structural checks.

kubernetes-validate misses enum values, server-side rules and malformed quantities: a manifest
that passes here can still be rejected by a real API server.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import re
import sys
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from packaging.requirements import Requirement

from flows.models import EksParams, PipelineParams
from tasks import aws
from tasks.backends.eks import security
from tasks.backends.eks.params import ALLOWED_ENV
from tasks.deployment_policy import BACKENDS, EVERY_LIST
from tasks.preflight.eks import PERMISSIONS as PREFLIGHT_PERMISSIONS
from tests.k8s_admission import constant
from tests.test_eks_render import K8S_VERSION, restricted_violations

REPO = Path(__file__).resolve().parents[1]
EKS_DIR = REPO / "deploy" / "eks"


def _permissions() -> Any:
    """deploy/eks/permissions.py: the calls the pipeline makes, what rbac.yaml and the IAM
    policy grant (not product code: nothing at run time reads it)."""
    path = EKS_DIR / "permissions.py"
    spec = importlib.util.spec_from_file_location("nvrx_eks_permissions", path)
    assert spec is not None and spec.loader is not None
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


permissions = _permissions()
MANIFESTS = (
    "fsx.yaml",
    "rbac.yaml",
    "network-policy.yaml",
    "admission-policy.yaml",
    "grafana-dashboard.yaml",
)
NAMESPACE = "nvrx"
PIPELINE_SA = "nvrx-pipeline"
GPU_INSTANCE = "p5.48xlarge"
PLACEHOLDER = re.compile(r"\{\{\s*([\w.-]+)\s*\}\}")
IRSA_ARN = re.compile(r"^arn:aws:iam::\d{12}:role/[\w+=,.@-]+$")


def _load_all(name: str) -> list[dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all((EKS_DIR / name).read_text()) if d is not None]
    assert docs, f"{name}: no YAML documents"
    return docs


def _load_one(name: str) -> Any:
    return yaml.safe_load((EKS_DIR / name).read_text())


def _manifest_cases() -> list[Any]:
    return [
        pytest.param(doc, id=f"{name}:{doc.get('kind')}/{doc.get('metadata', {}).get('name')}")
        for name in MANIFESTS
        for doc in _load_all(name)
    ]


def _by_kind(docs: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def _validate(doc: dict[str, Any]) -> None:
    used = kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    # the schema of the pinned version itself, not the nearest older one
    assert used == K8S_VERSION


# --- Kubernetes manifests ------------------------------------------------------------------------


@pytest.mark.parametrize("name", MANIFESTS)
def test_manifests_parse_into_named_resources(name: str) -> None:
    for doc in _load_all(name):
        assert isinstance(doc, dict)
        assert doc.get("apiVersion") and doc.get("kind"), doc
        assert doc.get("metadata", {}).get("name"), doc


@pytest.mark.parametrize("doc", _manifest_cases())
def test_manifest_is_valid_in_strict_mode(doc: dict[str, Any]) -> None:
    _validate(doc)


def test_strict_validation_rejects_unknown_fields_and_wrong_types() -> None:
    docs = _by_kind(_load_all("fsx.yaml"))
    typo = copy.deepcopy(docs[("PersistentVolume", "nvrx-fsx-pv")])
    typo["spec"]["csi"]["volumeAttribute"] = {}  # misspelt field
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(typo)
    wrong_type = copy.deepcopy(docs[("PersistentVolumeClaim", "fsx-claim")])
    wrong_type["spec"]["accessModes"] = "ReadWriteMany"  # a string, not a list
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(wrong_type)


def test_fsx_claim_is_statically_bound_to_the_lustre_volume() -> None:
    docs = _load_all("fsx.yaml")
    kinds = _by_kind(docs)
    pv = kinds[("PersistentVolume", "nvrx-fsx-pv")]
    eks = EksParams()
    pvc = kinds[("PersistentVolumeClaim", eks.fsx_claim)]
    assert pvc["metadata"]["namespace"] == eks.namespace == NAMESPACE

    csi = pv["spec"]["csi"]
    assert csi["driver"] == "fsx.csi.aws.com"
    assert re.fullmatch(r"fs-[0-9a-f]{17}", csi["volumeHandle"])
    assert csi["volumeAttributes"]["dnsname"].startswith(csi["volumeHandle"] + ".fsx.")
    assert csi["volumeAttributes"]["mountname"]
    # static: no StorageClass on either side, each names the other, same size and access mode
    assert pv["spec"]["storageClassName"] == pvc["spec"]["storageClassName"] == ""
    assert pvc["spec"]["volumeName"] == pv["metadata"]["name"]
    assert pv["spec"]["claimRef"] == {"namespace": NAMESPACE, "name": eks.fsx_claim}
    assert pv["spec"]["capacity"]["storage"] == "1200Gi"
    assert pvc["spec"]["resources"]["requests"]["storage"] == "1200Gi"
    assert pv["spec"]["accessModes"] == pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    assert pv["spec"]["persistentVolumeReclaimPolicy"] == "Retain"

    # `kubectl apply -l nvrx.io/fsx=static` (README) applies exactly the volume and the claim
    static = {d["kind"] for d in docs if d["metadata"]["labels"].get("nvrx.io/fsx") == "static"}
    assert static == {"PersistentVolume", "PersistentVolumeClaim"}

    sc = next(d for d in docs if d["kind"] == "StorageClass")
    assert sc["provisioner"] == "fsx.csi.aws.com"
    assert sc["parameters"]["deploymentType"] == "SCRATCH_2"
    assert {"subnetId", "securityGroupIds"} <= set(sc["parameters"])


def _rules(role: dict[str, Any]) -> dict[tuple[str, str], set[str]]:
    out: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        # no nonResourceURLs; resourceNames only where tested below
        assert set(rule) <= {"apiGroups", "resources", "verbs", "resourceNames"}, rule
        for field in ("apiGroups", "resources", "verbs"):
            assert "*" not in rule[field], rule  # no wildcards
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                out.setdefault((group, resource), set()).update(rule["verbs"])
    return out


def _resource_names(role: dict[str, Any]) -> dict[str, list[str]]:
    return {r["resources"][0]: r["resourceNames"] for r in role["rules"] if "resourceNames" in r}


# --- what the code calls --------------------------------------------------------------------------

# The kubernetes client objects on tasks.backends.eks.kube.Kube, and their API groups.
KUBE_APIS = {
    "core": "",
    "batch": "batch",
    "apps": "apps",
    "storage": "storage.k8s.io",
    "authz": "authorization.k8s.io",
    "networking": "networking.k8s.io",
}
# All of tasks/ and flows/: a call added anywhere (not only in the EKS backend) is caught.
KUBE_SOURCES = tuple(sorted(p for d in ("tasks", "flows") for p in (REPO / d).rglob("*.py")))
KUBE_CALL = re.compile(r"\b(?:self|kube)\.(" + "|".join(KUBE_APIS) + r")\.(\w+)\b")
# The flow runner's boto3 clients on backend=eks: FSx (hydrate, preflight), S3 (the preflight's
# S3 snapshot, export).
AWS_SOURCES = {
    "fsx": (*KUBE_SOURCES,),
    "s3": (
        REPO / "tasks" / "export.py",
        REPO / "tasks" / "storage" / "verified_upload.py",
        REPO / "tasks" / "preflight" / "local.py",
    ),
}
AWS_CALL = {"fsx": re.compile(r"\bfsx\.(\w+)\("), "s3": re.compile(r"\bclient\.(\w+)\(")}
VERBS = {"create": "create", "patch": "patch", "delete": "delete", "read": "get", "list": "list"}


def _plural(snake: str) -> str:
    word = snake.replace("_", "")
    return word[:-1] + "ies" if word.endswith("y") else word + "s"


def _verb_resource(method: str) -> tuple[str, str]:
    """What the API server authorizes for a kubernetes client method, from its name:
    ``read_namespaced_pod_log`` -> (get, pods/log), ``list_daemon_set_for_all_namespaces`` ->
    (list, daemonsets)."""
    verb, _, rest = method.partition("_")
    rest = rest.removeprefix("namespaced_").removesuffix("_for_all_namespaces")
    sub = ""
    for suffix in ("_log", "_status"):
        if rest.endswith(suffix):
            rest, sub = rest.removesuffix(suffix), "/" + suffix[1:]
    return VERBS[verb], _plural(rest) + sub


def _kube_calls_in_source() -> set[tuple[str, str]]:
    """(api group, method) of every kubernetes client call in the EKS sources."""
    found = set()
    for path in KUBE_SOURCES:
        for api, method in KUBE_CALL.findall(path.read_text()):
            found.add((KUBE_APIS[api], method))
    return found


def test_every_kubernetes_call_is_in_the_permissions_table() -> None:
    declared = {(c.group, c.method) for c in permissions.KUBE_CALLS}
    in_source = _kube_calls_in_source()
    assert in_source, "the grep found no calls: has the client moved?"
    assert in_source - declared == set(), "add these to deploy/eks/permissions.py"
    assert declared - in_source == set(), "the code no longer makes these calls"
    for c in permissions.KUBE_CALLS:
        verb, resource = _verb_resource(c.method)
        assert resource == c.resource, c
        # a watch is a list call with watch=true (Kube.watch)
        assert c.verb == verb or (c.verb == "watch" and verb == "list"), c
    watched = {c.resource for c in permissions.KUBE_CALLS if c.verb == "watch"}
    assert watched == {"pods", "nodes"}
    assert '"watch": "true"' in (REPO / "tasks" / "backends" / "eks" / "kube.py").read_text()


def test_source_grep_catches_an_undeclared_call() -> None:
    assert KUBE_CALL.findall("kube.core.delete_namespaced_secret(name, ns)") == [
        ("core", "delete_namespaced_secret")
    ]
    assert ("", "delete_namespaced_secret") not in {
        (c.group, c.method) for c in permissions.KUBE_CALLS
    }
    assert _verb_resource("delete_namespaced_network_policy") == ("delete", "networkpolicies")


def test_every_aws_call_is_in_the_permissions_table() -> None:
    declared = {c.method for c in permissions.AWS_CALLS}
    found = set()
    for service, paths in AWS_SOURCES.items():
        for path in paths:
            found |= {f"{service}.{m}" for m in AWS_CALL[service].findall(path.read_text())}
    assert {m for m in found if m.startswith("fsx.")}, "the grep found no FSx calls"
    assert found - declared == set(), "add these to deploy/eks/permissions.py"
    assert declared - found == set(), "the code no longer makes these calls"


def rbac_grants(*, cluster: bool) -> dict[tuple[str, str], set[str]]:
    """{(group, resource): verbs} the Role (``cluster=False``) or ClusterRole must grant: every
    call of ``permissions.KUBE_CALLS`` that Kubernetes does not allow by default."""
    out: dict[tuple[str, str], set[str]] = {}
    for c in permissions.KUBE_CALLS:
        if c.cluster == cluster and not c.default:
            out.setdefault((c.group, c.resource), set()).add(c.verb)
    return out


def iam_actions() -> set[str]:
    """The IAM actions the flow runner's policy must grant: every call's, and what FSx checks."""
    return {a for c in permissions.AWS_CALLS for a in c.actions} | set(permissions.AWS_IMPLIED)


def test_rbac_grants_exactly_what_the_flows_need() -> None:
    docs = _load_all("rbac.yaml")
    kinds = _by_kind(docs)
    assert [d["kind"] for d in docs].count("Namespace") == 1
    assert kinds[("Namespace", NAMESPACE)]
    for doc in docs:
        if doc["kind"] not in ("Namespace", "ClusterRole", "ClusterRoleBinding"):
            assert doc["metadata"]["namespace"] == NAMESPACE, doc["metadata"]

    role = kinds[("Role", PIPELINE_SA)]
    # exactly the calls the code makes: a missing grant fails, and so does an extra one
    assert _rules(role) == rbac_grants(cluster=False)
    # the one object the flows read by name: the FSx claim
    assert _resource_names(role) == {"persistentvolumeclaims": [EksParams().fsx_claim]}
    cluster_role = next(d for d in docs if d["kind"] == "ClusterRole")
    assert _rules(cluster_role) == rbac_grants(cluster=True)
    assert _resource_names(cluster_role) == {}
    # what the preflight's access review asks for is granted
    granted = {**_rules(role), **_rules(cluster_role)}
    for group, resource, sub, verb in PREFLIGHT_PERMISSIONS:
        key = (group, f"{resource}/{sub}" if sub else resource)
        assert verb in granted.get(key, set()), (group, resource, sub, verb)

    pipeline_subject = [{"kind": "ServiceAccount", "name": PIPELINE_SA, "namespace": NAMESPACE}]
    binding = next(d for d in docs if d["kind"] == "RoleBinding")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == pipeline_subject
    cluster_binding = next(d for d in docs if d["kind"] == "ClusterRoleBinding")
    assert cluster_binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": cluster_role["metadata"]["name"],
    }
    assert cluster_binding["subjects"] == pipeline_subject
    # nothing else is bound: the training pods' account has no Kubernetes API rights
    assert [d["kind"] for d in docs].count("RoleBinding") == 1
    assert [d["kind"] for d in docs].count("ClusterRoleBinding") == 1


def test_rbac_check_can_fail() -> None:
    docs = _load_all("rbac.yaml")
    role = copy.deepcopy(_by_kind(docs)[("Role", PIPELINE_SA)])
    role["rules"][0]["verbs"].append("deletecollection")  # one verb more than the code uses
    assert _rules(role) != rbac_grants(cluster=False)


def test_namespace_enforces_pod_security() -> None:
    ns = _by_kind(_load_all("rbac.yaml"))[("Namespace", NAMESPACE)]
    labels = ns["metadata"]["labels"]
    # every pod in nvrx meets "restricted" (the rendered ones: restricted_violations)
    assert labels["pod-security.kubernetes.io/enforce"] == "restricted"
    assert labels["pod-security.kubernetes.io/warn"] == "restricted"


def test_only_the_pipeline_has_an_aws_role_and_no_static_keys() -> None:
    docs = _load_all("rbac.yaml")
    accounts = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ServiceAccount"}
    assert set(accounts) == {PIPELINE_SA, EksParams().service_account}
    annotations = accounts[PIPELINE_SA]["metadata"]["annotations"]
    assert IRSA_ARN.match(annotations["eks.amazonaws.com/role-arn"])
    # the training and hydration pods call no AWS API: no role to steal from them
    trainer = accounts[EksParams().service_account]
    assert "eks.amazonaws.com/role-arn" not in (trainer["metadata"].get("annotations") or {})
    assert trainer["automountServiceAccountToken"] is False
    for name in MANIFESTS:
        assert all(d["kind"] != "Secret" for d in _load_all(name))
    for path in EKS_DIR.iterdir():
        text = path.read_text()
        assert not re.search(r"\bA(KI|SI)A[0-9A-Z]{16}\b", text), path
        assert "secret_access_key" not in text.lower(), path


def _iam() -> dict[str, Any]:
    return json.loads((EKS_DIR / "iam-flow-runner-policy.json").read_text())


def _as_list(v: str | list[str]) -> list[str]:
    return [v] if isinstance(v, str) else list(v)


def _iam_actions(policy: dict[str, Any]) -> set[str]:
    return {a for st in policy["Statement"] for a in _as_list(st["Action"])}


def test_iam_policy_grants_exactly_the_aws_calls() -> None:
    policy = _iam()
    assert policy["Version"] == "2012-10-17"
    assert all(st["Effect"] == "Allow" and "NotAction" not in st for st in policy["Statement"])
    actions = _iam_actions(policy)
    assert not [a for a in actions if "*" in a]  # no wildcard actions
    assert actions == iam_actions()


def test_iam_policy_is_scoped_to_the_deployments_file_system_and_buckets() -> None:
    (dep, *_) = _load_one("prefect.yaml")["deployments"]
    params = PipelineParams.model_validate(dep["parameters"])
    # No eks.region: the flow runner's (IRSA's AWS_REGION), README step 0's placeholder region,
    # which step 6 replaces in the policy as in the cluster.
    fs, region = params.eks.file_system_id, params.eks.region or aws.DEFAULT_REGION
    buckets = {params.dataset.bucket, params.export.bucket}
    for st in _iam()["Statement"]:
        resources = _as_list(st["Resource"])
        actions = set(_as_list(st["Action"]))
        if resources == ["*"]:
            # only what cannot be scoped: listing buckets and FSx's Describe* listings
            assert actions <= {"s3:ListAllMyBuckets"} | {
                a for a in actions if a.startswith("fsx:Describe")
            }, st
            continue
        for arn in resources:
            if arn.startswith("arn:aws:fsx:"):
                assert f":{region}:" in arn and (fs in arn or ":task/" in arn), arn
            elif arn.startswith("arn:aws:s3:::"):
                bucket = arn.removeprefix("arn:aws:s3:::").split("/")[0]
                assert bucket in buckets, arn
            else:
                assert "aws-service-role/s3.data-source.lustre.fsx.amazonaws.com" in arn, arn
    # writes go to the export prefix only, never to the dataset bucket
    writers = [st for st in _iam()["Statement"] if "s3:PutObject" in _as_list(st["Action"])]
    assert [_as_list(st["Resource"]) for st in writers] == [
        [f"arn:aws:s3:::{params.export.bucket}/{params.export.prefix}/*"]
    ]


def test_iam_check_can_fail() -> None:
    policy = _iam()
    policy["Statement"][0]["Action"].append("fsx:DeleteDataRepositoryAssociation")
    assert _iam_actions(policy) != iam_actions()


def test_admission_policies_hold_jobs_to_the_pool_allow_lists() -> None:
    """Each policy is bound in nvrx with Deny, fails closed, and lists what the pool allows:
    its images, FSx claims and script roots are NVRX_ALLOWED_*'s (the README's sed fills both).
    What they refuse: tests/adversarial/test_admission.py."""
    docs = _load_all("admission-policy.yaml")
    policies = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ValidatingAdmissionPolicy"}
    bindings = [d for d in docs if d["kind"] == "ValidatingAdmissionPolicyBinding"]
    assert set(policies) == {"nvrx-pipeline-jobs", "nvrx-flow-runs", "nvrx-pipeline-network"}
    assert sorted(b["spec"]["policyName"] for b in bindings) == sorted(policies)
    for binding in bindings:
        assert binding["spec"]["validationActions"] == ["Deny"]
        assert binding["spec"]["matchResources"]["namespaceSelector"]["matchLabels"] == {
            "kubernetes.io/metadata.name": NAMESPACE
        }
    allowed = _pool_allow_lists(every=True)
    for name, policy in policies.items():
        spec = policy["spec"]
        assert spec["failurePolicy"] == "Fail"
        assert f'"system:serviceaccount:{NAMESPACE}:{PIPELINE_SA}"' in " ".join(
            c["expression"] for c in spec["matchConditions"]
        )
        lists = {v["name"] for v in spec.get("variables", [])}
        for variable, env in (("images", "NVRX_ALLOWED_IMAGES"),
                              ("claims", "NVRX_ALLOWED_FSX_CLAIMS"),
                              ("scriptRoots", "NVRX_ALLOWED_SCRIPT_ROOTS")):  # fmt: skip
            if variable in lists:
                assert constant(policy, variable) == allowed[env].split(","), (name, variable)
        if "mounts" in lists:  # the FSx mount first, then the pods' own paths
            assert constant(policy, "mounts")[0] == allowed["NVRX_ALLOWED_FSX_MOUNTS"], name
    jobs = policies["nvrx-pipeline-jobs"]
    assert {"images", "claims", "scriptRoots"} <= {v["name"] for v in jobs["spec"]["variables"]}
    # a script root is regular-expression text in the entry-point rule: nothing special in it
    assert all(re.fullmatch(r"[A-Za-z0-9/_-]+", r) for r in constant(jobs, "scriptRoots"))
    text = " ".join(v["expression"] for v in jobs["spec"]["validations"])
    (account,) = re.findall(r'serviceAccountName == "([^"]+)"', text)
    assert account == allowed[ALLOWED_ENV["service_account"]] == EksParams().service_account


def test_static_network_policy_denies_ingress_namespace_wide() -> None:
    policy, metrics = _load_all("network-policy.yaml")
    assert policy["metadata"]["namespace"] == NAMESPACE
    assert policy["spec"] == {"podSelector": {}, "policyTypes": ["Ingress"]}
    # The one opening: the flow-run pods' metrics port, to the monitoring namespace only.
    assert metrics["metadata"]["namespace"] == NAMESPACE
    assert metrics["spec"]["podSelector"] == {
        "matchLabels": {"nvrx.io/component": "prefect-flow-run"}
    }
    [rule] = metrics["spec"]["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": PipelineParams().metrics_port}]
    assert rule["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    ]


# --- eksctl cluster ------------------------------------------------------------------------------


def _node_groups() -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    cluster = _load_one("cluster.yaml")
    return cluster, {ng["name"]: ng for ng in cluster["managedNodeGroups"]}


def test_cluster_pins_the_validated_kubernetes_version() -> None:
    cluster, _ = _node_groups()
    assert cluster["apiVersion"] == "eksctl.io/v1alpha5"
    assert cluster["kind"] == "ClusterConfig"
    assert cluster["metadata"]["name"] and cluster["metadata"]["region"]
    assert cluster["metadata"]["version"] == K8S_VERSION  # a string: unquoted 1.34 is a float
    assert cluster["iam"]["withOIDC"] is True
    assert "aws-fsx-csi-driver" in {a["name"] for a in cluster["addons"]}


def test_gpu_node_group_is_p5_with_efa_in_one_zone() -> None:
    cluster, groups = _node_groups()
    gpu = [ng for ng in groups.values() if ng.get("instanceType") == GPU_INSTANCE]
    assert len(gpu) == 1
    ng = gpu[0]
    assert ng["instanceType"] == EksParams().instance_type
    assert ng["efaEnabled"] is True
    assert (ng["minSize"], ng["maxSize"]) == (2, 8)
    assert ng["minSize"] <= ng["desiredCapacity"] <= ng["maxSize"]
    assert len(ng["availabilityZones"]) == 1  # EFA does not cross AZs
    assert ng["availabilityZones"][0] in cluster["availabilityZones"]
    assert {"key": "nvidia.com/gpu", "value": "true", "effect": "NoSchedule"} in ng["taints"]
    assert ng["labels"]["nvrx.io/role"] == "gpu"
    system = [n for n in groups.values() if n.get("labels", {}).get("nvrx.io/role") == "system"]
    assert len(system) == 1 and not system[0].get("taints")


# --- Dockerfile ----------------------------------------------------------------------------------


def _dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in (EKS_DIR / "Dockerfile").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        pending = f"{pending} {line}" if pending else line
        if pending.endswith("\\"):
            pending = pending[:-1].rstrip()
            continue
        instruction, _, args = pending.partition(" ")
        out.append((instruction.upper(), args.strip()))
        pending = ""
    assert not pending, "dangling line continuation"
    return out


def _args(instructions: list[tuple[str, str]]) -> dict[str, str]:
    return dict(a.split("=", 1) for i, a in instructions if i == "ARG" and "=" in a)


def test_dockerfile_entrypoint_is_ft_launcher() -> None:
    entrypoints = [a for i, a in _dockerfile() if i == "ENTRYPOINT"]
    assert len(entrypoints) == 1
    assert json.loads(entrypoints[0]) == ["ft_launcher"]


def test_dockerfile_runs_as_the_uid_the_pods_use() -> None:
    instructions = _dockerfile()
    args = _args(instructions)
    users = [a for i, a in instructions if i == "USER"]
    assert users, "the image must not run as root"
    uid, _, gid = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], users[-1]).partition(":")
    # numeric, so the kubelet can verify runAsNonRoot; the same numbers as every pod's
    assert (int(uid), int(gid)) == (security.UID, security.GID)
    runs = " ".join(a for i, a in instructions if i == "RUN")
    assert "useradd --uid ${NVRX_UID}" in runs and "groupadd --gid ${NVRX_GID}" in runs
    assert f"--home-dir {security.HOME}" in runs
    assert f"HOME={security.HOME}" in " ".join(a for i, a in instructions if i == "ENV")
    # the last USER comes after the last RUN: nothing later runs as root
    last_user = max(n for n, (i, _) in enumerate(instructions) if i == "USER")
    assert all(i != "RUN" for i, _ in instructions[last_user:])


def test_dockerfile_pins_the_base_image_and_installs_nvrx_not_torch() -> None:
    instructions = _dockerfile()
    args = _args(instructions)
    (base,) = [a for i, a in instructions if i == "FROM"]
    image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], base)
    repository, _, tag = image.rpartition(":")
    assert "pytorch" in repository and tag and tag != "latest", image

    # NVRx at a version the project accepts (pyproject.toml), installed by pip
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    (nvrx,) = [
        Requirement(r)
        for r in pyproject["project"]["dependencies"]
        if r.startswith("nvidia-resiliency-ext")
    ]
    assert args["NVRX_VERSION"] in nvrx.specifier
    pip_runs = [a for i, a in instructions if i == "RUN" and "pip install" in a]
    assert any('"nvidia-resiliency-ext==${NVRX_VERSION}"' in a for a in pip_runs)
    # torch stays the base image's: never a pip requirement, and the install is constrained
    for run in pip_runs:
        for token in run.split("pip install", 1)[1].split("&&")[0].split():
            assert not re.match(r"""["']?torch\b""", token), run
        assert "--constraint" in run

    copied = {a.split()[0] for i, a in instructions if i == "COPY"}
    assert {"trainer/", "tasks/", "flows/", "pyproject.toml"} <= copied
    assert "FI_PROVIDER=efa" in " ".join(a for i, a in instructions if i == "ENV")


# --- Prefect work pool and deployments -----------------------------------------------------------


def _template() -> dict[str, Any]:
    return json.loads((EKS_DIR / "work-pool-template.json").read_text())


def _placeholders(node: Any) -> set[str]:
    if isinstance(node, dict):
        return set().union(*(_placeholders(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(_placeholders(v) for v in node))
    return set(PLACEHOLDER.findall(node)) if isinstance(node, str) else set()


def _render(node: Any, values: dict[str, Any]) -> Any:
    """Fill ``{{ var }}`` placeholders the way Prefect does: a whole-string placeholder takes the
    value itself (dropped when None), an embedded one its text."""
    if isinstance(node, dict):
        rendered = {k: _render(v, values) for k, v in node.items()}
        return {k: v for k, v in rendered.items() if v is not None}
    if isinstance(node, list):
        return [_render(v, values) for v in node]
    if isinstance(node, str):
        whole = PLACEHOLDER.fullmatch(node.strip())
        if whole:
            return values.get(whole.group(1))
        return PLACEHOLDER.sub(lambda m: str(values.get(m.group(1)) or ""), node)
    return node


def _pool_allow_lists(every: bool = False) -> dict[str, str]:
    container = _template()["job_configuration"]["job_manifest"]["spec"]["template"]["spec"][
        "containers"
    ][0]
    names = EVERY_LIST if every else ALLOWED_ENV.values()
    return {e["name"]: e["value"] for e in container["env"] if e["name"] in names}


def test_work_pool_template_defaults_target_the_nvrx_namespace() -> None:
    template = _template()
    assert set(template) == {"job_configuration", "variables"}
    props = template["variables"]["properties"]
    # what the flow-run pod runs, as whom, where, with which image and environment, and the
    # worker's cluster credentials are the pool's, not a run's (tests/adversarial/
    # test_hostile_forms.py holds the refusals)
    assert not {"image", "service_account_name", "command", "env", "namespace"} & set(props)
    assert not {"cluster_config"} & set(props)
    assert template["variables"]["additionalProperties"] is False
    config = template["job_configuration"]
    assert config["namespace"] == NAMESPACE
    assert config["job_manifest"]["metadata"]["namespace"] == NAMESPACE
    # what the Prefect server checks when the pool is created: every placeholder is a variable
    assert _placeholders(config) <= set(props)


WORKER_ENV = [{"name": "PREFECT__FLOW_RUN_ID", "value": "0"}]


def flow_run_job(worker_env: list[dict[str, Any]] = WORKER_ENV) -> dict[str, Any]:
    """The Job the Prefect worker creates for a flow run from the pool's template: the template's
    defaults and what the worker supplies (prefect-kubernetes turns env into a list and puts it
    before the template's own, and copies the Job's labels onto the pod's)."""
    template = _template()
    props = template["variables"]["properties"]
    values = {k: v["default"] for k, v in props.items() if "default" in v}
    labels = {"prefect.io/flow-run-name": "brisk-otter"}
    values |= {"name": "brisk-otter", "env": worker_env, "labels": labels}
    job = _render(template["job_configuration"]["job_manifest"], values)
    for c in job["spec"]["template"]["spec"]["containers"]:
        c["env"] = [*worker_env, *c.get("env", [])]
    pod_meta = job["spec"]["template"]["metadata"]
    pod_meta["labels"] = {**pod_meta["labels"], **labels}
    return job


def test_work_pool_job_manifest_renders_to_a_valid_job() -> None:
    job = flow_run_job()
    _validate(job)
    # no annotations: not a job variable (a controller acts on a pod's: test_hostile_forms.py)
    assert job["metadata"] == {
        "generateName": "brisk-otter-",
        "labels": {"prefect.io/flow-run-name": "brisk-otter"},
        "namespace": NAMESPACE,
    }
    pod = job["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == PIPELINE_SA
    (container,) = pod["containers"]
    assert container["image"] == EksParams().image == "REGISTRY/nvrx-pipeline:latest"
    # the image's ENTRYPOINT is ft_launcher: flow-run pods must replace it
    assert container["command"] == ["/usr/bin/env"]
    assert container["args"] == ["prefect", "flow-run", "execute"]
    # flow-run pods run on the system node group and see the FSx volume at the same path
    _, groups = _node_groups()
    system_labels = groups["system"]["labels"]
    assert pod["nodeSelector"].items() <= system_labels.items()
    # the allow-lists are fixed in the template: prefect-kubernetes puts the job variables'
    # env *before* a hard-coded list (KubernetesWorkerJobConfiguration._populate_env_in_manifest)
    # and the kubelet takes the last definition of a name, so a run cannot widen them
    run_env = [{"name": n, "value": "attacker/image:1"} for n in EVERY_LIST]
    effective = {e["name"]: e["value"] for e in [*run_env, *container["env"]]}
    assert {n: effective[n] for n in EVERY_LIST} == _pool_allow_lists(every=True)
    assert effective[BACKENDS] == "eks"  # no backend=local run inside the pipeline's pod
    # the flow-run pods run as the image's user too, restricted (they do call the API)
    assert restricted_violations(pod, api_token=True) == []
    assert pod["securityContext"] == security.pod_security_context()
    assert container["securityContext"] == security.container_security_context()
    eks = EksParams()
    volume = next(v for v in pod["volumes"] if "persistentVolumeClaim" in v)
    assert volume["persistentVolumeClaim"]["claimName"] == eks.fsx_claim
    mount = next(m for m in container["volumeMounts"] if m["name"] == volume["name"])
    assert mount["mountPath"] == eks.fsx_mount


def test_eks_prefect_yaml_deploys_valid_eks_runs_to_the_pool(monkeypatch) -> None:
    spec = _load_one("prefect.yaml")
    try:
        from prefect.cli.deploy._models import PrefectYamlModel
    except ImportError:  # a private module of prefect 3.9; skip that one check if it moves
        PrefectYamlModel = None
    if PrefectYamlModel is not None:
        # `prefect deploy` skips (with a warning only) a file that fails this model
        PrefectYamlModel.model_validate(spec)

    workdir = [a for i, a in _dockerfile() if i == "WORKDIR"][-1]
    (pull,) = spec["pull"]
    assert pull["prefect.deployments.steps.set_working_directory"]["directory"] == workdir

    local_names = {
        d["name"]
        for d in yaml.safe_load((REPO / "deploy" / "prefect.yaml").read_text())["deployments"]
    }
    deployments = spec["deployments"]
    assert deployments and not {d["name"] for d in deployments} & local_names
    for dep in deployments:
        path, _, func = dep["entrypoint"].partition(":")
        assert f"def {func}(" in (REPO / path).read_text()
        assert dep["work_pool"]["name"] == "nvrx-eks"
        # the pool's flow-run pods allow exactly the deployment's image, ServiceAccount and
        # namespace (fixed in the template, not a job variable); its parameters validate there
        assert "job_variables" not in dep["work_pool"]
        env = _pool_allow_lists()
        assert set(env) == set(ALLOWED_ENV.values())
        for name, value in _pool_allow_lists(every=True).items():
            monkeypatch.setenv(name, value)
        params = PipelineParams.model_validate(dep["parameters"])
        assert params.backend == "eks" and params.s3_endpoint is None
        for field, name in ALLOWED_ENV.items():
            assert env[name].split(",") == [getattr(params.eks, field)]
        other = {**dep["parameters"], "eks": {**params.eks.model_dump(), "image": "x"}}
        with pytest.raises(ValueError, match="eks.image"):
            PipelineParams.model_validate(other)


def test_readme_walks_through_every_asset() -> None:
    readme = " ".join((EKS_DIR / "README.md").read_text().split())
    for path in sorted(EKS_DIR.iterdir()):
        if path.name != "README.md":
            assert path.name in readme, path.name
    for command in (
        "prefect work-pool create nvrx-eks --type kubernetes "
        "--base-job-template deploy/eks/work-pool-template.json",
        "prefect --no-prompt deploy --all --prefect-file deploy/eks/prefect.yaml",
        "eksctl create cluster -f deploy/eks/cluster.yaml",
    ):
        assert command in readme, command
    assert f'`"{K8S_VERSION}"`' in readme


def test_readme_tables_list_every_call_and_grant() -> None:
    readme = (EKS_DIR / "README.md").read_text()
    for kc in permissions.KUBE_CALLS:
        assert f"`{kc.method}`" in readme and f"`{kc.resource}`" in readme, kc
    for ac in permissions.AWS_CALLS:
        assert f"`{ac.method}`" in readme, ac
    for action in iam_actions():
        assert f"`{action}`" in readme, action


def test_the_image_installs_the_tested_versions_and_has_every_command_the_jobs_run(
    tmp_path: Path,
) -> None:
    """The image installs from constraints.txt (the versions the tests ran) and runs
    deploy/eks/check_image.py at build; the check itself, here: in this environment and read
    off the Dockerfile, it finds every command the rendered Jobs run, and it fails naming the
    Job and the command when the Dockerfile stops providing one."""
    import subprocess
    import sys

    runs = " ".join(a for i, a in _dockerfile() if i == "RUN")
    assert "--constraint constraints.txt" in runs and "check_image.py --inside" in runs
    ignore = (EKS_DIR / "Dockerfile.dockerignore").read_text().splitlines()
    assert {"!constraints.txt", "!deploy/eks/check_image.py"} <= set(ignore)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    script = str(EKS_DIR / "check_image.py")
    for mode in ("--inside", "--dockerfile"):
        done = subprocess.run([sys.executable, script, mode], capture_output=True, text=True,
                              env=env, timeout=120)  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        for needed in (
            "python -m trainer.data",
            "python -m trainer.agent",
            "prefect",
        ):
            assert needed in done.stdout, (mode, done.stdout)
    sys.path.insert(0, str(EKS_DIR))
    try:
        import check_image
    finally:
        sys.path.remove(str(EKS_DIR))
    dockerfile = (EKS_DIR / "Dockerfile").read_text()
    items = check_image.needs()
    assert check_image.missing_from_dockerfile(items, dockerfile) == []
    without_trainer = dockerfile.replace("COPY trainer/ trainer/\n", "")
    bad = check_image.missing_from_dockerfile(items, without_trainer)
    assert "hydration Job (hydrate): python -m trainer.data: package trainer/ is not copied" in (
        " | ".join(bad)
    )
    lfs = [check_image.Need("hydration Job (hydrate)", "executable", "lfs")]
    assert check_image.missing_from_dockerfile(lfs, dockerfile) == [
        "hydration Job (hydrate): lfs: neither the base image's nor installed by the Dockerfile"
    ]
    assert check_image.missing_here(lfs) == ["hydration Job (hydrate): lfs: not on PATH"]
