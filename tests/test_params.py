"""Pipeline parameters (the Prefect UI form), CLI parameter assembly, S3 URIs, the report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from flows.cli import main
from flows.cli.common import load_params_dict
from flows.models import FaultRecord, PipelineParams, PipelineResult
from flows.report import render_report
from tasks.errors import StorageError
from tasks.storage.s3 import parse_s3_uri


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"steps": 0}, "steps"),
        ({"nodes": 0}, "nodes"),
        ({"drills": {"faults": ["boom@step=1"]}}, "drills.faults"),
        # the old top-level field names its new home
        ({"faults": ["exception@step=1"]}, "drills.faults"),
        ({"run_id": "Bad ID"}, "run_id"),
        # whole-string matches: `re.match("^...$")` would let a trailing newline through
        ({"run_id": "abc\n"}, "run_id"),
        ({"s3_endpoint": "http://user:pw@host:9000"}, "s3_endpoint"),
        ({"s3_endpoint": "http://s3.lan:9000\n"}, "s3_endpoint"),
        ({"eks": {"namespace": "nvrx\n"}}, "namespace"),
        ({"eks": {"region": "us-east-1\n"}}, "region"),
        ({"eks": {"file_system_id": "fs-0123456789abcdef0\n"}}, "file_system_id"),
        # a corruption right after a commit must still leave one valid checkpoint
        ({"keep_last": 1}, "keep_last"),
        ({"unknown_field": 1}, "unknown_field"),
    ],
)
def test_bad_params_name_the_field(kw, field):
    with pytest.raises(ValidationError) as err:
        PipelineParams(**kw)
    assert field in str(err.value)


def test_cross_field_checks():
    with pytest.raises(ValidationError, match="divisible"):
        PipelineParams(nodes=3, global_batch=8)
    with pytest.raises(ValidationError, match="names node 2"):
        PipelineParams(nodes=2, drills={"faults": ["node-loss@step=3,node=2"]})
    with pytest.raises(ValidationError, match="after the last step"):
        PipelineParams(steps=10, drills={"faults": ["exception@step=11"]})


def test_cli_params_from_file_sets_and_injects(tmp_path: Path):
    cfg = tmp_path / "p.yaml"
    cfg.write_text("steps: 30\ndataset:\n  bucket: my-data\n")
    d = load_params_dict(
        cfg, ["dataset.prefix=x/y", "nodes=1", "s3_endpoint=null"], ["sigkill@step=3"], "r1"
    )
    p = PipelineParams(**d)
    assert (p.steps, p.nodes, p.dataset.bucket, p.dataset.prefix) == (30, 1, "my-data", "x/y")
    assert p.drills.faults == ["sigkill@step=3"] and p.run_id == "r1" and p.s3_endpoint is None


def test_cli_rejects_bad_params(capsys):
    assert main(["run", "--set", "steps=-1"]) == 2
    assert "steps" in capsys.readouterr().err


@pytest.mark.parametrize(
    "uri", ["s3://", "http://b/p", "s3://user:pw@bucket/p", "s3://bucket/a/../b", "s3://B_ad/p"]
)
def test_bad_s3_uris(uri):
    with pytest.raises(StorageError):
        parse_s3_uri(uri)


def test_good_s3_uri():
    assert parse_s3_uri("s3://nvrx-ckpt/exports/run1/") == ("nvrx-ckpt", "exports/run1")


def test_report_lists_faults_and_outputs():
    r = PipelineResult(
        status="completed",
        run_id="r1",
        target_steps=20,
        final_step=20,
        final_loss=4.2,
        faults=[
            FaultRecord(
                kind="node-loss", step=12, node=1, recovered_by="stage-retry", recovery_s=18.5
            )
        ],
        stage_attempts={"train": 2},
        stage_durations_s={"preflight": 5.0, "train": 50.0, "export": 15.0},
        ettr=0.42,
        wall_s=70,
    )
    md = render_report(r)
    assert md.startswith("# Run `r1`: completed")  # the outcome leads
    assert "| node-loss | 12 |  | 1 | stage-retry | 18.5 |  |  |  |" in md
    # the stage timeline: start offsets accumulate, bars scale with the share of wall time
    assert "| preflight | 0.0 | 5.0 | 1 | `#` |" in md
    assert "| train | 5.0 | 50.0 | 2 | `##############` |" in md
    assert "| export | 55.0 | 15.0 | 1 | `####` |" in md
    assert "**0.420**" in md
    assert json.loads(r.model_dump_json())["faults"][0]["recovered_by"] == "stage-retry"


def test_eks_backend_uses_aws_s3_unless_an_endpoint_is_given():
    from flows.models import PipelineParams

    assert PipelineParams(backend="eks", eks={"gpus_per_node": 1}).s3_endpoint is None
    given = PipelineParams(
        backend="eks", eks={"gpus_per_node": 1}, s3_endpoint="http://s3.lan:9000"
    )
    assert given.s3_endpoint == "http://s3.lan:9000"
    assert PipelineParams().s3_endpoint == "http://127.0.0.1:8333"  # the embedded default


def test_eks_file_system_id_is_checked():
    import pydantic
    import pytest

    from flows.models import PipelineParams

    with pytest.raises(pydantic.ValidationError) as err:
        PipelineParams(backend="eks", eks={"file_system_id": "fsx-123"})
    assert "file_system_id" in str(err.value)


def test_run_id_good_values_pass():
    assert PipelineParams(run_id="abc").run_id == "abc"
    assert PipelineParams(run_id="").run_id is None
    assert PipelineParams(keep_last=2).keep_last == 2


EKS = {"backend": "eks", "eks": {"gpus_per_node": 1}}


@pytest.mark.parametrize(
    ("field", "env", "allowed", "value"),
    [
        ("image", "NVRX_ALLOWED_IMAGES", "reg/nvrx:1,reg/nvrx:2", "reg/evil:1"),
        ("service_account", "NVRX_ALLOWED_SERVICE_ACCOUNTS", "nvrx-trainer", "admin"),
        ("namespace", "NVRX_ALLOWED_NAMESPACES", "nvrx, nvrx-dev", "kube-system"),
    ],
)
def test_eks_identity_comes_from_the_deployment(monkeypatch, field, env, allowed, value):
    monkeypatch.setenv(env, allowed)
    with pytest.raises(ValidationError) as err:
        PipelineParams(**{**EKS, "eks": {**EKS["eks"], field: value}})
    msg = str(err.value)
    # names the field, the refused value and every allowed one
    assert f"eks.{field}" in msg and repr(value) in msg and env in msg
    for ok in allowed.split(","):
        assert ok.strip() in msg
    for ok in allowed.split(","):
        p = PipelineParams(**{**EKS, "eks": {**EKS["eks"], field: ok.strip()}})
        assert getattr(p.eks, field) == ok.strip()


def test_eks_identity_defaults_without_a_deployment(monkeypatch):
    for env in ("NVRX_ALLOWED_IMAGES", "NVRX_ALLOWED_SERVICE_ACCOUNTS", "NVRX_ALLOWED_NAMESPACES"):
        monkeypatch.delenv(env, raising=False)
    PipelineParams(**EKS)  # the defaults are allowed: the CLI and render-k8s need no env
    with pytest.raises(ValidationError, match="eks.image"):
        PipelineParams(**{**EKS, "eks": {**EKS["eks"], "image": "reg/other:1"}})
    # a deployment that allows other images refuses the placeholder default too: a run whose
    # params replace the deployment's (shallow merge) cannot fall back to it silently
    monkeypatch.setenv("NVRX_ALLOWED_IMAGES", "reg/nvrx:1")
    with pytest.raises(ValidationError, match="REGISTRY/nvrx-pipeline:latest"):
        PipelineParams(**EKS)


def test_local_runs_never_need_eks_values(monkeypatch):
    monkeypatch.setenv("NVRX_ALLOWED_IMAGES", "reg/nvrx:1")
    monkeypatch.setenv("NVRX_ALLOWED_NAMESPACES", "elsewhere")
    assert PipelineParams().backend == "local"


@pytest.mark.parametrize(
    ("location", "value"),
    [
        ("dataset", {"prefix": "../../etc"}),
        ("dataset", {"prefix": "a/../../b"}),
        ("dataset", {"prefix": "/abs"}),
        ("dataset", {"prefix": "v1\n"}),
        ("dataset", {"prefix": "v1/.hidden"}),
        ("dataset", {"prefix": "v1\x00x"}),
        ("dataset", {"bucket": "Bad_Bucket"}),
        ("dataset", {"bucket": "bucket\n"}),
        ("export", {"prefix": "exports/.."}),
        ("export", {"bucket": "../x"}),
    ],
)
def test_s3_locations_that_would_leave_the_shared_filesystem_are_refused(location, value):
    """The dataset's bucket and prefix are also its path on the shared filesystem
    (``datasets/<bucket>/<prefix>``): nothing that could leave it gets that far."""
    with pytest.raises(ValidationError) as e:
        PipelineParams(**{location: value})
    assert e.value.errors()[0]["loc"][0] == location
    assert repr(next(iter(value.values()))) in str(e.value)


def test_s3_locations_good_values_pass():
    p = PipelineParams(
        dataset={"bucket": "my.data-1", "prefix": "llama/tok_v2/shard-set.3"},
        export={"bucket": "ckpts", "prefix": ""},
    )
    assert p.dataset.prefix == "llama/tok_v2/shard-set.3"


# -- discoverable parameters (issue 27) ---------------------------------------------------------
EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "params"


@pytest.mark.parametrize("backend", ["local", "eks"])
def test_example_params_file_per_backend_loads(backend: str, capsys):
    """The shipped params files are valid PipelineParams for their backend, and the EKS one
    renders its manifests as they are."""
    path = EXAMPLES / f"{backend}.yaml"
    p = PipelineParams(**load_params_dict(path, [], [], None))
    assert p.backend == backend
    if backend == "eks":
        assert main(["render-k8s", "--config", str(path)]) == 0
        assert "kind: Job" in capsys.readouterr().out


def test_params_lists_every_parameter_with_a_default_that_round_trips(capsys):
    """`nvrx-pipeline params --json`: every leaf field of the form, each described; setting each
    listed name to its listed default through --set gives the default parameters back."""
    from flows.param_docs import params_docs

    assert main(["params", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [d["name"] for d in listed] == [d.name for d in params_docs()]
    assert {"steps", "dataset.prefix", "eks.instance_type", "drills.faults"} <= {
        d["name"] for d in listed
    }
    undescribed = [d["name"] for d in listed if not d["description"]]
    assert not undescribed
    sets = [f"{d['name']}={json.dumps(d['default'])}" for d in listed]
    assert PipelineParams(**load_params_dict(None, sets, [], None)) == PipelineParams()


@pytest.mark.parametrize(
    ("typed", "near"),
    [
        ("stpes", "steps"),
        ("ckpt_intervall", "ckpt_interval"),
        ("dataset.prefx", "dataset.prefix"),
        ("eks.instnce_type", "eks.instance_type"),
        ("bucket", "dataset.bucket or export.bucket"),
        ("datset", "dataset"),
        ("zzz", None),
    ],
)
def test_did_you_mean(typed: str, near: str | None):
    from flows.param_docs import did_you_mean

    assert did_you_mean(typed) == near


def test_mistyped_field_fails_naming_the_nearest(capsys):
    assert main(["run", "--set", "stpes=3", "--set", "dataset.prefx=a"]) == 2
    err = capsys.readouterr().err
    assert "stpes: no such parameter (did you mean steps?)" in err
    assert "dataset.prefx: no such parameter (did you mean dataset.prefix?)" in err
    assert main(["params", "datset"]) == 2
    assert "did you mean dataset?" in capsys.readouterr().err


def test_report_breaks_the_train_stage_down_and_defines_every_figure():
    """Issue 27: the train stage's wall time in parts that add up, ETTR spelled out, each fault
    with where training went back to; every figure printed is defined in the README."""
    from tests.helpers import assert_figures_defined, figures_in_report
    from trainer.records import TimeBreakdown

    time_s = TimeBreakdown(
        wall_s=36.0, startup=20.0, productive=1.8, replayed=0.6, checkpoint_blocking=0.3,
        recovery=9.0, end=4.0, other=0.3,
    )  # fmt: skip
    r = PipelineResult(
        status="completed",
        run_id="r1",
        target_steps=30,
        final_step=30,
        faults=[
            FaultRecord(kind="exception", step=8, rank=1, recovered_by="inprocess",
                        recovery_s=1.2, resume_step=0, replayed_steps=7),
            FaultRecord(kind="sigkill", step=16, rank=0, recovered_by="injob", recovery_s=6.1,
                        resume_step=10, replayed_steps=5, resume_source="durable",
                        load_bytes=2_200_000, load_s=0.17),
        ],
        ettr=0.05,
        train_time=time_s,
        wall_s=60,
    )  # fmt: skip
    md = render_report(r)
    assert "ETTR: **0.050** (effective training time ratio" in md
    assert "(train attempts 36.0 s)" in md
    assert "| start-up | 20.0 | 56% |" in md and "| **train attempts** | **36.0** | 100% |" in md
    assert "too short for its ETTR to mean much" in md  # start-up outweighs the steps
    assert "| exception | 8 | 1 |  | inprocess | 1.2 | started over from step 1 | 7 |" in md
    assert "| injob | 6.1 | resumed from step 10's checkpoint (durable, 2.2 MB, 0.17 s) | 5 |" in md
    assert_figures_defined(figures_in_report(md))
    long_run = time_s.model_copy(update={"startup": 1.0, "productive": 20.8})
    assert "too short" not in render_report(r.model_copy(update={"train_time": long_run}))


def test_deterministic_reaches_the_workers_on_both_backends(tmp_path: Path):
    """`deterministic` is what makes a GPU recovery bitwise (benchmarks/results/
    gpu_check_h200.json): it must reach the trainer config the workers read, on both backends."""
    from flows.context import eks_train_config, train_config
    from tasks.backends.base import Placement

    for value in (False, True):
        local = PipelineParams(deterministic=value)
        where = Placement(shared_root=tmp_path, local_paths=False)
        cfg = train_config(local, where, tmp_path / "r", tmp_path / "d")
        assert cfg.deterministic is value
        eks = PipelineParams(backend="eks", nodes=2, global_batch=16, deterministic=value)
        assert eks_train_config(eks, "r").deterministic is value


@pytest.mark.parametrize(
    "source, text",
    [
        ("memory", "resumed from step 7 in the process's own copy (2.0 MB, 0.03 s)"),
        ("node", "resumed from step 7 in node memory (2.0 MB, 0.03 s)"),
        ("peer", "resumed from step 7 in peer copies (2.0 MB, 0.03 s)"),
        ("durable", "resumed from step 7's checkpoint (durable, 2.0 MB, 0.03 s)"),
        (None, "resumed from step 7's checkpoint"),
    ],
)
def test_the_report_names_the_tier_a_recovery_read(source, text):
    from flows.report import resumed_from

    read = {"load_bytes": 2_000_000, "load_s": 0.03} if source else {}
    fault = FaultRecord(kind="sigkill", resume_step=7, resume_source=source, **read)
    assert resumed_from(7, fault) == text
