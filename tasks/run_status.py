"""One run's status as ``nvrx-pipeline status`` shows it: where its directory is (checked against
the id it was asked for), what its events say (``trainer.history.RunHistory``), its saved result,
and who holds its lease. The command only parses and prints (``flows.cli.status``)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from tasks.ownership.lease import LeaseRecord, owner_alive
from trainer.history import RunHistory
from trainer.run_files import read_json_object
from trainer.rundir import Layout


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


def owner(run_root: Path) -> dict[str, Any] | None:
    """Who holds the run's lease (arch §6), if anyone."""
    try:
        rec = LeaseRecord.parse((run_root / Layout.LEASE).read_text())
    except OSError:
        return None
    if rec is None:
        return None
    return {
        "owner": rec.owner.describe(),
        "pid": rec.owner.pid,
        "host": rec.owner.host,
        # By the owner's clock against ours: a hint for a person, never a decision.
        "heartbeat_age_s": round(time.time() - rec.heartbeat_at, 1),
        # On this host, from the process table; on another, not known from one look (the
        # lease's takeover watches its record change instead).
        "alive": owner_alive(rec),
    }


def read_status(run_root: Path) -> dict[str, Any]:
    """The run's status: its history folded from ``events.jsonl``, its saved result, and its
    lease's owner (``owner``)."""
    st = RunHistory.read(run_root).status(read_json_object(run_root / Layout.PIPELINE_RESULT))
    st["owner"] = owner(run_root)
    return st
