"""The shipped admission policies (``deploy/eks/admission-policy.yaml``) as an API server would
answer a request: cel-python evaluates their CEL over the request, the object and the policy's
variables (an API server runs cel-go: the same language; corners may differ).

Kubernetes adds libraries to CEL; cel-python has the standard ones only, so the one extension
function the policies use is supplied here with Kubernetes' meaning: ``list.join(sep)``
(cel-go's strings extension, available in every Kubernetes version with admission policies).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import yaml

POLICY_FILE = Path(__file__).resolve().parents[1] / "deploy" / "eks" / "admission-policy.yaml"
PIPELINE_USER = "system:serviceaccount:nvrx:nvrx-pipeline"
# The Prefect worker's account (the prefect-worker chart's, in nvrx: deploy/eks/README.md step 9).
WORKER_USER = "system:serviceaccount:nvrx:prefect-worker"
RESOURCES = {
    "Job": "jobs",
    "Service": "services",
    "NetworkPolicy": "networkpolicies",
    "ConfigMap": "configmaps",
}


def policies(path: Path = POLICY_FILE, fsx_mount: str = "/fsx") -> dict[str, dict[str, Any]]:
    """The file's ValidatingAdmissionPolicies by name; ``fsx_mount``: the deployment's FSx mount
    in their ``mounts`` (as the README's sed fills the image)."""
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    out = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ValidatingAdmissionPolicy"}
    for policy in out.values():
        for v in policy["spec"].get("variables", []):
            if v["name"] == "mounts":
                v["expression"] = v["expression"].replace('"/fsx"', f'"{fsx_mount}"')
    return out


def _join(items: Any, sep: Any = "") -> Any:
    from celpy import celtypes

    return celtypes.StringType(str(sep).join(str(i) for i in items))


@cache
def _program(expr: str) -> Any:
    """The compiled expression (cel-python's parser is slow; the table reuses each many times)."""
    import celpy

    env = celpy.Environment()
    return env.program(env.compile(expr), functions={"join": _join})


def admit(policy: dict[str, Any], operation: str, obj: Any, old: Any = None,
          user: str = PIPELINE_USER) -> list[str]:  # fmt: skip
    """The messages of the failed validations (empty: admitted; not matched: admitted)."""
    import celpy
    from celpy import celtypes

    def ev(expr: str, act: dict[str, Any]) -> Any:
        return _program(expr).evaluate(act)

    subject = obj if obj is not None else old
    resource = RESOURCES[subject["kind"]]
    spec = policy["spec"]
    if not any(resource in r["resources"] and operation in r["operations"]
               for r in spec["matchConstraints"]["resourceRules"]):  # fmt: skip
        return []
    request = {"operation": operation, "userInfo": {"username": user},
               "resource": {"resource": resource}}  # fmt: skip
    act: dict[str, Any] = {
        "request": celpy.json_to_cel(request),
        "object": celpy.json_to_cel(obj),
        "oldObject": celpy.json_to_cel(old),
    }
    if not all(ev(c["expression"], act) for c in spec.get("matchConditions", [])):
        return []
    variables: dict[Any, Any] = {}
    for v in spec.get("variables", []):
        act["variables"] = celtypes.MapType(variables)
        variables[celtypes.StringType(v["name"])] = ev(v["expression"], act)
    act["variables"] = celtypes.MapType(variables)
    return [" ".join(v["message"].split()) for v in spec["validations"]
            if not ev(v["expression"], act)]  # fmt: skip


def constant(policy: dict[str, Any], name: str) -> Any:
    """A policy variable that is a literal (the lists the README's sed fills), as Python."""
    import celpy

    (expr,) = [v["expression"] for v in policy["spec"]["variables"] if v["name"] == name]
    env = celpy.Environment()
    value = env.program(env.compile(expr)).evaluate({})
    return [str(v) for v in value] if isinstance(value, list) else value
