"""The run directory (``cfg.run_root``): :class:`Layout`, the one list of its paths, and
:class:`RunDir`, a run root as one attempt's ``epoch`` sees it: the one way to its control files
(the fence, the result, the start-up facts, the open faults, the drills' claims, the markers, the
node beats) for the watcher and the workers alike.

Each start-up fact (arch §5) is a file of its own under ``control/``, read in O(1) whatever the
event log's length. Every file is written atomically and read as untrusted input
(:mod:`trainer.run_files`): bounded, schema-checked, and a bad one is no file (said in the log).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from trainer import fence as _fence
from trainer.elastic import PriorWorld
from trainer.event_read import EventReader
from trainer.event_types import Event, Fatal, Fault, decode_obj
from trainer.run_files import read_json_object, read_model, read_small, write_json_atomic

_log = logging.getLogger(__name__)

# More open faults than this at once is not a run of ours (a flooded directory): the rest wait.
MAX_OPEN_FAULTS = 256
MAX_BEAT_FILES = 4096  # a beats directory of more is not read further (a node is below this)


class Layout:
    """Every path of a run root, relative to it."""

    EVENTS = Path("events.jsonl")
    RESULT = Path("result.json")  # the trainer's (RunResult)
    PIPELINE_RESULT = Path("pipeline_result.json")  # the pipeline's (flows.models)
    CONTROL = Path("control")
    EPOCH = CONTROL / "epoch.json"
    FENCE_LOCK = CONTROL / ".fence.lock"
    COMMIT = CONTROL / "commit.json"
    LAUNCH = CONTROL / "launch.json"
    RETRY = CONTROL / "retry.json"
    OPEN_FAULTS = CONTROL / "faults"
    NO_RESTART = CONTROL / "no_restart"
    NODE_LOST = CONTROL / "node_lost"
    BEATS = CONTROL / "beats"
    FREEZE = CONTROL / "freeze"  # e<epoch>-node<N>: a node-freeze drill its agent carries out
    DRILLS = Path("faults")  # <slug>.fired: a drill claimed, once per run
    CONFIG = Path("config")  # train-attempt<N>.json, launch.json
    LOGS = Path("logs")  # attempt<N>-node<M>.log/.exit, inprocess-monitor-<rank>.log
    LEASE = Path("owner.lease")  # tasks.ownership.lease
    DEPLOYMENT = Path("deployment.json")  # tasks.ownership.binding: who created the run
    OWNER_LOCK = Path(".owner.lock")
    LEASE_LOCK = Path(".lease.lock")

    @staticmethod
    def train_config(attempt: int) -> Path:
        return Layout.CONFIG / f"train-attempt{attempt}.json"

    @staticmethod
    def attempt_log(attempt: int, name: str) -> Path:
        """``name`` of one train attempt: ``node<M>.log``, ``node<M>.exit``, ``net.log``."""
        return Layout.LOGS / f"attempt{attempt}-{name}"

    @staticmethod
    def monitor_log(rank: int | str) -> Path:
        return Layout.LOGS / f"inprocess-monitor-{rank}.log"

    @staticmethod
    def beat(epoch: int | None, node: int) -> Path:
        return Layout.BEATS / f"e{'x' if epoch is None else epoch}-node{node}"

    @staticmethod
    def freeze(epoch: int | None, node: int) -> Path:
        return Layout.FREEZE / f"e{'x' if epoch is None else epoch}-node{node}"


class _File(BaseModel):
    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")


class RunResult(_File):
    """``result.json``: how the trainer ended, written under the writer's fence."""

    # result.json gains fields over time: an unknown one is ignored, a bad known one refused.
    model_config = ConfigDict(frozen=True, strict=True, extra="ignore")

    status: Literal["completed", "failed"]
    final_step: int | None = Field(None, ge=0)
    final_loss: float | None = None
    params_sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")
    world_size: int | None = Field(None, ge=1)
    latest_checkpoint: int | None = Field(None, ge=0)
    config_hash: str | None = Field(None, max_length=256)
    error: str | None = None  # a failed run's cause
    requeue: bool | None = None
    epoch: int | None = Field(None, ge=1)  # the writer's (None: unfenced)


class CommitFact(_File):
    step: int | None = Field(ge=0)
    t: float


class LaunchFact(_File):
    job_id: str = Field(max_length=256)
    world_size: int = Field(ge=0)
    nodes: list[int] = Field(max_length=65536)
    t: float


class RetryFact(_File):
    attempt: int = Field(ge=2)
    t: float


class NoRestart(_File):  # NVRx's own request travels over its launcher's socket; a peer's
    # exit 93 can be masked on multi-node jobs, so the watcher reads this marker too.
    t: float
    rank: int
    reason: str
    epoch: int | None = None
    incarnation: str | None = Field(None, max_length=512)  # its worker group (trainer.launch)


class _Emits(Protocol):
    def emit(self, event: Event) -> Any: ...


class NodeLost(_File):  # the watcher's word that a node of an elastic job is gone, for the
    # survivors' in-process layer to hand the restart to the in-job layer at once.
    t: float
    node: int | None


@dataclass(frozen=True)
class RunDir:
    """A run root as one attempt sees it: ``epoch`` is its fence epoch (None: unfenced, a worker
    run by hand; the watcher's before it publishes)."""

    root: Path
    epoch: int | None = None

    @classmethod
    def from_env(cls, root: Path, env: dict[str, str] | None = None) -> RunDir:
        """A worker's view: the epoch it was launched with (``NVRX_EPOCH``)."""
        return cls(root, _fence.epoch_from_env(env))

    @property
    def events_file(self) -> Path:
        return self.root / Layout.EVENTS

    def event_reader(self, *, from_start: bool = True) -> EventReader:
        """The event log, read incrementally (``from_start`` False: only what comes next)."""
        return EventReader(self.events_file, from_start=from_start)

    @property
    def epoch_file(self) -> Path:
        return self.root / Layout.EPOCH

    @property
    def lock_file(self) -> Path:
        return self.root / Layout.FENCE_LOCK

    # -- the epoch and its fence (trainer.fence) ----------------------------------------------
    def publish(self, *, invocation: str, attempt: int) -> RunDir:
        """A new epoch for an attempt about to launch: the run root as that attempt sees it.
        Raises :class:`trainer.fence.LockTimeout` when the fence lock stays held."""
        new = _fence.publish(self, invocation=invocation, attempt=attempt)
        return replace(self, epoch=new.epoch)

    def adopted(self) -> RunDir:
        """A running attempt's view, for a watcher that adopts it: the highest epoch on record."""
        return replace(self, epoch=_fence.highest(self) or None)

    def fence(
        self, events: _fence.Emits | None = None, *, on_fenced: Callable[[], None] | None = None
    ) -> _fence.Fence:
        """This view's hold on the run root (:meth:`trainer.fence.Fence.hold`)."""
        return _fence.Fence(self, self.epoch, events, on_fenced=on_fenced)

    # -- result.json ---------------------------------------------------------------------------
    def result(self) -> RunResult | None:
        """``result.json`` if this attempt's workers wrote it (another epoch's is none, said)."""
        result = read_model(self.root / Layout.RESULT, RunResult)
        if result is None or self.epoch is None or self._mine(Layout.RESULT, result.epoch):
            return result
        return None

    def _mine(self, rel: Path, epoch: int | None) -> bool:
        if epoch != self.epoch:
            msg = "ignoring %s: written by epoch %s, not this attempt's %s"
            _log.warning(msg, self.root / rel, epoch, self.epoch)
        return epoch == self.epoch

    def write_result(self, result: RunResult, events: _fence.Emits | None) -> None:
        """``result.json`` with this view's epoch, under its fence (a replaced writer's: none)."""
        with self.fence(events).hold("write result.json"):
            self._write_result(result)

    def _write_result(self, result: RunResult) -> None:  # these two: under the fence
        stamped = result.model_copy(update={"epoch": self.epoch or result.epoch})
        write_json_atomic(self.root / Layout.RESULT, stamped.model_dump(exclude_none=True))

    def clear_result(self) -> None:
        (self.root / Layout.RESULT).unlink(missing_ok=True)

    # -- the start-up facts --------------------------------------------------------------------
    def record_commit(self, step: int | None) -> None:
        write_json_atomic(self.root / Layout.COMMIT, {"step": step, "t": time.time()})

    def recorded_commit(self) -> int | None:
        """The newest step recorded as committed since the last explicit fresh start."""
        fact = read_model(self.root / Layout.COMMIT, CommitFact)
        return None if fact is None else fact.step

    def record_launch(self, *, job_id: str | None, world_size: int, nodes: list[int]) -> None:
        if job_id:
            fact = {"job_id": job_id, "world_size": world_size, "nodes": nodes, "t": time.time()}
            write_json_atomic(self.root / Layout.LAUNCH, fact)

    def prior_world(self, job_id: str | None) -> PriorWorld | None:
        """The world launcher job ``job_id`` last trained in (a respawn's)."""
        fact = read_model(self.root / Layout.LAUNCH, LaunchFact) if job_id else None
        if fact is None or fact.job_id != job_id:
            return None
        # A node the watcher took away: lost, or confirmed slow (tasks.straggler).
        taken = ("node-loss", "slow")
        loss = any(f.fault_kind in taken and f.t > fact.t for _, f in self.open_faults())
        return PriorWorld(fact.world_size, tuple(fact.nodes), loss)

    def record_retry(self, attempt: int) -> None:
        """A train-stage attempt after the first began (the watcher, before it launches)."""
        if attempt > 1:
            write_json_atomic(self.root / Layout.RETRY, {"attempt": attempt, "t": time.time()})

    def retry_began(self) -> float:
        fact = read_model(self.root / Layout.RETRY, RetryFact)
        return 0.0 if fact is None else fact.t

    # -- open faults ---------------------------------------------------------------------------
    def open_fault(self, event: Fault) -> None:
        """Record a ``fault`` event (as emitted) as open until a recovery closes it."""
        name = f"{int(event.t * 1e9):020d}-{os.getpid()}-{uuid.uuid4().hex[:8]}.json"
        obj = event.model_dump(mode="json", exclude_unset=True)
        write_json_atomic(self.root / Layout.OPEN_FAULTS / name, obj)

    def open_faults(self) -> list[tuple[Path, Fault]]:
        """The open faults, oldest first (malformed files are skipped, and said); a recovery
        closes one by removing its path."""
        where = self.root / Layout.OPEN_FAULTS
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            names = sorted(e.name for e in os.scandir(where) if e.name.endswith(".json"))
            return [f for name in names[:MAX_OPEN_FAULTS] if (f := _fault(where / name))]
        return []

    # -- drills' claims ------------------------------------------------------------------------
    def claim(self, slug: str) -> bool:
        """Atomically record that the drill ``slug`` fired in this run; False when it already
        has (in any earlier life of a worker or attempt)."""
        marker_dir = self.root / Layout.DRILLS
        marker_dir.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(marker_dir / f"{slug}.fired", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(f"{time.time()}\n")
            f.flush()
            os.fsync(f.fileno())
        return True

    # -- markers -------------------------------------------------------------------------------
    def write_no_restart(self, *, rank: int, reason: str, events: _fence.Emits | None) -> None:
        """The terminal marker with this view's epoch (the watcher counts only its attempt's),
        under its fence."""
        with self.fence(events).hold("write the no_restart marker"):
            self._write_marker(rank, reason, incarnation=None)

    def _write_marker(self, rank: int, reason: str, *, incarnation: str | None) -> None:
        m = NoRestart(
            t=time.time(), rank=rank, reason=reason, epoch=self.epoch, incarnation=incarnation
        )
        write_json_atomic(self.root / Layout.NO_RESTART, m.model_dump(exclude_none=True))

    def record_terminal(
        self, *, rank: int, reason: str, events: _Emits, incarnation: str | None
    ) -> bool:
        """An error no restart can fix: the marker, the ``fatal`` event and ``result.json``, once
        per worker group, by its first rank under the fence lock (not rank 0: a peer exiting
        first may have its launcher stop rank 0). Whether this rank did."""
        with self.fence(events).hold("record a terminal error"):
            marker = read_model(self.root / Layout.NO_RESTART, NoRestart)
            if (
                incarnation is not None
                and marker is not None
                and (marker.incarnation, marker.epoch) == (incarnation, self.epoch)
            ):
                return False
            self._write_marker(rank, reason, incarnation=incarnation)
            events.emit(Fatal(error=reason, requeue=False))
            self._write_result(RunResult(status="failed", error=reason, requeue=False))
        return True

    def no_restart(self) -> str | None:
        """The marker's reason, if it carries this view's ``epoch`` (None for an unfenced run);
        any other marker is ignored, and said."""
        marker = read_model(self.root / Layout.NO_RESTART, NoRestart)
        if marker is None or not self._mine(Layout.NO_RESTART, marker.epoch):
            return None
        return marker.reason or "no_restart marker"

    def write_node_lost(self, *, node: int | None, t: float | None = None) -> None:
        marker = NodeLost(t=time.time() if t is None else t, node=node)
        write_json_atomic(self.root / Layout.NODE_LOST, marker.model_dump())

    def node_lost_since(self, since: float) -> bool:
        """Was a node of this job reported lost after ``since`` (a bad marker reads as no)?"""
        marker = read_model(self.root / Layout.NODE_LOST, NodeLost)
        return marker is not None and marker.t > since

    def clear_markers(self) -> None:
        """A new attempt starts without an earlier one's verdict or word of a lost node."""
        for rel in (Layout.NO_RESTART, Layout.NODE_LOST):
            (self.root / rel).unlink(missing_ok=True)

    # -- node beats (trainer.node_beat writes them) --------------------------------------------
    def beat_file(self, node: int) -> Path:
        return self.root / Layout.beat(self.epoch, node)

    def freeze_file(self, node: int) -> Path:
        """The node-freeze drill's marker for ``node`` of this epoch (its agent stops the node
        when it appears: trainer.node_beat)."""
        return self.root / Layout.freeze(self.epoch, node)

    def request_freeze(self, node: int) -> None:
        path = self.freeze_file(node)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()

    def beats(self) -> dict[int, str]:
        """Node -> its beat file's content, for this view's epoch only; a file that is not a
        small regular file is left out (a node's silence)."""
        prefix = Layout.beat(self.epoch, 0).name.removesuffix("0")
        out: dict[int, str] = {}
        for entry in self._beat_entries():
            node = entry.name.removeprefix(prefix)
            if node == entry.name or not (node.isascii() and node.isdigit()) or len(node) > 6:
                continue
            try:
                data = read_small(Path(entry.path), limit=256)
            except OSError:
                continue
            if data is not None:
                out[int(node)] = data.decode("utf-8", "replace")
        return out

    def clear_other_beats(self) -> None:
        """Before an attempt: earlier attempts' beat files go (this keeps the directory small)."""
        keep = Layout.beat(self.epoch, 0).name.removesuffix("node0")
        for entry in self._beat_entries():
            if not entry.name.startswith(keep) and entry.is_file(follow_symlinks=False):
                Path(entry.path).unlink(missing_ok=True)

    def _beat_entries(self) -> Iterator[os.DirEntry[str]]:
        with (
            contextlib.suppress(FileNotFoundError, NotADirectoryError),
            os.scandir(self.root / Layout.BEATS) as it,
        ):
            for i, entry in enumerate(it):
                if i >= MAX_BEAT_FILES:
                    return
                yield entry


def read_events(run_root: Path) -> list[Event]:
    """Every valid event of a run, at once (a fold streams them: ``RunHistory.read``)."""
    return RunDir(run_root).event_reader().read_new()


def _fault(path: Path) -> tuple[Path, Fault] | None:
    obj: Any = read_json_object(path)
    try:
        fault = decode_obj(obj)
    except ValidationError:
        _log.warning("ignoring %s: not a fault event", path)
        return None
    return (path, fault) if isinstance(fault, Fault) else None
