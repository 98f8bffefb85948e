"""The form's in-job timeouts: each ``auto`` (measured by the trainer) unless pinned."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

_TIMEOUT_HELP = (
    "seconds, or auto: derived from what each incarnation measures (trainer.timeouts), the "
    "start-up allowance until then"
)


def _timeout(what: str) -> Any:
    return Field("auto", description=f"{what}: {_TIMEOUT_HELP}")


class InJobParams(BaseModel):
    """The in-job layer's timeouts (``trainer.config.InJobConfig``), each ``auto`` by default:
    pin one only where a measured value cannot do (a known long pause, a policy)."""

    model_config = ConfigDict(extra="forbid")
    startup_allowance_s: float | Literal["auto"] = Field(
        "auto",
        description="what every auto timeout is until measured (start-up, the model build, "
        "the first steps and save): seconds, or auto (the backend's: 600 s locally, 1800 s "
        "on EKS)",
    )
    step_timeout_s: float | Literal["auto"] = Field(
        "auto",
        description="a step longer than this is a hang: seconds (the ceiling the learned one "
        f"stays under), or auto: {_TIMEOUT_HELP}",
    )
    checkpoint_timeout_s: float | Literal["auto"] = _timeout("a checkpoint save and commit")
    load_timeout_s: float | Literal["auto"] = _timeout("a checkpoint load")
    out_of_section_timeout_s: float | Literal["auto"] = _timeout(
        "start-up and an in-process restart"
    )
    heartbeat_timeout_s: float | Literal["auto"] = _timeout(
        "the backstop: no heartbeat for this long kills the rank (auto: the out-of-section "
        "timeout + the longest section's)"
    )
    initial_heartbeat_timeout_s: float | Literal["auto"] = _timeout("until the first heartbeat")
    node_silence_s: float | Literal["auto"] = _timeout(
        "a node whose beat stops this long while another's goes on is taken away as lost "
        "(auto: 5 beats of the node's agent, 5 s)"
    )
    evict_grace_s: float | Literal["auto"] = Field(
        "auto",
        description="a node evicted with notice (a drain, a spot reclaim) has this long "
        "between SIGTERM and SIGKILL: the pods' terminationGracePeriodSeconds and the "
        "node-evict drill's (seconds, more than 3; auto: 30)",
    )

    @field_validator("*")
    @classmethod
    def _seconds(cls, v: float | str) -> float | str:
        if v != "auto" and not 0 < float(v) <= 30 * 86400:
            raise ValueError("must be auto or seconds in (0, 2592000]")
        return v

    def pinned(self) -> dict[str, Any]:
        """The fields set to a number: what overrides the backend's ``InJobConfig``."""
        return {k: float(v) for k, v in self.model_dump().items() if v != "auto"}
