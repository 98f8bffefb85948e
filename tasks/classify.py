"""How a train attempt ended, decided by a pure function over what the watcher saw once the
attempt was over. No I/O here: the snapshot is gathered by :mod:`tasks.train_stage`."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from tasks.errors import (
    DoNotRequeue,
    InJobExhausted,
    NodeLost,
    TrainingFailed,
    TrainTimeout,
)

# ft_launcher's (NVRx >= 0.7) "do not requeue" exit code. NVRx 0.4.1 has no such code: a
# worker's no-restart request closes the rendezvous and the launcher exits 1, so the
# ``control/no_restart`` marker (trainer.resilience) is what tells it from exhausted restarts.
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
    no_restart: str | None = None  # the reason in <run_root>/control/no_restart, if written
    target_steps: int = 0
    log_hint: str = ""  # where to look (agent logs)
    # The nodes of the last world that trained (empty: not known). Any other node was waiting
    # (a spare, or a node returning as the job ended) and no step depended on it.
    world_nodes: frozenset[int] = frozenset()


@dataclass(frozen=True)
class Outcome:
    kind: EndKind
    message: str
    details: dict[str, Any] = field(default_factory=dict)

    def error(self) -> TrainingFailed | None:
        cls = {
            EndKind.NODE_LOSS: NodeLost,
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
    # First: a job that said "do not restart" and then lingered until the deadline, or whose
    # peers were signalled, is reported by its cause, not as a timeout or a node loss.
    terminal = do_not_requeue_cause(s)
    if terminal is not None:
        return Outcome(
            EndKind.DO_NOT_REQUEUE,
            f"training cannot continue: {terminal}{hint}",
            {"exit_codes": dict(s.exit_codes), "no_restart": s.no_restart},
        )
    if s.timed_out:
        return Outcome(EndKind.TIMEOUT, f"train stage passed its deadline and was stopped{hint}")
    r = s.result or {}
    done = r.get("status") == "completed" and r.get("final_step") == s.target_steps
    # A waiting node may find the rendezvous closed by the job's end as it joins (a node that
    # returned during the last steps) and exit 1: that decides nothing once the world that
    # trained ended well.
    idle = set(s.exit_codes) - s.world_nodes if s.world_nodes else set()
    others = [c for n, c in s.exit_codes.items() if n not in lost and n not in idle]
    if (lost or idle) and done and others and all(c == 0 for c in others):
        turned_away = sorted(n for n in idle if s.exit_codes[n] not in (0, None))
        # An elastic job or a hot spare carried on without the lost node(s), in-job.
        return Outcome(
            EndKind.COMPLETED,
            f"completed {s.target_steps} steps"
            + (f"; node(s) {lost} lost and recovered in-job" if lost else "")
            + (f"; waiting node(s) {turned_away} turned away at the end" if turned_away else ""),
            {"result": r, "lost_nodes": lost, "idle_nodes": sorted(idle)},
        )
    if lost:
        return Outcome(
            EndKind.NODE_LOSS,
            f"node(s) {lost} lost; the in-job layer cannot continue without them{hint}",
            {"lost_nodes": lost},
        )
    codes = list(s.exit_codes.values())
    if codes and all(c == 0 for c in codes):
        if done:
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


def do_not_requeue_cause(s: EndSnapshot) -> str | None:
    """Why no retry can help, from every node's end together, or None. A peer's exit 93 can be
    masked (the others are signalled, so their codes read as killed or 1): any node's 93, the
    no-restart marker or the trainer's fatal event decides it, before node loss is considered."""
    nodes_93 = sorted(n for n, c in s.exit_codes.items() if c == EXIT_DO_NOT_REQUEUE)
    causes = [c for c in (s.fatal, s.no_restart) if c]
    if nodes_93:
        causes.append(
            f"ft_launcher on node(s) {nodes_93} exited {EXIT_DO_NOT_REQUEUE} (do not requeue)"
        )
    # The fatal event and the marker usually carry the same message: say it once.
    unique = list(dict.fromkeys(causes))
    return "; ".join(unique) if unique else None
