"""Whoever may start a run, hostile: each job variable and run form below is what a new user tried
against the shipped pools and deployments (issue 43), with the refusal it must get (the field
named) and, where cheap, the proof that nothing was touched. Unit-level: Prefect's own job
variable validation and templating, the form's validation as ``resolve_params`` runs it under a
deployment, the run binding, the capacity-resume's templates; no server.

- Job variables: the pools expose none that reaches the flow-run's environment, command,
  namespace or the worker's cluster credentials; the Prefect server refuses one (the variables
  schema forbids any other), and one that got past it would fill no placeholder. Labels, which
  the worker copies onto the flow-run pod, only under user.nvrx.io/: no key a selector reads.
- Run forms: every endpoint, bucket, state directory, secret and drill is the deployment's own
  or on its list, refused at the form otherwise (before preflight: nothing created, nothing
  sent).
- Run ids: a deployment's run continues only the runs its deployment created.
- The capacity-resume: what it copies from an event is validated again, as any run's form.
"""

from __future__ import annotations

import json
import os
import re
import socket
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from flows.models import PipelineParams, deployment_scope
from flows.parameters import deep_merge
from tasks.deployment_policy import EVERY_LIST
from tasks.ownership import binding
from tests.helpers import REPO
from trainer.rundir import Layout

EKS_TEMPLATE = REPO / "deploy" / "eks" / "work-pool-template.json"
PROCESS_TEMPLATE = REPO / "deploy" / "work-pool-template.json"
KUBECONFIG_EXEC = {
    "config": {
        "apiVersion": "v1",
        "users": [{"name": "u", "user": {"exec": {"command": "sh", "args": ["-c", "id"]}}}],
    },
    "context_name": "x",
}


# --- job variables ---------------------------------------------------------------------------

# (pool template, the job variables a deployment or a flow run sets, the variable named)
JOB_VARIABLES = [
    (EKS_TEMPLATE, {"env": {"PREFECT_API_URL": "http://127.0.0.9:9/api"}}, "env"),
    (EKS_TEMPLATE, {"env.PREFECT_API_URL": "http://127.0.0.9:9/api"}, "env.PREFECT_API_URL"),
    (EKS_TEMPLATE, {"env": {"NVRX_ALLOWED_IMAGES": "attacker/image:1"}}, "env"),
    (EKS_TEMPLATE, {"cluster_config": KUBECONFIG_EXEC}, "cluster_config"),
    (EKS_TEMPLATE, {"namespace": "kube-system"}, "namespace"),
    (EKS_TEMPLATE, {"command": "sh -c id"}, "command"),
    # annotations reach the pod (prefect-kubernetes copies the Job's onto its pod template), where
    # controllers act on them: a secrets injector, a service mesh's sidecar, the autoscaler
    (EKS_TEMPLATE, {"annotations": {"vault.hashicorp.com/agent-inject": "true"}}, "annotations"),
    (EKS_TEMPLATE, {"annotations": {"sidecar.istio.io/inject": "true"}}, "annotations"),
    (EKS_TEMPLATE, {"annotations": {"cluster-autoscaler.kubernetes.io/safe-to-evict": "false"}},
     "annotations"),
    (PROCESS_TEMPLATE, {"command": "sh -c id"}, "command"),
    (PROCESS_TEMPLATE, {"env": {"PREFECT_API_URL": "http://127.0.0.9:9/api"}}, "env"),
    (PROCESS_TEMPLATE, {"working_dir": "/"}, "working_dir"),
]  # fmt: skip


def _template(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def _server_validates(template: dict[str, Any], variables: dict[str, Any]) -> None:
    """What the Prefect server runs on a deployment's and a flow run's job variables
    (prefect.server.api.validation._validate_work_pool_job_variables)."""
    from prefect.utilities.schema_tools import validate

    validate(
        variables,
        template["variables"],
        raise_on_error=True,
        preprocess=True,
        ignore_required=True,
        allow_none_with_default=True,
    )


def _defaults(template: dict[str, Any]) -> dict[str, Any]:
    props = template["variables"]["properties"]
    return {k: v["default"] for k, v in props.items() if "default" in v}


@pytest.mark.parametrize(
    ("path", "variables", "named"),
    JOB_VARIABLES,
    ids=[f"{p.parent.name}-{n}" for p, _, n in JOB_VARIABLES],
)
def test_a_widening_job_variable_is_refused_and_would_change_nothing(path, variables, named):
    from prefect.utilities.schema_tools import ValidationError as SchemaError
    from prefect.utilities.templating import apply_values

    template = _template(path)
    with pytest.raises(SchemaError, match=f"'{named}' was unexpected"):
        _server_validates(template, variables)
    # Past the server (a pool edited, a deployment stored before): the worker fills the
    # template with them (BaseJobConfiguration.from_template_and_values), and nothing changes.
    config = template["job_configuration"]
    plain = apply_values(config, _defaults(template))
    assert apply_values(config, {**_defaults(template), **variables}) == plain
    # ... and no fixed `env` for the worker to merge a job variable's env into.
    assert not {"env", "cluster_config", "command", "working_dir", "annotations"} & set(config)


def test_the_process_pool_runs_the_engine_in_the_workers_environment():
    """A process pool made from the template runs Prefect's own engine command, with the
    worker's environment: a run sets neither."""
    from prefect.utilities.templating import apply_values
    from prefect.workers.process import ProcessJobConfiguration

    template = _template(PROCESS_TEMPLATE)
    hostile = {"command": "sh -c id", "env": {"PREFECT_API_URL": "x"}, "working_dir": "/"}
    cfg = ProcessJobConfiguration(
        **apply_values(template["job_configuration"], {**_defaults(template), **hostile})
    )
    assert cfg.command is None and cfg.env == {} and cfg.working_dir is None
    # deploy/prefect.yaml creates the pool from this template
    assert (
        "--base-job-template deploy/work-pool-template.json"
        in (REPO / "deploy" / "prefect.yaml").read_text()
    )


def test_every_shipped_variable_is_harmless():
    """What the pools still let a deployment set: names, labels (on EKS only under
    user.nvrx.io/: the tests below), timeouts, resources."""
    from prefect.utilities.schema_tools import is_valid_schema

    # the check the Prefect server makes of the schema itself before validating with it
    is_valid_schema(_template(EKS_TEMPLATE)["variables"], preprocess=False)
    eks = set(_template(EKS_TEMPLATE)["variables"]["properties"])
    assert eks == {
        "name", "labels", "image_pull_policy", "backoff_limit",
        "finished_job_ttl", "job_watch_timeout_seconds", "pod_watch_timeout_seconds",
        "stream_output", "cpu_request", "cpu_limit", "memory_request", "memory_limit",
    }  # fmt: skip
    assert set(_template(PROCESS_TEMPLATE)["variables"]["properties"]) == {
        "name",
        "labels",
        "stream_output",
    }


# --- labels: the one map a run still sets on the flow-run pod -------------------------------------
# prefect-kubernetes (0.8.0, KubernetesWorkerJobConfiguration.prepare_for_flow_run) merges the
# `labels` job variable over its own prefect.io/* and app.kubernetes.io/* labels, slugifies each
# key, and copies the result onto the pod template over the template's own labels
# (_propagate_labels_to_pod). So a label is a pod label: the pool allows keys under
# user.nvrx.io/ only, which no selector, controller or the worker itself reads.
USER_LABEL = "user.nvrx.io/"

# (labels a deployment or a flow run sets, what the refusal says)
HOSTILE_LABELS = [
    # the flow-run pods' own selector (allow-metrics-scrape, the flow-run PodMonitor): set or
    # cleared, the pod leaves or joins them
    ({"nvrx.io/component": "trainer"}, "'nvrx.io/component' does not match"),
    # what delete_run_jobs and reattach list a run's Jobs by: another run's id would make this
    # Job one of that run's (deleted by it, or watched as its training)
    ({"nvrx.io/run-id": "team-b-run"}, "'nvrx.io/run-id' does not match"),
    ({"nvrx.io/attempt": "1"}, "'nvrx.io/attempt' does not match"),
    # the per-Job NetworkPolicy's peers (admits the Job's own pods to c10d/TCPStore/NCCL)
    ({"batch.kubernetes.io/job-name": "nvrx-team-b-a1"}, "'batch.kubernetes.io/job-name'"),
    ({"job-name": "nvrx-team-b-a1"}, "'job-name' does not match"),
    # the trainer PodMonitor: scraped as a training pod, its podTargetLabels another run's
    ({"app.kubernetes.io/component": "trainer"}, "'app.kubernetes.io/component'"),
    # Kueue would queue (suspend, preempt) the flow-run Job in the training queue
    ({"kueue.x-k8s.io/queue-name": "nvrx-training"}, "'kueue.x-k8s.io/queue-name'"),
    # the worker's observer maps Jobs to flow runs by it: when this Job fails or is deleted,
    # the other flow run is marked Crashed (prefect_kubernetes.observer)
    ({"prefect.io/flow-run-id": "0b5e-other-run"}, "'prefect.io/flow-run-id'"),
    # slugified by the worker onto nvrx.io/component: a deny-list of exact keys would miss them
    ({"nvrx.io/component!": "x"}, "'nvrx.io/component!' does not match"),
    ({"_nvrx.io/component": "x"}, "'_nvrx.io/component' does not match"),
    # the user prefix, but not a key Kubernetes accepts as it is
    ({USER_LABEL: "x"}, f"'{USER_LABEL}' does not match"),
    ({USER_LABEL + "a/b": "x"}, f"'{USER_LABEL}a/b' does not match"),
    ({USER_LABEL + "x" * 64: "x"}, "does not match"),
    # bounded: values as Kubernetes takes them, at most 8 labels
    ({USER_LABEL + "team": "x" * 64}, "is too long"),
    ({USER_LABEL + "team": "a b"}, "'a b' does not match"),
    ({f"{USER_LABEL}k{i}": "v" for i in range(9)}, "has too many properties"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("labels", "refusal"), HOSTILE_LABELS, ids=[next(iter(labels)) for labels, _ in HOSTILE_LABELS]
)
def test_a_label_outside_the_users_prefix_is_refused(labels, refusal):
    from prefect.utilities.schema_tools import ValidationError as SchemaError

    with pytest.raises(SchemaError, match="field .labels") as refused:
        _server_validates(_template(EKS_TEMPLATE), {"labels": labels})
    assert refusal in str(refused.value)


def _keys_read(node: Any) -> set[str]:
    """Every label key in ``node`` that a selector reads or an object carries: matchLabels,
    labels, a Service's selector, matchExpressions, podTargetLabels, a CEL ``"key" in``."""
    keys: set[str] = set()
    if isinstance(node, list):
        for item in node:
            keys |= _keys_read(item)
    elif isinstance(node, dict):
        for k, v in node.items():
            if k in ("matchLabels", "labels", "selector") and isinstance(v, dict):
                keys |= {key for key, val in v.items() if isinstance(val, str)}
            elif k == "matchExpressions":
                keys |= {e["key"] for e in v}
            elif k == "podTargetLabels":
                keys |= set(v)
            keys |= _keys_read(v)
    elif isinstance(node, str):
        keys |= set(re.findall(r'"([\w.-]+/[\w.-]+)" in ', node))
    return keys


def _selector_keys() -> set[str]:
    """The label keys of the deploy tree, the pool's pod, the renderer's objects, the Job
    controller and the Prefect worker."""
    from flows.context import eks_train_config
    from tasks.backends.eks.render import render_all

    keys = _keys_read(_template(EKS_TEMPLATE)["job_configuration"])
    for path in sorted((REPO / "deploy" / "eks").glob("*.yaml")):
        keys |= _keys_read(list(yaml.safe_load_all(path.read_text())))
    params = PipelineParams(backend="eks", run_id="r", global_batch=16)
    keys |= _keys_read(
        render_all(eks_train_config(params, "r"), run_id="r", attempt=1, nodes=2, eks=params.eks)
    )
    job_controller = {"job-name", "controller-uid", "batch.kubernetes.io/controller-uid"}
    # prefect-kubernetes 0.8.0's own (KubernetesWorkerJobConfiguration._base_*_labels)
    worker = {"prefect.io/flow-run-id", "prefect.io/deployment-id", "prefect.io/work-pool-id"}
    worker |= {f"app.kubernetes.io/{k}" for k in ("name", "managed-by", "part-of", "version")}
    return keys | job_controller | worker


def test_no_allowed_label_changes_a_selector_match_or_the_pod():
    """The most a run may set (8 labels, the longest keys and values) validates, and leaves every
    label any selector reads and the whole pod spec as the pool's defaults make them."""
    from prefect.utilities.schema_tools import ValidationError as SchemaError
    from prefect.utilities.templating import apply_values

    template = _template(EKS_TEMPLATE)
    most = {f"{USER_LABEL}{i}{'t' * 62}": "v" * 63 for i in range(8)}
    _server_validates(template, {"labels": most})
    read = _selector_keys()
    assert {"nvrx.io/component", "nvrx.io/run-id", "batch.kubernetes.io/job-name"} <= read
    for key in sorted(read):
        assert not key.startswith(USER_LABEL), f"{key}: a selector reads a run's label"
        with pytest.raises(SchemaError):
            _server_validates(template, {"labels": {key: "x"}})

    def job(variables: dict[str, Any]) -> dict[str, Any]:
        config = apply_values(template["job_configuration"], {**_defaults(template), **variables})
        job = config["job_manifest"]
        # what the worker does with them (_slugify_labels, _propagate_labels_to_pod)
        meta = job["spec"]["template"]["metadata"]
        meta["labels"] = {**meta["labels"], **config.get("labels", {})}
        return job

    plain, tagged = job({}), job({"labels": most})
    assert tagged["spec"]["template"]["spec"] == plain["spec"]["template"]["spec"]
    assert {k: v for k, v in tagged["spec"].items() if k != "template"} == {
        k: v for k, v in plain["spec"].items() if k != "template"
    }
    for labels in (tagged["metadata"]["labels"], tagged["spec"]["template"]["metadata"]["labels"]):
        assert set(labels) - set(most) <= read
    plain_pod = plain["spec"]["template"]["metadata"]["labels"]
    tagged_pod = tagged["spec"]["template"]["metadata"]["labels"]
    assert {k: tagged_pod.get(k) for k in read} == {k: plain_pod.get(k) for k in read}
    # and nothing but labels is a run's: no annotation anywhere
    assert "annotations" not in tagged["metadata"]
    assert "annotations" not in tagged["spec"]["template"]["metadata"]


# --- run forms -----------------------------------------------------------------------------------


def pool_env() -> dict[str, str]:
    """The allow-lists the EKS pool fixes in its flow-run pods."""
    pod = _template(EKS_TEMPLATE)["job_configuration"]["job_manifest"]["spec"]["template"]
    env = {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"]}
    assert set(EVERY_LIST) <= set(env), set(EVERY_LIST) - set(env)
    return env


def _deployment(path: Path) -> dict[str, Any]:
    return dict(yaml.safe_load(path.read_text())["deployments"][0]["parameters"])


EKS_DEPLOYMENT = _deployment(REPO / "deploy" / "eks" / "prefect.yaml")
LOCAL_DEPLOYMENT = _deployment(REPO / "deploy" / "prefect.yaml")
EKS_EXAMPLE = yaml.safe_load((REPO / "examples" / "params" / "eks.yaml").read_text())

# (where: the deployment's parameters, or None for a run outside any deployment; the form;
#  the field the refusal names)
HOSTILE_FORMS = [
    # the issue's own: the shipped example under the pool's lists, before any preflight
    (None, {**EKS_EXAMPLE, "s3_endpoint": "http://127.0.0.9:9"}, "s3_endpoint"),
    (None, {**EKS_EXAMPLE, "export": {"bucket": "other-team-ckpts"}}, "export.bucket"),
    (None, {**EKS_EXAMPLE, "dataset": {"bucket": "other-team-data", "prefix": "x"}},
     "dataset.bucket"),
    # from the EKS deployment, in its pool
    (EKS_DEPLOYMENT, {"s3_endpoint": "http://127.0.0.9:9"}, "s3_endpoint"),
    (EKS_DEPLOYMENT, {"export": {"bucket": "other-team-ckpts"}}, "export.bucket"),
    (EKS_DEPLOYMENT, {"dataset": {"bucket": "other-team-data"}}, "dataset.bucket"),
    (EKS_DEPLOYMENT, {"secrets": {"HF_TOKEN": "other-team-token"}}, "secrets"),
    (EKS_DEPLOYMENT, {"drills": {"faults": ["node-loss@step=9,node=1"]}}, "drills.faults"),
    (EKS_DEPLOYMENT, {"eks": {"monitoring_namespace": "default"}}, "eks.monitoring_namespace"),
    (EKS_DEPLOYMENT, {"state_dir": "/tmp/elsewhere"}, "state_dir"),
    # from the local deployments (no lists set: the deployment's own values only)
    (LOCAL_DEPLOYMENT, {"s3_endpoint": "http://127.0.0.9:9"}, "s3_endpoint"),
    (LOCAL_DEPLOYMENT, {"s3_endpoint": None}, "s3_endpoint"),  # AWS, with the server's creds
    (LOCAL_DEPLOYMENT, {"export": {"bucket": "other-team-ckpts"}}, "export.bucket"),
    (LOCAL_DEPLOYMENT, {"workload": "llama-tiny",
                        "workload_options": {"init_weights": "s3://other-team-data/w"}},
     "workload_options.init_weights"),
    (LOCAL_DEPLOYMENT, {"state_dir": "/tmp/other-user/.state"}, "state_dir"),
    (LOCAL_DEPLOYMENT, {"secrets": {"HF_TOKEN": "hf-token"}}, "secrets"),
    (LOCAL_DEPLOYMENT, {"drills": {"faults": ["sigkill@step=3"]}}, "drills.faults"),
    (LOCAL_DEPLOYMENT, {"drills": {"faults": ["corrupt-checkpoint@step=5"]}}, "drills.faults"),
]  # fmt: skip


def validate_form(
    deployment: dict[str, Any] | None, form: dict[str, Any], dep_id: str = "dep-1"
) -> PipelineParams:
    """What ``flows.pipeline.resolve_params`` does with a run of ``deployment``: the form over
    the deployment's parameters, validated whole, under that deployment."""
    if deployment is None:
        return PipelineParams.model_validate(form)
    scope = deployment_scope(dep_id, f"nvrx-training-pipeline/{dep_id}", deployment)
    return PipelineParams.model_validate(
        deep_merge(deployment, form), context={"deployment": scope}
    )


@pytest.fixture
def eks_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in pool_env().items():
        monkeypatch.setenv(name, value)


def _where(deployment: dict[str, Any] | None) -> str:
    return {None: "cli", id(EKS_DEPLOYMENT): "eks", id(LOCAL_DEPLOYMENT): "local"}.get(
        None if deployment is None else id(deployment), "?"
    )


@pytest.mark.parametrize(
    ("deployment", "form", "named"),
    HOSTILE_FORMS,
    ids=[f"{_where(d)}-{n}-{i}" for i, (d, _, n) in enumerate(HOSTILE_FORMS)],
)
def test_a_hostile_run_form_is_refused_at_the_form_naming_the_field(
    deployment, form, named, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
):
    if deployment is not LOCAL_DEPLOYMENT:
        for name, value in pool_env().items():
            monkeypatch.setenv(name, value)
    monkeypatch.chdir(tmp_path)  # a relative state_dir would be made here
    # The hostile endpoint's stand-in listens: a request to it would show as a connection.
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.setblocking(False)
        endpoint = f"http://127.0.0.1:{listener.getsockname()[1]}"
        form = json.loads(json.dumps(form).replace("http://127.0.0.9:9", endpoint))
        with pytest.raises(ValidationError) as err:
            validate_form(deployment, form)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing was sent
    msg = str(err.value)
    assert f"{named}:" in msg and "not allowed by this deployment" in msg, msg
    assert "NVRX_ALLOWED_" in msg  # the list that would allow it
    assert list(tmp_path.iterdir()) == []  # no state dir, no run root


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("s3_endpoint=http://127.0.0.9:9", "s3_endpoint"),
        ("export.bucket=other-team", "export.bucket"),
    ],
)
def test_the_shipped_eks_example_with_another_endpoint_or_bucket_exits_2(
    override, named, eks_pool, capsys
):
    """The issue's own case through the command line: refused at validation (exit 2), before
    any preflight; the example itself renders."""
    from flows.cli import main
    from flows.cli.common import EXIT_USAGE

    example = str(REPO / "examples" / "params" / "eks.yaml")
    argv = ["render-k8s", "--config", example, "--set", "run_id=r1"]
    assert main([*argv, "--set", override]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert named in err and "NVRX_ALLOWED_" in err, err
    assert main(argv) == 0


ALLOWED_FORMS = [
    (None, EKS_EXAMPLE),
    (EKS_DEPLOYMENT, {}),
    (EKS_DEPLOYMENT, {"steps": 50, "eks": {"queue": "nvrx-training"}}),
    (LOCAL_DEPLOYMENT, {}),
    (LOCAL_DEPLOYMENT, {"s3_endpoint": "http://127.0.0.1:8333/"}),  # its own, written longer
    (LOCAL_DEPLOYMENT, {"state_dir": "./.state"}),
]


@pytest.mark.parametrize(("deployment", "form"), ALLOWED_FORMS)
def test_what_the_deployment_names_itself_passes(deployment, form, eks_pool, monkeypatch):
    if deployment is LOCAL_DEPLOYMENT:
        for name in EVERY_LIST:
            monkeypatch.delenv(name, raising=False)
    validate_form(deployment, form)


def test_the_deployments_list_lets_a_run_choose_among_allowed_values(monkeypatch, eks_pool):
    monkeypatch.setenv("NVRX_ALLOWED_EXPORT_BUCKETS", "nvrx-checkpoints-111122223333,team-b")
    monkeypatch.setenv("NVRX_ALLOWED_SECRETS", "hf-token")
    monkeypatch.setenv("NVRX_ALLOWED_DRILLS", "node-loss")
    p = validate_form(
        EKS_DEPLOYMENT,
        {
            "export": {"bucket": "team-b"},
            "secrets": {"HF_TOKEN": "hf-token"},
            "drills": {"faults": ["node-loss@step=9,node=1"]},
        },
    )
    assert p.export.bucket == "team-b" and p.secrets == {"HF_TOKEN": "hf-token"}
    with pytest.raises(ValidationError, match="drills.faults: 'exception@step=3,rank=1'"):
        validate_form(EKS_DEPLOYMENT, {"drills": {"faults": ["exception@step=3,rank=1"]}})


def test_a_deployment_that_names_a_drill_runs_it(monkeypatch):
    """The deployment's own drills are its decision (a drill deployment); a form adds none."""
    for name in EVERY_LIST:
        monkeypatch.delenv(name, raising=False)
    drilling = {**LOCAL_DEPLOYMENT, "drills": {"faults": ["exception@step=3,rank=1"]}}
    assert validate_form(drilling, {}).drills.faults == ["exception@step=3,rank=1"]
    with pytest.raises(ValidationError, match="drills.faults: 'sigkill@step=4'"):
        validate_form(drilling, {"drills": {"faults": ["sigkill@step=4"]}})


# --- run ids --------------------------------------------------------------------------------

A = binding.Creator("dep-a", "nvrx-training-pipeline/team-a")
B = binding.Creator("dep-b", "nvrx-training-pipeline/team-b")
CLI = binding.Creator()

# (who asks, what the run root records, whether it exists, refused?)
BINDINGS = [
    (B, A, True, "was created by deployment nvrx-training-pipeline/team-a"),
    (B, CLI, True, "was created by no deployment"),
    (B, None, True, "has no record of the deployment"),
    (B, False, True, f"has an unreadable {Layout.DEPLOYMENT}"),
    (A, A, True, None),
    (B, None, False, None),  # a new run: B creates it
    (CLI, A, True, None),  # the caller's own powers
]


@pytest.mark.parametrize(("me", "found", "exists", "refused"), BINDINGS)
def test_a_run_is_continued_only_from_the_deployment_that_created_it(me, found, exists, refused):
    why = binding.refusal("victim", me, found, exists)
    if refused is None:
        assert why is None
    else:
        assert why is not None and refused in why and why.startswith("run_id: run 'victim'")
        assert "team-b" in why  # both deployments named


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _victim(tmp_path: Path) -> Path:
    """Deployment A's run, resumable (a checkpoint, events)."""
    run_root = tmp_path / "fsx" / "runs" / "victim"
    run_root.mkdir(parents=True)
    binding.bind(run_root, "victim", A, existed=False)
    (run_root / "events.jsonl").write_text('{"kind": "run_start"}\n')
    return run_root


def test_another_deployments_run_is_refused_before_anything_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """Through the flow: deployment B's form names A's run id; refused before the lease."""
    import logging

    import flows.pipeline as pipeline
    from flows.pipeline import training_pipeline

    run_root = _victim(tmp_path)
    before = _tree(run_root)
    params = PipelineParams(run_id="victim", state_dir=str(tmp_path))
    monkeypatch.setattr(pipeline, "resolve_params", lambda fields, dep: params)
    monkeypatch.setattr(pipeline, "creator", lambda: B)
    monkeypatch.setattr(pipeline, "get_run_logger", lambda: logging.getLogger("test"))
    with pytest.raises(binding.RunOfAnotherDeployment, match="team-a.*team-b"):
        training_pipeline.fn(**params.flow_parameters())
    assert _tree(run_root) == before  # no lease, no event, no result


def test_two_deployments_racing_for_a_new_run_id_cannot_both_have_it(tmp_path: Path):
    run_root = tmp_path / "runs" / "new"
    binding.check(run_root, "new", A)  # both see no run
    binding.check(run_root, "new", B)
    run_root.mkdir(parents=True)  # A's lease made it
    binding.bind(run_root, "new", A, existed=False)
    with pytest.raises(binding.RunOfAnotherDeployment, match="team-a"):
        binding.bind(run_root, "new", B, existed=False)  # B's lease, after A's
    assert binding.recorded(run_root) == A


def test_a_symlinked_record_is_not_followed(tmp_path: Path):
    run_root = tmp_path / "run"
    run_root.mkdir()
    (tmp_path / "forged.json").write_text(B.to_json())
    (run_root / Layout.DEPLOYMENT).symlink_to(tmp_path / "forged.json")
    assert binding.recorded(run_root) is False
    with pytest.raises(binding.RunOfAnotherDeployment, match="unreadable"):
        binding.check(run_root, "run", B)


def test_the_cleanup_hook_leaves_another_deployments_run_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """A flow run of B naming A's run id, cancelled at once: its hook removes nothing of A's."""
    from types import SimpleNamespace

    import flows.pipeline as pipeline

    run_root = _victim(tmp_path)
    before = _tree(run_root)
    params = PipelineParams(run_id="victim", state_dir=str(tmp_path))
    monkeypatch.setattr(pipeline, "resolve_params", lambda fields, dep: params)

    def no_backend(*a: Any, **k: Any) -> None:
        raise AssertionError("the hook built a backend to clean up another deployment's run")

    monkeypatch.setattr(pipeline.registry, "create", no_backend)
    flow_run = SimpleNamespace(parameters={}, deployment_id="dep-b", id="0" * 32)
    state = SimpleNamespace(type=SimpleNamespace(value="CANCELLED"))
    pipeline._clean_up_after(None, flow_run, state)
    assert _tree(run_root) == before


# --- the capacity-resume automation ----------------------------------------------------------


def _rendered(payload_parameters: dict[str, Any]) -> dict[str, Any]:
    """The run-deployment action's parameters for a (forged) awaiting-capacity event, rendered
    with a sandboxed Jinja as Prefect renders them (``json`` of ``jinja``)."""
    from jinja2.sandbox import SandboxedEnvironment

    from flows.automations import AWAITING_CAPACITY, resume_parameters

    env = SandboxedEnvironment()
    events = [{"event": AWAITING_CAPACITY, "payload": {"parameters": payload_parameters}}]
    out = {}
    for name, spec in resume_parameters().items():
        text = env.from_string(spec["value"]["template"]).render(events=events)
        out[name] = json.loads(text)
    return out


def test_a_forged_event_adds_no_drill_and_its_values_are_validated_again(monkeypatch):
    for name in EVERY_LIST:
        monkeypatch.delenv(name, raising=False)
    forged = PipelineParams().flow_parameters() | {
        "run_id": "victim",
        "drills": {"faults": ["sigkill@step=3"]},
    }
    resumed = _rendered(forged)
    assert "drills" not in resumed and resumed["run_id"] == "victim"
    validate_form(LOCAL_DEPLOYMENT, resumed)  # the event's own values pass as a run's would
    for field, value in [
        ("s3_endpoint", "http://127.0.0.9:9"),
        ("export", {"bucket": "other-team-ckpts"}),
        ("state_dir", "/tmp/other-user/.state"),
    ]:
        resumed = _rendered(forged | {field: value})
        with pytest.raises(ValidationError, match=f"{field}.*not allowed by this deployment"):
            validate_form(LOCAL_DEPLOYMENT, resumed)


def test_a_forged_event_naming_another_deployments_run_is_refused(tmp_path: Path):
    run_root = _victim(tmp_path)
    resumed = _rendered(PipelineParams().flow_parameters() | {"run_id": "victim"})
    with pytest.raises(binding.RunOfAnotherDeployment, match="team-a"):
        binding.check(run_root.parent / resumed["run_id"], resumed["run_id"], B)


def test_eks_pool_env_has_no_secret_or_drill_by_default():
    env = pool_env()
    assert env["NVRX_ALLOWED_SECRETS"] == env["NVRX_ALLOWED_DRILLS"] == "none"
    assert env["NVRX_ALLOWED_UNPINNED_WEIGHTS"] == "none"
    assert env["NVRX_ALLOWED_S3_ENDPOINTS"] == "aws"
    assert os.path.normpath(env["NVRX_ALLOWED_STATE_DIRS"]) == ".state"


def test_unpinned_weights_are_refused_where_the_deployment_requires_a_pin(monkeypatch, tmp_path):
    """Whoever can write the weights' prefix chooses the model a run starts from: a deployment
    that sets NVRX_ALLOWED_UNPINNED_WEIGHTS=none takes only pinned s3:// weights, even from its
    own bucket; refused at the form, before anything is read or written."""
    for name in EVERY_LIST:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NVRX_ALLOWED_UNPINNED_WEIGHTS", "none")
    monkeypatch.chdir(tmp_path)
    form = {
        "workload": "llama-tiny",
        "workload_options": {"init_weights": "s3://nvrx-datasets/llama/init"},  # its own bucket
    }
    with pytest.raises(ValidationError) as err:
        validate_form(LOCAL_DEPLOYMENT, form)
    msg = str(err.value)
    assert "initial_weights.sha256:" in msg and "not allowed by this deployment" in msg, msg
    assert "NVRX_ALLOWED_UNPINNED_WEIGHTS" in msg and "weights-digest" in msg
    assert list(tmp_path.iterdir()) == []
    validate_form(LOCAL_DEPLOYMENT, {**form, "initial_weights": {"sha256": "a" * 64}})
