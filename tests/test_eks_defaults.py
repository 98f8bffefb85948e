"""Defaults that run (issue 14, part 6): ``render-k8s`` with no options renders valid manifests;
the training and hydration pods are Guaranteed QoS with cpu and memory from the instance type;
eks.priority_class and eks.queue (Kueue) render and validate; a hydration pod that cannot pull
its image fails the stage at once, not after eks.hydrate_timeout_s."""

from __future__ import annotations

import subprocess
import sys
import time
from decimal import Decimal
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kubernetes.utils.quantity import parse_quantity
from pydantic import ValidationError

from flows.context import eks_train_config, render_global_batch
from flows.models import PipelineParams
from tasks.backends.eks.hydrate import hydration_job, image_pull_failure, wait_for_job
from tasks.backends.eks.kube import JOB_NAME_LABEL, Kube
from tasks.backends.eks.params import (
    INSTANCE_TYPES,
    EksParams,
    kube_reserved_cpu_m,
    pod_cpu_for,
    pod_memory_gi_for,
)
from tasks.backends.eks.render import KUEUE_QUEUE_LABEL, render_all
from tasks.errors import HydrationError
from tests.eks_cluster import NS
from tests.helpers import REPO, worker_env
from tests.test_eks_render import K8S_VERSION

# -- Kubernetes' QoS class, computed as the API server does --------------------------------------
QOS_RESOURCES = ("cpu", "memory")  # qos.go: supportedQoSComputeResources


def _with_defaulted_requests(resources: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The API server's defaulting (core/v1 SetDefaults_Container... via
    SetDefaults_ResourceList): a resource with a limit and no request gets request = limit."""
    limits = dict(resources.get("limits") or {})
    requests = {**limits, **(resources.get("requests") or {})}
    return requests, limits


def qos_class(pod: dict[str, Any]) -> str:
    """``ComputePodQOS`` of pkg/apis/core/helper/qos (Kubernetes 1.34) over a pod spec as it is
    submitted: pod-level resources when set; else every container and init container; only cpu
    and memory count; zero quantities are ignored; Guaranteed needs a cpu and a memory limit in
    every container and the summed requests equal to the summed limits."""
    if pod.get("resources"):  # PodLevelResources
        requests, limits = _with_defaulted_requests(pod["resources"])
        req = {k: parse_quantity(v) for k, v in requests.items() if k in QOS_RESOURCES}
        lim = {k: parse_quantity(v) for k, v in limits.items() if k in QOS_RESOURCES}
        req = {k: v for k, v in req.items() if v > 0}
        lim = {k: v for k, v in lim.items() if v > 0}
        if not req and not lim:
            return "BestEffort"
        if set(lim) == set(QOS_RESOURCES) and req == lim:
            return "Guaranteed"
        return "Burstable"
    total_req: dict[str, Decimal] = {}
    total_lim: dict[str, Decimal] = {}
    guaranteed = True
    for c in [*(pod.get("containers") or []), *(pod.get("initContainers") or [])]:
        requests, limits = _with_defaulted_requests(c.get("resources") or {})
        for name, q in requests.items():
            if name in QOS_RESOURCES and parse_quantity(q) > 0:
                total_req[name] = total_req.get(name, Decimal(0)) + parse_quantity(q)
        found = set()
        for name, q in limits.items():
            if name in QOS_RESOURCES and parse_quantity(q) > 0:
                found.add(name)
                total_lim[name] = total_lim.get(name, Decimal(0)) + parse_quantity(q)
        if not found >= set(QOS_RESOURCES):
            guaranteed = False
    if not total_req and not total_lim:
        return "BestEffort"
    same = all(total_lim.get(k) == v for k, v in total_req.items())
    if guaranteed and same and len(total_req) == len(total_lim):
        return "Guaranteed"
    return "Burstable"


def _pod(*containers: dict[str, Any], init: tuple[dict[str, Any], ...] = ()) -> dict[str, Any]:
    return {"containers": list(containers), "initContainers": list(init)}


def _c(requests: dict[str, str] | None = None, limits: dict[str, str] | None = None) -> dict:
    res: dict[str, Any] = {}
    if requests is not None:
        res["requests"] = requests
    if limits is not None:
        res["limits"] = limits
    return {"name": "c", "resources": res}


FULL = {"cpu": "2", "memory": "4Gi"}


@pytest.mark.parametrize(
    ("pod", "want"),
    [
        (_pod(_c()), "BestEffort"),
        (_pod(_c({"nvidia.com/gpu": "8"}, {"nvidia.com/gpu": "8"})), "BestEffort"),  # today's
        (_pod(_c({"cpu": "0"})), "BestEffort"),  # zero quantities do not count
        (_pod(_c({"cpu": "1"})), "Burstable"),
        (_pod(_c(FULL, FULL)), "Guaranteed"),
        (_pod(_c(None, FULL)), "Guaranteed"),  # requests default to limits
        (_pod(_c({"cpu": "2000m", "memory": "4096Mi"}, FULL)), "Guaranteed"),  # same quantity
        (_pod(_c({"cpu": "1", "memory": "4Gi"}, FULL)), "Burstable"),
        (_pod(_c({"cpu": "2"}, {"cpu": "2"})), "Burstable"),  # no memory limit
        (_pod(_c(FULL, FULL), init=(_c({"cpu": "1"}),)), "Burstable"),  # init containers count
        (_pod(_c(FULL, FULL), init=(_c(FULL, FULL),)), "Guaranteed"),
        ({"resources": {"limits": FULL}, "containers": [_c()]}, "Guaranteed"),  # pod-level
    ],
)
def test_qos_class_follows_kubernetes(pod: dict[str, Any], want: str):
    assert qos_class(pod) == want


# -- the training pod: Guaranteed, sized from the instance type ---------------------------------
def _params(**kw: Any) -> PipelineParams:
    base: dict[str, Any] = {"backend": "eks", "nodes": 2, "global_batch": 32, "run_id": "r1"}
    return PipelineParams(**{**base, **kw})


def _job(p: PipelineParams) -> dict[str, Any]:
    docs = render_all(
        eks_train_config(p, "r1"),
        run_id="r1",
        attempt=1,
        nodes=p.nodes,
        eks=p.eks,
        deadline_s=p.train_timeout_s,
    )
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    return next(d for d in docs if d["kind"] == "Job")


def _gi(q: str) -> Decimal:
    return parse_quantity(q) / 2**30


@pytest.mark.parametrize("itype", sorted(INSTANCE_TYPES))
def test_training_pod_is_guaranteed_on_every_known_instance_type(itype: str):
    gpus = INSTANCE_TYPES[itype].gpus
    p = _params(eks={"instance_type": itype, "gpus_per_node": gpus}, global_batch=2 * gpus)
    pod = _job(p)["spec"]["template"]["spec"]
    assert qos_class(pod) == "Guaranteed"
    spec = INSTANCE_TYPES[itype]
    for c in [*pod.get("initContainers", []), *pod["containers"]]:
        res = c["resources"]
        assert res["requests"] == res["limits"]  # every resource, GPUs and EFA included
        assert set(res["requests"]) >= {"cpu", "memory", "nvidia.com/gpu"}
        # what is left on the node covers kube-reserved, eviction and the daemonsets
        assert 0 < parse_quantity(res["requests"]["cpu"]) <= spec.vcpus - 2
        assert _gi(res["requests"]["memory"]) < spec.memory_gib * Decimal("0.95") - 9
        shm = next(v for v in pod["volumes"] if v["name"] == "shm")["emptyDir"]["sizeLimit"]
        assert _gi(shm) < _gi(res["limits"]["memory"])


def test_p5_defaults_and_the_stated_reserve():
    p5 = INSTANCE_TYPES["p5.48xlarge"]
    # EKS AMI kube-reserved: 60 + 10 + 2 x 5 + 188 x 2.5 millicores
    assert kube_reserved_cpu_m(192) == 550
    assert kube_reserved_cpu_m(1) == 60 and kube_reserved_cpu_m(4) == 80
    assert pod_cpu_for(p5) == 189  # 192 cores - 0.55 - 2 (daemonsets), whole cores
    assert pod_memory_gi_for(p5) == 1934
    res = _job(_params())["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert res["limits"] == {
        "cpu": "189",
        "memory": "1934Gi",
        "nvidia.com/gpu": "8",
        "vpc.amazonaws.com/efa": "32",
    }


def test_overrides_and_unknown_instance_types():
    p = _params(eks={"instance_type": "p6-b200.48xlarge", "cpu": "180", "memory_gi": 1800})
    res = _job(p)["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert res["requests"]["cpu"] == "180" and res["requests"]["memory"] == "1800Gi"
    assert qos_class(_job(p)["spec"]["template"]["spec"]) == "Guaranteed"
    millicores = _params(eks={"cpu": "1500m", "memory_gi": 100, "shm_gi": 8})
    (container,) = _job(millicores)["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["cpu"] == "1500m"
    with pytest.raises(ValidationError) as err:
        EksParams(instance_type="x9.huge")
    msg = str(err.value)
    assert "eks.instance_type: 'x9.huge'" in msg and "set eks.cpu and eks.memory_gi" in msg
    with pytest.raises(ValidationError, match="set eks.memory_gi for it"):
        EksParams(instance_type="x9.huge", cpu="8")


@pytest.mark.parametrize(
    ("eks", "field", "fix"),
    [
        ({"shm_gi": 64, "memory_gi": 64}, "eks.shm_gi", "lower eks.shm_gi or raise eks.memory_gi"),
        ({"shm_gi": 2048}, "eks.shm_gi", "memory limit of 1934 GiB"),
        ({"gpus_per_node": 16}, "eks.gpus_per_node", "has 8 GPUs"),
        ({"cpu": "200"}, "eks.cpu", "192 vCPUs"),
        ({"cpu": "0.0", "instance_type": "x", "memory_gi": 9}, "eks.cpu", "more than 0"),
        ({"cpu": "2 cores"}, "cpu", "pattern"),
        ({"memory_gi": 4096}, "eks.memory_gi", "2048 GiB"),
        ({"priority_class": "Training"}, "priority_class", "pattern"),
        ({"priority_class": "system-node-critical"}, "eks.priority_class", "reserved"),
        ({"queue": "team_a"}, "queue", "pattern"),
        ({"queue": "q" * 64}, "queue", "at most 63"),
    ],
)
def test_resource_and_scheduling_fields_are_validated(eks: dict, field: str, fix: str):
    with pytest.raises(ValidationError) as err:
        EksParams(**eks)
    assert field in str(err.value) and fix in str(err.value)


# -- priority class and Kueue ------------------------------------------------------------------
def test_priority_class_and_queue_render_and_validate():
    p = _params(eks={"priority_class": "training-high", "queue": "team-a"})
    job = _job(p)
    assert job["metadata"]["labels"][KUEUE_QUEUE_LABEL] == "team-a"
    # Kueue's webhook suspends the Job on creation and resumes it on admission; created
    # unsuspended, it also runs where Kueue is absent
    assert "suspend" not in job["spec"]
    pod = job["spec"]["template"]["spec"]
    assert pod["priorityClassName"] == "training-high"
    # the queue is the Job's; the pods' labels (the NetworkPolicy's selector) do not change
    assert KUEUE_QUEUE_LABEL not in job["spec"]["template"]["metadata"]["labels"]
    hydrate = hydration_job(
        name="nvrx-r1-hydrate", eks=p.eks, data_dir="/fsx/datasets/b/p", manifest_sha256="ab" * 32
    )
    kubernetes_validate.validate(hydrate, K8S_VERSION, strict=True)
    assert hydrate["spec"]["template"]["spec"]["priorityClassName"] == "training-high"


def test_defaults_render_neither_priority_class_nor_queue():
    job = _job(_params())
    assert KUEUE_QUEUE_LABEL not in job["metadata"]["labels"]
    assert "priorityClassName" not in job["spec"]["template"]["spec"]


DATASET = {"data_dir": "/fsx/datasets/b/p", "manifest_sha256": "ab" * 32}


def test_hydration_pod_is_guaranteed():
    job = hydration_job(
        name="nvrx-r1-hydrate",
        eks=EksParams(),
        data_dir="/fsx/datasets/b/p",
        manifest_sha256="ab" * 32,
    )
    kubernetes_validate.validate(job, K8S_VERSION, strict=True)
    pod = job["spec"]["template"]["spec"]
    assert qos_class(pod) == "Guaranteed"
    assert "priorityClassName" not in pod


# -- render-k8s with no options -----------------------------------------------------------------
def test_render_k8s_with_no_options_renders_valid_manifests():
    proc = subprocess.run(
        [sys.executable, "-m", "flows.cli", "render-k8s"],
        capture_output=True,
        text=True,
        env=worker_env(),
        cwd=REPO,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    docs = list(yaml.safe_load_all(proc.stdout))
    assert [d["kind"] for d in docs] == ["NetworkPolicy", "Service", "ConfigMap", "Job"]
    for doc in docs:
        assert kubernetes_validate.validate(doc, K8S_VERSION, strict=True) == K8S_VERSION
    # the default world is 2 nodes x 8 GPUs: the batch the CLI chose is said, and used
    assert "global_batch not set; using 16" in proc.stderr
    pod = docs[3]["spec"]["template"]["spec"]
    assert qos_class(pod) == "Guaranteed"
    assert "--nproc-per-node=8" in pod["containers"][0]["args"]


@pytest.mark.parametrize(
    ("data", "want"),
    [
        ({}, 16),  # 2 nodes x 8 GPUs, default 8 -> 16
        ({"nodes": 1, "eks": {"gpus_per_node": 4}}, 8),  # 8 divides already
        ({"nodes": 3, "eks": {"gpus_per_node": 1}}, 9),
        ({"global_batch": 7}, None),  # the user's own: validated as given
        ({"nodes": "two"}, None),  # unreadable: validation names the field
        ({"nodes": 0}, None),
    ],
)
def test_render_global_batch(data: dict, want: int | None):
    assert render_global_batch(data) == want


def test_eks_deployment_defaults_render_guaranteed_pods(monkeypatch):
    """deploy/eks/prefect.yaml's run parameters validate, and render valid Guaranteed pods."""
    from tasks.backends.eks.params import ALLOWED_ENV

    spec = yaml.safe_load((REPO / "deploy" / "eks" / "prefect.yaml").read_text())
    for dep in spec["deployments"]:
        raw = dep["parameters"]
        for field, env in ALLOWED_ENV.items():
            monkeypatch.setenv(env, raw["eks"].get(field, EksParams.model_fields[field].default))
        p = PipelineParams.model_validate({**raw, "run_id": "r1"})
        assert p.global_batch % p.world_size == 0
        assert qos_class(_job(p)["spec"]["template"]["spec"]) == "Guaranteed"


# -- a wrong image fails hydration at once ------------------------------------------------------
def _waiting_pod(job: str, reason: str, image: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"{job}-abcde", "namespace": NS, "labels": {JOB_NAME_LABEL: job}},
        "spec": {"containers": [{"name": "hydrate", "image": image}]},
        "status": {
            "phase": "Pending",
            "containerStatuses": [
                {
                    "name": "hydrate",
                    "image": image,
                    "ready": False,
                    "state": {
                        "waiting": {
                            "reason": reason,
                            "message": f'Back-off pulling image "{image}"',
                        }
                    },
                }
            ],
        },
    }


@pytest.mark.parametrize("reason", ["ErrImagePull", "ImagePullBackOff", "InvalidImageName"])
def test_image_pull_failure_names_image_pod_and_fix(reason: str):
    why = image_pull_failure([_waiting_pod("j", reason, "REGISTRY/nvrx-pipeline:latest")])
    assert why is not None
    assert "pod j-abcde" in why and "'REGISTRY/nvrx-pipeline:latest'" in why and reason in why
    assert "eks.image" in why and "NVRX_ALLOWED_IMAGES" in why and "registry" in why


def test_image_pull_failure_ignores_other_waits():
    pod = _waiting_pod("j", "ContainerCreating", "img")
    assert image_pull_failure([pod]) is None
    assert image_pull_failure([]) is None
    init = _waiting_pod("j", "ErrImagePull", "init-img")
    init["status"]["initContainerStatuses"] = init["status"].pop("containerStatuses")
    assert "init-img" in (image_pull_failure([init]) or "")


def test_hydration_fails_at_once_on_a_wrong_image(kube: Kube):
    """Through the real client against kmock: the Job is applied as hydrate_fsx applies it, its
    pod waits in ImagePullBackOff, and the wait raises within a poll or two, not at the
    6-hour deadline."""
    name, image = "nvrx-r1-hydrate", "REGISTRY/nvrx-pipeline:typo"
    eks = EksParams(image="REGISTRY/nvrx-pipeline:latest")
    kube.apply(hydration_job(name=name, eks=eks, **DATASET))
    kube.core.create_namespaced_pod(
        NS, _waiting_pod(name, "ImagePullBackOff", image), _preload_content=False
    )
    t0 = time.monotonic()
    with pytest.raises(HydrationError) as err:
        wait_for_job(kube, NS, name, deadline_s=eks.hydrate_timeout_s, poll_s=0.1)
    assert time.monotonic() - t0 < 10
    msg = str(err.value)
    assert f"hydration Job {NS}/{name}" in msg and f"pod {name}-abcde" in msg
    assert repr(image) in msg and "ImagePullBackOff" in msg and "NVRX_ALLOWED_IMAGES" in msg


def test_hydration_wait_still_completes_when_pods_pull(kube: Kube):
    name = "nvrx-r2-hydrate"
    kube.apply(
        hydration_job(
            name=name, eks=EksParams(), data_dir="/fsx/datasets/b/p", manifest_sha256="ab" * 32
        )
    )
    kube.core.create_namespaced_pod(
        NS, _waiting_pod(name, "ContainerCreating", "img"), _preload_content=False
    )
    kube.batch.patch_namespaced_job_status(
        name,
        NS,
        {"status": {"conditions": [{"type": "Complete", "status": "True"}]}},
        _preload_content=False,
    )
    wait_for_job(kube, NS, name, deadline_s=5, poll_s=0.1)
