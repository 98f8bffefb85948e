"""A run's history, folded once from its typed events: what every reader decides and reports from.

:class:`RunHistory` takes events one at a time, in file order, and keeps only what its readers
ask. Its state grows with attempts, faults, restarts and world changes, never with steps: a 1
M-step log folds in the memory of a 1 k-step one (``benchmarks/fold_events.py``).

Productive time (each step's *last* execution: a replay replaces the lost one) is kept exactly
with a window: a step's time is final once a kept checkpoint at or after it exists, since no
resume goes back past the oldest kept checkpoint (a fresh start discards everything). The window
spans at most the checkpoints kept and one interval.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from pathlib import Path

from trainer.event_types import (
    Checkpoint,
    Event,
    Fatal,
    Fault,
    MemoryInterval,
    Recovered,
    Restart,
    Resume,
    StageAttempt,
    StageAttemptEnd,
    Step,
    Straggler,
    Takeover,
    TimeoutsSet,
    TrainEnd,
    WorldChange,
)
from trainer.records import (
    AttemptView,
    FaultRecord,
    RunSummary,
    StragglerRecord,
    TimeBreakdown,
    WorldChangeRecord,
)
from trainer.rundir import RunDir

# Straggler confirmations remembered (each takes windows of steps; a node that flaps for days
# must not grow the fold with them): the newest.
KEPT_STRAGGLERS = 100
# Committed checkpoints remembered for the window: a writer that never reports pruning (the
# torchrun baseline) is bounded here; a resume from further back is not a case to plan for.
KEPT_CHECKPOINTS = 64


class RunHistory:
    """The fold. ``since`` (unix time) ignores older events: one invocation's share of a run
    resumed by several."""

    def __init__(self, *, since: float = 0.0) -> None:
        self.since = since
        # The newest epoch on record: an older epoch's event after it is a replaced attempt's
        # zombie (its appends are not fenced) and counts for nothing here.
        self.epoch: int | None = None
        self.stale_events = 0
        self.events_seen = 0
        self.attempts: list[AttemptView] = []
        self._train_wall_s = 0.0
        # (stage, attempt) -> when its newest end event was written
        self.ended_attempts: dict[tuple[str, int], float] = {}
        self._last_end_message: str | None = None
        self.faults: list[Fault] = []
        self._recovered: dict[tuple[str | None, int | None], Recovered] = {}
        self.world_changes: list[WorldChange] = []
        self.stragglers: list[Straggler] = []  # confirmed, replaced or rate-limited only
        self.restarts: list[Restart] = []
        self.timeouts: TimeoutsSet | None = None  # the newest in-job timeouts rank 0 applied
        self.memory_interval: MemoryInterval | None = None  # the newest memory cadence chosen
        self.takeover: Takeover | None = None
        self.end: TrainEnd | Fatal | None = None  # the newest train_end or fatal
        self.first_fatal: Fatal | None = None
        self.train_ended = False
        # Steps
        self.last_step: Step | None = None
        self.max_step = 0
        self.steps_run = 0
        self.last_progress_t: float | None = None  # newest step/checkpoint/restart/resume
        # Checkpoints
        self.checkpoints = 0
        self.last_checkpoint: Checkpoint | None = None
        self.blocking_max: float | None = None
        self._blocking_sum = 0.0
        # Productive time: final seconds, and the window of steps a resume may still replay.
        self._final_s = 0.0
        self._window: dict[int, float] = {}
        self._kept: list[int] = []  # committed steps not pruned, ascending
        # The time breakdown (TimeBreakdown): running sums, and the open train attempt's bounds.
        self._steps_s = 0.0  # every execution's step time
        self._step_blocking_s = 0.0
        self._time = {"startup": 0.0, "recovery": 0.0, "end": 0.0, "other": 0.0}
        self._attempt_t: float | None = None  # the open train attempt's start
        # The time parts before the open attempt began (``_close_attempt`` may scale its own).
        self._time_before: dict[str, float] = dict(self._time)
        self._timed_before = 0.0  # and the step and blocking seconds before it
        self._prev_step_t: float | None = None  # its newest step event
        self._disturbed = False  # a fault or restart since that step
        # Per fault: the step training went back to, and how many completed steps ran again.
        self._resumed: dict[tuple[str | None, int | None], tuple[int, int, Resume | None]] = {}
        # Per fault still open: the newest load since it (what its recovery resumed from). Per
        # fault: another rank's fault can be recorded before the first one's recovered event.
        self._load_of: dict[tuple[str | None, int | None], Resume] = {}

    # -- building -------------------------------------------------------------------------

    @classmethod
    def read(cls, run_root: Path, *, since: float = 0.0) -> RunHistory:
        """The fold of a run's ``events.jsonl``, streamed (never held whole)."""
        return cls.of(RunDir(run_root).event_reader().iter_new(), since=since)

    @classmethod
    def of(cls, events: Iterable[Event], *, since: float = 0.0) -> RunHistory:
        """The fold of events already read."""
        h = cls(since=since)
        for e in events:
            h.observe(e)
        return h

    def stale(self, ev: Event) -> bool:
        """Of an epoch older than the newest on record: a zombie's."""
        return ev.epoch is not None and self.epoch is not None and ev.epoch < self.epoch

    def observe(self, ev: Event) -> None:
        if ev.t < self.since:
            return
        if self.stale(ev):
            self.stale_events += 1
            return
        if ev.epoch is not None:
            self.epoch = ev.epoch
        self.events_seen += 1
        if isinstance(ev, Step):
            self._step(ev)
        elif isinstance(ev, Checkpoint):
            self._checkpoint(ev)
        elif isinstance(ev, Fault):
            self.faults.append(ev)
            self._disturbed = True
        elif isinstance(ev, Recovered):
            if (ev.fault, ev.fault_step) not in self._recovered:
                # Made right after the first step since the restart: training went back to the
                # step before it, and every step done up to the fault runs again.
                back_to = max(0, ev.step - 1)
                self._resumed[(ev.fault, ev.fault_step)] = (
                    back_to,
                    max(0, self.max_step - back_to),
                    self._load_of.get((ev.fault, ev.fault_step)),
                )
            self._recovered.setdefault((ev.fault, ev.fault_step), ev)
        elif isinstance(ev, Restart):
            self.restarts.append(ev)
            self.last_progress_t = ev.t
            self._disturbed = True
        elif isinstance(ev, Resume):
            self.last_progress_t = ev.t
            if ev.action == "fresh":
                self._final_s, self._window, self._kept = 0.0, {}, []
            elif ev.action == "loaded" and ev.step is not None:
                for f in self.faults:
                    key = (f.fault, f.step)
                    if key not in self._recovered and f.t <= ev.t:
                        self._load_of[key] = ev
                # Steps after the loaded checkpoint run again: their earlier execution is lost.
                for s in [s for s in self._window if s > ev.step]:
                    del self._window[s]
        elif isinstance(ev, StageAttempt):
            self.attempts.append(AttemptView(ev.attempt, ev.stage, ev.t, ev.backend, ev.adopted))
            if ev.stage == "train":
                self._attempt_t, self._prev_step_t = ev.t, None
                self._time_before = dict(self._time)
                self._timed_before = self._steps_s + self._step_blocking_s
        elif isinstance(ev, StageAttemptEnd):
            self._last_end_message = ev.message
            self.ended_attempts[(ev.stage, ev.attempt)] = ev.t
            if ev.stage == "train":
                self._train_wall_s += ev.wall_s
                self._close_attempt(ev)
            for a in self.attempts:
                same = (a.stage, a.attempt) == (ev.stage, ev.attempt)
                if same and a.outcome is None and a.t <= ev.t:
                    a.outcome, a.message, a.wall_s = ev.outcome, ev.message, ev.wall_s
        elif isinstance(ev, WorldChange):
            self.world_changes.append(ev)
        elif isinstance(ev, Straggler):
            if ev.verdict not in ("suspect", "cleared"):
                self.stragglers = [*self.stragglers, ev][-KEPT_STRAGGLERS:]
        elif isinstance(ev, TimeoutsSet):
            self.timeouts = ev
        elif isinstance(ev, MemoryInterval):
            self.memory_interval = ev
        elif isinstance(ev, TrainEnd):
            self.end, self.train_ended = ev, True
        elif isinstance(ev, Fatal):
            self.end = ev
            self.first_fatal = self.first_fatal or ev
        elif isinstance(ev, Takeover):
            self.takeover = self.takeover or ev

    def _step(self, ev: Step) -> None:
        blocking = ev.ckpt_blocking_s or 0.0
        self._steps_s += ev.step_s
        self._step_blocking_s += blocking
        began = ev.t - ev.step_s - blocking  # the event is made after the step and its save
        if self._prev_step_t is not None:
            self._time["recovery" if self._disturbed else "other"] += max(
                0.0, began - self._prev_step_t
            )
        elif self._attempt_t is not None:
            self._time["startup"] += max(0.0, began - self._attempt_t)
        self._prev_step_t, self._disturbed = ev.t, False
        self.steps_run += 1
        self.last_step = ev
        self.max_step = max(self.max_step, ev.step)
        self.last_progress_t = ev.t
        floor = self._kept[0] if self._kept else 0
        if ev.step > floor:
            self._window[ev.step] = ev.step_s
        else:  # a replay from before the oldest kept checkpoint: not a path of ours
            self._final_s += ev.step_s

    def _close_attempt(self, ev: StageAttemptEnd) -> None:
        if self._attempt_t is None:
            return  # its start is before ``since``
        if self._prev_step_t is None:  # no step at all: it never got past its start
            self._time["startup"] += max(0.0, ev.t - self._attempt_t)
        else:
            tail = max(0.0, ev.t - self._prev_step_t)
            done = ev.outcome == "completed" and not self._disturbed
            self._time["end" if done else "recovery"] += tail
        # The parts above are wall-clock spans, wall_s is monotonic: where the wall clock ran
        # ahead (a paused VM resumed), scale this attempt's spans down to fit (the steps' own
        # measured seconds stay).
        timed = self._steps_s + self._step_blocking_s - self._timed_before
        span = ev.t - self._attempt_t
        if span > ev.wall_s > 0 and span > timed:
            factor = max(0.0, ev.wall_s - timed) / (span - timed)
            for k, before in self._time_before.items():
                self._time[k] = before + (self._time[k] - before) * factor
        self._attempt_t, self._prev_step_t, self._disturbed = None, None, False

    def time_breakdown(self) -> TimeBreakdown | None:
        """Where the train stage's wall time went (None before any train attempt ended)."""
        wall = self._train_wall_s
        if wall <= 0:
            return None
        productive = self.productive_s()
        parts = {
            "startup": self._time["startup"],
            "productive": productive,
            "replayed": max(0.0, self._steps_s - productive),
            "checkpoint_blocking": self._step_blocking_s,
            "recovery": self._time["recovery"],
            "end": self._time["end"],
        }
        # The rest, so that the parts add up to the wall time the ETTR is taken over.
        parts["other"] = wall - sum(parts.values())
        return TimeBreakdown(wall_s=round(wall, 3), **{k: round(v, 3) for k, v in parts.items()})

    def _checkpoint(self, ev: Checkpoint) -> None:
        self.checkpoints += 1
        self.last_checkpoint = ev
        self.last_progress_t = ev.t
        self.blocking_max = max(ev.blocking_s, self.blocking_max or 0.0)
        self._blocking_sum += ev.blocking_s
        if ev.step not in self._kept:
            bisect.insort(self._kept, ev.step)
        for s in ev.pruned:
            if s in self._kept:
                self._kept.remove(s)
        del self._kept[:-KEPT_CHECKPOINTS]
        if self._kept:  # steps at or before the oldest kept checkpoint never run again
            floor = self._kept[0]
            for s in [s for s in self._window if s <= floor]:
                self._final_s += self._window.pop(s)

    # -- views ----------------------------------------------------------------------------

    def fault_records(self) -> list[FaultRecord]:
        """Every fault with the layer that recovered it and how long it took (``none`` if no
        ``recovered`` event closed it)."""
        out = []
        for f in self.faults:
            r = self._recovered.get((f.fault, f.step))
            resume_step, replayed, loaded = self._resumed.get((f.fault, f.step), (None, None, None))
            out.append(
                FaultRecord(
                    **f.model_dump(
                        include={"fault", "step", "rank", "node", "path", "detail", "t"}
                    ),
                    kind=f.fault_kind,
                    recovered_by=r.layer if r else "none",
                    recovery_s=r.recovery_s if r else None,
                    resume_step=resume_step,
                    replayed_steps=replayed,
                    resume_source=(loaded.source or "durable") if loaded else None,
                    load_bytes=loaded.bytes if loaded else None,
                    load_s=loaded.load_s if loaded else None,
                )
            )
        return out

    def world_change_records(self) -> list[WorldChangeRecord]:
        """Every time an elastic job re-formed on another number of ranks (trainer.elastic)."""
        return [WorldChangeRecord.model_validate(c.model_dump()) for c in self.world_changes]

    def straggler_records(self) -> list[StragglerRecord]:
        """Every node confirmed slow (tasks.straggler), with its score and the evidence."""
        return [
            StragglerRecord.model_validate(
                e.model_dump(
                    include={"node", "verdict", "score", "steps", "seconds", "evidence", "t"}
                )
            )
            for e in self.stragglers
        ]

    def stage_attempts(self, stage: str = "train") -> int:
        return sum(1 for a in self.attempts if a.stage == stage)

    def train_wall_s(self) -> float:
        return self._train_wall_s

    def productive_s(self) -> float:
        """Seconds of the steps that count: each step's last execution."""
        return self._final_s + sum(self._window.values())

    def ettr(self, *, now: float | None = None) -> float | None:
        """Productive step time / train-stage wall time; ``now``: a running attempt's counts too."""
        wall = self.train_wall_s()
        if now is not None and self._attempt_t is not None:
            wall += max(0.0, now - self._attempt_t)
        return round(self.productive_s() / wall, 4) if wall > 0 else None

    def progress(self) -> int:
        """The newest step reported (0 before any)."""
        return self.last_step.step if self.last_step else 0

    def last_attempt_cause(self) -> str | None:
        """Why the newest ended train attempt ended (its ``stage_attempt_end`` message)."""
        return self._last_end_message

    def summary(self) -> RunSummary:
        """``python -m trainer.report``: faults with their recovery, checkpoints, steps."""
        n, end = self.checkpoints, self.end
        return RunSummary(
            final_step=self.max_step,
            steps_run=self.steps_run,
            final_loss=self.last_step.loss if self.last_step else None,
            faults=self.fault_records(),
            world_changes=self.world_change_records(),
            timeouts=self.timeouts.detail if self.timeouts is not None else None,
            restart_layers=[r.layer for r in self.restarts],
            checkpoints=n,
            ckpt_blocking_s_max=self.blocking_max,
            ckpt_blocking_s_mean=self._blocking_sum / n if n else None,
            outcome=None if end is None else "completed" if isinstance(end, TrainEnd) else "failed",
            params_sha256=end.params_sha256 if isinstance(end, TrainEnd) else None,
        )
