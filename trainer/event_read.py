"""The one decoder of ``events.jsonl``: incremental, bounded, and never raising into its caller.

:class:`EventReader` opens the file only as a regular file (no FIFO, no symlink), reads at most
``CHUNK`` bytes at a time from where it stopped, caps a line at ``MAX_LINE`` bytes, and decodes
each line against :mod:`trainer.event_types`. What does not decode is dropped and counted by
reason (:class:`DropCounts`), never raised: one bad line must not stop a healthy job. An
incomplete last line is held until its newline arrives.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from trainer.event_types import Event, ValidationError, decode_json
from trainer.run_files import open_regular

# The longest event written is a few KB (a checkpoint's pruned list, a long error message);
# a longer line is not ours.
MAX_LINE = 64 * 1024
# Bytes read per system call: a 1 M-step log is folded in ~45 of these, never held whole.
CHUNK = 4 * 1024 * 1024

DROP_REASONS = ("not-json", "not-an-event", "too-long", "unreadable")

_log = logging.getLogger(__name__)


@dataclass
class DropCounts:
    """Lines dropped, by reason: ``not-json`` (torn or foreign), ``not-an-event`` (``1``, an
    unknown kind, a wrong type), ``too-long``, ``unreadable`` (not a regular file, or failed)."""

    by_reason: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DROP_REASONS, 0))

    @property
    def total(self) -> int:
        return sum(self.by_reason.values())

    def add(self, reason: str, detail: str) -> None:
        first = self.by_reason[reason] == 0
        self.by_reason[reason] += 1
        if first:  # once per reason and reader: a flood of bad lines must not flood the log
            _log.warning("events: dropped a line (%s): %s", reason, detail)


class EventReader:
    """Follows one ``events.jsonl``: each :meth:`read_new` returns the events appended since
    the last (from the start, or from its end at construction). Thread-safe."""

    def __init__(self, path: Path, *, from_start: bool = True) -> None:
        self.path = Path(path)
        self.dropped = DropCounts()
        self._lock = threading.RLock()
        self._partial = b""
        self._skipping = False  # inside a line longer than MAX_LINE: drop up to its newline
        self.offset = 0
        if not from_start:
            try:
                with open_regular(self.path) as fd:
                    self.offset = os.fstat(fd).st_size
            except OSError:
                self.offset = 0

    def read_new(self) -> list[Event]:
        """Every complete, valid event appended since the last call."""
        return list(self.iter_new())

    def iter_new(self) -> Iterator[Event]:
        """As :meth:`read_new`, chunk by chunk: folding a large file never holds it whole."""
        with self._lock:
            try:
                with open_regular(self.path) as fd:
                    size = os.fstat(fd).st_size
                    if size < self.offset:
                        # Rewritten or truncated under us (not by a writer of ours, which
                        # only appends): read it again from its start.
                        self.dropped.add("unreadable", f"{self.path} shrank below {self.offset}")
                        self.offset, self._partial, self._skipping = 0, b"", False
                    while True:
                        data = os.pread(fd, CHUNK, self.offset)
                        if not data:
                            return
                        self.offset += len(data)
                        for line in self._split(data):
                            if (ev := self._decode(line)) is not None:
                                yield ev
            except FileNotFoundError:
                return
            except OSError as e:  # UnsafeFile (a FIFO, a link), EIO from a failing mount
                self.dropped.add("unreadable", str(e))
                return

    def _split(self, data: bytes) -> Iterator[bytes]:
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        for line in lines:
            if self._skipping:
                self._skipping = False  # this was the rest of the over-long line
                continue
            if len(line) > MAX_LINE:
                self.dropped.add("too-long", f"a line of {len(line)} bytes")
                continue
            if line.strip():
                yield line
        if len(self._partial) > MAX_LINE:
            if not self._skipping:
                self.dropped.add("too-long", f"a line of more than {MAX_LINE} bytes")
            self._partial, self._skipping = b"", True

    def _decode(self, raw: bytes) -> Event | None:
        try:
            return decode_json(raw)
        except ValidationError as e:
            json_invalid = any(err["type"] == "json_invalid" for err in e.errors())
            reason = "not-json" if json_invalid else "not-an-event"
            self.dropped.add(reason, _short(raw, e))
            return None


def _short(raw: bytes, e: ValidationError) -> str:
    first = e.errors()[0]
    where = ".".join(str(x) for x in first.get("loc", ()))
    return f"{raw[:80]!r}: {where + ': ' if where else ''}{first.get('msg')}"
