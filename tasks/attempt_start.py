"""How a train attempt begins (arch §4 and §6): launched under a new epoch published first, or
adopted from a dead watcher under the epoch it published; either way its ``stage_attempt``
event, and what an adopted attempt said before the new watcher came."""

from __future__ import annotations

import dataclasses

from tasks.backends.base import Backend, Job, LaunchRequest
from tasks.errors import FenceBusy
from tasks.off_loop import bounded
from trainer.event_types import Fatal, StageAttempt
from trainer.events import EventLog
from trainer.rundir import RunDir

# How long a read of the shared filesystem may take at an attempt's start.
READ_TIMEOUT_S = 10.0


def start(
    backend: Backend, request: LaunchRequest, run_dir: RunDir
) -> tuple[Job, RunDir, EventLog, str | None]:
    """The attempt's job (launched now, or adopted), its run directory under its epoch, its
    event log, and the first fatal error it said before we came (adopted)."""
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
        request = dataclasses.replace(request, epoch=run_dir.epoch)
        events = EventLog(run_dir.root, epoch=run_dir.epoch)
        run_dir.clear_result()  # only this attempt's result counts
        run_dir.clear_markers()  # nor an earlier attempt's verdict (the config was fixed)
        run_dir.clear_other_beats()
        run_dir.record_retry(request.attempt)
        events.emit(_attempt(backend, request, request.attempt, adopted=False))
        return backend.launch(request), run_dir, events, None
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
    return job, run_dir, events, fatal


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


def _attempt(backend: Backend, request: LaunchRequest, n: int, adopted: bool) -> StageAttempt:
    return StageAttempt(
        stage="train",
        attempt=n,
        nodes=request.nodes,
        nproc_per_node=request.nproc_per_node,
        backend=backend.name,
        adopted=adopted,
    )
