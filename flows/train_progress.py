"""A train attempt's progress as its flow run shows it: rank 0's events in the log (steps
throttled) and a progress artifact, each also a Prefect event."""

from __future__ import annotations

import time
from typing import cast
from uuid import UUID

from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.logging import get_run_logger

from flows.events import emit_for_trainer_event
from trainer.event_types import Checkpoint, Event, Fatal, Fault, Recovered, Restart, Resume, Step


class TrainProgress:
    """Streams rank-0 progress into the flow log (throttled) and a progress artifact."""

    def __init__(self, target: int, attempt: int, run_id: str) -> None:
        self.log = get_run_logger()
        self.target = target
        self.run_id = run_id
        self.artifact = cast(
            UUID,
            create_progress_artifact(
                0.0, key="train-progress", description=f"training steps (attempt {attempt})"
            ),
        )
        self.last_log = 0.0

    def __call__(self, e: Event) -> None:
        emit_for_trainer_event(self.run_id, e)
        match e:
            case Step():
                now = time.monotonic()
                if now - self.last_log >= 2.0 or e.step == self.target:
                    self.last_log = now
                    update_progress_artifact(self.artifact, 100.0 * e.step / self.target)
                    self.log.info(
                        "step %d/%d loss %s %.0f tok/s",
                        e.step,
                        self.target,
                        "?" if e.loss is None else f"{e.loss:.4f}",
                        e.tokens_per_s or 0.0,
                    )
            case Fault():
                self.log.warning("fault injected: %s at step %s", e.fault, e.step)
            case Restart():
                self.log.warning("restart by the %s layer", e.layer)
            case Recovered():
                self.log.info("recovered from %s by %s in %.1f s", e.fault, e.layer, e.recovery_s)
            case Resume(action="loaded" | "skipped" | "failed"):
                self.log.info("resume %s: step %s %s", e.action, e.step, e.reason or "")
            case Checkpoint():
                self.log.info("checkpoint step %d committed (blocked %.3f s)", e.step, e.blocking_s)
            case Fatal():
                self.log.error("trainer fatal error: %s", e.error)
