"""The few facts a worker decides from at start-up, as small files under ``control/``.

A worker used to scan the whole ``events.jsonl`` (three times per start) for these; at a million
steps that is seconds and a gigabyte per start. Each fact now lives in a file of its own, written
by whoever makes it true, read in O(1) whatever the log's length
(``benchmarks/fold_events.py`` measures a start-up with a 1 M-line log beside it):

- ``control/commit.json``: the newest step rank 0 recorded as committed (``null`` after an
  explicit fresh start). A resume that finds no checkpoint on disk but a recorded commit
  refuses to start from step 0 (trainer.checkpointing.manager).
- ``control/launch.json``: the last launcher job that trained (its rendezvous id, world size and
  nodes): whether a starting worker is a respawn of that job, and which layer its restart is.
- ``control/retry.json``: when the newest train-stage retry (attempt > 1, not adopted) began: a
  fault from before it was recovered by the stage retry.
- ``control/faults/*.json``: one file per fault not yet recovered (the ``fault`` event itself),
  created by whoever records the fault and removed by rank 0 once its first step after the
  restart closes it (trainer.hooks.emit_recoveries).

Every one is written atomically (a temporary file, then ``rename``) and, like everything on
the shared filesystem, read as untrusted input: bounded, type-checked, and ignored when
malformed. The event log still records each of these facts; the run's reports fold it.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from trainer.elastic import PriorWorld
from trainer.event_types import Fault, decode_obj
from trainer.run_files import read_json_object, read_model, write_json_atomic

CONTROL = Path("control")
COMMIT = CONTROL / "commit.json"
LAUNCH = CONTROL / "launch.json"
RETRY = CONTROL / "retry.json"
FAULTS = CONTROL / "faults"
# More open faults than this at once is not a run of ours (a flooded directory): the rest wait.
MAX_OPEN_FAULTS = 256

_log = logging.getLogger(__name__)


class _Fact(BaseModel):
    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")


class CommitFact(_Fact):
    step: int | None = Field(ge=0)
    t: float


class LaunchFact(_Fact):
    job_id: str = Field(max_length=256)
    world_size: int = Field(ge=0)
    nodes: list[int] = Field(max_length=65536)
    t: float


class RetryFact(_Fact):
    attempt: int = Field(ge=2)
    t: float


def _write(run_root: Path, rel: Path, obj: dict[str, Any]) -> None:
    write_json_atomic(run_root / rel, obj)  # a reader sees the old fact or the new one


def _read(run_root: Path, rel: Path, model: type[_Fact]) -> Any:
    """The fact, None when absent; a malformed one is ignored (and said)."""
    return read_model(run_root / rel, model)


# -- the newest recorded commit ---------------------------------------------------------------


def record_commit(run_root: Path, step: int | None) -> None:
    _write(run_root, COMMIT, {"step": step, "t": time.time()})


def recorded_commit(run_root: Path) -> int | None:
    """The newest step recorded as committed since the last explicit fresh start; None: none,
    or no (readable) ``control/commit.json``."""
    fact: CommitFact | None = _read(run_root, COMMIT, CommitFact)
    return None if fact is None else fact.step


# -- the last launch ---------------------------------------------------------------------------


def record_launch(run_root: Path, *, job_id: str | None, world_size: int, nodes: list[int]) -> None:
    if job_id:
        fact = {"job_id": job_id, "world_size": world_size, "nodes": nodes, "t": time.time()}
        _write(run_root, LAUNCH, fact)


def prior_world(run_root: Path, job_id: str | None) -> PriorWorld | None:
    """The world launcher job ``job_id`` last trained in, if it trained (a respawn)."""
    fact: LaunchFact | None = _read(run_root, LAUNCH, LaunchFact) if job_id else None
    if fact is None or fact.job_id != job_id:
        return None
    open_loss = any(f.fault_kind == "node-loss" and f.t > fact.t for _, f in open_faults(run_root))
    return PriorWorld(fact.world_size, tuple(fact.nodes), open_loss)


# -- the newest stage retry --------------------------------------------------------------------


def record_retry(run_root: Path, attempt: int) -> None:
    """A train-stage attempt after the first began (the watcher, before it launches)."""
    if attempt > 1:
        _write(run_root, RETRY, {"attempt": attempt, "t": time.time()})


def retry_began(run_root: Path) -> float:
    fact: RetryFact | None = _read(run_root, RETRY, RetryFact)
    return 0.0 if fact is None else fact.t


# -- open faults -------------------------------------------------------------------------------


def open_fault(run_root: Path, event: Fault) -> None:
    """Record a ``fault`` event (as emitted) as open until a recovery closes it."""
    name = f"{int(event.t * 1e9):020d}-{os.getpid()}-{uuid.uuid4().hex[:8]}.json"
    _write(run_root, FAULTS / name, event.model_dump(mode="json", exclude_unset=True))


def open_faults(run_root: Path) -> list[tuple[Path, Fault]]:
    """The open faults, oldest first (malformed files are skipped, and said)."""
    try:
        names = sorted(e.name for e in os.scandir(run_root / FAULTS) if e.name.endswith(".json"))[
            :MAX_OPEN_FAULTS
        ]
    except (FileNotFoundError, NotADirectoryError):
        return []
    out = []
    for name in names:
        path = run_root / FAULTS / name
        obj = read_json_object(path)
        try:
            fault = decode_obj(obj)
        except ValidationError:
            _log.warning("ignoring %s: not a fault event", path)
            continue
        if isinstance(fault, Fault):
            out.append((path, fault))
    return out


def close_fault(path: Path) -> None:
    path.unlink(missing_ok=True)
