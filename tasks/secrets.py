"""What a worker may know: a clean environment, and the secrets a run declares.

The orchestrator's environment holds its own credentials (``PREFECT_API_KEY``, AWS keys, an
exported ``HF_TOKEN``); the workers run the user's code on data anyone who can write the shared
filesystem controls, and need none of them: they get :func:`scrubbed`, built from an allow-list
(:data:`INHERITED`: what the trainer, torch, its launcher and the libraries under them read),
anything credential-like dropped from it even so, the AWS SDKs' sources pointed at nothing (the
load check too). A deny-list of names missed ``PGPASSWORD``, a proxy URL with a password,
``*_SECRET_ACCESS_KEY`` variants.

What a workload needs (a Hugging Face token, a tracker's key) it declares in the run's
``secrets`` (environment variable -> secret name): the values live in the platform's secret
store and reach the workers' environment only, never a config file, manifest, event, argv or
export. Locally: Prefect Secret blocks, read at launch (:func:`resolve_local`); on EKS:
Kubernetes Secrets in the run's namespace (key ``value``), put into the pods' environment by the
kubelet (:func:`kubernetes_env`): the Job's manifest carries only the reference.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from typing import Any

from trainer.credentials import is_credential

# What a worker inherits of the orchestrator's environment, by name: the process basics, the
# interpreter's, the dynamic loader's library path, Hugging Face's cache and offline switches
# (never its token), TLS trust and proxies (a proxy URL with a password is dropped).
INHERITED = frozenset(
    {"PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TERM", "TMPDIR", "SHELL",
     "PYTHONPATH", "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE", "PYTHONFAULTHANDLER",
     "PYTHONHASHSEED", "PYTHONWARNINGS", "VIRTUAL_ENV", "LD_LIBRARY_PATH", "XDG_CACHE_HOME",
     "HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE",
     "TOKENIZERS_PARALLELISM", "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE",
     "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy"}
)  # fmt: skip
# ...and by prefix: the locale, the pipeline's own (NVRX_*: the trainer's config, node, epoch,
# drills), torch and its launcher (TORCH*, PYTORCH_*), the collectives (NCCL_*, GLOO_*), the GPU
# stack, and the thread pools' sizes.
INHERITED_PREFIXES = (
    "LC_", "NVRX_", "TORCH", "PYTORCH_", "NCCL_", "GLOO_", "CUDA_", "NVIDIA_", "CUBLAS_",
    "CUDNN_", "TRITON_", "OMP_", "KMP_", "MKL_", "OPENBLAS_",
)  # fmt: skip
# The AWS SDKs' other sources (~/.aws files, instance metadata) pointed at nothing: a worker
# has no AWS credentials of any kind.
OVERRIDES = {
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_EC2_METADATA_DISABLED": "true",
}
# A declared secret's variable: an environment name of the workload's own, never one the
# pipeline, the launcher, torch or the dynamic loader reads.
ENV_NAME = re.compile(r"[A-Z_][A-Z0-9_]{0,63}")
RESERVED_PREFIXES = ("NVRX_", "TORCH", "PYTHON", "LD_", "CUDA_", "NCCL_", "FI_", "OMP_", "PREFECT_")
RESERVED = frozenset(
    {"PATH", "HOME", "USER", "SHELL", "TMPDIR", "RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK",
     "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "HOSTNAME"}
)  # fmt: skip
# A secret's name: a DNS-1123 label, valid as a Kubernetes Secret and a Prefect block name.
SECRET_REF = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
MAX_SECRETS = 16
SECRET_KEY = "value"  # the key of a Kubernetes Secret that holds the value


def inherited(name: str, value: str) -> bool:
    """Whether a worker is given the orchestrator's variable ``name``: allowed by name or
    prefix, and nothing about it looks like a credential (an ``NCCL_*_TOKEN`` is not passed)."""
    allowed = name in INHERITED or name.startswith(INHERITED_PREFIXES)
    return allowed and not is_credential(name, value)


def scrubbed(parent: Mapping[str, str]) -> dict[str, str]:
    """What a worker inherits of ``parent`` (:func:`inherited`), the SDKs' other credential
    sources pointed at nothing; the declared secrets are added by the caller."""
    env = {k: v for k, v in parent.items() if inherited(k, v)}
    env.update(OVERRIDES)
    return env


def check_declared(secrets: Mapping[str, str]) -> None:
    """Refuse a ``secrets`` mapping that is not environment name -> secret name (ValueError
    naming the entry and the fix)."""
    if len(secrets) > MAX_SECRETS:
        raise ValueError(f"secrets: {len(secrets)} entries, at most {MAX_SECRETS}")
    for name, ref in secrets.items():
        where = f"secrets.{name}"
        if not isinstance(name, str) or not ENV_NAME.fullmatch(name):
            raise ValueError(
                f"secrets: {name!r} is not an environment variable name (A-Z, 0-9, _; at most "
                "64 characters, not starting with a digit)"
            )
        if name in RESERVED or name.startswith(RESERVED_PREFIXES):
            raise ValueError(
                f"{where}: the pipeline, the launcher or torch reads {name}; name the "
                "workload's own variable (e.g. HF_TOKEN)"
            )
        if not isinstance(ref, str) or not SECRET_REF.fullmatch(ref):
            raise ValueError(
                f"{where}: {ref!r} is not a secret name: lowercase letters, digits and '-', at "
                "most 63 (a Kubernetes Secret in the run's namespace on EKS, a Prefect Secret "
                "block locally)"
            )


def _prefect_secret(name: str) -> str:
    from prefect.blocks.system import Secret

    block: Any = Secret.load(name)  # sync here: the flows are synchronous
    return str(block.get())


def resolve_local(
    secrets: Mapping[str, str], load: Callable[[str], Any] = _prefect_secret
) -> dict[str, str]:
    """The declared secrets' values, from Prefect's Secret blocks (the flow's own API access):
    environment name -> value, for the workers' environment only."""
    out: dict[str, str] = {}
    for name, ref in secrets.items():
        try:
            out[name] = str(load(ref))
        except ValueError as e:  # Prefect: "Unable to find block document named ..."
            raise ValueError(
                f"secrets.{name}: no Prefect Secret block {ref!r} ({e}); create it: "
                f"`prefect block create secret` or Secret(value=...).save({ref!r})"
            ) from None
    return out


def kubernetes_env(secrets: Mapping[str, str]) -> list[dict[str, Any]]:
    """A container's env entries for the declared secrets: references, never values."""
    return [
        {"name": name, "valueFrom": {"secretKeyRef": {"name": ref, "key": SECRET_KEY}}}
        for name, ref in sorted(secrets.items())
    ]
