"""A node's sign of life on the shared filesystem, for the watcher (arch §4, silent nodes).

A node can stop without dying: a frozen VM, a partitioned host, a stalled kubelet. Its processes
stay in the process table (locally) or its pod stays ``Running`` (EKS), and its own rank monitor
is frozen with it, so no layer of the job notices; the survivors only block in a collective. So
the first worker of each node (local rank 0) rewrites a small file every ``interval_s`` from a
thread of its own, beside the training loop (which may block in a collective for good reasons):
``control/beats/e<epoch>-node<N>`` (:meth:`trainer.rundir.RunDir.beat_file`), which the watcher
reads (:meth:`~trainer.rundir.RunDir.beats`) and judges on its own monotonic clock
(:func:`tasks.watch_state.silent`): no two hosts' clocks are ever compared.

The file holds no decision, only a changing token; a frozen writer that wakes writes its own
epoch's file, which no watcher of a later attempt reads.
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
