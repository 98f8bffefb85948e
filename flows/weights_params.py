"""The form's pin on the initial weights (``workload_options.init_weights`` as ``s3://``): the
digest they must have (:mod:`tasks.weights_pin` defines it) and a cap on their size."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from tasks.weights_pin import DEFAULT_MAX_GIB, GIB, SHA256_HEX, WeightsPin

MAX_GIB = 512  # the most a run may raise the cap to


class InitialWeightsParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    sha256: str | None = Field(
        None,
        description="the digest s3:// workload_options.init_weights must have (64 hex digits, "
        "what `nvrx-pipeline weights-digest DIR_OR_S3_URI` prints): checked before the weights "
        "are used. Empty: not pinned (said in the hydrate log; a deployment may require it)",
    )
    max_gib: float = Field(
        DEFAULT_MAX_GIB,
        gt=0,
        le=MAX_GIB,
        description="the most the initial weights may hold, in GiB: checked from the S3 listing "
        "before anything is copied, and while copying",
    )

    @field_validator("sha256")
    @classmethod
    def _sha256(cls, v: str | None) -> str | None:
        if v in (None, ""):
            return None
        v = v.strip().lower().removeprefix("sha256:")
        if not SHA256_HEX.fullmatch(v):
            raise ValueError(
                "expected 64 hex digits, the digest `nvrx-pipeline weights-digest DIR_OR_S3_URI` "
                "prints for the weights"
            )
        return v

    def pin(self) -> WeightsPin:
        return WeightsPin(sha256=self.sha256, max_bytes=int(self.max_gib * GIB))


def check_initial_weights(
    pin: InitialWeightsParams, weights: str | None, init_weights: object
) -> None:
    """A digest pins s3:// weights only (those the pipeline copies and checks): refuse one with
    nothing to pin, rather than let it read as a check that never runs. ``weights``: the s3://
    URI, ``init_weights``: the option as given."""
    if pin.sha256 is None or weights is not None:
        return
    if init_weights in (None, ""):
        raise ValueError(
            "initial_weights.sha256: no initial weights to pin; set workload_options.init_weights "
            "to their s3:// prefix, or leave initial_weights.sha256 empty"
        )
    raise ValueError(
        f"initial_weights.sha256: pins s3:// weights, which hydrate copies and checks; "
        f"{init_weights!r} is read where it is, unchecked: give its s3:// prefix instead, or "
        "leave initial_weights.sha256 empty"
    )
