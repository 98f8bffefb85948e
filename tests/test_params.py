"""Pipeline parameters (the Prefect UI form), CLI parameter assembly, S3 URIs, the report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from flows.cli import load_params_dict, main
from flows.models import FaultRecord, PipelineParams, PipelineResult
from flows.report import render_report
from tasks.errors import StorageError
from tasks.storage.s3 import parse_s3_uri


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"steps": 0}, "steps"),
        ({"nodes": 0}, "nodes"),
        ({"faults": ["boom@step=1"]}, "faults"),
        ({"run_id": "Bad ID"}, "run_id"),
        ({"s3_endpoint": "http://user:pw@host:9000"}, "s3_endpoint"),
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
        PipelineParams(nodes=2, faults=["node-loss@step=3,node=2"])
    with pytest.raises(ValidationError, match="after the last step"):
        PipelineParams(steps=10, faults=["exception@step=11"])


def test_cli_params_from_file_sets_and_injects(tmp_path: Path):
    cfg = tmp_path / "p.yaml"
    cfg.write_text("steps: 30\ndataset:\n  bucket: my-data\n")
    d = load_params_dict(
        cfg, ["dataset.prefix=x/y", "nodes=1", "s3_endpoint=null"], ["sigkill@step=3"], "r1"
    )
    p = PipelineParams(**d)
    assert (p.steps, p.nodes, p.dataset.bucket, p.dataset.prefix) == (30, 1, "my-data", "x/y")
    assert p.faults == ["sigkill@step=3"] and p.run_id == "r1" and p.s3_endpoint is None


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
    assert "| node-loss | 12 |  | 1 | stage-retry | 18.5 |" in md
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
