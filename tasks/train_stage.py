"""One attempt of the train stage on any backend: launch (or reattach), watch (progress, node-loss
drills, deadline), judge, release. Plain functions (no Prefect): the stage flow adds logging and
artifacts through callbacks.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tasks import straggler
from tasks.attempt_start import start
from tasks.backends.base import (
    Backend,
    Cordons,
    ElasticJob,
    EvictDrills,
    Job,
    LaunchRequest,
    ReturnDrills,
)
from tasks.classify import EndKind, Evidence, Outcome, judge
from tasks.loss_policy import LossDecision, LossPath, LossSnapshot, decide
from tasks.off_loop import OffLoop, bounded
from tasks.ownership.lease import LeaseLost
from tasks.watch_state import (
    Tick,
    WatchState,
    beat,
    condemned,
    drop,
    due,
    frozen,
    leaving,
    lost,
    mine,
    observe,
    quiet,
    returned,
    silent,
    tick,
)
from trainer.elastic import NodeRange
from trainer.event_types import (
    Event,
    Fault,
    NodeReturn,
    Recovered,
    StageAttemptEnd,
    Step,
    StepCheck,
    TrainStart,
)
from trainer.events import EventLog
from trainer.faults import FaultSpec
from trainer.rundir import RunDir

# After a wait for a returning node (tasks.loss_policy NODE_WAIT), how long past the survivors'
# own join timeout the watcher lets them end by themselves before it stops the attempt.
WAIT_GRACE_S = 10.0
# How long the loop waits for a read of the shared filesystem on each poll (it goes on in the
# background and is picked up by a later poll), and once the attempt is over.
READ_TIMEOUT_S = 1.0
END_READ_TIMEOUT_S = 10.0

_log = logging.getLogger(__name__)


@dataclass
class AttemptReport:
    attempt: int
    outcome: Outcome
    wall_s: float
    released: dict[str, Any] = field(default_factory=dict)  # what Job.finish reported


def run_attempt(
    backend: Backend,
    request: LaunchRequest,
    *,
    on_event: Callable[[Event], None] = lambda e: None,
    check_owner: Callable[[str], None] = lambda action: None,
    clock: Callable[[], float] = time.monotonic,
) -> AttemptReport:
    """Run one attempt and watch it to its end, ``request.deadline_s`` at most; or, when the
    backend finds one of this run still running and healthy (a dead invocation's, arch §6),
    only watch that: no relaunch, its result stands.

    Every decision is a pure transition of :mod:`tasks.watch_state` on ``clock``'s time; this
    shell reads (off the loop, with timeouts: a hung mount or a FIFO never holds the deadline
    or a cancel) and acts. An error while observing is logged and the watch goes on: only a
    decided outcome, the deadline or a cancel stops a job. ``check_owner(action)`` (the
    lease's :meth:`RunLease.check`) runs before the launch, on every poll and before the
    release; once it raises :class:`LeaseLost` the attempt is left to the run's new owner."""
    cfg = request.cfg
    run_dir = RunDir(cfg.run_root)
    run_dir.root.mkdir(parents=True, exist_ok=True)
    # Only what is appended from now on: this attempt's events.
    tail = run_dir.event_reader(from_start=False)
    started = clock()
    check_owner("start an attempt")
    job, run_dir, events, fatal, request, evicted_at = start(backend, request, run_dir)
    # An elastic job's survivors below its minimum wait in the rendezvous for a node to return,
    # as long as their own join timeout lets them (tasks.loss_policy NODE_WAIT); a fixed-size
    # job's lost node nothing replaces in-job (nor one whose backend cannot re-form it).
    elastic = isinstance(job, ElasticJob) and (request.node_range.elastic or request.spares > 0)
    # The drills the watcher carries out: node losses and returns, in step order.
    drills = (f for f in cfg.faults if f.is_node_fault)
    state = WatchState(
        started=started,
        deadline_s=request.deadline_s,
        loss_grace_s=job.loss_grace_s,
        wait_s=cfg.injob.rdzv_join_timeout_s if elastic else 0.0,
        min_nodes=request.node_range.min,
        wait_grace_s=WAIT_GRACE_S,
        silence_s=cfg.injob.seconds("node_silence_s"),
        epoch=run_dir.epoch,
        drills=tuple(sorted(drills, key=lambda f: (f.step, not f.kills_node))),
        fatal=fatal,
    )
    watch = _Watch(
        state, job, request, run_dir, events, on_event, clock,
        events_read=OffLoop("the event log", tail.read_new),
        beats_read=OffLoop("the node beats", run_dir.beats),
        # The eviction budget spans the run's attempts (read from its record at the start).
        slow=straggler.StragglerState(evicted_at=evicted_at),
    )  # fmt: skip
    _watch_to_the_end(watch, check_owner)
    watch.pump(END_READ_TIMEOUT_S)
    outcome, kept = _conclude(watch, check_owner)
    wall = clock() - started
    events.emit(
        StageAttemptEnd(
            stage="train",
            attempt=job.attempt,
            outcome=outcome.kind.value,
            message=outcome.message,
            wall_s=round(wall, 3),
            **kept,
        )
    )
    watch.pump(END_READ_TIMEOUT_S)
    return AttemptReport(job.attempt, outcome, wall, kept)


def _watch_to_the_end(watch: _Watch, check_owner: Callable[[str], None]) -> None:
    """Polls until the watch decides, stopping the job where the decision is not its own end;
    on a cancel or a crash the job is stopped too, but not after a lost lease: then it is the
    run's new owner's."""
    job = watch.job
    # The lease's poll reads the shared filesystem too: off the loop, like the event log. A
    # read stuck past its timeout says nothing about the owner (the deadline still decides);
    # once stuck, later polls only look whether it has answered.
    owner_read = OffLoop("the lease", lambda: check_owner("watch (and stop) the attempt"))
    try:
        while True:
            try:
                owner_read.call(0.0 if owner_read.stuck else READ_TIMEOUT_S)
            except LeaseLost:
                raise
            except Exception as e:  # Stuck, or the read's own error: not a lost lease
                watch.complain("reading the lease", e)
            watch.pump(READ_TIMEOUT_S)
            verdict = watch.tick()
            if verdict != Tick.CONTINUE:
                if verdict != Tick.ENDED:
                    _log.info("stopping %s: %s", job.name, verdict.value)
                    job.stop()
                return
            time.sleep(job.poll_s)
    except LeaseLost:
        raise  # the attempt is its new owner's now, not this invocation's to stop
    except BaseException:
        # Cancelled (Prefect's SIGTERM bridge, Ctrl-C) or crashed acting: nothing of the
        # attempt may stay behind holding the nodes, and a failure to stop must not hide why.
        with contextlib.suppress(Exception):
            job.stop()
        raise


def _conclude(watch: _Watch, check_owner: Callable[[str], None]) -> tuple[Outcome, dict[str, Any]]:
    """The attempt's outcome, judged once over the backend's observation and the watch's
    evidence, and what releasing the job reported."""
    s, job, run_dir, cfg = watch.state, watch.job, watch.run_dir, watch.request.cfg
    evidence = Evidence(
        lost_nodes=frozenset(s.lost),
        timed_out=s.timed_out,
        result=bounded("result.json", run_dir.result, END_READ_TIMEOUT_S, None),
        fatal=s.fatal,
        no_restart=bounded("the no_restart marker", run_dir.no_restart, END_READ_TIMEOUT_S, None),
        target_steps=cfg.steps,
        world_nodes=s.world_nodes,
    )
    outcome = judge(job.observation(), evidence)
    check_owner("release the attempt")
    kept = job.finish(outcome)
    if outcome.kind == EndKind.NODE_LOSS and not s.lost:
        # A real loss (not a drill): recorded as a fault, so the next attempt's ``recovered``
        # event (the trainer emits it) closes it with layer ``stage-retry``.
        step = s.last_step
        fault_event = watch.events.emit(
            Fault(
                fault=f"node-loss@step={step}" if step is not None else "node-loss",
                fault_kind="node-loss",
                step=step,
                nodes=outcome.details.get("lost_nodes", []),
                detail=outcome.message,
            )
        )
        run_dir.open_fault(fault_event)
    return outcome, kept


@dataclass
class _Watch:
    """The shell around :class:`WatchState`: reads what the transitions need and carries out
    what they decide (drills, losses) through the job."""

    state: WatchState
    job: Job
    request: LaunchRequest
    run_dir: RunDir
    events: EventLog
    on_event: Callable[[Event], None]
    clock: Callable[[], float]
    events_read: OffLoop[list[Event]]
    beats_read: OffLoop[dict[int, str]]
    # What went wrong observing, said once each.
    _complaints: dict[str, str] = field(default_factory=dict)
    # The straggler judge's state (tasks.straggler).
    slow: straggler.StragglerState = field(default_factory=straggler.StragglerState)

    def complain(self, what: str, e: BaseException) -> None:
        """An observation failed: said once per kind of failure (until it changes), never
        raised: the next poll tries again and the deadline still holds."""
        text = f"{type(e).__name__}: {e}"
        if self._complaints.get(what) != text:
            self._complaints[what] = text
            _log.warning("watching %s: %s failed (%s); watching on", self.job.name, what, text)

    def tick(self) -> Tick:
        try:
            running = self.job.running()
        except Exception as e:
            self.complain("polling the job", e)
            running = True  # not known to have ended: the deadline still decides
        self.state, verdict = tick(self.state, self.clock(), running=running)
        return verdict

    def pump(self, timeout: float) -> None:
        try:
            batch = self.events_read.call(timeout)
        except Exception as err:  # Stuck (a hung mount), or the read's own error
            self.complain("reading the event log", err)
            batch = []
        for event in batch:
            if not mine(self.state, event):  # another epoch's: not this attempt's to count
                continue
            self.state = observe(self.state, event, self.clock())
            for what, fn in (("on_event", self.on_event), ("the job's observe", self.job.observe)):
                try:
                    fn(event)
                except Exception as err:
                    self.complain(what, err)
            self._drills(event.step if isinstance(event, Step) else None)
            if isinstance(event, StepCheck):
                for node in condemned(self.state, event):
                    self._condemn(node, event)
            if isinstance(event, (Step, TrainStart)):
                self._stragglers(event)
        self._drills(None)
        try:
            self.state = beat(self.state, self.beats_read.call(min(timeout, 1.0)), self.clock())
        except Exception as e:
            self.complain("reading the node beats", e)
        for node in leaving(self.state):
            self._evicted(node)
        for node in silent(self.state, self.clock()):
            self._silent(node)
        # Losses only the backend saw (EKS: a node gone under its pod), after the drills'.
        try:
            seen = self.job.losses()
        except Exception as e:
            self.complain("asking the backend for lost nodes", e)
            seen = frozenset()
        for node in sorted(seen - self.state.lost):
            step = self.state.last_step
            self._lose(node, _loss_name(step, node), step, drilled=False)

    def _drills(self, at_step: int | None) -> None:
        while (spec := due(self.state, at_step)) is not None:
            self.state = drop(self.state, spec)
            if self.run_dir.claim(spec.slug):  # fire-once per run, across attempts
                self._drill(spec, at_step if at_step is not None else self.state.last_step or 0)

    def _drill(self, spec: FaultSpec, step: int) -> None:
        node = spec.target_node
        job = self.job
        if spec.returns_node:
            if not isinstance(job, ReturnDrills):
                raise ValueError(f"{spec}: {job.name} cannot start a lost node again")
            self.events.emit(NodeReturn(fault=str(spec), step=step, node=node))
            job.restore_node(node)
            self.state = returned(self.state, node)
        elif spec.freezes_node:
            # Its agent stops the node (trainer.node_beat): the same on every backend.
            _log.warning("drill %s: node %d told to stop every process of its own", spec, node)
            self.run_dir.request_freeze(node)
            self.state = frozen(self.state, node, spec)
        elif spec.evicts_node:
            grace = self.request.cfg.injob.evict_grace_s
            why = f"node {node} evicted with notice (SIGTERM, SIGKILL {grace:g} s later)"
            self._lose(
                node, str(spec), step, drilled=True, why=why, evict_grace_s=grace, notice_s=grace
            )
        else:
            self._lose(node, str(spec), step, drilled=True)

    def _condemn(self, node: int, e: StepCheck) -> None:
        """A node whose step failed its check again on replay: corrupting, so taken away."""
        why = (
            f"node {node} failed step {e.step}'s check twice (rejected, then again on replay: "
            f"{e.reason}): a node that corrupts, taken away"
        )
        _log.warning("%s", why)
        fault = f"step-check@step={e.step},node={node}"
        self._lose(node, fault, e.step, drilled=True, why=why, best_effort=True)

    def _stragglers(self, event: Step | TrainStart) -> None:
        """Each step's per-node busy times judged (tasks.straggler; a train_start is a new
        median); every verdict said as a ``straggler`` event; under policy ``replace`` a
        confirmed node is taken away as lost (cordoned first where the backend can)."""
        if isinstance(event, TrainStart):
            self.slow = straggler.restarted(self.slow, self.state.world_nodes)
            return
        cfg = self.request.cfg.straggler
        sample = straggler.Sample.of(event)
        nodes = self.request.nodes
        self.slow, verdicts = straggler.judge(self.slow, sample, event.t, cfg, nodes_total=nodes)
        for v in verdicts:
            self.events.emit(straggler.event(v, cfg))
            if v.kind != straggler.Kind.REPLACED or v.node in self.state.lost:
                continue
            _log.warning("straggler: %s; taking it away", v.evidence)
            if isinstance(self.job, Cordons):
                try:
                    self.job.cordon_node(v.node)
                except Exception as e:  # its replacement may land on it again: said, not fatal
                    self.complain(f"cordoning node {v.node}", e)
            fault = f"slow@step={event.step},node={v.node}"
            why = f"slow node taken away: {v.evidence}"
            self._lose(
                v.node, fault, event.step, drilled=True, why=why, best_effort=True,
                fault_kind="slow",
            )  # fmt: skip

    def _evicted(self, node: int) -> None:
        """A node told to go that no drill of ours evicted (a drain, a spot reclaim: its agent
        got SIGTERM and says so in its beat): taken away as lost, named as an eviction; its
        workers save the step in flight and leave on their own (trainer.notice)."""
        step = self.state.last_step
        fault = _loss_name(step, node) if step is None else f"node-evict@step={step},node={node}"
        grace = self.request.cfg.injob.evict_grace_s
        why = f"node {node} evicted with notice (its agent got SIGTERM; {grace:g} s to leave)"
        _log.warning("%s", why)
        self._lose(node, fault, step, drilled=True, why=why, notice_s=grace)

    def _silent(self, node: int) -> None:
        """A training node silent past the bound while others beat: taken away as lost."""
        s = self.state
        b = s.beats.get(node)
        since = max(s.world_at or 0.0, b.changed_at if b is not None else 0.0)
        quiet = (s.beats_read_at or self.clock()) - since
        step = s.last_step
        fault = s.frozen.get(node, _loss_name(step, node))
        why = f"node {node} silent for {quiet:.0f} s (no beat: frozen or partitioned), taken away"
        _log.warning("%s", why)
        self._lose(node, fault, step, drilled=True, why=why, best_effort=True)

    def _decide(self, node: int) -> LossDecision:
        """The path the loss of ``node`` takes (tasks.loss_policy), from what is known now."""
        job, request = self.job, self.request
        return decide(
            LossSnapshot(
                lost=node,
                world_nodes=self.state.world_nodes,
                # A node alive to the backend but silent (a frozen one) is no spare.
                alive=job.alive_nodes() - {node} - quiet(self.state, self.clock()),
                nodes=(
                    request.node_range
                    if isinstance(job, ElasticJob)
                    else NodeRange(request.nodes, request.nodes)
                ),
                store_host=job.store_host,
                wait_s=self.state.wait_s,
            )
        )

    def _lose(
        self,
        node: int,
        fault: str,
        step: int | None,
        *,
        drilled: bool,
        why: str = "",
        best_effort: bool = False,
        evict_grace_s: float | None = None,
        notice_s: float | None = None,
        fault_kind: str = "node-loss",
    ) -> None:
        """A node lost, by a drill or a silence (``drilled``: the watcher takes it away now)
        or as the backend saw it: which path its loss takes, decided once, and recorded.
        ``evict_grace_s``: the drill evicts it with that grace; ``notice_s``: it was evicted
        with that much notice (by the drill or not), and is not ended here: it leaves on its
        own once its step is saved, which a stop waits for."""
        job, run_dir = self.job, self.run_dir
        # Decided before a drilled node goes: the survivors read the marker the moment they fail.
        decision = self._decide(node)
        if decision.path != LossPath.STAGE_RETRY and isinstance(job, ElasticJob):
            if not decision.idle_spare:
                run_dir.write_node_lost(node=node)
            job.absorb(node)
        try:
            if drilled and evict_grace_s is not None:
                if not isinstance(job, EvictDrills):
                    raise ValueError(f"{fault}: {job.name} cannot evict a node")
                job.evict_node(node, evict_grace_s)
            elif drilled and notice_s is None:
                job.lose_node(node)
        except Exception as e:
            # A silent node: ending it is best effort (its pod may be gone already, or its host
            # unreachable); its loss is decided and recorded either way, and a writer of it
            # that wakes is fenced by the next attempt's epoch.
            if not best_effort:
                raise
            _log.warning("could not end silent node %d: %s: %s", node, type(e).__name__, e)
        # Reaches on_event through the tail, like every other event.
        fault_event = self.events.emit(
            Fault(
                fault=fault,
                fault_kind=fault_kind,
                step=step,
                node=node,
                path=decision.path.value,
                detail=f"{why}; {decision.reason}" if why else decision.reason,
            )
        )
        self.state = lost(
            self.state,
            node,
            decision,
            drilled=drilled,
            now=self.clock(),
            wall=time.time(),
            notice_s=notice_s,
        )
        if not decision.idle_spare:  # open until the first step after the recovery
            run_dir.open_fault(fault_event)
        else:
            # Nothing trained there: nothing to recover, and no later recovery may claim it.
            self.events.emit(
                Recovered(
                    layer=LossPath.SPARE.value,
                    fault=fault,
                    fault_kind=fault_kind,
                    fault_step=step,
                    step=step or 0,  # no step read yet: before the first
                    recovery_s=0.0,
                )
            )


def _loss_name(step: int | None, node: int) -> str:
    return f"node-loss@step={step},node={node}" if step is not None else f"node-loss@node={node}"
