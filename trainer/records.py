"""The fold's typed outputs (:class:`trainer.history.RunHistory`), each going into
:class:`flows.models.PipelineResult` as it is."""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field


class TimeBreakdown(BaseModel):
    """Where the train stage's wall time went (seconds adding up to ``wall_s``): why ETTR is
    what it is, from rank 0's step events and the watcher's attempt bounds. ``startup``: launch
    to first step, failed starts included; ``productive``: each step's last execution (ETTR's
    numerator); ``replayed``: executions a restart ran again; ``checkpoint_blocking``: waiting on
    saves; ``recovery``: after a fault or restart until training resumed, and a failed attempt's
    end; ``end``: a completed attempt's last step to its end; ``other``: the rest."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    wall_s: float
    startup: float
    productive: float
    replayed: float
    checkpoint_blocking: float
    recovery: float
    end: float
    other: float


class FaultRecord(BaseModel):
    """A fault as the fold saw it: the layer that recovered it and how."""

    model_config = ConfigDict(frozen=True)

    fault: str | None = None  # its spec (``exception@step=3,rank=1``)
    kind: str
    step: int | None = None
    rank: int | None = None
    node: int | None = None
    recovered_by: str = "none"  # a RecoveryLayer, or none: no recovered event closed it
    recovery_s: float | None = None
    # A node loss: the path chosen at the loss (tasks.loss_policy) and why.
    path: str | None = None
    detail: str | None = None
    # The step training went back to, and the completed steps that ran again (None: no restart).
    resume_step: int | None = None
    replayed_steps: int | None = None
    # The tier that step was loaded from (None: training started over), its bytes and seconds.
    resume_source: str | None = None
    load_bytes: int | None = None
    load_s: float | None = None
    t: float | None = Field(None, exclude=True)  # when it was recorded (not in the result)


class WorldChangeRecord(BaseModel):
    """An elastic job re-formed on another number of ranks (a loss, or a node's return)."""

    model_config = ConfigDict(frozen=True)

    step: int | None = None  # the first step trained on the new world
    from_world: int
    to_world: int
    nodes: list[int] = Field(default_factory=list)
    cause: str  # shrink or grow
    t: float | None = Field(None, exclude=True)


class StragglerRecord(BaseModel):
    """A node the straggler judge confirmed slow (tasks.straggler): reported, replaced, or
    reported only because the eviction budget was spent (``rate-limited``)."""

    model_config = ConfigDict(frozen=True)

    node: int
    verdict: str  # confirmed, replaced or rate-limited
    score: float  # its newest window's busy time over the job's median
    steps: list[int] = Field(default_factory=list)  # first and last step of the evidence
    seconds: float = 0.0
    evidence: str = ""
    t: float | None = Field(None, exclude=True)


class RunSummary(BaseModel):
    """``python -m trainer.report``: outcome, faults and recoveries, restarts, checkpoints."""

    model_config = ConfigDict(frozen=True)

    outcome: str | None  # completed, failed, or None: no train_end or fatal yet
    final_step: int
    steps_run: int  # replays after restarts included
    final_loss: float | None
    params_sha256: str | None
    faults: list[FaultRecord]
    world_changes: list[WorldChangeRecord]
    timeouts: dict[str, str] | None
    restart_layers: list[str]
    checkpoints: int
    ckpt_blocking_s_max: float | None
    ckpt_blocking_s_mean: float | None


@dataclass
class AttemptView:
    """A stage attempt as its start and end events say (``status``'s attempts)."""

    attempt: int
    stage: str
    t: float
    backend: str | None
    adopted: bool
    outcome: str | None = None  # None: still running (no stage_attempt_end yet)
    message: str | None = None
    wall_s: float = 0.0
