"""One attempt of the train stage on any backend: launch (or reattach), watch (progress, node-loss
drills, deadline), judge, release. Plain functions (no Prefect): the stage flow adds logging and
artifacts through callbacks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tasks.backends.base import Backend, Evidence, LaunchRequest
from tasks.classify import EndKind, Outcome
from tasks.loss_policy import LossPath, LossSnapshot, decide
from tasks.ownership.lease import LeaseLost
from trainer import fence, run_state
from trainer.event_read import EVENTS_FILE, EventReader
from trainer.event_types import Fatal, StageAttempt
from trainer.events import EventLog
from trainer.faults import FaultSpec, claim, parse_fault
from trainer.resilience import (
    clear_no_restart,
    clear_node_lost,
    read_no_restart,
    write_node_lost,
)
from trainer.run_files import read_json_object

# After a wait for a returning node (tasks.loss_policy NODE_WAIT), how long past the survivors'
# own join timeout the watcher lets them end by themselves before it stops the attempt.
WAIT_GRACE_S = 10.0

_log = logging.getLogger(__name__)


@dataclass
class AttemptReport:
    attempt: int
    outcome: Outcome
    wall_s: float
    released: dict[str, Any] = field(default_factory=dict)  # what Job.finish reported


def _of_epoch(e: dict[str, Any], epoch: int | None) -> bool:
    """Does the attempt's fate depend on this event? Only its own epoch's decide it (another
    attempt's, or another run's writer's, inform at most)."""
    return epoch is None or e.get("epoch") == epoch


def _result(run_root: Path, epoch: int | None) -> dict[str, Any] | None:
    """``result.json`` if this attempt's workers wrote it."""
    result = read_json_object(run_root / "result.json")
    if result is not None and epoch is not None and result.get("epoch") != epoch:
        _log.warning(
            "ignoring %s: written by epoch %s, not this attempt's %s",
            run_root / "result.json",
            result.get("epoch"),
            epoch,
        )
        return None
    return result


def _fatal_since_last_attempt_start(run_root: Path, epoch: int | None) -> str | None:
    """The first ``fatal`` error of epoch ``epoch`` recorded since the newest train attempt
    started (streamed: the watcher keeps no event it has read)."""
    fatal: str | None = None
    for e in EventReader(run_root / EVENTS_FILE).iter_new():
        if isinstance(e, StageAttempt):
            fatal = None
        elif isinstance(e, Fatal) and fatal is None and (epoch is None or e.epoch == epoch):
            fatal = e.error
    return fatal


def node_faults(specs: list[str] | tuple[str, ...]) -> list[FaultSpec]:
    """The drills the watcher carries out: node losses and returns, in step order."""
    out = [f for f in map(parse_fault, specs) if f.kind in ("node-loss", "node-return")]
    return sorted(out, key=lambda f: (f.step, f.kind != "node-loss"))


def run_attempt(
    backend: Backend,
    request: LaunchRequest,
    *,
    on_event: Callable[[dict[str, Any]], None] = lambda e: None,
    check_owner: Callable[[str], None] = lambda action: None,
) -> AttemptReport:
    """Run one attempt on any backend and watch it to its end: or, when the backend finds one
    of this run still running and healthy (a dead or replaced invocation's, arch §6), only
    watch that: no relaunch, its result stands. ``request.deadline_s`` bounds the watch.

    ``check_owner(action)`` (the lease's :meth:`RunLease.check`) runs before the launch, on
    every poll and before the release; when it raises :class:`LeaseLost`, watching stops and
    the attempt is left running for the run's new owner: a lost lease never stops a job."""
    cfg = request.cfg
    run_root = cfg.run_root
    run_root.mkdir(parents=True, exist_ok=True)
    # Only what is appended from now on: this attempt's events.
    tail = EventReader(run_root / EVENTS_FILE, from_start=False)
    drills = node_faults(cfg.faults)
    fatal: str | None = None  # the attempt's first fatal error
    started = time.monotonic()
    check_owner("start an attempt")
    job = backend.reattach(request)
    if job is None:
        # A new epoch first: from here on, no writer of an earlier attempt (a pod on an
        # unreachable node, a frozen host that wakes) changes the run root (trainer.fence).
        epoch: int | None = fence.publish(
            run_root, invocation=request.invocation, attempt=request.attempt
        ).epoch
        request = dataclasses.replace(request, epoch=epoch)
        events = EventLog(run_root, epoch=epoch)
        (run_root / "result.json").unlink(missing_ok=True)  # only this attempt's result counts
        clear_no_restart(run_root)  # nor an earlier attempt's verdict (the config was fixed)
        clear_node_lost(run_root)
        run_state.record_retry(run_root, request.attempt)
        _attempt_event(events, backend, request, request.attempt)
        job = backend.launch(request)
    else:
        # Adopted: the attempt runs under the epoch its (dead) watcher published.
        now = fence.current(run_root)
        epoch = now.epoch if now is not None else None
        events = EventLog(run_root, epoch=epoch)
        # What the attempt said before we came: a fatal error there decides its outcome too.
        fatal = _fatal_since_last_attempt_start(run_root, epoch)
        _attempt_event(events, backend, request, job.attempt, adopted=True)
    deadline = request.deadline_s
    timed_out = False
    lost: set[int] = set()
    loss_at: float | None = None
    ended = False
    # The nodes training now (the last train_start says): a loss of any other is a spare's.
    world_nodes: frozenset[int] = frozenset()
    # Lost nodes the job has re-formed without (a train_start came after the loss): a
    # node-return drill counts its steps from then on, not the dying world's last steps, which
    # the watcher may read only after the loss (a return then would race the job's end).
    reformed: set[int] = set()
    # An elastic job's survivors below its minimum wait in the rendezvous for a node to return,
    # as long as their own join timeout lets them (tasks.loss_policy NODE_WAIT); a fixed-size
    # job's lost node nothing replaces in-job.
    elastic = request.node_range.elastic or request.spares > 0
    wait_s = cfg.injob.rdzv_join_timeout_s if elastic else 0.0
    waiting_until: float | None = None  # the watcher's end of that wait (monotonic)
    last_step: int | None = None  # the newest step event read (kept as they arrive)
    wait_began = 0.0  # when it began (epoch seconds, as events carry)

    def drill(spec: FaultSpec, step: int) -> None:
        node = spec.node or 0
        if spec.kind == "node-return":
            events.emit("node_return", fault=str(spec), step=step, node=node)
            job.restore_node(node)
            lost.discard(node)
            reformed.discard(node)
            return
        lose(node, str(spec), step, drilled=True)

    def lose(node: int, fault: str, step: int | None, *, drilled: bool) -> None:
        """A node lost, by a drill (``drilled``: the watcher takes it away now) or as the
        backend saw it: which path its loss takes, decided once, and recorded."""
        nonlocal loss_at, waiting_until, wait_began
        # Decided before a drilled node goes: the survivors read the marker the moment they fail.
        decision = decide(
            LossSnapshot(
                lost=node,
                world_nodes=world_nodes,
                alive=job.alive_nodes() - {node},
                nodes=request.node_range,
                store_host=job.store_host,
                wait_s=wait_s,
            )
        )
        if decision.path != LossPath.STAGE_RETRY:
            if not decision.idle_spare:
                write_node_lost(run_root, node=node)
            job.absorb(node)
        if drilled:
            job.lose_node(node)
        # Reaches on_event through the tail, like every other event.
        fault_event = events.emit(
            "fault",
            fault=fault,
            fault_kind="node-loss",
            step=step,
            node=node,
            rank=None,
            path=decision.path.value,
            detail=decision.reason,
        )
        lost.add(node)
        if not decision.idle_spare:  # open until the first step after the recovery
            run_state.open_fault(run_root, fault_event)
        if decision.idle_spare:
            # Nothing trained there: nothing to recover, and no later recovery may claim it.
            events.emit(
                "recovered",
                layer=LossPath.SPARE.value,
                fault=fault,
                fault_kind="node-loss",
                fault_step=step,
                rank=None,
                step=step,
                recovery_s=0.0,
            )
        elif decision.path == LossPath.STAGE_RETRY and drilled:
            # A loss the backend saw ends the attempt through its own classification.
            loss_at = time.monotonic()
        elif decision.path == LossPath.NODE_WAIT and waiting_until is None:
            # The survivors give up after their join timeout (and the attempt ends in a node
            # loss, so a stage retry); the watcher stops whatever is left a little later.
            waiting_until = time.monotonic() + wait_s + WAIT_GRACE_S
            wait_began = time.time()

    def pump() -> None:
        nonlocal world_nodes, waiting_until, last_step, fatal
        for e in tail.read_new_dicts():
            if e["kind"] == "fatal" and fatal is None and _of_epoch(e, epoch):
                fatal = e["error"]
            on_event(e)
            job.observe(e)
            if e["kind"] == "train_start" and isinstance(e.get("nodes"), list):
                named = frozenset(int(n) for n in e["nodes"])
                # -1: a worker no backend told its node; then which nodes train is unknown.
                world_nodes = named if all(n >= 0 for n in named) else frozenset()
                reformed.update(lost)
                # A lost node training again (its replacement joined): a later loss is new.
                lost.difference_update(world_nodes)
                if len(named) >= request.node_range.min and e["t"] > wait_began:
                    waiting_until = None  # a node returned in time: the world re-formed
            if e["kind"] != "step":
                continue
            last_step = max(e["step"], last_step or 0)
            for spec in drills:
                if spec.kind == "node-return" and (spec.node or 0) not in reformed:
                    continue
                if e["step"] >= spec.step and claim(run_root, spec):
                    drill(spec, e["step"])
        if waiting_until is not None:
            # No world trains while the survivors wait for a node: a lost node's return drill
            # comes now, its step notwithstanding (no step would ever reach it).
            for spec in drills:
                due = spec.kind == "node-return" and (spec.node or 0) in lost
                if due and claim(run_root, spec):
                    drill(spec, last_step or 0)
        # Losses only the backend saw (EKS: a node gone under its pod), after the drills'.
        for node in sorted(job.losses() - lost):
            where = f"@step={last_step},node={node}" if last_step is not None else f"@node={node}"
            lose(node, f"node-loss{where}", last_step, drilled=False)

    lease_lost = False
    try:
        while True:
            try:
                check_owner("watch (and stop) the attempt")
            except LeaseLost:
                lease_lost = True
                raise
            pump()
            if not job.running():
                break
            # After the watcher takes a node away and too few remain (tasks.loss_policy), the
            # survivors fail their collectives and then wait in rendezvous (bounded by
            # ft_launcher's join_timeout). The watcher knows the node is gone: it stops them
            # (after the backend's grace) instead of waiting.
            if loss_at is not None and time.monotonic() - loss_at >= job.loss_grace_s:
                job.stop()
                break
            if waiting_until is not None and time.monotonic() > waiting_until:
                job.stop()  # no node returned in time: the stage retry (the loss is recorded)
                break
            if deadline is not None and time.monotonic() - started > deadline:
                timed_out = True
                job.stop()
                break
            time.sleep(job.poll_s)
        ended = True
    finally:
        if not ended and not lease_lost:
            # Cancelled (Prefect's SIGTERM bridge, Ctrl-C) or crashed: nothing of the attempt
            # may stay behind holding the nodes, and a failure to stop must not hide why. (Its
            # new owner's, after a lost lease, is not this invocation's to stop.)
            with contextlib.suppress(Exception):
                job.stop()
    pump()
    evidence = Evidence(
        lost_nodes=frozenset(lost),
        timed_out=timed_out,
        result=_result(run_root, epoch),
        fatal=fatal,
        no_restart=read_no_restart(run_root, epoch=epoch),
        target_steps=cfg.steps,
        world_nodes=world_nodes,
    )
    outcome = job.outcome(evidence)
    check_owner("release the attempt")
    kept = job.finish(outcome)
    if outcome.kind == EndKind.NODE_LOSS and not lost:
        # A real loss (not a drill): recorded as a fault, so the next attempt's ``recovered``
        # event (the trainer emits it) closes it with layer ``stage-retry``.
        step = last_step
        fault_event = events.emit(
            "fault",
            fault=f"node-loss@step={step}" if step is not None else "node-loss",
            fault_kind="node-loss",
            step=step,
            node=None,
            rank=None,
            nodes=outcome.details.get("lost_nodes", []),
            detail=outcome.message,
        )
        run_state.open_fault(run_root, fault_event)
    wall = time.monotonic() - started
    events.emit(
        "stage_attempt_end",
        stage="train",
        attempt=job.attempt,
        outcome=outcome.kind.value,
        message=outcome.message,
        wall_s=round(wall, 3),
        **kept,
    )
    pump()
    return AttemptReport(job.attempt, outcome, wall, kept)


def _attempt_event(
    events: EventLog,
    backend: Backend,
    request: LaunchRequest,
    attempt: int,
    *,
    adopted: bool = False,
) -> None:
    events.emit(
        "stage_attempt",
        stage="train",
        attempt=attempt,
        nodes=request.nodes,
        nproc_per_node=request.nproc_per_node,
        backend=backend.name,
        **({"adopted": True} if adopted else {}),
    )
