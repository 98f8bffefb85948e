"""One writer per run directory (arch §6): the lease.

``<run_root>/owner.lease`` names the invocation that may write the run: its pid, host, process
start time (a reused pid is not the same owner), start and heartbeat, and every process it
started that outlives a step. Two guards, since the filesystem may weaken either:

- an exclusive ``flock`` on ``<run_root>/.owner.lock`` for the whole invocation: the kernel
  drops it however the owner dies (Lustre mounted with ``flock`` makes it cluster-wide);
- the lease file, created with ``O_EXCL`` and refreshed by a heartbeat thread: where the lock is
  only node-local, a live owner on another host shows by its fresh heartbeat.

A lease whose owner is gone (same host: the pid is dead or another process; another host: the
record unchanged for ``stale_after_s`` on the reader's own monotonic clock, so no two hosts'
clocks are compared) is taken over; the new owner gets the dead one's records
(:attr:`RunLease.takeover`). Every change of the file is a compare-and-swap under
``<run_root>/.lease.lock`` (:func:`swapping`): an owner paused between reading and writing
cannot overwrite a takeover made meanwhile.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import psutil

from tasks.errors import PipelineError
from trainer.fence import LockTimeout, locked
from trainer.run_files import write_text_atomic
from trainer.rundir import Layout

# A swap holds its lock for a read and a rename; longer means a holder stopped while holding it.
SWAP_TIMEOUT_S = 5.0
HEARTBEAT_S = 5.0
STALE_AFTER_S = 60.0


log = logging.getLogger(__name__)


class LeaseLost(PipelineError):
    """Another invocation holds this run's lease now (it took it over, across hosts or with the
    lock lost): this one must stop acting for the run: no destructive action, and the running
    attempt is left to its new owner. Not retried, and no failure is notified (the run is not
    failing: its owner changed)."""


class RunBusy(PipelineError):
    """Another live invocation holds this run's lease."""


@contextlib.contextmanager
def swapping(run_root: Path, *, flock: bool = True) -> Iterator[None]:
    """Hold the lease file's swap lock for one read-compare-write (``flock`` False: a
    filesystem without flock, where the lease file and its heartbeat alone decide). Raises
    :class:`trainer.fence.LockTimeout` (an OSError) past :data:`SWAP_TIMEOUT_S`."""
    if not flock:
        yield
        return
    with locked(Path(run_root) / Layout.LEASE_LOCK, timeout_s=SWAP_TIMEOUT_S):
        yield


@dataclass(frozen=True)
class Owner:
    invocation: str  # unique per invocation; tags every process it starts
    pid: int
    host: str
    create_time: float  # the process's start time: a recycled pid is a different owner
    started_at: float
    flow_run: str = ""  # the Prefect flow run it executes (a rescheduled one runs it again)

    @classmethod
    def me(cls, flow_run: str = "") -> Owner:
        return cls(
            invocation=uuid.uuid4().hex[:16],
            pid=os.getpid(),
            host=socket.gethostname(),
            create_time=psutil.Process().create_time(),
            started_at=time.time(),
            flow_run=flow_run,
        )

    def describe(self) -> str:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(self.started_at))
        return f"pid {self.pid} on {self.host} (invocation {self.invocation}, since {started} UTC)"


@dataclass(frozen=True)
class LeaseRecord:
    """What the lease file says, parsed once (the file is untrusted: a bad one is stale)."""

    run_id: str
    owner: Owner
    heartbeat_at: float
    resources: tuple[dict[str, Any], ...] = ()

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1, sort_keys=True)

    @classmethod
    def parse(cls, text: str) -> LeaseRecord | None:
        try:
            d = json.loads(text)
            o = d["owner"]
            owner = Owner(
                invocation=str(o["invocation"]),
                pid=int(o["pid"]),
                host=str(o["host"]),
                create_time=float(o["create_time"]),
                started_at=float(o["started_at"]),
                flow_run=str(o.get("flow_run", "")),
            )
            resources = tuple(r for r in d.get("resources", []) if isinstance(r, dict))
            return cls(str(d["run_id"]), owner, float(d["heartbeat_at"]), resources)
        except (ValueError, KeyError, TypeError):
            return None


@dataclass
class HeartbeatWatch:
    """Is a lease held on another host still beating? Judged by its record *changing*, timed on
    this process's monotonic clock: the owner's wall clock (skewed, stepped by NTP) and ours are
    never compared. A change seen proves a live owner; the same record for ``stale_after_s``
    proves a dead one; until either, the owner is not known (None)."""

    stale_after_s: float
    clock: Callable[[], float] = time.monotonic
    _seen: tuple[str, float] | None = None  # (invocation, heartbeat_at) last seen
    _since: float = 0.0  # when it was first seen (our clock)
    _changed: bool = False

    def alive(self, rec: LeaseRecord) -> bool | None:
        key = (rec.owner.invocation, rec.heartbeat_at)
        now = self.clock()
        if key != self._seen:
            # The same owner wrote again: it lives; another owner now: judged afresh.
            self._changed = self._seen is not None and self._seen[0] == key[0]
            self._seen, self._since = key, now
        if self._changed:
            return True
        return False if now - self._since >= self.stale_after_s else None


def owner_alive(rec: LeaseRecord, watch: HeartbeatWatch | None = None) -> bool | None:
    """Is the owner of a lease still there? On this host, from the process table; on another,
    from ``watch`` (None without one, or until it knows)."""
    if rec.owner.host == socket.gethostname():
        return process_is(rec.owner.pid, rec.owner.create_time)
    return watch.alive(rec) if watch is not None else None


def process_is(pid: int, create_time: float) -> bool:
    """Is ``pid`` alive and the very process that was recorded (not a recycled pid)?"""
    try:
        p = psutil.Process(pid)
        return abs(p.create_time() - create_time) < 0.01 and p.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def record_alive(rec: Mapping[str, object]) -> bool:
    """Does a record's ``pid`` and ``create_time`` name a live process? A malformed one: no."""
    try:
        return process_is(int(str(rec["pid"])), float(str(rec["create_time"])))
    except (KeyError, ValueError):
        return False


@dataclass
class RunLease:
    run_root: Path
    run_id: str
    owner: Owner = field(default_factory=Owner.me)
    heartbeat_s: float = HEARTBEAT_S
    # The dead owner's record when this invocation took the lease over.
    takeover: LeaseRecord | None = None
    # The dead owner's attempt, healthy and still running, for the train stage to watch
    # (a tasks.ownership.takeover.Plan; taken once).
    adoptable: Any = None
    _resources: list[dict[str, Any]] = field(default_factory=list)
    _lock_fd: int | None = None
    _flock: bool = True  # False where the filesystem has no flock
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _mu: threading.Lock = field(default_factory=threading.Lock)
    # Why this invocation no longer owns the run (None while it does): the heartbeat found
    # another owner in the file, and stopped rewriting it.
    lost: str | None = None

    @property
    def path(self) -> Path:
        return self.run_root / Layout.LEASE

    # -- taking and giving back ------------------------------------------------------------------
    def acquire(self, *, wait_s: float = 0.0, stale_after_s: float = STALE_AFTER_S) -> None:
        """Take the lease, waiting up to ``wait_s`` for a live owner to finish. Raises
        :class:`RunBusy` naming the owner when it does not."""
        self.run_root.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + wait_s
        # An owner on another host is watched until it is known: alive (its record changed)
        # or dead (unchanged for stale_after_s), whatever wait_s says.
        watch = HeartbeatWatch(stale_after_s)
        fd = os.open(self.run_root / Layout.OWNER_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            while True:
                undecided = False
                try:
                    self._lock(fd)
                    with swapping(self.run_root, flock=self._flock):
                        got = self._create(watch)
                    if got == "created":
                        break
                    undecided = got == "undecided"
                    self._unlock(fd)
                except BlockingIOError:
                    pass
                except LockTimeout as e:
                    # The swap lock held by a stopped owner (frozen mid-swap): as busy as a
                    # live one, until it lets go or wait_s runs out.
                    self._unlock(fd)
                    log.warning("run %s: %s", self.run_id, e)
                if time.monotonic() >= deadline and not undecided:
                    raise RunBusy(self._busy_message())
                time.sleep(0.5)
        except BaseException:
            os.close(fd)
            raise
        self._lock_fd = fd
        self._thread = threading.Thread(target=self._beat, name="run-lease", daemon=True)
        self._thread.start()

    def _lock(self, fd: int) -> None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            # A filesystem without flock (Lustre mounted without `-o flock`): the O_EXCL lease
            # file and its heartbeat alone decide (deploy/eks/fsx.yaml mounts with flock).
            if e.errno not in (errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK):
                raise  # BlockingIOError (EAGAIN) included: another holds it
            self._flock = False

    def _unlock(self, fd: int) -> None:
        if self._flock:
            fcntl.flock(fd, fcntl.LOCK_UN)

    def _create(self, watch: HeartbeatWatch) -> Literal["created", "busy", "undecided"]:
        """Under the lock: create the lease file exclusively, taking over a stale one; or a
        live owner holds it (busy), or one on another host not known dead yet (undecided)."""
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                old = self.read()
                if old is not None:
                    alive = owner_alive(old, watch)
                    if alive is None:
                        return "undecided"
                    if alive:
                        return "busy"  # a live owner on a host our lock does not reach
                self.takeover = old
                self.path.unlink(missing_ok=True)
                continue
            with os.fdopen(fd, "w") as f:
                f.write(self._record().to_json())
                f.flush()
                os.fsync(f.fileno())
            return "created"
        return "busy"

    def release(self) -> None:
        """Give the lease back (idempotent). Only the owner's own file is removed."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._lock_fd is None:
            return
        with contextlib.suppress(OSError), swapping(self.run_root, flock=self._flock):
            current = self.read()
            if current is not None and current.owner.invocation == self.owner.invocation:
                self.path.unlink(missing_ok=True)
        self._unlock(self._lock_fd)
        os.close(self._lock_fd)
        self._lock_fd = None

    # -- records -----------------------------------------------------------------------------------
    def record(self, resource: dict[str, Any]) -> None:
        """Note a process (or other resource) this invocation started, before it can outlive
        us: a takeover then finds it."""
        with self._mu:
            self._resources.append(resource)
            self._write()

    def forget(self, match: dict[str, Any]) -> None:
        with self._mu:
            self._resources = [
                r for r in self._resources if any(r.get(k) != v for k, v in match.items())
            ]
            self._write()

    def read(self) -> LeaseRecord | None:
        return peek(self.run_root)

    def _record(self) -> LeaseRecord:
        return LeaseRecord(self.run_id, self.owner, time.time(), tuple(self._resources))

    def check(self, action: str) -> None:
        """Before a destructive action (stopping or deleting the run's attempt, removing its
        files, exporting, writing its result) and on every watch poll: raises
        :class:`LeaseLost` unless the lease file still names this invocation."""
        if self.lost is None and self._lock_fd is not None:
            self.lost = self._taken_by()
        if self.lost is not None:
            raise LeaseLost(f"run {self.run_id!r}: {self.lost}; not going to {action}")

    def _taken_by(self) -> str | None:
        """Why the file says another invocation owns the run, or None while it names this one.
        An unreadable file is not a new owner (a torn read, a slow mount): the next look decides."""
        cur = self.read()
        if cur is None or cur.owner.invocation == self.owner.invocation:
            return None
        return f"the lease was taken over by {cur.owner.describe()}"

    def _write(self) -> None:
        """Compare and swap, under the swap lock: the record is rewritten only while the file
        still names this invocation. Once another owner took it over, this invocation never
        writes it again (it used to, every heartbeat, and the file flip-flopped between two
        owners)."""
        if self._lock_fd is None or self.lost is not None:
            return
        with swapping(self.run_root, flock=self._flock):
            self.lost = self._taken_by()
            if self.lost is None:
                write_text_atomic(self.path, self._record().to_json())
        if self.lost is not None:
            log.error("run %s: %s; this invocation stops acting for it", self.run_id, self.lost)

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            with self._mu, contextlib.suppress(OSError):
                self._write()

    def _busy_message(self) -> str:
        cur = self.read()
        who = cur.owner.describe() if cur is not None else "another process (lease unreadable)"
        return (
            f"run {self.run_id!r} is being run by {who}; its run directory {self.run_root} has "
            "exactly one writer. Wait for it to finish (or stop it), or use another run_id"
        )


_HELD: dict[Path, RunLease] = {}


@contextlib.contextmanager
def hold(
    run_root: Path, run_id: str, *, wait_s: float = 0.0, flow_run: str = ""
) -> Iterator[RunLease]:
    """Hold the run's lease for the block; the stages find it with :func:`held`.

    A flow run executed again (Prefect rescheduled it after its runner's pod was evicted) finds
    its own earlier execution's lease, on another host and not yet stale: it waits for the
    heartbeat to go stale (that execution is gone) instead of refusing the run."""
    previous = peek(run_root)
    if flow_run and previous is not None and previous.owner.flow_run == flow_run:
        wait_s = max(wait_s, STALE_AFTER_S + 2 * HEARTBEAT_S)
    lease = RunLease(Path(run_root), run_id, owner=Owner.me(flow_run))
    lease.acquire(wait_s=wait_s)
    _HELD[lease.run_root] = lease
    try:
        yield lease
    finally:
        _HELD.pop(lease.run_root, None)
        lease.release()


def held(run_root: Path) -> RunLease | None:
    """The lease this process holds on ``run_root`` (None outside a pipeline run, e.g. tests
    that drive one stage)."""
    return _HELD.get(Path(run_root))


def peek(run_root: Path) -> LeaseRecord | None:
    """The run's lease as it stands, without taking it."""
    try:
        return LeaseRecord.parse((Path(run_root) / Layout.LEASE).read_text())
    except OSError:
        return None


def live_owner(run_root: Path, *, stale_after_s: float = STALE_AFTER_S) -> str | None:
    """The invocation of a live owner of the run other than this process (its resources must
    be left alone), or None when the lease is free, stale, or this process's. An owner on
    another host is watched until its record changes (alive) or stays the same for
    ``stale_after_s`` (dead): up to that long."""
    watch = HeartbeatWatch(stale_after_s)
    while True:
        rec = peek(run_root)
        if rec is None or (rec.owner.pid == os.getpid() and rec.owner.host == socket.gethostname()):
            return None
        alive = owner_alive(rec, watch)
        if alive is not None:
            return rec.owner.invocation if alive else None
        time.sleep(0.5)
