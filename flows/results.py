"""What each stage flow returns: typed models built from the typed reports of ``tasks``,
persisted as JSON with the flow run (Prefect's result storage) and shown in its Artifacts tab
(:func:`publish`). ``TrainResult`` is the completed part of the trainer's ``result.json``
(:class:`trainer.rundir.RunResult`, validated where it is read)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tasks.checks import Status


class _Result(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PreflightRow(_Result):
    check: str
    status: Status
    detail: str
    fix: str | None = None


class PreflightResult(_Result):
    checks: list[PreflightRow]


class HydrateResult(_Result):
    source: str  # s3://bucket/prefix
    dest: str  # the dataset directory on the shared filesystem
    files: int
    seconds: float
    # The digest of the manifest every file was checked against; None for a weights directory.
    manifest_sha256: str | None = None
    detail: str = ""
    # What the backend adds (local: downloaded/skipped counts; EKS: the FSx association, the
    # import task and the hydration Job).
    backend: dict[str, Any] = Field(default_factory=dict)


class TrainResult(_Result):
    # result.json gains fields over time; an unknown one is ignored, a bad known one refused.
    model_config = ConfigDict(extra="ignore", frozen=True)
    status: Literal["completed"]
    final_step: int = Field(ge=0)
    final_loss: float | None = None
    params_sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")
    world_size: int | None = Field(None, ge=1)
    latest_checkpoint: int | None = Field(None, ge=0)
    config_hash: str | None = None


class CheckRow(_Result):
    name: str
    status: Status
    detail: str
    # False: a check this checkpoint does not need (advisory, or not applicable: a script's
    # own model, a metadata-only validation); a SKIPPED required check rejects it.
    required: bool = True


class RejectedCheckpoint(_Result):
    step: int | None
    failed: list[CheckRow]


class ValidationResult(_Result):
    step: int | None
    path: str
    validated: bool
    checks: list[CheckRow]
    hash_mb_s: float | None = None
    # Newer committed checkpoints that failed validation (the chosen one is a fallback).
    fell_back_from: list[RejectedCheckpoint] = Field(default_factory=list)


class ExportResult(_Result):
    uri: str  # s3://bucket/prefix/run/step_N/
    objects: int
    uploaded: int
    skipped: int
    bytes: int
    bytes_uploaded: int
    verified: bool
    verification: str
    link: str | None = None  # where a browser shows the objects (S3 console, or the endpoint)


def publish(stage: str, result: BaseModel, run_id: str) -> None:
    """The stage's result in its flow run's Artifacts tab (a report never fails the stage)."""
    from prefect.artifacts import create_markdown_artifact
    from prefect.logging import get_run_logger

    try:
        create_markdown_artifact(
            f"# {stage} result of run `{run_id}`\n\n```json\n"
            f"{result.model_dump_json(indent=2)}\n```\n",
            key=f"{stage}-result",
            description=f"what the {stage} stage of {run_id} returned",
        )
    except Exception as e:
        get_run_logger().warning("could not publish the %s result: %s", stage, e)


def console_link(uri: str, endpoint: str | None, region: str | None) -> str:
    """A browser link to an S3 prefix: the AWS console, or the custom endpoint's own URL."""
    from urllib.parse import quote

    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    if endpoint:  # the S3 API's own listing of the prefix (what a local server can show)
        return f"{endpoint.rstrip('/')}/{bucket}?prefix={quote(prefix)}"
    where = f"&region={region}" if region else ""
    return (
        f"https://s3.console.aws.amazon.com/s3/buckets/{bucket}?prefix={quote(prefix)}{where}"
        "&showversions=false"
    )
