"""Blocking reads kept off a loop that must keep its deadline (the train-stage watcher's): a read
of the shared filesystem blocks as long as the mount hangs (Lustre waiting for a lost server, an
NFS hard mount), and the loop enforcing the deadline and answering a cancel must not block too.

One :class:`OffLoop` per kind of read: its calls run in one daemon thread of its own (it does
not hold the interpreter's exit), waited for up to a timeout. A call still blocked is not
started again: the next call waits for the same one and receives its result when it comes (so
a slow read of new events loses none of them).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Stuck(Exception):
    """The read did not answer within its timeout (it goes on in the background)."""


class OffLoop(Generic[T]):
    """One kind of read, run by one long-lived daemon thread (started on the first call): a
    poll every 0.2 s starts no thread of its own."""

    def __init__(self, what: str, fn: Callable[[], T]) -> None:
        self.what = what
        self._fn = fn
        self._thread: threading.Thread | None = None
        self._wanted = threading.Event()  # a read is asked for and not started yet
        self._done = threading.Event()  # the read asked for has answered
        self._pending = False  # asked for, its answer not taken yet
        self._value: T | None = None
        self._error: BaseException | None = None

    def _serve(self) -> None:
        while True:
            self._wanted.wait()
            self._wanted.clear()
            try:
                self._value, self._error = self._fn(), None
            except BaseException as e:  # handed to the caller, never lost in the thread
                self._value, self._error = None, e
            self._done.set()

    def call(self, timeout: float) -> T:
        """The read's result; :class:`Stuck` when it has not answered within ``timeout``
        seconds; the read's own error, raised here."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._serve, name=f"read {self.what}", daemon=True
            )
            self._thread.start()
        if not self._pending:
            self._pending = True
            self._done.clear()
            self._wanted.set()
        if not self._done.wait(timeout):
            raise Stuck(f"reading {self.what} has not answered for {timeout:g} s (still trying)")
        self._pending = False
        value, error = self._value, self._error
        self._value, self._error = None, None
        if error is not None:
            raise error
        return value  # type: ignore[return-value]

    @property
    def stuck(self) -> bool:
        """A read has started and not answered yet."""
        return self._pending and not self._done.is_set()


def bounded(what: str, fn: Callable[[], T], timeout: float, default: T) -> T:
    """One read off the loop; ``default`` when it does not answer within ``timeout``."""
    try:
        return OffLoop(what, fn).call(timeout)
    except Stuck:
        return default
