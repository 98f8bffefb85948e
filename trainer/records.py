"""The fold's typed outputs (:class:`trainer.history.RunHistory`): what the result, the report
and ``status`` show, each a record that goes into :class:`flows.models.PipelineResult` as it is."""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field


class TimeBreakdown(BaseModel):
    """Where the train stage's wall time went (seconds; they add up to ``wall_s``): what a
    reader needs to see why ETTR is what it is. Measured from rank 0's step events and the
    watcher's attempt bounds:

    - ``startup``: each attempt's launch to its first step (processes, imports, process
      groups, resume), failed starts included;
    - ``productive``: each step's last execution (ETTR's numerator);
    - ``replayed``: executions that a later restart ran again (lost work);
    - ``checkpoint_blocking``: the training thread waiting on saves;
    - ``recovery``: after a fault or restart, until training resumed (detection, restart,
      reload), and a failed attempt's end;
    - ``end``: a completed attempt's last step to its end (the last save's commit, exit);
    - ``other``: the rest (gaps between steps without a fault, the watcher's own overhead,
      time between attempts' events)."""

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
    """A fault as the fold saw it: the layer that recovered it and how (the result's
    ``faults``, the report's and ``status``'s rows)."""

    model_config = ConfigDict(frozen=True)

    fault: str | None = None  # its spec (``exception@step=3,rank=1``)
    kind: str
    step: int | None = None
    rank: int | None = None
    node: int | None = None
    recovered_by: str = "none"  # a RecoveryLayer, or none: no recovered event closed it
    recovery_s: float | None = None
    # A node loss: the path chosen at the loss (elastic, spare, node-wait, stage-retry: see
    # tasks.loss_policy) and why; recovered_by is the layer that did recover it.
    path: str | None = None
    detail: str | None = None
    # The step training went back to after it, and the completed steps that ran again (None:
    # no restart followed it).
    resume_step: int | None = None
    replayed_steps: int | None = None
    # Where that step was loaded from (a tier: memory, node, peer or durable; None: nothing
    # was committed, training started over), the bytes read and the seconds the load took.
    resume_source: str | None = None
    load_bytes: int | None = None
    load_s: float | None = None
    t: float | None = Field(None, exclude=True)  # when it was recorded (not in the result)


class WorldChangeRecord(BaseModel):
    """An elastic job re-formed on another number of ranks: shrank after a loss, or grew when
    a node returned."""

    model_config = ConfigDict(frozen=True)

    step: int | None = None  # the first step trained on the new world
    from_world: int
    to_world: int
    nodes: list[int] = Field(default_factory=list)
    cause: str  # shrink or grow
    t: float | None = Field(None, exclude=True)


class RunSummary(BaseModel):
    """``python -m trainer.report``: the run's outcome, its faults and their recovery, the
    restarts (by layer, in order) and the checkpoints' cost."""

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
