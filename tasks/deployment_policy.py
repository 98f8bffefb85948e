"""What a deployment lets a run ask for: the allow-lists of whoever runs the flows.

Anyone who may start a run fills its form (the Prefect UI, a deployment's parameters, Python);
what it may reach is the deployment's decision. The EKS work pool's base job template fixes the
lists in the flow-run pod's environment (deploy/eks/work-pool-template.json) after the job
variables' env, so neither a deployment nor a run's custom job variables can widen them (the
kubelet takes a name's last definition). Each list is comma-separated; a value outside it is
refused when the parameters are validated, before anything launches, naming the field, the
value, what is allowed and the variable that says so.

Unset, a list allows only its field's default where that is the safe choice and a value the
cluster cannot check (which image runs, as which account, where, whom Prometheus's namespace
reaches: ``STRICT``), and anything the form accepts otherwise (``OPEN``: the CLI and tests run
with the caller's own powers; the EKS pool sets every list). An optional field left empty asks
for nothing and is always allowed.

What a run reaches beyond its own run (:class:`Reach`: the S3 endpoint, the dataset, weights
and export buckets, the state directory, the secrets it reads, the drills it injects) is the
deployment's own: a run started from a deployment may name its deployment's own value or one on
the deployment's list, never a new one (:func:`check_reach`); outside a deployment (the CLI,
Python) a list, when set, limits it. Drills kill, stall, slow or corrupt: a deployment's run
injects only those its deployment names itself or whose kind ``NVRX_ALLOWED_DRILLS`` lists.
``s3://`` initial weights without a digest (``initial_weights.sha256``) come only from a bucket
``NVRX_ALLOWED_UNPINNED_WEIGHTS`` lists, when it is set (:func:`check_pinned`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# eks.* fields whose unset list allows only the default (the admission policy holds Jobs to the
# same image and account).
STRICT = {
    "image": "NVRX_ALLOWED_IMAGES",
    "service_account": "NVRX_ALLOWED_SERVICE_ACCOUNTS",
    "namespace": "NVRX_ALLOWED_NAMESPACES",
    # The Job's NetworkPolicy admits this namespace to the metrics port: another would open it
    # to whatever runs there.
    "monitoring_namespace": "NVRX_ALLOWED_MONITORING_NAMESPACES",
}
# eks.* fields whose unset list allows any valid value.
OPEN = {
    "instance_type": "NVRX_ALLOWED_INSTANCE_TYPES",
    "fsx_claim": "NVRX_ALLOWED_FSX_CLAIMS",
    "fsx_mount": "NVRX_ALLOWED_FSX_MOUNTS",
    "priority_class": "NVRX_ALLOWED_PRIORITY_CLASSES",
    "queue": "NVRX_ALLOWED_QUEUES",
}
# Run-level lists (unset: any). A workload entry is a name (gpt-tiny, pkg.mod:attr) or
# ``script:`` for scripts, which must then lie under one of the script roots.
BACKENDS = "NVRX_ALLOWED_BACKENDS"
WORKLOADS = "NVRX_ALLOWED_WORKLOADS"
SCRIPT_ROOTS = "NVRX_ALLOWED_SCRIPT_ROOTS"
# What a run reaches (:class:`Reach`), each a list of the values a run may name besides its
# deployment's own. ``aws`` in the endpoints is AWS S3's own (an empty ``s3_endpoint``); a list
# that is just ``none`` allows nothing beyond the deployment's own.
S3_ENDPOINTS = "NVRX_ALLOWED_S3_ENDPOINTS"
DATASET_BUCKETS = "NVRX_ALLOWED_DATASET_BUCKETS"  # dataset.bucket, s3:// init_weights' bucket
EXPORT_BUCKETS = "NVRX_ALLOWED_EXPORT_BUCKETS"
STATE_DIRS = "NVRX_ALLOWED_STATE_DIRS"
SECRETS = "NVRX_ALLOWED_SECRETS"  # secret names (the values of `secrets`)
DRILLS = "NVRX_ALLOWED_DRILLS"  # drill kinds (exception, node-loss, ...)
# Buckets whose s3:// initial weights a run may use without a digest (initial_weights.sha256);
# unset: any (said in the hydrate log), ``none``: every run pins its weights.
UNPINNED_WEIGHTS = "NVRX_ALLOWED_UNPINNED_WEIGHTS"
REACH_LISTS = (S3_ENDPOINTS, DATASET_BUCKETS, EXPORT_BUCKETS, STATE_DIRS, SECRETS, DRILLS)
EVERY_LIST = (
    *STRICT.values(),
    *OPEN.values(),
    BACKENDS,
    WORKLOADS,
    SCRIPT_ROOTS,
    UNPINNED_WEIGHTS,
    *REACH_LISTS,
)
AWS = "aws"
NONE = "none"


def listed(name: str, env: Mapping[str, str] | None = None) -> tuple[str, ...] | None:
    """The values a list allows, or None when the deployment does not set it."""
    raw = (os.environ if env is None else env).get(name, "")
    values = tuple(v.strip() for v in raw.split(",") if v.strip())
    if values == (NONE,):
        return ()
    return values or None


def deployment_allowed(
    field: str, default: str, env: Mapping[str, str] | None = None
) -> tuple[str, ...]:
    """The values a STRICT eks field may take (unset: its default)."""
    return listed(STRICT[field], env) or (default,)


def _refuse(field: str, value: Any, allowed: tuple[str, ...], name: str) -> ValueError:
    return ValueError(
        f"{field}: {value!r} is not allowed by this deployment; allowed: {', '.join(allowed)} "
        f"(the deployment sets {name})"
    )


def check_eks(eks: Any, env: Mapping[str, str] | None = None) -> None:
    """Refuse an eks.* value the deployment does not allow (the STRICT defaults included: a
    run that replaces ``params`` falls back to them)."""
    for field, name in STRICT.items():
        value = getattr(eks, field)
        allowed = deployment_allowed(field, str(type(eks).model_fields[field].default), env)
        if value not in allowed:
            raise _refuse(f"eks.{field}", value, allowed, name)
    for field, name in OPEN.items():
        value, allowed_or_none = getattr(eks, field), listed(name, env)
        if value is not None and allowed_or_none is not None and value not in allowed_or_none:
            raise _refuse(f"eks.{field}", value, allowed_or_none, name)


def check_run(backend: str, workload: str, env: Mapping[str, str] | None = None) -> None:
    """Refuse a backend, workload or script the deployment does not allow."""
    backends = listed(BACKENDS, env)
    if backends is not None and backend not in backends:
        raise _refuse("backend", backend, backends, BACKENDS)
    is_script = workload.startswith("script:")
    workloads = listed(WORKLOADS, env)
    scripts_allowed = is_script and workloads is not None and "script:" in workloads
    if workloads is not None and workload not in workloads and not scripts_allowed:
        raise _refuse("workload", workload, workloads, WORKLOADS)
    roots = listed(SCRIPT_ROOTS, env)
    if is_script and roots is not None:
        path = workload.removeprefix("script:")
        real = Path(os.path.realpath(path))  # links and '..' resolved: where it really is
        if not any(real.is_relative_to(os.path.realpath(r)) for r in roots):
            raise ValueError(
                f"workload: script {path!r} (really {str(real)!r}) is not under a script root "
                f"this deployment allows: {', '.join(roots)} (the deployment sets {SCRIPT_ROOTS})"
            )


def check_pinned(
    weights_bucket: str | None, pinned: bool, env: Mapping[str, str] | None = None
) -> None:
    """Refuse s3:// initial weights without a digest from a bucket the deployment does not let
    go unpinned: whoever can write the prefix could otherwise swap the model a run starts from."""
    allowed = listed(UNPINNED_WEIGHTS, env)
    if weights_bucket is None or pinned or allowed is None or weights_bucket in allowed:
        return
    raise ValueError(
        f"initial_weights.sha256: unpinned initial weights from {weights_bucket!r} are not "
        f"allowed by this deployment; allowed unpinned: {', '.join(allowed) or 'none'} (the "
        f"deployment sets {UNPINNED_WEIGHTS}); set initial_weights.sha256 to the digest "
        "`nvrx-pipeline weights-digest` prints for them"
    )


@dataclass(frozen=True)
class Reach:
    """What a run form reaches beyond its own run, normalized as the form keeps it: an endpoint
    without its trailing slash (AWS S3's own: None), the state directory's path normalized (a
    relative one is relative to where the flow runs, for a run as for its deployment), each
    drill as its parsed text and its kind."""

    s3_endpoint: str | None
    dataset_bucket: str
    export_bucket: str
    state_dir: str
    init_weights_bucket: str | None = None
    secrets: tuple[str, ...] = ()  # secret names
    drills: tuple[tuple[str, str], ...] = ()  # (the drill as parsed, its kind)


@dataclass(frozen=True)
class Deployment:
    """The deployment a run was started from: what it reaches itself is what its runs may."""

    id: str
    name: str  # FLOW/DEPLOYMENT
    own: Reach = dataclasses.field(compare=False)


# (field as the form names it, the list, the Reach attribute)
_ONE_VALUE = (
    ("s3_endpoint", S3_ENDPOINTS, "s3_endpoint"),
    ("dataset.bucket", DATASET_BUCKETS, "dataset_bucket"),
    ("workload_options.init_weights", DATASET_BUCKETS, "init_weights_bucket"),
    ("export.bucket", EXPORT_BUCKETS, "export_bucket"),
    ("state_dir", STATE_DIRS, "state_dir"),
)


def _shown(value: str | None) -> str:
    return AWS if value is None else value


def _reach_refused(
    where: str,
    value: str | None,
    own: tuple[str, ...],
    allowed_list: tuple[str, ...] | None,
    name: str,
    deployment: Deployment | None,
) -> ValueError:
    allowed = [
        f"{v} (an empty s3_endpoint: AWS S3)" if v == AWS and where == "s3_endpoint" else v
        for v in sorted({*own, *(allowed_list or ())})
    ]
    said = " and ".join(
        ([f"deployment {deployment.name}'s own"] if deployment is not None else [])
        + ([name] if allowed_list is not None else [])
    )
    return ValueError(
        f"{where}: {_shown(value)!r} is not allowed by this deployment; allowed: "
        f"{', '.join(allowed) or 'none'} ({said}); choose one of those, or have the "
        f"deployment's owner add it to {name}"
    )


def _owns(attr: str, deployment: Deployment) -> tuple[str, ...]:
    """The values of ``attr`` the deployment reaches itself."""
    own = deployment.own
    if attr == "init_weights_bucket":  # weights are read like the dataset
        return tuple(b for b in (own.init_weights_bucket, own.dataset_bucket) if b is not None)
    return (_shown(getattr(own, attr)),)


def check_reach(
    reach: Reach, deployment: Deployment | None, env: Mapping[str, str] | None = None
) -> None:
    """Refuse an endpoint, bucket, state directory, secret or drill the run's deployment does
    not name itself nor list (outside a deployment: one its list, when set, leaves out)."""
    for where, name, attr in _ONE_VALUE:
        value = getattr(reach, attr)
        if attr == "init_weights_bucket" and value is None:
            continue  # no s3:// weights: nothing asked
        allowed_list = listed(name, env)
        owns = _owns(attr, deployment) if deployment is not None else ()
        if deployment is None and allowed_list is None:
            continue  # the caller's own powers
        if _shown(value) not in (*owns, *(allowed_list or ())):
            raise _reach_refused(where, value, owns, allowed_list, name, deployment)
    allowed_secrets = listed(SECRETS, env)
    if deployment is not None or allowed_secrets is not None:
        own_refs = deployment.own.secrets if deployment is not None else ()
        for ref in reach.secrets:
            if ref not in (*own_refs, *(allowed_secrets or ())):
                raise _reach_refused("secrets", ref, own_refs, allowed_secrets, SECRETS, deployment)
    allowed_kinds = listed(DRILLS, env)
    if deployment is not None or allowed_kinds is not None:
        own_drills = tuple(t for t, _ in deployment.own.drills) if deployment is not None else ()
        for text, kind in reach.drills:
            if text not in own_drills and kind not in (allowed_kinds or ()):
                raise ValueError(
                    f"drills.faults: {text!r} is not allowed by this deployment: a drill kills, "
                    "stalls, slows or corrupts the run; allowed: the deployment's own drills "
                    f"({', '.join(own_drills) or 'none'}) and the kinds {DRILLS} lists "
                    f"({', '.join(allowed_kinds or ()) or 'none'}); leave drills empty, or "
                    "run them from a deployment made for drills"
                )
