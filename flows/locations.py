"""Where a run's dataset comes from and its export goes: the form's S3 locations."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


def _s3_location(bucket: str, prefix: str) -> None:
    """Bucket and prefix become paths on the shared filesystem too: refuse what could leave it."""
    from tasks.errors import StorageError
    from tasks.storage.s3 import validate_bucket, validate_prefix

    try:
        validate_bucket(bucket)
        validate_prefix(prefix)
    except StorageError as e:
        raise ValueError(str(e)) from e


class DatasetLocation(BaseModel):
    model_config = ConfigDict(extra="forbid")
    bucket: str = Field("nvrx-datasets", min_length=3, max_length=63, description="S3 bucket")
    prefix: str = Field("synthetic/v1", min_length=1, description="prefix holding dataset.json")

    @model_validator(mode="after")
    def _safe(self) -> DatasetLocation:
        _s3_location(self.bucket, self.prefix)
        return self


DEMO_DATASET = DatasetLocation()  # the only prefix seed_demo_dataset writes into


class ExportLocation(BaseModel):
    model_config = ConfigDict(extra="forbid")
    bucket: str = Field("nvrx-checkpoints", min_length=3, max_length=63, description="S3 bucket")
    prefix: str = Field("exports", description="prefix; objects go to PREFIX/RUN_ID/step_N/")
    sse: Literal["none", "AES256", "aws:kms"] = Field(
        "none", description="server-side encryption: none, AES256 (SSE-S3) or aws:kms (SSE-KMS)"
    )
    kms_key_id: str | None = Field(None, description="KMS key id or ARN, with sse=aws:kms")
    consolidated: bool = Field(
        False, description="also export the full weights as one model.safetensors"
    )

    @model_validator(mode="after")
    def _kms(self) -> ExportLocation:
        _s3_location(self.bucket, self.prefix)
        if self.kms_key_id and self.sse != "aws:kms":
            raise ValueError("kms_key_id needs sse='aws:kms'")
        return self
