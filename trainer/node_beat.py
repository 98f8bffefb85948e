"""A node's sign of life on the shared filesystem, for the watcher (arch §4, silent nodes).

A frozen VM or a partitioned host keeps its processes (or its pod ``Running``) and freezes its
own rank monitor with it, so no layer notices; the survivors only block in a collective. So each
node's first worker rewrites ``control/beats/e<epoch>-node<N>`` every ``interval_s`` from a
thread of its own (the loop may block in a collective for good reasons), and the watcher judges
it on its own monotonic clock (:func:`tasks.watch_state.silent`): no two hosts' clocks are
compared. A frozen writer that wakes writes its own epoch's file, which no later watcher reads.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)


class NodeBeat:
    """Rewrites this node's beat file until :meth:`close` (a daemon thread)."""

    def __init__(self, path: Path, *, interval_s: float):
        self.path = path
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="node beat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        n = 0
        warned = False
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        while not self._stop.is_set():
            n += 1
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                tmp.write_text(f"{os.getpid()} {n} {time.time():.3f}\n")
                os.replace(tmp, self.path)
                warned = False
            except OSError as e:  # a full or flaky filesystem: the watcher sees silence
                if not warned:
                    log.warning("could not write the node beat %s: %s", self.path, e)
                    warned = True
            self._stop.wait(self.interval_s)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
