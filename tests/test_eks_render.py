"""The EKS train-stage manifests: schema-valid (kubernetes-validate, strict, at the pinned
Kubernetes version), idempotent names, and the launch contract the watcher relies on."""

from __future__ import annotations

import subprocess
import sys

import kubernetes_validate
import pytest
import yaml

from flows.context import eks_train_config
from flows.models import PipelineParams
from tasks.backends.eks import K8S_VERSION
from tasks.backends.eks.render import job_name, render_all
from tests.helpers import REPO, worker_env


def params(**kw) -> PipelineParams:
    return PipelineParams(
        **{
            "backend": "eks",
            "nodes": 4,
            "global_batch": 256,
            "workload": "llama3-8b",
            "run_id": "run-2026-11-29",
            **kw,
        }
    )


def render(p: PipelineParams, attempt: int = 1) -> list[dict]:
    return render_all(
        eks_train_config(p, p.run_id or "x"),
        run_id=p.run_id or "x",
        attempt=attempt,
        nodes=p.nodes,
        eks=p.eks,
    )


@pytest.mark.parametrize("attempt", [1, 2])
def test_manifests_validate_strictly(attempt: int):
    for doc in render(params(), attempt):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_schema_catches_a_wrong_field():
    _svc, job = render(params())
    job["spec"]["template"]["spec"]["containers"][0]["resource"] = {}  # typo'd field
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, K8S_VERSION, strict=True)


def test_same_attempt_same_names_next_attempt_new_names():
    a, b, c = render(params(), 1), render(params(), 1), render(params(), 2)
    assert a == b
    assert a[1]["metadata"]["name"] != c[1]["metadata"]["name"]
    long = job_name("x" * 80, 3)
    assert len(long) <= 52 and long.endswith("-a3") and long != job_name("x" * 81, 3)


def test_launch_contract():
    p = params(faults=["exception@step=5,rank=3"])
    svc, job = render(p)
    name = job["metadata"]["name"]
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == 4 and spec["backoffLimit"] == 0
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never" and pod["subdomain"] == svc["metadata"]["name"] == name
    assert svc["spec"]["clusterIP"] == "None"
    c = pod["containers"][0]
    assert c["command"] == ["ft_launcher"]
    args = c["args"]
    assert f"--rdzv-endpoint={name}-0.{name}.nvrx.svc.cluster.local:29500" in args
    assert "--nproc-per-node=8" in args and "--nnodes=4" in args and "--max-restarts=3" in args
    # The workers read the attempt's whole config from the shared FSx mount (the flow writes
    # it there before it creates the Job); nothing travels as flags.
    assert args[-3:] == [
        "-m",
        "trainer.train",
        "--config=/fsx/runs/run-2026-11-29/config/train-attempt1.json",
    ]
    cfg = eks_train_config(p, "run-2026-11-29")
    assert str(cfg.run_root) == "/fsx/runs/run-2026-11-29" and cfg.device.value == "cuda"
    assert cfg.faults == ("exception@step=5,rank=3",) and cfg.workload == "llama3-8b"
    assert c["resources"]["limits"] == {"nvidia.com/gpu": "8", "vpc.amazonaws.com/efa": "32"}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert mounts == {"/fsx": "fsx", "/dev/shm": "shm"}
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["fsx"]["persistentVolumeClaim"]["claimName"] == "fsx-claim"
    assert vols["shm"]["emptyDir"]["medium"] == "Memory"
    rules = spec["podFailurePolicy"]["rules"]
    assert rules[0]["onExitCodes"]["values"] == [93]
    assert rules[1]["onPodConditions"] == [{"type": "DisruptionTarget", "status": "True"}]
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["NVRX_STAGE_ATTEMPT"] == "1" and env["FI_PROVIDER"] == "efa"


def test_render_k8s_cli():
    argv = [
        sys.executable,
        "-m",
        "flows.cli",
        "render-k8s",
        "--run-id",
        "cli-run",
        "--set",
        "nodes=2",
        "--set",
        "global_batch=32",
        "--attempt",
        "2",
    ]
    proc = subprocess.run(
        argv, capture_output=True, text=True, env=worker_env(), cwd=REPO, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    docs = list(yaml.safe_load_all(proc.stdout))
    assert [d["kind"] for d in docs] == ["Service", "Job"]
    assert docs[1]["metadata"]["name"] == "nvrx-cli-run-a2"
    bad = subprocess.run(
        [*argv[:4], "--set", "global_batch=7"],
        capture_output=True,
        text=True,
        env=worker_env(),
        cwd=REPO,
        timeout=120,
    )
    assert bad.returncode == 2 and "global_batch" in bad.stderr
