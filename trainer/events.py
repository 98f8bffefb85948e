"""The run's event log: ``<run_root>/events.jsonl``, one JSON object per line (arch §5).

Rank 0 writes steps, checkpoints, restarts and resumes; any rank the ``fault`` it fires. A line
is one ``write`` on an ``O_APPEND`` descriptor, which keeps concurrent writers' lines whole on a
local or Lustre filesystem. A writer killed mid-``write`` (or a full disk) can leave a torn last
line: readers skip it, and the next writer starts its line with a newline.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal, TypeVar, cast, get_args

from trainer.event_types import Event, ValidationError, decode_json
from trainer.fence import epoch_from_env
from trainer.rundir import Layout

# The layers a recovery is attributed to (``restart``/``recovered`` events, ``recovered_by``).
RecoveryLayer = Literal["inprocess", "injob", "elastic", "spare", "stage-retry"]
LAYERS: tuple[str, ...] = get_args(RecoveryLayer)

ECHO_ENV = "NVRX_EVENTS_STDOUT"  # set: every event is also printed on stdout
STDOUT_PREFIX = "NVRX_EVENT "
FLUSH_S = 1.0  # buffered events (steps) reach the file at most this late

_log = logging.getLogger(__name__)

E = TypeVar("E", bound=Event)


class EventLog:
    def __init__(self, run_root: Path, *, enabled: bool = True, epoch: int | None = None) -> None:
        """``epoch``: the one every event carries (None: ``NVRX_EPOCH``, if given)."""
        self.path = Path(run_root) / Layout.EVENTS
        self.enabled = enabled
        self.epoch = epoch if epoch is not None else epoch_from_env()
        self.echo = os.environ.get(ECHO_ENV) == "1"
        self._buffer: list[bytes] = []
        self._flushed = time.monotonic()
        self._lock = threading.Lock()
        self._warned = False
        # Called with every event as it is made (buffered or not): rank 0's Prometheus metrics
        # (trainer.metrics) read the values the loop already reports, with no I/O of their own.
        self.observers: list[Callable[[Event], None]] = []
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def emit(self, event: E) -> E:
        """Append one event (and any buffered before it); the event as written."""
        return self._add(event, buffered=False)

    def buffer(self, event: E) -> E:
        """The per-step events: held until the next ``emit`` or ``FLUSH_S``, so the loop opens
        the file about once a second; a killed process loses at most the last second."""
        return self._add(event, buffered=True)

    def _add(self, event: E, *, buffered: bool) -> E:
        if self.epoch is not None and event.epoch is None:
            event = cast(E, event.model_copy(update={"epoch": self.epoch}))
        # What the writer set (and its time, kind and epoch), as the JSON a reader decodes.
        fields = event.model_dump(mode="json", exclude_unset=True)
        fields.update(t=event.t, kind=event.kind)
        if event.epoch is not None:
            fields["epoch"] = event.epoch
        line = (json.dumps(fields, sort_keys=True, default=str) + "\n").encode()
        try:
            # Written through the types: an event no reader would decode is a writer's bug.
            typed = cast(E, decode_json(line))
        except ValidationError as e:
            raise ValueError(
                f"event {event.kind!r} does not match its type (trainer.event_types): {e}"
            ) from e
        for observe in self.observers:
            try:
                observe(typed)
            except Exception as e:  # an observer informs; it must never stop training
                _log.warning("event observer failed on a %s event: %s", event.kind, e)
        if self.enabled:
            with self._lock:
                self._buffer.append(line)
                if not buffered or time.monotonic() - self._flushed >= FLUSH_S:
                    self._write()
        return typed

    def flush(self) -> None:
        with self._lock:
            self._write()

    def _unwritable(self, why: str) -> None:
        if not self._warned:
            self._warned = True
            _log.error("events: %s: %s; events are not recorded there", self.path, why)

    def _write(self) -> None:
        lines, self._buffer = b"".join(self._buffer), []
        self._flushed = time.monotonic()
        if not lines:
            return
        # Never through a link, never into a FIFO or device (a write into a FIFO blocks once
        # its buffer fills): anything but a regular file loses these events, said once.
        flags = os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(self.path, flags, 0o644)
        except OSError as e:
            self._unwritable(f"cannot open it: {e.strerror}")
            return
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                self._unwritable("not a regular file")
                return
            os.write(fd, _after_torn_line(fd) + lines)
        finally:
            os.close(fd)
        if self.echo:
            # Structured progress in `kubectl logs` and the rank-0 log the flow streams.
            os.write(1, b"".join(STDOUT_PREFIX.encode() + ln for ln in lines.splitlines(True)))


def _after_torn_line(fd: int) -> bytes:
    """A newline if the file does not end with one (its last line is torn), else nothing."""
    size = os.fstat(fd).st_size
    return b"\n" if size and os.pread(fd, 1, size - 1) != b"\n" else b""
