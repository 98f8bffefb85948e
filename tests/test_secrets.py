"""What a worker may know (tasks.secrets): the orchestrator's credentials scrubbed, the run's
declared secrets by name, resolved only where the workers start; on EKS references the kubelet
resolves, never values in the manifest. Pure (the real run's check is in the baseline fixture:
tests/conftest.py, assert_no_secret_leaked)."""

from __future__ import annotations

import os

import kubernetes_validate
import pytest

from flows.context import eks_train_config
from flows.models import PipelineParams
from tasks.backends.eks.render import render_all
from tasks.secrets import check_declared, kubernetes_env, resolve_local, scrubbed
from tests.test_eks_render import K8S_VERSION

PARENT = {
    "PATH": "/usr/bin", "HOME": "/home/u", "PREFECT_API_URL": "http://x/api", "LANG": "C.UTF-8",
    "AWS_ACCESS_KEY_ID": "AKIA", "AWS_SECRET_ACCESS_KEY": "s", "AWS_PROFILE": "p",
    "AWS_WEB_IDENTITY_TOKEN_FILE": "/t", "AWS_CONTAINER_CREDENTIALS_FULL_URI": "http://x",
    "PREFECT_API_KEY": "pnu", "PREFECT_API_AUTH_STRING": "a:b", "HF_TOKEN": "hf",
    "GITHUB_TOKEN": "g", "DB_PASSWORD": "pw", "SSH_AUTH_SOCK": "/s", "WANDB_API_KEY": "w",
    "GOOGLE_APPLICATION_CREDENTIALS": "/c.json", "OPENAI_APIKEY": "o",
}  # fmt: skip
KEPT = {"PATH", "HOME", "LANG"}


# (variable, value, passed to the workers): built from an allow-list, so what a deny-list of
# names missed is not passed; what the trainer, torch and the collectives read is.
INHERITANCE = [
    ("PGPASSWORD", "pw", False),
    ("MYSQL_PWD", "pw", False),
    ("DATABASE_URL", "postgres://app:pw@db:5432/x", False),
    ("HTTPS_PROXY", "http://user:pw@proxy:3128", False),  # allowed by name, not with a password
    ("HTTPS_PROXY", "http://proxy:3128", True),
    ("FOO_SECRET_ACCESS_KEY", "s", False),
    ("FOOSECRETACCESSKEY", "s", False),
    ("AWS_SECRET_ACCESS_KEY", "s", False),
    ("R2_SECRET_ACCESS_KEY", "s", False),
    ("NCCL_IB_SECRET_TOKEN", "s", False),  # an allowed prefix, a credential's name
    ("NVRX_TEST_PASSWORD", "s", False),
    ("TORCH_HOME", "/cache", True),
    ("NVRX_API_URL", "https://u:p@x/", False),  # an allowed prefix, a password in the value
    ("PREFECT_API_URL", "http://x/api", False),  # the orchestrator's: a worker has no use for it
    ("SSH_AUTH_SOCK", "/s", False),
    ("LD_PRELOAD", "/x.so", False),
    ("PATH", "/usr/bin", True), ("HOME", "/home/u", True), ("LANG", "C.UTF-8", True),
    ("LC_ALL", "C.UTF-8", True), ("PYTHONPATH", "/repo", True), ("TMPDIR", "/tmp", True),
    ("NVRX_CONFIG", "/run/config.json", True), ("NVRX_LOG_LEVEL", "INFO", True),
    ("TORCH_CPP_LOG_LEVEL", "ERROR", True), ("TORCHELASTIC_RUN_ID", "r", True),
    ("NCCL_DEBUG", "INFO", True), ("GLOO_SOCKET_IFNAME", "lo", True),
    ("CUDA_VISIBLE_DEVICES", "0", True), ("OMP_NUM_THREADS", "2", True),
    ("HF_HOME", "/cache/hf", True), ("TOKENIZERS_PARALLELISM", "false", True),
    ("HF_TOKEN", "hf", False),
]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "value", "passed"), INHERITANCE, ids=[f"{n}={v}" for n, v, _ in INHERITANCE]
)
def test_the_workers_environment_is_built_from_an_allow_list(name: str, value: str, passed: bool):
    assert (name in scrubbed({name: value})) == passed


def test_the_workers_environment_has_no_credential_of_the_orchestrator():
    env = scrubbed(PARENT)
    assert set(env) - {"AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE",
                       "AWS_EC2_METADATA_DISABLED"} == KEPT  # fmt: skip
    # the SDKs' other sources point at nothing
    assert env["AWS_SHARED_CREDENTIALS_FILE"] == env["AWS_CONFIG_FILE"] == os.devnull
    assert env["AWS_EC2_METADATA_DISABLED"] == "true"


@pytest.mark.parametrize(
    ("secrets", "words"),
    [({"hf_token": "hf"}, "not an environment variable name"),
     ({"1TOKEN": "hf"}, "not an environment variable name"),
     ({"NVRX_CONFIG": "x"}, "the pipeline, the launcher or torch reads NVRX_CONFIG"),
     ({"LD_PRELOAD": "x"}, "reads LD_PRELOAD"), ({"PYTHONPATH": "x"}, "reads PYTHONPATH"),
     ({"MASTER_ADDR": "x"}, "reads MASTER_ADDR"), ({"PATH": "x"}, "reads PATH"),
     ({"HF_TOKEN": "Has_Caps"}, "secrets.HF_TOKEN: 'Has_Caps' is not a secret name"),
     ({"HF_TOKEN": "../x"}, "is not a secret name"), ({"HF_TOKEN": ""}, "is not a secret name"),
     ({f"V{i}": "s" for i in range(17)}, "at most 16")],
)  # fmt: skip
def test_a_declared_secret_is_refused_naming_the_entry(secrets, words):
    with pytest.raises(ValueError, match=words):
        check_declared(secrets)
    with pytest.raises(ValueError, match=words):  # through the run form
        PipelineParams(secrets=secrets)


def test_local_secrets_come_from_the_store_by_name_and_a_missing_one_names_the_fix():
    store = {"hf-token": "hf_value"}

    def load(name: str) -> str:
        if name not in store:
            raise ValueError(f"Unable to find block document named {name}")
        return store[name]

    assert resolve_local({"HF_TOKEN": "hf-token"}, load) == {"HF_TOKEN": "hf_value"}
    with pytest.raises(ValueError, match=r"secrets.WANDB_API_KEY: no Prefect Secret block 'wandb'"):
        resolve_local({"WANDB_API_KEY": "wandb"}, load)


def test_on_eks_the_job_carries_references_never_values():
    params = PipelineParams(backend="eks", nodes=2, global_batch=16, run_id="r1",
                            secrets={"HF_TOKEN": "hf-token", "WANDB_API_KEY": "wandb"})  # fmt: skip
    docs = render_all(eks_train_config(params, "r1"), run_id="r1", attempt=1, nodes=2,
                      eks=params.eks, secrets=params.secrets)  # fmt: skip
    job = next(d for d in docs if d["kind"] == "Job")
    kubernetes_validate.validate(job, K8S_VERSION, strict=True)
    env = job["spec"]["template"]["spec"]["containers"][0]["env"]
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in env if "valueFrom" in e}
    assert refs == {"HF_TOKEN": {"name": "hf-token", "key": "value"},
                    "WANDB_API_KEY": {"name": "wandb", "key": "value"}}  # fmt: skip
    assert all("value" not in e for e in env if e["name"] in refs)
    assert kubernetes_env({}) == []
