"""A node's sign of life on the shared filesystem, for the watcher (docs/architecture.md §4,
"Silent nodes"): a frozen host keeps its processes and freezes its own rank monitor, so no layer
of the job notices. The node's agent (:mod:`trainer.agent`, the process that outlives every
respawn of its workers) rewrites ``control/beats/e<epoch>-node<N>`` from a thread of its own, so
a silence of a few beats is a frozen node, never a respawn; its last word on a normal exit is
``done``, so a node that finished is never read as silent. The watcher judges the changes on its
own monotonic clock. The file holds no decision, only a changing token and that state. A node
told to go (an eviction's SIGTERM to its agent: :mod:`trainer.agent`) beats ``leaving`` from
then on: the watcher names the eviction and waits for its hand-off (docs/architecture.md §4,
"Evictions with notice").

The same thread carries out a ``node-freeze`` drill aimed at its node (the watcher's marker,
``Layout.freeze``, looked for only where the run has such a drill): it stops its children and
then itself (SIGSTOP), as a hung host would. The
drill thus runs the same way on every backend (a pod's agent can stop its own pod), with no
permission to reach into another node.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from pathlib import Path

from trainer.run_files import write_text_atomic

log = logging.getLogger(__name__)

UP = "up"
DONE = "done"  # the agent's last beat on a normal exit: finished, not silent
LEAVING = "leaving"  # told to go (an eviction's notice): saving what it has, then gone
FREEZE_POLL_S = 0.05


def is_done(token: str) -> bool:
    """Whether a beat file's content is a finished node's last beat."""
    return token.split()[-1:] == [DONE]


def is_leaving(token: str) -> bool:
    """Whether a beat file's content says the node was told to go (and has not ended yet)."""
    return token.split()[-1:] == [LEAVING]


class NodeBeat:
    """Rewrites this node's beat file until :meth:`close` (a daemon thread); freezes the node
    when ``freeze`` (a drill's marker) appears."""

    def __init__(self, path: Path, *, interval_s: float, freeze: Path | None = None):
        self.path = path
        self.interval_s = interval_s
        self.freeze = freeze
        self._n = 0
        self._state = UP
        self._warned = False
        self._lock = threading.Lock()  # the thread's beat and close()'s last one never interleave
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="node beat", daemon=True)
        self._thread.start()

    def _write(self, state: str) -> None:
        with self._lock:
            self._n += 1
            try:
                write_text_atomic(self.path, f"{os.getpid()} {self._n} {time.time():.3f} {state}\n")
                self._warned = False
            except OSError as e:  # a full or flaky filesystem: the watcher sees silence
                if not self._warned:
                    log.warning("could not write the node beat %s: %s", self.path, e)
                    self._warned = True

    def _run(self) -> None:
        while not self._stop.is_set():
            self._write(self._state)
            if self.freeze is None:
                self._stop.wait(self.interval_s)
                continue
            # A freeze drill is due: looked for every FREEZE_POLL_S between beats, so the node
            # stops within a step or two of the drill's (a tiny model's steps take 0.1 s).
            until = time.monotonic() + self.interval_s
            while not self._stop.wait(min(FREEZE_POLL_S, max(0.0, until - time.monotonic()))):
                if self.freeze.exists():
                    _freeze_self()
                if time.monotonic() >= until:
                    break

    def leave(self) -> None:
        """Told to go: every beat from now on says so, the first one at once (the workers are
        told after it, so the watcher can name the eviction before their hand-off)."""
        self._state = LEAVING
        self._write(LEAVING)

    def close(self, *, done: bool = True) -> None:
        """Stop beating; ``done``: say so first (a normal exit), so the watcher never reads
        this node's end as a silence."""
        self._stop.set()
        self._thread.join(timeout=5)
        if done:
            self._write(DONE)


def _freeze_self() -> None:
    """SIGSTOP every descendant (twice: whatever a stopping parent started in between stops
    too), then this process: alive to the process table, silent to the job."""
    import psutil

    log.warning("node-freeze drill: stopping this node's processes (SIGSTOP)")
    me = psutil.Process()
    for _ in range(2):
        for child in me.children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                child.send_signal(signal.SIGSTOP)
    os.kill(os.getpid(), signal.SIGSTOP)
