"""The form's straggler settings (``trainer.straggler_config.StragglerConfig``): what a node
confirmed slow costs it, and how long it must stay slow first."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from trainer.errors import ConfigError
from trainer.straggler_config import StragglerConfig

_DEFAULT = StragglerConfig()


class StragglerParams(BaseModel):
    """A node is scored per window of steps against the job's median busy time; confirmed
    slow after ``confirm_windows`` windows in a row at least ``enter`` times the median that
    also span ``confirm_s`` seconds (docs/architecture.md, section 4, Stragglers)."""

    model_config = ConfigDict(extra="forbid")
    policy: Literal["off", "report", "replace"] = Field(
        _DEFAULT.policy.value,
        description="what a node confirmed slow costs: off (not judged), report (an event, "
        "a metric and a line in the run report; it trains on) or replace (taken away as "
        "lost: a spare, the elastic world or a stage retry; cordoned on EKS)",
    )
    enter: float = Field(
        _DEFAULT.enter,
        ge=1.10,
        le=100.0,
        description="a window scored this many times the job's median busy time makes a node "
        "suspect (at least 1.10: a change of 10 %)",
    )
    window: int = Field(_DEFAULT.window, ge=1, le=10_000, description="steps per scored window")
    confirm_windows: int = Field(
        _DEFAULT.confirm_windows,
        ge=1,
        le=1000,
        description="consecutive windows at or above enter that confirm a node slow",
    )
    confirm_s: float = Field(
        _DEFAULT.confirm_s,
        ge=0,
        le=86400,
        description="seconds those windows must span too (shorter slowdowns cost less than a "
        "replacement)",
    )
    warmup_steps: int = Field(
        _DEFAULT.warmup_steps,
        ge=0,
        le=100_000,
        description="steps after every (re)start that are not judged",
    )

    @model_validator(mode="after")
    def _valid(self) -> StragglerParams:
        try:
            self.config()
        except ConfigError as e:
            raise ValueError(str(e)) from e
        return self

    def config(self) -> StragglerConfig:
        """The trainer config's section (the leave threshold and the eviction rate: theirs)."""
        return StragglerConfig(**self.model_dump())  # type: ignore[arg-type]
