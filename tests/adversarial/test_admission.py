"""The admission policies hold the line (``deploy/eks/admission-policy.yaml``; issue 43, item 3).

Each object is evaluated against the shipped policies with a real CEL evaluator (cel-python,
:mod:`tests.k8s_admission`), as the API server would answer the identity that sends it:

- **admitted**: what the pipeline itself renders, through the code the flow launches with
  (``EksBackend.bundle``: fixed and elastic Jobs, hot spares, a declared secret, a freeze drill,
  a script workload; the hydration Job; the flow-run Job the worker makes from
  ``work-pool-template.json``);
- **refused**: a table of widenings, each with the rule that refuses it (the policy's message):
  root, privilege, host namespaces, another image, command or module, an environment variable
  that changes what runs, a Secret outside the declared channel, a volume the bundle does not
  use, a NetworkPolicy with open peers, a Service that leaves the cluster;
- and the lists the policies hold (entry points, environment names, volume kinds, reserved
  secret names) are the renderer's, derived from its output, so the two cannot part silently.

Pure evaluation, no cluster: fast. (An API server runs cel-go; corners may differ.)
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from functools import cache
from typing import Any

import pytest

from flows.context import eks_train_config, launch_request
from flows.models import PipelineParams
from tasks import secrets as declared
from tasks.backends.eks.backend import EksBackend
from tasks.backends.eks.hydrate import hydration_job
from tasks.backends.eks.params import EksParams
from tasks.backends.eks.pod import CONFIG_MOUNT
from tests.k8s_admission import PIPELINE_USER, WORKER_USER, admit, constant, policies
from tests.test_deploy_assets import _load_all, flow_run_job

POLICIES = policies()
JOBS = POLICIES["nvrx-pipeline-jobs"]
FLOW_RUNS = POLICIES["nvrx-flow-runs"]
NETWORK = POLICIES["nvrx-pipeline-network"]
SCRIPT = "/opt/nvrx-pipeline/examples/fsdp_script/train.py"  # under NVRX_ALLOWED_SCRIPT_ROOTS

# The bundles the train flow launches, one per shape the renderer has.
SHAPES: dict[str, dict[str, Any]] = {
    "fixed": {},
    "elastic": {"nodes": "1:2"},
    "spares": {"spares": 1},
    "secret": {"secrets": {"HF_TOKEN": "hf-token"}},
    "freeze-drill": {"drills": {"faults": ["node-freeze@step=5,node=1"]}},
    "script": {"workload": f"script:{SCRIPT}", "script_args": ["--lr", "0.1", "--note=a b"]},
}


@cache
def _bundle(shape: str) -> dict[str, dict[str, Any]]:
    params = PipelineParams(**{"backend": "eks", "nodes": 2, "global_batch": 16, "run_id": "r1",
                               **SHAPES[shape]})  # fmt: skip
    cfg = eks_train_config(params, "r1")
    request = launch_request(params, cfg, run_id="r1", attempt=1, invocation="inv001", epoch=3)
    docs = EksBackend(params.eks, nodes=params.launched_nodes).bundle(request)
    return {d["kind"]: d for d in docs}


def bundle(shape: str = "fixed") -> dict[str, dict[str, Any]]:
    return copy.deepcopy(_bundle(shape))


def training_job(shape: str = "fixed") -> dict[str, Any]:
    return bundle(shape)["Job"]


def hydration() -> dict[str, Any]:
    return hydration_job(name="nvrx-hydrate-r1", eks=EksParams(), data_dir="/fsx/datasets/d",
                         manifest_sha256="ab" * 32)  # fmt: skip


def rendered() -> list[Any]:
    """(id, object, user): everything the pipeline and its worker create in nvrx."""
    out = [
        pytest.param(obj, PIPELINE_USER, id=f"{shape}:{kind}")
        for shape in SHAPES
        for kind, obj in bundle(shape).items()
    ]
    out.append(pytest.param(hydration(), PIPELINE_USER, id="hydration:Job"))
    out.append(pytest.param(flow_run_job(), WORKER_USER, id="flow-run:Job"))
    # prefect-kubernetes may keep the worker's API key in a Secret and pass a reference
    api_key = [{"name": "PREFECT_API_KEY",
                "valueFrom": {"secretKeyRef": {"name": "prefect-nvrx-worker-api-key",
                                               "key": "value"}}}]  # fmt: skip
    out.append(pytest.param(flow_run_job(api_key), WORKER_USER, id="flow-run-api-key:Job"))
    # NodeLocal DNSCache's one address, as the README says to add it (an ipBlock of one address)
    netpol = bundle()["NetworkPolicy"]
    netpol["spec"]["egress"].append({"to": [{"ipBlock": {"cidr": "169.254.20.10/32"}}],
                                     "ports": [{"protocol": "UDP", "port": 53}]})  # fmt: skip
    out.append(pytest.param(netpol, PIPELINE_USER, id="node-local-dns:NetworkPolicy"))
    return out


@pytest.mark.parametrize(("obj", "user"), rendered())
def test_what_the_pipeline_renders_is_admitted(obj: dict[str, Any], user: str) -> None:
    for policy in POLICIES.values():
        assert admit(policy, "CREATE", obj, user=user) == []
        assert admit(policy, "UPDATE", obj, obj, user=user) == []
        if obj["kind"] != "Job":
            assert admit(policy, "DELETE", None, obj, user=user) == []


# --- the table of refusals -----------------------------------------------------------------------

Edit = Callable[[dict[str, Any]], None]


def _pod(job: dict[str, Any]) -> dict[str, Any]:
    return job["spec"]["template"]["spec"]


def _c(job: dict[str, Any]) -> dict[str, Any]:
    return _pod(job)["containers"][0]


def _set(path: str, value: Any) -> Edit:
    """Set (None: remove) a dotted path of the object, lists by index."""

    def edit(obj: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = obj
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node.setdefault(p, {})
        if value is None:
            node.pop(last, None)
        else:
            node[last] = copy.deepcopy(value)

    return edit


def _args(change: Callable[[list[str]], list[str]]) -> Edit:
    def edit(job: dict[str, Any]) -> None:
        _c(job)["args"] = change(list(_c(job)["args"]))

    return edit


def _entry(*entry: str) -> Edit:
    """The trainer's arguments after ft_launcher's options replaced by ``entry``."""
    return _args(lambda a: [*a[: a.index("-m", 2)], *entry])


def _launcher_option(option: str, entry: list[str] | None = None) -> Edit:
    """``option`` first among ft_launcher's; ``entry`` (if given) in place of the trainer's."""

    def change(a: list[str]) -> list[str]:
        sep, end = a.index("--") + 1, a.index("-m", 2)
        return [*a[:sep], option, *a[sep:end], *(a[end:] if entry is None else entry)]

    return _args(change)


def _env(*entries: dict[str, Any]) -> Edit:
    def edit(job: dict[str, Any]) -> None:
        _c(job)["env"] = [*_c(job)["env"], *entries]

    return edit


def _volume(volume: dict[str, Any]) -> Edit:
    def edit(job: dict[str, Any]) -> None:
        _pod(job)["volumes"].append({"name": "extra", **volume})
        _c(job)["volumeMounts"].append({"name": "extra", "mountPath": "/extra"})

    return edit


def _init_container(**changes: Any) -> Edit:
    def edit(job: dict[str, Any]) -> None:
        _pod(job)["initContainers"] = [{**copy.deepcopy(_c(job)), "name": "init", **changes}]

    return edit


def _secret(env: str, name: str, key: str = "value") -> dict[str, Any]:
    return {"name": env, "valueFrom": {"secretKeyRef": {"name": name, "key": key}}}


NON_ROOT = "Jobs of nvrx-pipeline run as a non-root user"
PRIVILEGE = "Jobs of nvrx-pipeline allow no privilege escalation and drop every capability"
HOST = "Jobs of nvrx-pipeline share no host namespace or port"
IMAGE = "Jobs of nvrx-pipeline run an image the deployment allows"
ACCOUNT = "Jobs of nvrx-pipeline run as the ServiceAccount nvrx-trainer"
TOKEN = "Jobs of nvrx-pipeline mount no API token"
ENTRY = "Jobs of nvrx-pipeline run the pipeline's own entry points"
ENV = "Jobs of nvrx-pipeline set only the pipeline's own environment variables"
SECRETS = "Jobs of nvrx-pipeline read Secrets only through the declared channel"
VOLUMES = "Jobs of nvrx-pipeline mount only the bundle's volumes"
FR_ACCOUNT = "flow-run Jobs run as the ServiceAccount nvrx-pipeline"
FR_IMAGE = "flow-run Jobs run an image the deployment allows"
FR_NON_ROOT = "flow-run Jobs run as a non-root user"
FR_PRIVILEGE = "flow-run Jobs allow no privilege escalation and drop every capability"
FR_HOST = "flow-run Jobs share no host namespace or port"
FR_COMMAND = "flow-run Jobs run the pool's fixed command"
FR_SECRETS = "flow-run Jobs read a Secret only for the worker's Prefect API credentials"
FR_VOLUMES = "flow-run Jobs mount only the pool's volumes"
OWN = "nvrx-pipeline writes and deletes only its own"
HEADLESS = "a Service of nvrx-pipeline is headless"
OWN_PODS = "a NetworkPolicy of nvrx-pipeline selects only its own Job's pods"
BOTH_WAYS = "a NetworkPolicy of nvrx-pipeline restricts both ingress and egress"
PEERS = "a NetworkPolicy of nvrx-pipeline opens to named peers only"

ANY_SECRET = {"name": "other-team-token", "key": "value"}
HOST_ROOT = {"hostPath": {"path": "/"}}


def _job_rows() -> list[Any]:
    """(id, edit of the rendered training Job, the rule that refuses it)."""
    sc = "spec.template.spec.securityContext"
    csc = "spec.template.spec.containers.0.securityContext"
    rows = [
        # non-root
        ("pod-runAsNonRoot-false", _set(f"{sc}.runAsNonRoot", False), NON_ROOT),
        ("pod-runAsUser-0", _set(f"{sc}.runAsUser", 0), NON_ROOT),
        ("no-pod-securityContext", _set(sc, None), NON_ROOT),
        ("container-runAsUser-0", _set(f"{csc}.runAsUser", 0), NON_ROOT),
        ("container-runAsNonRoot-false", _set(f"{csc}.runAsNonRoot", False), NON_ROOT),
        # privilege and capabilities
        ("allowPrivilegeEscalation", _set(f"{csc}.allowPrivilegeEscalation", True), PRIVILEGE),
        ("privileged", _set(f"{csc}.privileged", True), PRIVILEGE),
        ("add-SYS_ADMIN", _set(f"{csc}.capabilities.add", ["SYS_ADMIN"]), PRIVILEGE),
        ("add-IPC_LOCK", _set(f"{csc}.capabilities.add", ["IPC_LOCK"]), PRIVILEGE),
        ("drop-nothing", _set(f"{csc}.capabilities.drop", []), PRIVILEGE),
        ("privileged-init-container", _init_container(securityContext={"privileged": True}),
         PRIVILEGE),
        # host namespaces
        ("hostNetwork", _set("spec.template.spec.hostNetwork", True), HOST),
        ("hostPID", _set("spec.template.spec.hostPID", True), HOST),
        ("hostIPC", _set("spec.template.spec.hostIPC", True), HOST),
        ("hostPort", _set("spec.template.spec.containers.0.ports.0.hostPort", 29500), HOST),
        # image and account
        ("other-image", _set("spec.template.spec.containers.0.image", "evil/img:1"), IMAGE),
        ("other-image-in-init", _init_container(image="evil/img:1"), IMAGE),
        ("other-account", _set("spec.template.spec.serviceAccountName", "nvrx-pipeline"),
         ACCOUNT),
        ("api-token", _set("spec.template.spec.automountServiceAccountToken", True), TOKEN),
        # command and args: only the pipeline's entry points
        ("shell", _set("spec.template.spec.containers.0.command", ["sh", "-c", "env"]), ENTRY),
        ("image-entrypoint", _set("spec.template.spec.containers.0.command", None), ENTRY),
        ("python-c", _args(lambda a: ["-c", "import os; print(os.environ)"]), ENTRY),
        ("other-module", _entry("-m", "http.server"), ENTRY),
        ("no-python", _launcher_option("--no-python", entry=["sh", "-c", "env"]), ENTRY),
        ("config-from-fsx", _entry("-m", "trainer", "--config=/fsx/runs/evil.json"), ENTRY),
        ("script-elsewhere", _entry("/fsx/runs/evil.py"), ENTRY),
        ("script-dot-dot", _entry("/opt/nvrx-pipeline/examples/../../../fsx/evil.py"), ENTRY),
        ("unknown-launcher-option", _launcher_option("--run-path=x"), ENTRY),
        # an allowed script hidden in an option's value, the real entry after it
        ("smuggled-entry", _entry(f"--rdzv-id=x {SCRIPT}", "/fsx/evil.py"), ENTRY),
        ("agent-unknown-option", _args(lambda a: [*a[:2], "--exec", "sh", *a[2:]]), ENTRY),
        # python -m puts the working directory first on sys.path: /fsx/x/trainer/agent.py
        ("working-dir", _set("spec.template.spec.containers.0.workingDir", "/fsx/x"), ENTRY),
        ("postStart-exec", _set("spec.template.spec.containers.0.lifecycle",
                                {"postStart": {"exec": {"command": ["sh", "-c", "env"]}}}), ENTRY),
        ("exec-probe", _set("spec.template.spec.containers.0.livenessProbe",
                            {"exec": {"command": ["sh", "-c", "env"]}}), ENTRY),
        # environment that changes what runs
        ("PYTHONPATH", _env({"name": "PYTHONPATH", "value": "/fsx/evil"}), ENV),
        ("LD_PRELOAD", _env({"name": "LD_PRELOAD", "value": "/fsx/evil.so"}), ENV),
        # Secrets outside the declared channel
        ("worker-api-key", _env(_secret("X", "prefect-api-key", key="key")), SECRETS),
        ("undeclared-secret", _env({"name": "TOKEN", "valueFrom": {"secretKeyRef": ANY_SECRET}}),
         SECRETS),
        ("secret-as-reserved-name", _env(_secret("PYTHONSTARTUP", "hf-token")), SECRETS),
        ("secret-as-PATH", _env(_secret("PATH", "hf-token")), SECRETS),
        ("envFrom-secret", _set("spec.template.spec.containers.0.envFrom",
                                [{"secretRef": {"name": "hf-token"}}]), SECRETS),
        ("configMap-value", _env({"name": "X", "valueFrom": {
            "configMapKeyRef": {"name": "aws-auth", "key": "mapRoles"}}}), SECRETS),
        # volumes the bundle does not use
        ("hostPath", _volume(HOST_ROOT), VOLUMES),
        ("secret-volume", _volume({"secret": {"secretName": "hf-token"}}), VOLUMES),
        ("other-claim", _volume({"persistentVolumeClaim": {"claimName": "team-b"}}), VOLUMES),
        ("other-configmap", _volume({"configMap": {"name": "aws-auth"}}), VOLUMES),
        ("projected-token", _volume({"projected": {"sources": [
            {"serviceAccountToken": {"path": "token"}}]}}), VOLUMES),
        ("csi-inline", _volume({"csi": {"driver": "fsx.csi.aws.com"}}), VOLUMES),
        # the FSx claim over the image's code: the allowed command would run what it holds
        ("fsx-over-the-code", _set("spec.template.spec.containers.0.volumeMounts.0.mountPath",
                                   "/opt/nvrx-pipeline"), VOLUMES),
    ]  # fmt: skip
    return [pytest.param(edit, rule, id=name) for name, edit, rule in rows]


def _denied(policy: dict[str, Any], obj: Any, user: str, operation: str = "CREATE",
            old: Any = None) -> list[str]:  # fmt: skip
    return admit(policy, operation, obj, old, user=user)


@pytest.mark.parametrize(("edit", "rule"), _job_rows())
def test_a_widened_pipeline_job_is_refused_by_its_rule(edit: Edit, rule: str) -> None:
    job = training_job()
    edit(job)
    denied = _denied(JOBS, job, PIPELINE_USER)
    assert [d for d in denied if d.startswith(rule)] == denied and denied, denied
    # UPDATE too: a Job patched wider is refused like a new one
    assert _denied(JOBS, job, PIPELINE_USER, "UPDATE", training_job()) == denied


@pytest.mark.parametrize(
    ("edit", "rule"),
    [
        pytest.param(_set("spec.template.spec.containers.0.command",
                          ["python", "-c", "print(open('/fsx/x').read())"]), ENTRY, id="python-c"),
        pytest.param(_set("spec.template.spec.containers.0.command",
                          ["python", "-m", "trainer.data", "--verify", "--out", "/fsx/d",
                           "--readers", "8", "--manifest-sha256", "ab" * 32, "--then", "x"]),
                     ENTRY, id="extra-argument"),
        pytest.param(_set("spec.template.spec.securityContext.runAsUser", 0), NON_ROOT,
                     id="root"),
        pytest.param(_volume(HOST_ROOT), VOLUMES, id="hostPath"),
    ],
)  # fmt: skip
def test_a_widened_hydration_job_is_refused(edit: Edit, rule: str) -> None:
    job = hydration()
    edit(job)
    denied = _denied(JOBS, job, PIPELINE_USER)
    assert denied and all(d.startswith(rule) for d in denied), denied


def _flow_run_rows() -> list[Any]:
    csc = "spec.template.spec.containers.0.securityContext"
    rows = [
        ("other-image", _set("spec.template.spec.containers.0.image", "evil/img:1"), FR_IMAGE),
        ("shell", _set("spec.template.spec.containers.0.command", ["sh", "-c", "env"]),
         FR_COMMAND),
        ("other-args", _set("spec.template.spec.containers.0.args",
                            ["python", "-c", "import boto3"]), FR_COMMAND),
        ("no-command", _set("spec.template.spec.containers.0.command", None), FR_COMMAND),
        ("root", _set("spec.template.spec.securityContext.runAsUser", 0), FR_NON_ROOT),
        ("privileged", _set(f"{csc}.privileged", True), FR_PRIVILEGE),
        ("hostNetwork", _set("spec.template.spec.hostNetwork", True), FR_HOST),
        ("as-the-trainer", _set("spec.template.spec.serviceAccountName", "nvrx-trainer"),
         FR_ACCOUNT),
        ("hostPath", _volume(HOST_ROOT), FR_VOLUMES),
        ("configmap-volume", _volume({"configMap": {"name": "aws-auth"}}), FR_VOLUMES),
        ("fsx-over-the-code", _set("spec.template.spec.containers.0.volumeMounts.0.mountPath",
                                   "/opt/nvrx-pipeline"), FR_VOLUMES),
        ("working-dir", _set("spec.template.spec.containers.0.workingDir", "/fsx/x"), FR_COMMAND),
        ("postStart-exec", _set("spec.template.spec.containers.0.lifecycle",
                                {"postStart": {"exec": {"command": ["sh", "-c", "env"]}}}),
         FR_COMMAND),
        ("envFrom-secret", _set("spec.template.spec.containers.0.envFrom",
                                [{"secretRef": {"name": "hf-token"}}]), FR_SECRETS),
        ("secret-in-env", _env(_secret("HF_TOKEN", "hf-token")), FR_SECRETS),
    ]  # fmt: skip
    return [pytest.param(edit, rule, id=name) for name, edit, rule in rows]


@pytest.mark.parametrize(("edit", "rule"), _flow_run_rows())
def test_a_widened_flow_run_job_is_refused_by_its_rule(edit: Edit, rule: str) -> None:
    job = flow_run_job()
    edit(job)
    denied = _denied(FLOW_RUNS, job, WORKER_USER)
    assert [d for d in denied if d.startswith(rule)] == denied and denied, denied


def test_a_job_as_the_pipelines_account_is_a_flow_run_whoever_creates_it() -> None:
    """Any Job whose pods would hold nvrx-pipeline's AWS role is held to the flow-run shape, a
    person's kubectl included; the worker cannot start a training-shaped Job either."""
    job = flow_run_job()
    _c(job)["image"] = "evil/img:1"
    assert _denied(FLOW_RUNS, job, "kubernetes-admin") == [FR_IMAGE + " (NVRX_ALLOWED_IMAGES)"]
    assert FR_ACCOUNT in _denied(FLOW_RUNS, training_job(), WORKER_USER)
    # a person's own Job under another account is not these policies' business
    other = training_job()
    assert [_denied(p, other, "kubernetes-admin") for p in POLICIES.values()] == [[], [], []]


def _network_rows() -> list[Any]:
    b = bundle()
    svc, netpol, config = b["Service"], b["NetworkPolicy"], b["ConfigMap"]
    deny_all, metrics_in = _load_all("network-policy.yaml")

    def peers(direction: str, rule: dict[str, Any]) -> dict[str, Any]:
        out = copy.deepcopy(netpol)
        out["spec"]["ingress" if direction == "from" else "egress"].append(rule)
        return out

    def with_(obj: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
        out = copy.deepcopy(obj)
        _set(path, value)(out)
        return out

    rows = [
        # (id, operation, object, old object, rule)
        ("service-LoadBalancer", "CREATE", with_(svc, "spec.type", "LoadBalancer"), None,
         HEADLESS),
        ("service-clusterIP", "CREATE", with_(svc, "spec.clusterIP", None), None, HEADLESS),
        ("service-externalIPs", "CREATE", with_(svc, "spec.externalIPs", ["1.2.3.4"]), None,
         HEADLESS),
        ("service-other-pods", "CREATE", with_(svc, "spec.selector", {"app": "db"}), None,
         HEADLESS),
        ("policy-all-pods", "CREATE", with_(netpol, "spec.podSelector", {}), None, OWN_PODS),
        ("policy-other-pods", "UPDATE",
         with_(netpol, "spec.podSelector.matchLabels", {"app": "db"}), netpol, OWN_PODS),
        ("ingress-only", "CREATE", with_(netpol, "spec.policyTypes", ["Ingress"]), None,
         BOTH_WAYS),
        ("ingress-from-anyone", "CREATE", peers("from", {"ports": [{"port": 22}]}), None, PEERS),
        ("ingress-from-empty", "CREATE", peers("from", {"from": []}), None, PEERS),
        ("egress-to-anyone", "CREATE", peers("to", {}), None, PEERS),
        ("egress-0.0.0.0/0", "CREATE", peers("to", {"to": [{"ipBlock": {"cidr": "0.0.0.0/0"}}]}),
         None, PEERS),
        ("egress-::/0", "CREATE", peers("to", {"to": [{"ipBlock": {"cidr": "::/0"}}]}), None,
         PEERS),
        ("ingress-0.0.0.0/0-except", "CREATE", peers("from", {"from": [{"ipBlock": {
            "cidr": "0.0.0.0/0", "except": ["10.0.0.0/8"]}}]}), None, PEERS),
        ("egress-to-the-vpc", "CREATE", peers("to", {"to": [{"ipBlock": {"cidr": "10.0.0.0/8"}}]}),
         None, PEERS),
        ("egress-every-namespace", "CREATE", peers("to", {"to": [{"namespaceSelector": {}}]}),
         None, PEERS),
        ("ingress-every-pod-here", "CREATE", peers("from", {"from": [{"podSelector": {}}]}), None,
         PEERS),
        ("egress-namespaces-by-label", "CREATE",
         peers("to", {"to": [{"namespaceSelector": {"matchLabels": {"team": "x"}}}]}), None,
         PEERS),
        ("delete-default-deny", "DELETE", None, deny_all, OWN),
        ("delete-metrics-policy", "DELETE", None, metrics_in, OWN),
        ("widen-default-deny", "UPDATE", with_(deny_all, "spec.ingress", [{}]), deny_all, OWN),
        ("unlabelled-policy", "CREATE", with_(netpol, "metadata.labels", {"app": "x"}), None, OWN),
        ("delete-aws-auth", "DELETE", None, with_(config, "metadata.name", "aws-auth"), OWN),
        ("unlabel-configmap", "UPDATE", with_(config, "metadata.labels", {}), config, OWN),
    ]  # fmt: skip
    return [pytest.param(op, obj, old, rule, id=name) for name, op, obj, old, rule in rows]


@pytest.mark.parametrize(("operation", "obj", "old", "rule"), _network_rows())
def test_a_widened_network_object_is_refused_by_its_rule(
    operation: str, obj: Any, old: Any, rule: str
) -> None:
    denied = _denied(NETWORK, obj, PIPELINE_USER, operation, old)
    assert any(d.startswith(rule) for d in denied), denied


def test_another_identity_is_not_the_network_policys_business() -> None:
    deny_all, _ = _load_all("network-policy.yaml")
    assert _denied(NETWORK, None, "kubernetes-admin", "DELETE", deny_all) == []


# --- the policies' lists are the renderer's ------------------------------------------------------


def _jobs() -> list[dict[str, Any]]:
    return [training_job(s) for s in SHAPES] + [hydration()]


def _launcher_options(args: list[str]) -> set[str]:
    """The ft_launcher options of a rendered trainer.agent command (between `--` and the
    trainer's own arguments)."""
    out = set()
    for a in args[args.index("--") + 1 :]:
        m = re.fullmatch(r"--([a-z-]+)=.*", a)
        if not m:
            break
        out.add(m.group(1))
    return out


def test_the_policies_lists_are_what_the_renderer_emits() -> None:
    training = [training_job(s) for s in SHAPES]
    options = set().union(*(_launcher_options(_c(j)["args"]) for j in training))
    assert set(constant(JOBS, "launcherOptions")) == options
    plain_env = {e["name"] for j in training for e in _c(j)["env"] if "value" in e}
    assert set(constant(JOBS, "pipelineEnv")) == plain_env
    assert constant(JOBS, "reservedPrefixes") == list(declared.RESERVED_PREFIXES)
    assert set(constant(JOBS, "reservedNames")) == declared.RESERVED
    text = " ".join(v["expression"] for v in JOBS["spec"]["validations"])
    assert f'secretKeyRef.key == "{declared.SECRET_KEY}"' in text
    trainer_entry = next(v for v in JOBS["spec"]["variables"] if v["name"] == "trainingEntry")
    assert f"--config={CONFIG_MOUNT}/" in trainer_entry["expression"]

    def kinds(jobs: list[dict[str, Any]]) -> set[str]:
        return {k for j in jobs for v in _pod(j).get("volumes", []) for k in v if k != "name"}

    def allowed(policy: dict[str, Any]) -> set[str]:
        (rule,) = [v for v in policy["spec"]["validations"] if "volumes" in v["expression"]]
        return set(re.findall(r"has\(v\.(\w+)\)", rule["expression"]))

    assert allowed(JOBS) == kinds(_jobs()) == {"persistentVolumeClaim", "emptyDir", "configMap"}
    assert allowed(FLOW_RUNS) == kinds([flow_run_job()]) == {"persistentVolumeClaim", "emptyDir"}

    def mounts(jobs: list[dict[str, Any]]) -> set[str]:
        containers = [c for j in jobs for c in _pod(j)["containers"]]
        return {m["mountPath"] for c in containers for m in c["volumeMounts"]}

    assert set(constant(JOBS, "mounts")) == mounts(_jobs())
    assert set(constant(FLOW_RUNS, "mounts")) == mounts([flow_run_job()])
    (fr,) = flow_run_job()["spec"]["template"]["spec"]["containers"]
    command = next(v for v in FLOW_RUNS["spec"]["validations"] if "c.command" in v["expression"])
    assert (
        f"c.command == {fr['command']}".replace("'", '"') in command["expression"]
        and f"c.args == {fr['args']}".replace("'", '"') in command["expression"]
    )


def test_each_rule_is_held_by_a_row() -> None:
    """Every validation of the Job and network policies refuses at least one row here."""
    rules = {r for p in _job_rows() + _flow_run_rows() for r in p.values[1:]}
    rules |= {p.values[3] for p in _network_rows()}
    for policy in POLICIES.values():
        for v in policy["spec"]["validations"]:
            message = " ".join(v["message"].split())
            assert any(message.startswith(r) for r in rules), message
