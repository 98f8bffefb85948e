"""A node's sign of life on the shared filesystem, for the watcher (arch §4, silent nodes).

A node can stop without dying: a frozen VM, a partitioned host, a stalled kubelet. Its processes
stay in the process table (locally) or its pod stays ``Running`` (EKS), and its own rank monitor
is frozen with it, so no layer of the job notices; the survivors only block in a collective. So
the first worker of each node (local rank 0) rewrites a small file every ``interval_s`` from a
thread of its own, beside the training loop (which may block in a collective for good reasons):
``control/beats/e<epoch>-node<N>``. The watcher judges the changes on its own monotonic clock
(:func:`tasks.watch_state.silent`): no two hosts' clocks are ever compared.

The file holds no decision, only a changing token; a frozen writer that wakes writes its own
epoch's file, which no watcher of a later attempt reads.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from pathlib import Path

from trainer.run_files import read_small

BEATS_DIR = Path("control") / "beats"
_NAME = re.compile(r"e(\d+|x)-node(\d{1,6})")
MAX_FILES = 4096  # a directory of more is not read further (a node index is below this)

log = logging.getLogger(__name__)


def beat_name(epoch: int | None, node: int) -> str:
    return f"e{'x' if epoch is None else epoch}-node{node}"


class NodeBeat:
    """Rewrites this node's beat file until :meth:`close` (a daemon thread)."""

    def __init__(self, run_root: Path, *, epoch: int | None, node: int, interval_s: float):
        self.path = Path(run_root) / BEATS_DIR / beat_name(epoch, node)
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


def read_beats(run_root: Path, epoch: int | None) -> dict[int, str]:
    """Node -> its beat file's content, for the attempt of ``epoch`` (other epochs' files are
    not read). A file that is not a small regular file is left out (a node's silence)."""
    want = "x" if epoch is None else str(epoch)
    out: dict[int, str] = {}
    try:
        with os.scandir(Path(run_root) / BEATS_DIR) as it:
            for i, entry in enumerate(it):
                if i >= MAX_FILES:
                    break
                m = _NAME.fullmatch(entry.name)
                if m is None or m.group(1) != want:
                    continue
                try:
                    data = read_small(Path(entry.path), limit=256)
                except OSError:
                    continue
                if data is not None:
                    out[int(m.group(2))] = data.decode("utf-8", "replace")
    except (FileNotFoundError, NotADirectoryError):
        return {}
    return out


def clear_other_epochs(run_root: Path, epoch: int | None) -> None:
    """Before an attempt: beat files of earlier attempts go (only the current one's are read;
    this only keeps the directory small)."""
    keep = f"e{'x' if epoch is None else epoch}-"
    try:
        with os.scandir(Path(run_root) / BEATS_DIR) as it:
            for i, entry in enumerate(it):
                if i >= MAX_FILES:
                    break
                if not entry.name.startswith(keep) and entry.is_file(follow_symlinks=False):
                    Path(entry.path).unlink(missing_ok=True)
    except (FileNotFoundError, NotADirectoryError):
        return
