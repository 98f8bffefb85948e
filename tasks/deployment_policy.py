"""What a deployment lets a run ask for: the allow-lists of whoever runs the flows.

Anyone who may start a run fills its form (the Prefect UI, a deployment's parameters, Python);
what it may reach is the deployment's decision. The EKS work pool's base job template fixes the
lists in the flow-run pod's environment (deploy/eks/work-pool-template.json) after the job
variables' env, so neither a deployment nor a run's custom job variables can widen them (the
kubelet takes a name's last definition). Each list is comma-separated; a value outside it is
refused when the parameters are validated, before anything launches, naming the field, the
value, what is allowed and the variable that says so.

Unset, a list allows only its field's default where that is the safe choice and a value the
cluster cannot check (which image runs, as which account, where: ``STRICT``), and anything the
form accepts otherwise (``OPEN``: the CLI and tests run with the caller's own powers; the EKS
pool sets every list). An optional field left empty asks for nothing and is always allowed.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# eks.* fields whose unset list allows only the default (the admission policy holds Jobs to the
# same image and account).
STRICT = {
    "image": "NVRX_ALLOWED_IMAGES",
    "service_account": "NVRX_ALLOWED_SERVICE_ACCOUNTS",
    "namespace": "NVRX_ALLOWED_NAMESPACES",
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
EVERY_LIST = (*STRICT.values(), *OPEN.values(), BACKENDS, WORKLOADS, SCRIPT_ROOTS)


def listed(name: str, env: Mapping[str, str] | None = None) -> tuple[str, ...] | None:
    """The values a list allows, or None when the deployment does not set it."""
    raw = (os.environ if env is None else env).get(name, "")
    values = tuple(v.strip() for v in raw.split(",") if v.strip())
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
