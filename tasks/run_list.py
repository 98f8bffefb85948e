"""The runs under a shared root (``<state_dir>/fsx/runs`` locally, ``/fsx/runs`` on EKS): what
``nvrx-pipeline runs`` lists, newest first (issue 27: there was no way to find a run's id
again but reading directory names).

Every file read is the run's own and untrusted: ``pipeline_result.json`` through the bounded
JSON reader, the lease through its validated record. A run that has not ended (no result) is
folded from its events for its step, streamed, bounded in memory."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from trainer.history import RunHistory
from trainer.rundir import Layout

MAX_RUNS = 1000  # listed at most (newest first): a shared root may hold many


@dataclass(frozen=True)
class RunRow:
    run_id: str
    state: str  # completed, failed, cancelled (the saved result), or running / interrupted
    step: int
    target_steps: int | None
    updated: float  # unix time of the newest write to its events or result
    owner: str | None  # the lease's holder while one is alive on this host


def _row(run_root: Path) -> RunRow | None:
    from tasks.ownership.lease import LeaseRecord, owner_alive
    from tasks.run_status import SavedEnd

    events = run_root / Layout.EVENTS
    result_path = run_root / Layout.PIPELINE_RESULT
    stamps = [p.stat().st_mtime for p in (events, result_path) if p.is_file()]
    if not stamps:
        return None  # not a run directory (or not started)
    owner = None
    try:
        rec = LeaseRecord.parse((run_root / Layout.LEASE).read_text())
    except OSError:
        rec = None
    if rec is not None and owner_alive(rec):
        owner = rec.owner.describe()
    end = SavedEnd.read(run_root)
    # A live owner's run is running even over an earlier invocation's saved result.
    if end is not None and owner is None:
        return RunRow(
            run_id=run_root.name,
            state=end.status,
            step=end.final_step or 0,
            target_steps=end.target_steps,
            updated=max(stamps),
            owner=None,
        )
    history = RunHistory.read(run_root)
    state = "running" if owner is not None else "interrupted (run it again to resume)"
    return RunRow(
        run_id=run_root.name,
        state=state,
        step=history.progress(),
        target_steps=None,
        updated=max(stamps),
        owner=owner,
    )


def list_runs(runs_root: Path) -> list[RunRow]:
    """The runs under ``runs_root``, newest first (empty when it does not exist)."""
    if not runs_root.is_dir():
        return []
    dirs = [d for d in runs_root.iterdir() if d.is_dir() and not d.is_symlink()]
    rows = [r for d in dirs if (r := _row(d)) is not None]
    rows.sort(key=lambda r: r.updated, reverse=True)
    return rows[:MAX_RUNS]
