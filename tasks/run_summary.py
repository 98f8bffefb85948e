"""Pure summaries of a run's ``events.jsonl``: faults with the layer that recovered them,
stage attempts, ETTR. What the report, the result and ``status`` are built from."""

from __future__ import annotations

from typing import Any

from trainer.report import faults_with_recovery, world_changes

__all__ = [
    "ettr",
    "faults_with_recovery",
    "productive_s",
    "progress",
    "stage_attempts",
    "world_changes",
]


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


def status(events: list[dict[str, Any]], result: dict[str, Any] | None = None) -> dict[str, Any]:
    """What ``nvrx-pipeline status`` shows: from the events file, plus the pipeline's saved
    result when the run has ended (``pipeline_result.json``)."""
    steps = [e for e in events if e["kind"] == "step"]
    last = steps[-1] if steps else None
    attempts = [
        {
            "attempt": e.get("attempt"),
            "backend": e.get("backend"),
            "outcome": next(
                (
                    x.get("outcome")
                    for x in events
                    if x["kind"] == "stage_attempt_end"
                    and x.get("attempt") == e.get("attempt")
                    and x["t"] >= e["t"]
                ),
                "running",
            ),
        }
        for e in events
        if e["kind"] == "stage_attempt" and e.get("stage") == "train"
    ]
    ckpts = [e for e in events if e["kind"] == "checkpoint"]
    if result is not None:
        state = str(result.get("status"))
    elif any(e["kind"] == "train_end" for e in events):
        state = "trained (validation/export pending or not recorded)"
    elif any(e["kind"] == "fatal" for e in events):
        state = "failed"
    else:
        state = "running or interrupted"
    return {
        "state": state,
        "step": last["step"] if last else 0,
        "loss": last.get("loss") if last else None,
        "tokens_per_s": last.get("tokens_per_s") if last else None,
        "train_attempts": attempts,
        "faults": faults_with_recovery(events),
        "checkpoints": len(ckpts),
        "latest_checkpoint_step": ckpts[-1]["step"] if ckpts else None,
        "ckpt_blocking_s_max": max((c["blocking_s"] for c in ckpts), default=None),
        "ettr": ettr(events),
        "stages": (result or {}).get("stage_durations_s"),
        "export_uri": ((result or {}).get("export") or {}).get("uri"),
        "error": (result or {}).get("error"),
    }
