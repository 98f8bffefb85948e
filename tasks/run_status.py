"""One run's status as ``nvrx-pipeline status`` shows it: where its directory is (checked against
the id it was asked for), what its events say (``trainer.history.RunHistory``), its saved result,
and who holds its lease; and the runs under a shared root as ``nvrx-pipeline runs`` lists them,
newest first (issue 27: there was no way to find a run's id again but reading directory names).
The commands only parse and print (``flows.cli.status``).

Every file read is the run's own and untrusted: ``pipeline_result.json`` validated
(:class:`SavedEnd`), the lease through its validated record. A run that has not ended is folded
from its events, streamed, bounded in memory."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tasks.ownership.lease import owner_alive, peek
from trainer.history import RunHistory
from trainer.records import FaultRecord, TimeBreakdown
from trainer.run_files import read_json_object
from trainer.rundir import Layout

_log = logging.getLogger(__name__)
MAX_RUNS = 1000  # listed at most (newest first): a shared root may hold many


class RunNotFound(Exception):
    """The run asked for is not where it was looked for; the message says what to pass."""


def locate_run(run_id: str, *, state_dir: Path, run_root: Path | None = None) -> Path:
    """The directory of run ``run_id``: ``run_root`` if given, else ``<state_dir>/fsx/runs/<id>``.
    A run's directory is named by its id (<fsx>/runs/<id>), so another run's directory given as
    ``run_root`` is refused rather than reported under this id."""
    root = run_root or Path(state_dir) / "fsx" / "runs" / run_id
    if root.resolve().name != run_id:
        raise RunNotFound(
            f"{root} is run {root.resolve().name!r}, not {run_id!r}: pass that run's id, or the "
            "--run-root of this one"
        )
    if not (root / Layout.EVENTS).exists():
        raise RunNotFound(
            f"no events for run {run_id!r} at {root / Layout.EVENTS}; pass --state-dir (local "
            "runs) or --run-root (e.g. /fsx/runs/ID on EKS)"
        )
    return root


class AttemptLine(BaseModel):
    """One train attempt as ``status`` lists it."""

    model_config = ConfigDict(frozen=True)

    attempt: int
    backend: str | None
    outcome: str  # its end, or "running"


class OwnerView(BaseModel):
    """Who holds the run's lease (tasks.ownership.lease), as ``status`` shows it."""

    model_config = ConfigDict(frozen=True)

    owner: str
    pid: int
    host: str
    heartbeat_age_s: float  # by the owner's clock against ours: a hint, never a decision
    alive: bool | None  # None: on another host, not known from one look


class RunStatus(BaseModel):
    """``nvrx-pipeline status``: the fold's view of a run, its saved result's end (when the
    pipeline ended) and its lease's owner."""

    model_config = ConfigDict(frozen=True)

    state: str
    step: int
    loss: float | None
    tokens_per_s: float | None
    train_attempts: list[AttemptLine]
    faults: list[FaultRecord]
    checkpoints: int
    latest_checkpoint_step: int | None
    ckpt_blocking_s_max: float | None
    ettr: float | None
    time: TimeBreakdown | None
    stages: dict[str, float] | None
    export_uri: str | None
    error: str | None
    owner: OwnerView | None = None


def fold_status(h: RunHistory) -> RunStatus:
    """What ``status`` shows of the events (:func:`read_status` adds the pipeline's saved end
    and the lease's owner)."""
    last = h.last_step
    if h.train_ended:
        state = "trained (validation/export pending or not recorded)"
    elif h.first_fatal is not None:
        state = "failed"
    else:
        state = "running or interrupted"
    return RunStatus(
        state=state,
        step=last.step if last else 0,
        loss=last.loss if last else None,
        tokens_per_s=last.tokens_per_s if last else None,
        train_attempts=[
            AttemptLine(attempt=a.attempt, backend=a.backend, outcome=a.outcome or "running")
            for a in h.attempts
            if a.stage == "train"
        ],
        faults=h.fault_records(),
        checkpoints=h.checkpoints,
        latest_checkpoint_step=h.last_checkpoint.step if h.last_checkpoint else None,
        ckpt_blocking_s_max=h.blocking_max,
        ettr=h.ettr(),
        time=h.time_breakdown(),
        stages=None,
        export_uri=None,
        error=None,
    )


class SavedEnd(BaseModel):
    """What ``status`` and ``runs`` take of the pipeline's saved result (``pipeline_result.json``,
    written when the pipeline ended): a file of the shared filesystem, so validated, and a bad
    one is no end (the events still say the rest)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    status: str = Field(max_length=64)
    final_step: int | None = Field(None, ge=0)
    target_steps: int | None = Field(None, ge=0)
    stage_durations_s: dict[str, float] | None = None
    export: dict[str, object] | None = None
    error: str | None = None

    def uri(self) -> str | None:
        uri = (self.export or {}).get("uri")
        return uri if isinstance(uri, str) else None

    @classmethod
    def read(cls, run_root: Path) -> SavedEnd | None:
        path = run_root / Layout.PIPELINE_RESULT
        saved = read_json_object(path)
        try:
            return None if saved is None else cls.model_validate(saved)
        except ValidationError as e:
            _log.warning("ignoring %s: %d errors", path, e.error_count())
            return None


def owner(run_root: Path) -> OwnerView | None:
    """Who holds the run's lease (arch §6), if anyone."""
    rec = peek(run_root)
    if rec is None:
        return None
    return OwnerView(
        owner=rec.owner.describe(),
        pid=rec.owner.pid,
        host=rec.owner.host,
        heartbeat_age_s=round(time.time() - rec.heartbeat_at, 1),
        # On this host, from the process table; on another, not known from one look (the
        # lease's takeover watches its record change instead).
        alive=owner_alive(rec),
    )


def read_status(run_root: Path) -> RunStatus:
    """The run's status: its history folded from ``events.jsonl``, the pipeline's saved end
    when it ended, and its lease's owner."""
    st = fold_status(RunHistory.read(run_root))
    end = SavedEnd.read(run_root)
    update: dict[str, object] = {"owner": owner(run_root)}
    if end is not None:
        update |= {
            "state": end.status,
            "stages": end.stage_durations_s,
            "export_uri": end.uri(),
            "error": end.error,
        }
    return st.model_copy(update=update)


@dataclass(frozen=True)
class RunRow:
    run_id: str
    state: str  # completed, failed, cancelled (the saved result), or running / interrupted
    step: int
    target_steps: int | None
    updated: float  # unix time of the newest write to its events or result
    owner: str | None  # the lease's holder while one is alive on this host


def _row(run_root: Path) -> RunRow | None:
    paths = (run_root / Layout.EVENTS, run_root / Layout.PIPELINE_RESULT)
    stamps = [p.stat().st_mtime for p in paths if p.is_file()]
    if not stamps:
        return None  # not a run directory (or not started)
    held = owner(run_root)
    live = held.owner if held is not None and held.alive else None
    end = SavedEnd.read(run_root)
    # A live owner's run is running even over an earlier invocation's saved result.
    if end is not None and live is None:
        step, target = end.final_step or 0, end.target_steps
        return RunRow(run_root.name, end.status, step, target, max(stamps), None)
    state = "running" if live is not None else "interrupted (run it again to resume)"
    step = RunHistory.read(run_root).progress()
    return RunRow(run_root.name, state, step, None, max(stamps), live)


def list_runs(runs_root: Path) -> list[RunRow]:
    """The runs under ``runs_root``, newest first (empty when it does not exist)."""
    if not runs_root.is_dir():
        return []
    dirs = [d for d in runs_root.iterdir() if d.is_dir() and not d.is_symlink()]
    rows = [r for d in dirs if (r := _row(d)) is not None]
    rows.sort(key=lambda r: r.updated, reverse=True)
    return rows[:MAX_RUNS]
