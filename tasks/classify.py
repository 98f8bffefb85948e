"""How a train attempt ended, decided by a pure function over what the watcher saw once the
attempt was over. No I/O here: the snapshot is gathered by :mod:`tasks.train_stage`."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from tasks.errors import (
    DoNotRequeue,
    InJobExhausted,
    NodeLossExhausted,
    TrainingFailed,
    TrainTimeout,
)

# ft_launcher's (NVRx) "do not requeue" exit code.
EXIT_DO_NOT_REQUEUE = 93


class EndKind(enum.StrEnum):
    COMPLETED = "completed"
    NODE_LOSS = "node-loss"
    INJOB_EXHAUSTED = "injob-exhausted"
    DO_NOT_REQUEUE = "do-not-requeue"
    TIMEOUT = "timeout"
    BUG = "bug"


@dataclass(frozen=True)
class EndSnapshot:
    exit_codes: dict[int, int | None]  # node -> agent exit code (None: killed by the watcher)
    lost_nodes: frozenset[int] = frozenset()
    timed_out: bool = False
    result: dict[str, Any] | None = None  # result.json written during this attempt
    fatal: str | None = None  # the trainer's "fatal" event during this attempt
    target_steps: int = 0
    log_hint: str = ""  # where to look (agent logs)


@dataclass(frozen=True)
class Outcome:
    kind: EndKind
    message: str
    details: dict[str, Any] = field(default_factory=dict)

    def error(self) -> TrainingFailed | None:
        cls = {
            EndKind.NODE_LOSS: NodeLossExhausted,
            EndKind.INJOB_EXHAUSTED: InJobExhausted,
            EndKind.DO_NOT_REQUEUE: DoNotRequeue,
            EndKind.TIMEOUT: TrainTimeout,
            EndKind.BUG: TrainingFailed,
        }.get(self.kind)
        return None if cls is None else cls(self.message)


def classify(s: EndSnapshot) -> Outcome:
    hint = f" (logs: {s.log_hint})" if s.log_hint else ""
    signalled = sorted(n for n, c in s.exit_codes.items() if c is not None and c < 0)
    lost = sorted(set(s.lost_nodes) | set(signalled))
    if s.timed_out:
        return Outcome(EndKind.TIMEOUT, f"train stage passed its deadline and was stopped{hint}")
    if s.fatal is not None or EXIT_DO_NOT_REQUEUE in s.exit_codes.values():
        cause = s.fatal or f"ft_launcher exited {EXIT_DO_NOT_REQUEUE} (do not requeue)"
        return Outcome(EndKind.DO_NOT_REQUEUE, f"training cannot continue: {cause}{hint}")
    if lost:
        return Outcome(
            EndKind.NODE_LOSS,
            f"node(s) {lost} lost; the in-job layer cannot continue without them{hint}",
            {"lost_nodes": lost},
        )
    codes = list(s.exit_codes.values())
    if codes and all(c == 0 for c in codes):
        r = s.result or {}
        if r.get("status") == "completed" and r.get("final_step") == s.target_steps:
            return Outcome(EndKind.COMPLETED, f"completed {s.target_steps} steps", {"result": r})
        return Outcome(
            EndKind.BUG,
            f"ft_launcher exited 0 but no completed result for {s.target_steps} steps{hint}",
        )
    if 1 in codes:
        return Outcome(
            EndKind.INJOB_EXHAUSTED,
            f"ft_launcher exhausted its in-job restarts (exit 1) with no node lost{hint}",
        )
    return Outcome(EndKind.BUG, f"unexpected launcher exit codes {s.exit_codes}{hint}")
