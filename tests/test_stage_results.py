"""Every stage flow returns a typed model, persisted with its flow run (readable back through the
API) and shown as an artifact; the export has a link artifact. Read off the session's fault-free
pipeline run (the ``baseline`` fixture): no run of its own."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from pydantic import BaseModel

from flows.models import PipelineResult
from flows.results import (
    ExportResult,
    HydrateResult,
    PreflightResult,
    TrainResult,
    ValidationResult,
)

pytestmark = pytest.mark.slow

STAGES: dict[str, type[BaseModel]] = {
    "preflight": PreflightResult,
    "hydrate": HydrateResult,
    "train": TrainResult,
    "validate": ValidationResult,
    "export": ExportResult,
}


def _artifact(client: Any, key: str, run_id: str) -> Any:
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    arts = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))
    [art] = [a for a in arts if f" {run_id} " in f" {a.description} "]
    return art


def test_every_stage_returns_a_typed_persisted_result(baseline: PipelineResult):
    from prefect.client.orchestration import get_client

    got: dict[str, BaseModel] = {}
    with get_client(sync_client=True) as client:
        for stage, model in STAGES.items():
            art = _artifact(client, f"{stage}-result", baseline.run_id)
            flow_run = client.read_flow_run(art.flow_run_id)
            assert flow_run.state is not None and flow_run.state.is_completed()
            # Named for what it is (issue 27), not with Prefect's random words.
            label = "train attempt 1" if stage == "train" else stage
            assert flow_run.name == f"{baseline.run_id}: {label}"
            # The persisted result, read back from the result storage, is the model itself.
            value = flow_run.state.result()
            assert type(value) is model, (stage, type(value))
            assert value.model_dump_json(indent=2) in str(art.data)  # the artifact shows it
            got[stage] = value
        link = _artifact(client, "export", baseline.run_id)
    train, validation, export = got["train"], got["validate"], got["export"]
    assert isinstance(train, TrainResult) and isinstance(validation, ValidationResult)
    assert isinstance(export, ExportResult) and isinstance(got["preflight"], PreflightResult)
    # The pipeline's result is built from these, attribute by attribute.
    assert baseline.params_sha256 == train.params_sha256 and train.final_step == 20
    assert (baseline.checkpoint.step, baseline.checkpoint.uri) == (validation.step, validation.path)
    assert validation.validated and all(c.status != "FAILED" for c in validation.checks)
    assert baseline.export.uri == export.uri and export.verified
    assert all(r.status != "FAILED" for r in got["preflight"].checks)
    hydrate = got["hydrate"]
    assert isinstance(hydrate, HydrateResult) and hydrate.files > 0 and hydrate.manifest_sha256
    # The link artifact goes to the export: here the local S3 server's listing of its prefix.
    assert export.link and f"({export.link})" in str(link.data)  # markdown: [uri](link)
    listing = httpx.get(export.link, timeout=30)
    assert listing.status_code == 200 and "manifest.json" in listing.text


def test_a_forged_train_result_is_refused():
    """result.json is on the shared filesystem: a bad known field is refused, naming it."""
    from pydantic import ValidationError

    good = {"status": "completed", "final_step": 20, "params_sha256": "a" * 64, "new": 1}
    assert TrainResult.model_validate(good).final_step == 20
    for bad, field in (
        ({**good, "params_sha256": "../x"}, "params_sha256"),
        ({**good, "final_step": -1}, "final_step"),
        ({**good, "status": "failed"}, "status"),
    ):
        with pytest.raises(ValidationError, match=field):
            TrainResult.model_validate(bad)
