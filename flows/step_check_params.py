"""The form's step check settings (``trainer.step_check.StepCheckConfig``): whether a step's loss
and gradient norm are checked before its update, and what counts as a spike."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from trainer.errors import ConfigError
from trainer.step_check import StepCheckConfig

_DEFAULT = StepCheckConfig()


class StepCheckParams(BaseModel):
    """Before every update, every rank's loss and gradient norm must be finite and at most
    ``mean + sigma x max(std, 5 % of the mean)`` of the last ``window`` accepted steps (judged
    once ``min_samples`` are in); a step that fails is not applied and is computed again in
    place (docs/architecture.md, section 2, Step check)."""

    model_config = ConfigDict(extra="forbid")
    enabled: bool = Field(
        _DEFAULT.enabled,
        description="check each step before its update. Off: a NaN or a spike is applied and "
        "saved, and the straggler detector gets no per-node times (it judges nothing); the "
        "gray drills need it on",
    )
    window: int = Field(
        _DEFAULT.window,
        ge=2,
        le=100_000,
        description="accepted steps whose loss and gradient norm the spike bound is taken over",
    )
    sigma: float = Field(
        _DEFAULT.sigma,
        gt=0,
        le=1000,
        description="standard deviations above the window's mean that make a spike (6 is "
        "conservative: a fault-free run never trips)",
    )
    min_samples: int = Field(
        _DEFAULT.min_samples,
        ge=2,
        le=100_000,
        description="accepted steps needed before spikes are judged (at most window); only "
        "non-finite values fail before then, after every restart too",
    )
    repeat_wait_s: float = Field(
        _DEFAULT.repeat_wait_s,
        ge=0,
        le=3600,
        description="after a replay fails again: seconds the ranks wait, training nothing, for "
        "the watcher to take the named node away before they restart from the newest good "
        "state (0: restart at once)",
    )

    @model_validator(mode="after")
    def _valid(self) -> StepCheckParams:
        # The cross-field rule (min_samples <= window) is the config's: one place states it.
        try:
            self.config()
        except ConfigError as e:
            raise ValueError(str(e)) from e
        return self

    def config(self) -> StepCheckConfig:
        """The trainer config's section."""
        return StepCheckConfig(**self.model_dump())
