"""Epoch fencing: which attempt may change the run root (arch §5; docs/architecture.md §6,
"Epoch fencing").

Deleting a Job does not stop a pod on an unreachable node, and a frozen VM can wake long after
its attempt was replaced. So the watcher publishes a new epoch before each launch
(``control/epoch.json``, handed over as ``NVRX_EPOCH``), and every mutation a worker makes runs
inside :meth:`Fence.hold`: under an exclusive ``flock`` of ``control/.fence.lock`` it re-reads
the epoch, and a writer of an older one changes nothing, emits ``fenced`` and exits 4. A new
epoch is one more than the highest on record (``epoch.json``'s or any event's), so a lost
``epoch.json`` lets no zombie pass. A worker started without an epoch is unfenced.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field

from trainer.errors import ExitCode, TrainerError
from trainer.event_types import FencedEvent, ValidationError, decode_json
from trainer.run_files import open_regular, read_model, write_json_atomic

EPOCH_ENV = "NVRX_EPOCH"
# A mutation holds the lock for milliseconds; longer means a holder that stopped (frozen).
LOCK_TIMEOUT_S = 60.0
# The event log's tail read for the highest epoch on record (the newest attempt's are last).
EVENTS_TAIL = 4 << 20

_log = logging.getLogger(__name__)


class Fenced(TrainerError, RuntimeError):
    """This writer's epoch is no longer the run's: it must change nothing."""


class LockTimeout(TrainerError, TimeoutError):
    pass


class Files(Protocol):
    """Where a run root keeps the fence's files (:class:`trainer.rundir.RunDir`)."""

    @property
    def epoch_file(self) -> Path: ...
    @property
    def lock_file(self) -> Path: ...
    @property
    def events_file(self) -> Path: ...


class Emits(Protocol):
    """Where a fenced writer says so (trainer.events.EventLog)."""

    def emit(self, event: FencedEvent) -> Any: ...


class Epoch(BaseModel):
    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")

    epoch: int = Field(ge=1)
    invocation: str = Field(max_length=128)
    attempt: int = Field(ge=1)
    t: float


def epoch_from_env(env: dict[str, str] | None = None) -> int | None:
    """The epoch this process was launched with; None outside the pipeline."""
    value = (os.environ if env is None else env).get(EPOCH_ENV, "")
    return int(value) if value.isdigit() and int(value) > 0 else None


@contextlib.contextmanager
def locked(path: Path | str, *, timeout_s: float | None = None) -> Iterator[None]:
    """The lock file ``path`` (the fence's, a lease's), exclusive, waited for at most
    ``timeout_s`` (default :data:`LOCK_TIMEOUT_S`)."""
    timeout_s = LOCK_TIMEOUT_S if timeout_s is None else timeout_s
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    fd = os.open(path, flags, 0o644)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, f"{path}: not a regular file")
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise LockTimeout(
                        f"{path}: held for more than {timeout_s:.0f} s (a writer stopped while "
                        "holding it?)"
                    ) from None
                time.sleep(0.01)
        yield
    finally:
        os.close(fd)  # releases the lock


def current(files: Files) -> Epoch | None:
    """The run's epoch; None when none was published (or the file is malformed: said)."""
    return read_model(files.epoch_file, Epoch)


def logged(files: Files) -> int:
    """The highest epoch the event log's end records (0: none)."""
    try:
        with open_regular(files.events_file) as fd:
            size = os.fstat(fd).st_size
            start = max(0, size - EVENTS_TAIL)
            lines = os.pread(fd, size - start, start).split(b"\n")[1 if start else 0 :]
    except OSError:
        return 0
    best = 0
    for line in lines:  # the first, cut by the tail's start, skipped; bad ones too
        with contextlib.suppress(ValidationError):
            best = max(best, decode_json(line).epoch or 0)
    return best


def highest(files: Files) -> int:
    """The highest epoch on record, ``epoch.json``'s or the event log's (0: none)."""
    now = current(files)
    return max(now.epoch if now is not None else 0, logged(files))


def publish(files: Files, *, invocation: str, attempt: int) -> Epoch:
    """A new epoch for an attempt about to launch (the watcher): earlier ones are fenced."""
    with locked(files.lock_file):
        new = Epoch(
            epoch=highest(files) + 1,
            invocation=invocation[:128],
            attempt=attempt,
            t=time.time(),
        )
        write_json_atomic(files.epoch_file, new.model_dump())
        return new


def _exit_fenced() -> None:
    """A zombie's end: ask its launcher not to respawn it (no marker: that would change the run
    root), then exit."""
    with contextlib.suppress(Exception):
        from trainer import nvrx_compat

        nvrx_compat.request_no_restart(int(os.environ.get("RANK", "0")), "fenced")
    logging.shutdown()
    os._exit(ExitCode.FENCED)


class Fence:
    """A worker's hold on the run root for its epoch (None: unfenced); made by
    :meth:`trainer.rundir.RunDir.fence`."""

    def __init__(
        self,
        files: Files,
        epoch: int | None,
        events: Emits | None = None,
        *,
        on_fenced: Callable[[], None] | None = None,
    ) -> None:
        self.files = files
        self.epoch = epoch
        self.events = events
        # A fenced writer exits, from whichever thread found out (tests raise instead).
        self.on_fenced = on_fenced or _exit_fenced

    @contextlib.contextmanager
    def hold(self, action: str) -> Iterator[None]:
        """Run one mutation of the run root, if this writer's epoch is still the run's."""
        if self.epoch is None:
            yield
            return
        with locked(self.files.lock_file):
            now = current(self.files)
            if now is None and highest(self.files) <= self.epoch:
                now = self._repair()
            if now is None or now.epoch != self.epoch:
                self._fenced(action, now)
            yield

    def _repair(self) -> Epoch:
        """Under the lock: ``epoch.json`` is lost or corrupt and this writer's epoch is the
        highest on record: written back, and said."""
        assert self.epoch is not None
        _log.warning("%s unreadable: repaired with epoch %d", self.files.epoch_file, self.epoch)
        now = Epoch(epoch=self.epoch, invocation="repaired", attempt=1, t=time.time())
        write_json_atomic(self.files.epoch_file, now.model_dump())
        return now

    def still_current(self) -> bool:
        """A check without the lock, for a decision that mutates nothing by itself."""
        if self.epoch is None:
            return True
        now = current(self.files)
        return now.epoch == self.epoch if now is not None else highest(self.files) <= self.epoch

    def _fenced(self, action: str, now: Epoch | None) -> None:
        reason = (
            f"epoch {self.epoch} is not the run's: "
            + (f"epoch {now.epoch} (attempt {now.attempt}) is" if now else "no epoch is published")
            + f"; refusing to {action}"
        )
        _log.error("fenced: %s", reason)
        if self.events is not None:
            with contextlib.suppress(Exception):  # saying so must not stop the refusal
                self.events.emit(
                    FencedEvent(
                        action=action,
                        current=now.epoch if now else None,
                        reason=reason,
                    )
                )
        self.on_fenced()
        raise Fenced(reason)
