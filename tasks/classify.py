"""How a train attempt ended: one judge for every backend (arch §2).

The judge is a pure function of two snapshots taken once the attempt is over: the backend's
:class:`Observation` (what it saw of its workers: launcher exit codes, nodes lost, a reason of its
own that they could not run) and the watcher's :class:`Evidence` (what the run directory and the
event log say: drills, the deadline, the markers, ``result.json``). Each backend only builds its
observation; no verdict is decided anywhere else. No I/O here.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tasks.errors import (
    DoNotRequeue,
    InJobExhausted,
    NodeLost,
    TrainingFailed,
    TrainTimeout,
)
from trainer.rundir import RunResult

# ft_launcher's (NVRx >= 0.7) "do not requeue" exit code. NVRx 0.4.1 has no such code: a
# worker's no-restart request closes the rendezvous and the launcher exits 1, so the
# ``control/no_restart`` marker (trainer.rundir) is what tells it from exhausted restarts.
EXIT_DO_NOT_REQUEUE = 93


class EndKind(enum.StrEnum):
    COMPLETED = "completed"
    NODE_LOSS = "node-loss"
    INJOB_EXHAUSTED = "injob-exhausted"
    DO_NOT_REQUEUE = "do-not-requeue"
    TIMEOUT = "timeout"
    BUG = "bug"


class Blocked(enum.StrEnum):
    """A reason of the backend's own that its workers stopped or could never run, beside their
    exit codes (EKS: Pod and Job conditions). None of them is helped by a retry."""

    REMOVED = "removed"  # deleted outside the pipeline (a Job, a pod on a healthy node)
    CANNOT_START = "cannot-start"  # an image that cannot be pulled, a missing Secret
    UNSCHEDULABLE = "unschedulable"  # no node for a worker within the backend's bound
    OOM_KILLED = "oom-killed"  # the kernel killed a worker and the in-job layer gave up
    FAILED = "failed"  # the backend says it failed, with no launcher exit code to read

    @property
    def kind(self) -> EndKind:
        return EndKind.TIMEOUT if self is Blocked.UNSCHEDULABLE else EndKind.BUG


@dataclass(frozen=True)
class Blocker:
    why: Blocked
    detail: str  # the backend's words: what it saw, and the fix


@dataclass(frozen=True, kw_only=True)
class Observation:
    """What a backend saw of its workers' end: the only thing a backend gives the judge."""

    # node (EKS: the pod's completion index) -> its launcher's exit code; None: stopped by the
    # watcher, or not ended when the backend's view settled.
    exit_codes: Mapping[int, int | None] = field(default_factory=dict)
    lost: frozenset[int] = frozenset()  # nodes the backend saw go (a killed process tree)
    lost_hosts: tuple[str, ...] = ()  # the machines behind a loss, where the backend names them
    loss: str = ""  # how a loss showed (EKS: the pod and node conditions)
    succeeded: bool = False  # the backend itself reports success (a Job's Complete condition)
    blocker: Blocker | None = None
    ended: bool = True  # False: the watcher stopped the attempt before the backend saw its end
    where: str = ""  # where to look: the launchers' logs, the Job
    result_hint: str = ""  # why result.json can be missing though the workers succeeded


@dataclass(frozen=True)
class Evidence:
    """What the watcher gathered for every backend alike, once the attempt is over."""

    lost_nodes: frozenset[int]  # taken away by node-loss drills or the watcher's loss rule
    timed_out: bool
    result: RunResult | None  # result.json written during this attempt
    fatal: str | None  # the trainer's "fatal" event during this attempt
    no_restart: str | None  # NVRx's verdict file (<run_root>/control/no_restart)
    target_steps: int
    # The nodes of the last world that trained (its train_start); empty: none reported. Any
    # other node was waiting (a spare, a node returning as the job ended): no step needed it.
    world_nodes: frozenset[int] = frozenset()

    def done(self) -> bool:
        r = self.result
        return r is not None and r.status == "completed" and r.final_step == self.target_steps


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


def judge(obs: Observation, ev: Evidence) -> Outcome:
    """The attempt's outcome. In order: do not requeue, timeout, completed (also without lost or
    waiting nodes), node loss, the backend's own blocker, then the launchers' exit codes."""
    where = f" ({obs.where})" if obs.where else ""
    # First: a job that said "do not restart" and then lingered until the deadline, or whose
    # peers were signalled, is reported by its cause, not as a timeout or a node loss.
    terminal = do_not_requeue_cause(obs, ev)
    if terminal is not None:
        return Outcome(
            EndKind.DO_NOT_REQUEUE,
            f"training cannot continue: {terminal}{where}",
            {"exit_codes": dict(obs.exit_codes), "no_restart": ev.no_restart},
        )
    if ev.timed_out:
        return Outcome(EndKind.TIMEOUT, f"train attempt passed its deadline and was stopped{where}")
    # A launcher killed by a signal (a negative code) went with its node.
    signalled = {n for n, c in obs.exit_codes.items() if c is not None and c < 0}
    lost = sorted(obs.lost | ev.lost_nodes | signalled)
    completed = _completed(obs, ev, lost)
    if completed is not None:
        return completed
    if lost or obs.loss:
        return _node_loss(obs, lost, where)
    if obs.blocker is not None:
        return Outcome(obs.blocker.why.kind, obs.blocker.detail)
    if not obs.ended:
        return Outcome(EndKind.BUG, f"the watch ended with no outcome{where}")
    codes = list(obs.exit_codes.values())
    if obs.succeeded or (codes and all(c == 0 for c in codes)):
        return _no_result(obs, ev, where)
    if 1 in codes:
        return Outcome(
            EndKind.INJOB_EXHAUSTED,
            f"ft_launcher exhausted its in-job restarts (exit 1) with no node lost{where}",
        )
    return Outcome(EndKind.BUG, f"unexpected launcher exit codes {dict(obs.exit_codes)}{where}")


def _completed(obs: Observation, ev: Evidence, lost: list[int]) -> Outcome | None:
    """Completed: the result says so, and every node the last world trained on that was not
    lost ended well. A waiting node may find the rendezvous closed by the job's end as it joins
    (a node that returned during the last steps) and exit 1: that decides nothing."""
    if not ev.done():
        return None
    idle = set(obs.exit_codes) - ev.world_nodes if ev.world_nodes else set()
    others = [c for n, c in obs.exit_codes.items() if n not in lost and n not in idle]
    if not (obs.succeeded or (others and all(c == 0 for c in others))):
        return None
    turned_away = sorted(n for n in idle if obs.exit_codes[n] not in (0, None))
    # An elastic job or a hot spare carried on without the lost node(s), in-job.
    return Outcome(
        EndKind.COMPLETED,
        f"completed {ev.target_steps} steps"
        + (f"; node(s) {lost} lost and recovered in-job" if lost else "")
        + (f"; waiting node(s) {turned_away} turned away at the end" if turned_away else ""),
        {"result": ev.result, "lost_nodes": lost, "idle_nodes": sorted(idle)},
    )


def _node_loss(obs: Observation, lost: list[int], where: str) -> Outcome:
    said = [f"node(s) {lost} lost; the in-job layer cannot continue without them"] if lost else []
    said += [obs.loss] if obs.loss else []
    said += [f"machine(s) {list(obs.lost_hosts)} unreachable or gone"] if obs.lost_hosts else []
    return Outcome(
        EndKind.NODE_LOSS,
        "node loss: " + "; ".join(said) + where,
        {"lost_nodes": lost or list(obs.lost_hosts)},
    )


def _no_result(obs: Observation, ev: Evidence, where: str) -> Outcome:
    r = ev.result
    if r is None:
        hint = f": {obs.result_hint}" if obs.result_hint else ""
        return Outcome(
            EndKind.BUG,
            f"the workers ended well but wrote no result.json for {ev.target_steps} steps"
            f"{where}{hint}",
        )
    return Outcome(
        EndKind.BUG,
        f"the workers ended well but the result says {r.status} at step "
        f"{r.final_step} of {ev.target_steps}{where}",
    )


def do_not_requeue_cause(obs: Observation, ev: Evidence) -> str | None:
    """Why no retry can help, from every node's end together, or None. A peer's exit 93 can be
    masked (the others are signalled, so their codes read as killed or 1): any node's 93, the
    no-restart marker or the trainer's fatal event decides it, before node loss is considered."""
    nodes_93 = sorted(n for n, c in obs.exit_codes.items() if c == EXIT_DO_NOT_REQUEUE)
    causes = [c for c in (ev.fatal, ev.no_restart) if c]
    if nodes_93:
        causes.append(
            f"ft_launcher on node(s) {nodes_93} exited {EXIT_DO_NOT_REQUEUE} (do not requeue)"
        )
    # The fatal event and the marker usually carry the same message: say it once.
    unique = list(dict.fromkeys(causes))
    return "; ".join(unique) if unique else None
