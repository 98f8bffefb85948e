"""A node's sign of life on the shared filesystem, for the watcher (docs/architecture.md §4,
"Silent nodes"): a frozen host keeps its processes and freezes its own rank monitor, so no layer
of the job notices. Each node's first worker rewrites ``control/beats/e<epoch>-node<N>`` from a
thread of its own (the loop may block in a collective for good reasons); the watcher judges the
changes on its own monotonic clock. The file holds no decision, only a changing token.
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
