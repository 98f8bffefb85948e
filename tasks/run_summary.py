"""Pure summaries of a run's ``events.jsonl``: faults with the layer that recovered them,
stage attempts, ETTR. What the report, the result and ``status`` are built from."""

from __future__ import annotations

from typing import Any

from trainer.report import faults_with_recovery

__all__ = ["ettr", "faults_with_recovery", "productive_s", "progress", "stage_attempts"]


def stage_attempts(events: list[dict[str, Any]], stage: str = "train") -> int:
    return sum(1 for e in events if e["kind"] == "stage_attempt" and e.get("stage") == stage)


def train_wall_s(events: list[dict[str, Any]]) -> float:
    return sum(
        e.get("wall_s", 0.0)
        for e in events
        if e["kind"] == "stage_attempt_end" and e.get("stage") == "train"
    )


def productive_s(events: list[dict[str, Any]]) -> float:
    """Seconds of the steps that count: for each step, its last execution (replays of steps
    lost to a fault are not productive)."""
    last: dict[int, float] = {}
    for e in events:
        if e["kind"] == "step":
            last[e["step"]] = e.get("step_s", 0.0)
    return sum(last.values())


def ettr(events: list[dict[str, Any]]) -> float | None:
    """Effective training time ratio: productive training time / train-stage wall time."""
    wall = train_wall_s(events)
    return round(productive_s(events) / wall, 4) if wall > 0 else None


def progress(events: list[dict[str, Any]]) -> int:
    steps = [e["step"] for e in events if e["kind"] == "step"]
    return steps[-1] if steps else 0
