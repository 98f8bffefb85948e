"""What a new owner does with what a dead one left running: adopt it or end it.

The decision is a pure function over a snapshot gathered once (the dead owner's records, which
of its processes still live, the run's events); acting on it is separate and idempotent.
An orchestrator crash should cost the training nothing: a healthy job is watched to its end from
here, with no restart and no lost step. A job that is not healthy (a node gone, no progress for
longer than the in-job layer takes to recover) is ended before anything new starts, so a run
never trains beside itself.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tasks.backends import node_memory
from tasks.ownership import processes
from tasks.ownership.lease import LeaseRecord
from trainer.history import RunHistory

# Longer than the in-job layer takes to replace a worker (heartbeat timeout + restart) on the
# embedded default, so a job in the middle of a restart still counts as healthy.
HEALTHY_WITHIN_S = 90.0


class Action(enum.StrEnum):
    ADOPT = "adopt"  # watch the running attempt to its end
    END = "end"  # kill what is left, then run as usual
    NOTHING = "nothing"  # nothing of the dead owner still runs


class NodeRecord(BaseModel):
    """A node the previous owner recorded in its lease: validated, since the lease is a file of
    the shared filesystem. The node's exit file is derived from the run root, never read here."""

    model_config = ConfigDict(frozen=True, strict=True, extra="ignore")

    kind: Literal["node"]
    attempt: int = Field(ge=1)
    node: int = Field(ge=0, le=65535)
    pid: int = Field(gt=1)
    create_time: float = Field(gt=0)

    @classmethod
    def parse(cls, r: dict[str, Any]) -> NodeRecord | None:
        try:
            return cls.model_validate(r)
        except ValidationError:
            return None


@dataclass(frozen=True)
class Snapshot:
    previous: LeaseRecord
    nodes: tuple[NodeRecord, ...]  # node records of the newest attempt
    alive: frozenset[int]  # which of those nodes' processes still run
    strays: int  # other live processes tagged with the dead invocation
    last_event_t: float | None
    attempt_ended: bool  # the events already close that attempt
    last_step: int | None
    last_commit: int | None
    now: float


@dataclass(frozen=True)
class Plan:
    action: Action
    reason: str
    attempt: int | None = None
    nodes: tuple[NodeRecord, ...] = ()
    steps_lost: int = 0


def gather(previous: LeaseRecord, run_root: Path, *, now: float | None = None) -> Snapshot:
    node_records = [r for r in map(NodeRecord.parse, previous.resources) if r is not None]
    attempt = max((r.attempt for r in node_records), default=None)
    nodes = tuple(r for r in node_records if r.attempt == attempt)
    invocation = previous.owner.invocation
    alive = frozenset(
        r.node for r in nodes if processes.carries(r.pid, r.create_time, run_root, invocation)
    )
    strays = sum(1 for t in processes.tagged(run_root) if t.invocation == previous.owner.invocation)
    history = RunHistory.read(run_root)
    # Only the previous owner's own events say whether its attempt ended.
    ended_t = history.ended_attempts.get(("train", attempt), -1.0) if attempt else -1.0
    ended = ended_t >= previous.owner.started_at
    return Snapshot(
        previous=previous,
        nodes=nodes,
        alive=alive,
        strays=strays,
        last_event_t=history.last_progress_t,
        attempt_ended=ended,
        last_step=history.last_step.step if history.last_step else None,
        last_commit=history.last_checkpoint.step if history.last_checkpoint else None,
        now=time.time() if now is None else now,
    )


def decide(s: Snapshot, *, healthy_within_s: float = HEALTHY_WITHIN_S) -> Plan:
    attempt = s.nodes[0].attempt if s.nodes else None
    lost = max(0, (s.last_step or 0) - (s.last_commit or 0))
    wanted = {r.node for r in s.nodes}
    if not s.alive and not s.strays:
        return Plan(Action.NOTHING, "nothing of the previous owner still runs", attempt)
    if s.nodes and s.alive == wanted and not s.attempt_ended:
        quiet = None if s.last_event_t is None else s.now - s.last_event_t
        if quiet is not None and quiet <= healthy_within_s:
            return Plan(
                Action.ADOPT,
                f"attempt {attempt}: all {len(wanted)} node(s) alive, last progress "
                f"{quiet:.0f} s ago",
                attempt,
                s.nodes,
            )
        why = "no progress recorded" if quiet is None else f"no progress for {quiet:.0f} s"
        return Plan(Action.END, f"attempt {attempt}: {why}", attempt, steps_lost=lost)
    missing = sorted(wanted - s.alive)
    why = f"node(s) {missing} gone" if missing else f"{s.strays} stray process(es)"
    return Plan(Action.END, f"attempt {attempt}: {why}", attempt, steps_lost=lost)


def carry_out(plan: Plan, previous: LeaseRecord, run_root: Path) -> list[int]:
    """End what the plan says to end (every process tagged with the dead invocation, and its
    node memory: its launcher never removed it). Adopted processes are left alone. Returns the
    pids ended."""
    if plan.action == Action.ADOPT:
        return []
    node_memory.forget(run_root)  # nothing of this invocation's is there yet
    victims = [t for t in processes.tagged(run_root) if t.invocation == previous.owner.invocation]
    processes.end([t.process for t in victims])
    return [t.pid for t in victims]
