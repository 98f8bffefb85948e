"""What a deployment lets a run ask for (tasks.deployment_policy): every widening of powers the
run form could ask for is refused naming the field, the value, what is allowed and the list that
says so; what the lists allow, and a run inside them, passes. Pure, over environments as the EKS
pool's flow-run pod has them (deploy/eks/work-pool-template.json)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flows.models import PipelineParams
from tasks.backends.eks.params import EksParams
from tasks.deployment_policy import EVERY_LIST, check_eks, check_run

REPO = Path(__file__).resolve().parents[1]


def pool_env() -> dict[str, str]:
    """The allow-lists the EKS pool's base job template fixes."""
    template = json.loads((REPO / "deploy" / "eks" / "work-pool-template.json").read_text())
    pod = template["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]
    env = {e["name"]: e["value"] for e in pod["containers"][0]["env"]}
    assert set(EVERY_LIST) <= set(env), set(EVERY_LIST) - set(env)  # the pool sets every list
    return env


# (what the form asks, the field named, the words of what is allowed)
WIDENINGS = [
    ({"backend": "local"}, "backend: 'local'", "allowed: eks"),
    ({"workload": "evil.module:spec"}, "workload: 'evil.module:spec'", "llama3-8b"),
    ({"workload": "script:/tmp/x.py"}, "workload: script '/tmp/x.py'",
     "/opt/nvrx-pipeline/examples"),
    ({"workload": "script:/opt/nvrx-pipeline/examples/../../../tmp/x.py"}, "really '/tmp/x.py'",
     "script root"),
    ({"eks": {"image": "evil:1"}}, "eks.image: 'evil:1'", "REGISTRY/nvrx-pipeline:latest"),
    ({"eks": {"service_account": "admin"}}, "eks.service_account: 'admin'", "nvrx-trainer"),
    ({"eks": {"namespace": "kube-system"}}, "eks.namespace: 'kube-system'", "allowed: nvrx"),
    ({"eks": {"instance_type": "p4d.24xlarge"}}, "eks.instance_type: 'p4d.24xlarge'",
     "p5.48xlarge"),
    ({"eks": {"fsx_claim": "other-team"}}, "eks.fsx_claim: 'other-team'", "fsx-claim"),
    ({"eks": {"fsx_mount": "/etc"}}, "eks.fsx_mount: '/etc'", "allowed: /fsx"),
    ({"eks": {"priority_class": "urgent"}}, "eks.priority_class: 'urgent'", "training-high"),
    ({"eks": {"queue": "other-queue"}}, "eks.queue: 'other-queue'", "nvrx-training"),
]  # fmt: skip


def _ask(asked: dict) -> tuple[str, str, EksParams]:
    eks = EksParams(**asked.get("eks", {}))
    return asked.get("backend", "eks"), asked.get("workload", "llama3-8b"), eks


@pytest.mark.parametrize(("asked", "field", "allowed"), WIDENINGS, ids=[w[1] for w in WIDENINGS])
def test_each_widening_is_refused_naming_field_value_and_allowed(asked, field, allowed):
    env = pool_env()
    backend, workload, eks = _ask(asked)
    with pytest.raises(ValueError) as err:
        check_run(backend, workload, env)
        check_eks(eks, env)
    msg = str(err.value)
    assert field in msg and allowed in msg and "NVRX_ALLOWED_" in msg, msg


def test_what_the_lists_allow_passes():
    env = pool_env()
    for workload in (
        "llama3-8b",
        "gpt-tiny",
        "script:/opt/nvrx-pipeline/examples/fsdp_script/train.py",
    ):
        check_run("eks", workload, env)
    check_eks(EksParams(priority_class="training-high", queue="nvrx-training"), env)
    check_eks(EksParams(), env)  # empty optional fields ask for nothing


def test_unset_lists_leave_open_fields_open_and_strict_ones_at_their_default():
    check_run("local", "script:/anywhere/train.py", {})
    check_eks(EksParams(fsx_mount="/mnt/x", instance_type="g5.48xlarge", queue="q"), {})
    with pytest.raises(ValueError, match="eks.image: 'evil:1' is not allowed"):
        check_eks(EksParams(image="evil:1"), {})


def test_the_form_refuses_before_it_resolves_the_workload(monkeypatch):
    """Through the run form: a workload the deployment does not allow is never imported."""
    monkeypatch.setenv("NVRX_ALLOWED_WORKLOADS", "gpt-tiny")
    with pytest.raises(ValueError, match="workload: 'no_such_module:spec' is not allowed"):
        PipelineParams(workload="no_such_module:spec")
    monkeypatch.setenv("NVRX_ALLOWED_BACKENDS", "eks")
    with pytest.raises(ValueError, match="backend: 'local' is not allowed"):
        PipelineParams(workload="gpt-tiny")
