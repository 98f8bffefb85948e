"""What the fresh-process load (:mod:`tasks.validation.load_check`) reports to its parent, one
JSON line on stdout: typed on both sides, so the parent's checks, the result and export's
consolidation read fields, and a line that is not a report is a failed load, not a crash."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class _Part(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class WrittenFile(_Part):
    name: str = Field(max_length=4096)
    bytes: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class Safetensors(_Part):
    """The full model weights in one safetensors file."""

    path: str
    bytes: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class Pretrained(_Part):
    """The workload's own self-contained layout (Hugging Face for Llama), every file of it."""

    path: str
    files: list[WrittenFile]


class LoadReport(_Part):
    loaded: bool
    error: str | None = None  # why it did not load
    tensors: int | None = Field(None, ge=0)
    nonfinite: list[str] = Field(default_factory=list, max_length=20)  # the first few
    params_sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")
    heldout_loss: float | None = None  # None: not asked for, or not finite
    safetensors: Safetensors | None = None
    pretrained: Pretrained | None = None

    @classmethod
    def failed(cls, why: str) -> LoadReport:
        return cls(loaded=False, error=why[:2000])

    @classmethod
    def parse(cls, line: str) -> LoadReport:
        try:
            return cls.model_validate_json(line)
        except ValidationError as e:
            return cls.failed(f"the load process printed no load report ({e.error_count()} errors)")
