"""How a train attempt begins (arch §4 and §6): launched under a new epoch published first, or
adopted from a dead watcher under the epoch it published; either way its ``stage_attempt``
event, and what an adopted attempt said before the new watcher came."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from tasks import evict_grace
from tasks.backends.base import Backend, Job, LaunchRequest
from tasks.errors import FenceBusy
from tasks.off_loop import bounded
from trainer.event_types import Fatal, StageAttempt
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
        grace = _grace(request, run_dir)
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
        return Started(backend.launch(request), run_dir, events, None, request)
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
    return Started(job, run_dir, events, fatal, dataclasses.replace(request, epoch=run_dir.epoch))


def _grace(request: LaunchRequest, run_dir: RunDir) -> evict_grace.Grace:
    """The eviction grace this attempt renders, sized from what the run measured (one bounded
    fold of its event log: a log that does not answer leaves the configured grace)."""
    configured = request.cfg.injob.evict_grace_s
    measured = bounded(
        "the event log",
        lambda: evict_grace.measured(run_dir.event_reader().iter_new()),
        READ_TIMEOUT_S,
        None,
    )
    if measured is None:
        return evict_grace.Grace(
            configured, f"{configured:g} s as configured: the log did not answer"
        )
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
