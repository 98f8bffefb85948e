"""Pure summaries of a run's events: faults with the layer that recovered them, stage attempts,
ETTR. What the report, the result and ``status`` are built from: each is a view of the one fold,
:class:`trainer.history.RunHistory`, taken here over recorded events (typed, or JSON objects)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from trainer.event_types import Event
from trainer.history import RunHistory
from trainer.report import faults_with_recovery, world_changes

__all__ = [
    "ettr",
    "faults_with_recovery",
    "productive_s",
    "progress",
    "stage_attempts",
    "world_changes",
]

Events = Iterable[Event | dict[str, Any]]


def stage_attempts(events: Events, stage: str = "train") -> int:
    return RunHistory.of(events).stage_attempts(stage)


def train_wall_s(events: Events) -> float:
    return RunHistory.of(events).train_wall_s()


def productive_s(events: Events) -> float:
    """Seconds of the steps that count: for each step, its last execution (replays of steps
    lost to a fault are not productive)."""
    return RunHistory.of(events).productive_s()


def ettr(events: Events) -> float | None:
    """Effective training time ratio: productive training time / train-stage wall time."""
    return RunHistory.of(events).ettr()


def progress(events: Events) -> int:
    return RunHistory.of(events).progress()


def status(events: Events, result: dict[str, Any] | None = None) -> dict[str, Any]:
    """What ``nvrx-pipeline status`` shows: from the events, plus the pipeline's saved result
    when the run has ended (``pipeline_result.json``)."""
    return RunHistory.of(events).status(result)
