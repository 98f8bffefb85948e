"""Every kind of ``events.jsonl`` line as a frozen, typed record (arch §5).

Any process that can write the run root can append to the file, so a reader trusts only what
decodes against these types: one pydantic union on ``kind`` that writers go through
(``EventLog.emit`` refuses an event that would not decode) and the one decoder
(:mod:`trainer.event_read`) drops every line that does not. Types are strict (``"5"`` is not a
step); fields a reader decides from are required; undeclared fields are kept (``extra="allow"``),
so a newer writer's additions reach an older reader instead of failing its decode.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationInfo,
    model_validator,
)
from pydantic import ValidationError as ValidationError  # re-exported: the decoders' error

# A step or node number, a count, a world size: never negative. Node -1 is the trainer's "no
# backend told this worker its node" (trainer.loop), so node lists admit it.
NonNeg = Annotated[int, Field(ge=0)]
Seconds = Annotated[float, Field(ge=0.0)]
_WIRE = {"wire": True}  # the validation context of a decode


class _Base(BaseModel):
    model_config = ConfigDict(frozen=True, strict=True, extra="allow")

    # Unix time the event was made (the writer's clock); a line read back must carry it.
    t: float = Field(default_factory=time.time)
    # The writer's attempt (trainer.fence; None: run by hand). The watcher decides only from its
    # own epoch's events.
    epoch: Annotated[int, Field(ge=1)] | None = None

    @model_validator(mode="before")
    @classmethod
    def _on_the_wire(cls, data: Any, info: ValidationInfo) -> Any:
        # Decoded (not built by a writer): the time is the line's, never the reader's clock.
        if info.context == _WIRE and isinstance(data, dict) and "t" not in data:
            raise ValueError("t: an event read back must carry its time")
        return data


class WorkerStart(_Base):
    kind: Literal["worker_start"] = "worker_start"
    world_size: NonNeg
    restart_count: NonNeg = 0
    process_start_t: float | None = None
    data_s: Seconds | None = None
    secret_env: list[str] | None = None  # credential-like variable names it was given


class Phase(_Base):
    kind: Literal["phase"] = "phase"
    phase: str
    s: Seconds
    how: Literal["fork", "spawn"] | None = None  # writer_ready: how the writer started


class TrainStart(_Base):
    kind: Literal["train_start"] = "train_start"
    world_size: NonNeg
    start_step: NonNeg | None = None
    steps: NonNeg | None = None
    nodes: list[int] = []
    iteration: int | None = None
    restart_count: NonNeg = 0
    job_id: str | None = None


class WorldChange(_Base):
    kind: Literal["world_change"] = "world_change"
    from_world: NonNeg
    to_world: NonNeg
    from_nodes: list[int] = []
    nodes: list[int] = []
    step: NonNeg
    cause: str


class NodeTime(BaseModel):
    """One node's share of a step: the slowest of its ranks' time from the step's start to the
    step check (trainer.step_check), before any wait on the others: the straggler signal."""

    model_config = ConfigDict(frozen=True, strict=True, extra="allow")
    node: Annotated[int, Field(ge=-1)]
    busy_s: Seconds


class Step(_Base):
    kind: Literal["step"] = "step"
    step: NonNeg
    loss: float | None = None
    step_s: Seconds = 0.0
    ckpt_blocking_s: Seconds | None = None
    tokens_per_s: float | None = None
    tokens: NonNeg | None = None  # the step's tokens, all ranks (a script may not say)
    # Per node (the step check gathers them in its one collective); absent without the check.
    nodes: list[NodeTime] | None = None


class StepCheck(_Base):
    """A step's pre-update check (trainer.step_check) failed, or its replay decided: no update
    was applied from a rejected step. ``verdict``: ``rejected`` (first failure, replaying in
    place), ``transient`` (the replay passed), ``repeat`` (the replay failed again: the
    ``nodes`` named are bad)."""

    kind: Literal["step_check"] = "step_check"
    step: NonNeg
    verdict: Literal["rejected", "transient", "repeat"]
    reason: str
    ranks: list[NonNeg] = []
    nodes: list[Annotated[int, Field(ge=-1)]] = []
    loss: float | None = None
    grad_norm: float | None = None
    bound: float | None = None


class Handoff(_Base):
    """Ranks told their node must go (an eviction's notice: trainer.notice) were heard by every
    rank at ``step``, and that step was saved durably (``path``, committed) before they left:
    a resume replays nothing before it. ``leaving``: how many ranks were told; ``s``: from the
    first notice to the commit."""

    kind: Literal["handoff"] = "handoff"
    step: NonNeg
    leaving: NonNeg
    path: str | None = None
    save_s: Seconds = 0.0
    s: Seconds | None = None


class Straggler(_Base):
    """The watcher's straggler judge (tasks.straggler) about one node: ``verdict`` suspect,
    confirmed (policy report: it trains on), replaced (policy replace: taken away as lost),
    rate-limited (replace, but the eviction budget is spent: reported only) or cleared.
    ``score``: the newest window's median of the node's busy time over the job's median;
    ``scores``: the windows the verdict rests on; ``steps``: their first and last step."""

    kind: Literal["straggler"] = "straggler"
    node: NonNeg
    verdict: Literal["suspect", "confirmed", "replaced", "rate-limited", "cleared"]
    score: float
    scores: list[float] = []
    window: NonNeg  # steps per window
    steps: list[NonNeg] = []
    seconds: Seconds = 0.0
    policy: str
    evidence: str


class TrainEnd(_Base):
    kind: Literal["train_end"] = "train_end"
    final_step: NonNeg
    final_loss: float | None = None
    params_sha256: str | None = None
    world_size: NonNeg | None = None


class Checkpoint(_Base):
    kind: Literal["checkpoint"] = "checkpoint"
    step: NonNeg
    blocking_s: Seconds
    total_s: Seconds | None = None
    commit_s: Seconds | None = None
    path: str | None = None
    pruned: list[int] = []


class CheckpointFailed(_Base):
    kind: Literal["checkpoint_failed"] = "checkpoint_failed"
    step: NonNeg
    error: str
    path: str | None = None


class PruneRefused(_Base):
    kind: Literal["prune_refused"] = "prune_refused"
    step: NonNeg
    reason: str


class Resume(_Base):
    kind: Literal["resume"] = "resume"
    # loaded, skipped, failed, fresh, or a crash repair (rolled-forward, removed-partial, ...)
    action: str
    step: NonNeg | None = None
    reason: str | None = None
    saved_world_size: NonNeg | None = None
    world_size: NonNeg | None = None
    load_s: Seconds | None = None
    # A load's tier (trainer.checkpointing.tiers: memory, node, peer or durable) and the bytes
    # it read (every rank's).
    source: str | None = None
    bytes: NonNeg | None = None


class Fault(_Base):
    kind: Literal["fault"] = "fault"
    fault: str
    fault_kind: str
    step: NonNeg | None = None
    rank: NonNeg | None = None
    node: NonNeg | None = None
    nodes: list[int] | None = None
    path: str | None = None  # a node loss's path (tasks.loss_policy)
    detail: str | None = None
    # A hang or stall drill: the step timeout in force on the rank, to hold detection against.
    bound_s: Seconds | None = None


class MemoryInterval(_Base):
    """How often this incarnation's memory saves run (``checkpoint.memory.interval: auto``,
    trainer.checkpointing.memory_cadence): chosen at ``step`` from the worst rank's medians."""

    kind: Literal["memory_interval"] = "memory_interval"
    step: NonNeg
    interval: int = Field(ge=1)
    step_s: Seconds
    blocking_s: Seconds
    background_s: Seconds
    budget: float
    samples: NonNeg
    detail: str | None = None


class TimeoutsSet(_Base):
    """The in-job timeouts rank 0's rank monitor now times with (trainer.timeouts): derived
    from this incarnation's own sections, each with why (``detail``: field -> "S s: why")."""

    kind: Literal["timeouts"] = "timeouts"
    step_timeout_s: Seconds
    checkpoint_timeout_s: Seconds
    load_timeout_s: Seconds
    out_of_section_timeout_s: Seconds
    heartbeat_timeout_s: Seconds
    applied: bool = True  # False: this NVRx could not take them; the launch ones stay
    detail: dict[str, str] = {}


class Restart(_Base):
    kind: Literal["restart"] = "restart"
    layer: str
    restart_count: NonNeg | None = None
    iteration: int | None = None
    world_size: NonNeg | None = None


class Recovered(_Base):
    kind: Literal["recovered"] = "recovered"
    layer: str
    fault: str | None = None
    fault_kind: str | None = None
    fault_step: NonNeg | None = None
    rank: NonNeg | None = None
    step: NonNeg
    recovery_s: Seconds


class Fatal(_Base):
    kind: Literal["fatal"] = "fatal"
    error: str
    requeue: bool = False


class NodeReturn(_Base):
    kind: Literal["node_return"] = "node_return"
    fault: str
    step: NonNeg
    node: NonNeg


class StageAttempt(_Base):
    kind: Literal["stage_attempt"] = "stage_attempt"
    stage: str
    attempt: Annotated[int, Field(ge=1)]
    nodes: NonNeg | None = None
    nproc_per_node: NonNeg | None = None
    backend: str | None = None
    adopted: bool = False
    # What a node evicted with notice gets to save and leave (tasks.evict_grace), and why.
    evict_grace_s: Seconds | None = None
    evict_grace: str | None = None


class StageAttemptEnd(_Base):
    kind: Literal["stage_attempt_end"] = "stage_attempt_end"
    stage: str
    attempt: Annotated[int, Field(ge=1)]
    outcome: str
    message: str | None = None
    wall_s: Seconds = 0.0


class Takeover(_Base):
    kind: Literal["takeover"] = "takeover"
    previous: str
    action: str
    reason: str
    attempt: int | None = None
    ended_pids: list[int] = []
    steps_lost: NonNeg = 0


class Cleanup(_Base):
    kind: Literal["cleanup"] = "cleanup"
    state: str
    removed: Any = None


class FencedEvent(_Base):
    """A writer whose epoch was no longer the run's refused a mutation (trainer.fence)."""

    kind: Literal["fenced"] = "fenced"
    action: str
    current: int | None = None
    reason: str


class StaleJobsDeleted(_Base):
    kind: Literal["stale_jobs_deleted"] = "stale_jobs_deleted"
    jobs: list[str]
    attempt: int | None = None


Event = Annotated[
    WorkerStart
    | Phase
    | TrainStart
    | WorldChange
    | Step
    | StepCheck
    | Handoff
    | Straggler
    | TrainEnd
    | Checkpoint
    | CheckpointFailed
    | PruneRefused
    | Resume
    | Fault
    | TimeoutsSet
    | MemoryInterval
    | Restart
    | Recovered
    | Fatal
    | NodeReturn
    | StageAttempt
    | StageAttemptEnd
    | Takeover
    | Cleanup
    | FencedEvent
    | StaleJobsDeleted,
    Field(discriminator="kind"),
]

_ADAPTER: TypeAdapter[Event] = TypeAdapter(Event)


def decode_json(raw: bytes | str) -> Event:
    """One line as its typed event; raises :class:`ValidationError` when it is not one."""
    return _ADAPTER.validate_json(raw, context=_WIRE)


def decode_obj(obj: Any) -> Event:
    """An already-parsed JSON object (a recorded history in a test, an echoed log line) as its
    typed event; raises :class:`ValidationError` when it is not one."""
    return _ADAPTER.validate_python(obj, context=_WIRE)
