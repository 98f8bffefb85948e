"""How a train attempt begins (arch §4 and §6): launched under a new epoch published first, or
adopted from a dead watcher under the epoch it published; either way its ``stage_attempt``
event, and what an adopted attempt said before the new watcher came."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import NamedTuple

from tasks import evict_grace, straggler
from tasks.backends.base import Backend, Job, LaunchRequest
from tasks.errors import FenceBusy
from tasks.off_loop import bounded
from trainer.event_types import Event, Fatal, StageAttempt
from trainer.events import EventLog
from trainer.rundir import RunDir

# How long a read of the shared filesystem may take at an attempt's start.
READ_TIMEOUT_S = 10.0


class Started(NamedTuple):
    job: Job
    run_dir: RunDir  # under the attempt's epoch
    events: EventLog
    fatal: str | None  # the first fatal error it said before we came (adopted)
    request: LaunchRequest  # as launched: its epoch, its eviction grace sized (tasks.evict_grace)
    # The run's recorded straggler evictions (tasks.straggler.recorded_evictions): the budget
    # spans attempts.
    evicted_at: tuple[float, ...]


class _Record(NamedTuple):
    measured: evict_grace.Measured | None  # None: the log did not answer
    evicted_at: tuple[float, ...]


def start(backend: Backend, request: LaunchRequest, run_dir: RunDir) -> Started:
    """The attempt's job, launched now or adopted (see :class:`Started`)."""
    job = backend.reattach(request)
    if job is None:
        # A new epoch first: from here on, no writer of an earlier attempt (a pod on an
        # unreachable node, a frozen host that wakes) changes the run root (trainer.fence). A
        # fence lock held past its timeout (a writer frozen holding it) launches nothing: a
        # stage retry's (FenceBusy), not the run's end.
        try:
            run_dir = run_dir.publish(invocation=request.invocation, attempt=request.attempt)
        except TimeoutError as e:  # trainer.fence.LockTimeout
            raise FenceBusy(f"attempt {request.attempt} not launched: {e}") from e
        record = _record(request, run_dir)
        grace = _grace(request.cfg.injob.evict_grace_s, record.measured)
        cfg = request.cfg
        cfg = dataclasses.replace(
            cfg, injob=dataclasses.replace(cfg.injob, evict_grace_s=grace.seconds)
        )
        request = dataclasses.replace(request, epoch=run_dir.epoch, cfg=cfg)
        events = EventLog(run_dir.root, epoch=run_dir.epoch)
        run_dir.clear_result()  # only this attempt's result counts
        run_dir.clear_markers()  # nor an earlier attempt's verdict (the config was fixed)
        run_dir.clear_other_beats()
        run_dir.record_retry(request.attempt)
        events.emit(_attempt(backend, request, request.attempt, adopted=False, grace=grace))
        job = backend.launch(request)
        return Started(job, run_dir, events, None, request, record.evicted_at)
    # Adopted: the attempt runs under the epoch its (dead) watcher published, the highest
    # on record (epoch.json's, or the event log's where that file was lost).
    run_dir = run_dir.adopted()
    events = EventLog(run_dir.root, epoch=run_dir.epoch)
    # What the attempt said before we came: a fatal error there decides its outcome too.
    fatal = bounded(
        "the event log", lambda: _fatal_since_last_attempt_start(run_dir),
        READ_TIMEOUT_S, None,
    )  # fmt: skip
    events.emit(_attempt(backend, request, job.attempt, adopted=True))
    # Its eviction grace is what its first watcher rendered: not known here, the configured one
    # stands for it.
    adopted = dataclasses.replace(request, epoch=run_dir.epoch)
    return Started(job, run_dir, events, fatal, adopted, _record(request, run_dir).evicted_at)


def _record(request: LaunchRequest, run_dir: RunDir) -> _Record:
    """What an attempt starts from in the run's event log, in one bounded pass: the longest step
    and save (the eviction grace) and the straggler evictions (their budget). A log that does
    not answer leaves the configured grace and a fresh budget."""

    def read() -> _Record:
        measured = evict_grace.Measured()

        def events() -> Iterator[Event]:
            nonlocal measured
            for e in run_dir.event_reader().iter_new():
                measured = measured.with_event(e)
                yield e

        stream = events()
        evicted = straggler.recorded_evictions(stream, request.cfg.straggler)
        for _ in stream:  # what that did not read (it reads nothing unless policy replace)
            pass
        return _Record(measured, evicted)

    return bounded("the event log", read, READ_TIMEOUT_S, _Record(None, ()))


def _grace(configured: float, measured: evict_grace.Measured | None) -> evict_grace.Grace:
    """The eviction grace this attempt renders (tasks.evict_grace)."""
    if measured is None:
        why = f"{configured:g} s as configured: the event log did not answer"
        return evict_grace.Grace(configured, why)
    return evict_grace.size(configured, measured)


def _fatal_since_last_attempt_start(run_dir: RunDir) -> str | None:
    """The first ``fatal`` error of ``run_dir``'s epoch recorded since the newest train attempt
    started (streamed: the watcher keeps no event it has read)."""
    fatal: str | None = None
    epoch = run_dir.epoch
    for e in run_dir.event_reader().iter_new():
        if isinstance(e, StageAttempt):
            fatal = None
        elif isinstance(e, Fatal) and fatal is None and (epoch is None or e.epoch == epoch):
            fatal = e.error
    return fatal


def _attempt(
    backend: Backend,
    request: LaunchRequest,
    n: int,
    adopted: bool,
    grace: evict_grace.Grace | None = None,
) -> StageAttempt:
    return StageAttempt(
        stage="train",
        attempt=n,
        nodes=request.nodes,
        nproc_per_node=request.nproc_per_node,
        backend=backend.name,
        adopted=adopted,
        evict_grace_s=grace.seconds if grace is not None else None,
        evict_grace=grace.why if grace is not None else None,
    )
