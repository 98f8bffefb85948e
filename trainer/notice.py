"""An eviction's notice, as a worker hears it (docs/architecture.md §4, "Evictions with notice").

Kubernetes evicts with notice (a drain, a spot reclaim, an upgrade): SIGTERM to the pod's first
process, the node's agent (:mod:`trainer.agent`), and SIGKILL after the grace period. The agent
tells its workers with ``SIGUSR1``, not the SIGTERM NVRx's launcher forwards: that one also
stops the workers for every in-job restart, and must go on ending a rank at once, even one
blocked in a collective (a Python handler would only run once the collective returns).

Here the signal only raises a flag. The step loop carries it in ``step_end``'s one all-reduce,
so every rank learns of it at the same step; they save that step durably together, and then
every rank ends at once (:func:`leave`): the ranks told to go with ``ExitCode.LEFT``, the
others with ``ExitCode.REFORM``, for their launchers to restart them without that node.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from types import FrameType
from typing import Any, NoReturn

from trainer.errors import ExitCode

log = logging.getLogger(__name__)

SIGNAL = signal.SIGUSR1

_given_at: float | None = None


def install() -> None:
    """At the worker's start, before anything slow: until then SIGUSR1's default action would
    end the worker, as an eviction did before (a node loss, nothing saved)."""
    signal.signal(SIGNAL, _on_notice)


def _on_notice(signum: int, frame: FrameType | None) -> None:
    global _given_at
    if _given_at is None:
        _given_at = time.time()


def given() -> bool:
    """Whether this process was told its node must go."""
    return _given_at is not None


def given_at() -> float | None:
    return _given_at


def leave(why: str, saver: Any, code: ExitCode) -> NoReturn:
    """The hand-off's step is committed: the process ends now, its writer first. ``LEFT``: this
    rank's node was told to go. ``REFORM``: another's was; the launcher restarts this node's
    workers at once, into a world without that node (a spare's, a smaller one, or none: a stage
    retry), where the in-process layer would first wait out its barrier for a rank that is gone.
    Not through the in-process layer's exit either: that took 2-4 s more."""
    log.warning("rank %s: %s", os.environ.get("RANK", "0"), why)
    with contextlib.suppress(Exception):
        saver.close()
    logging.shutdown()
    os._exit(code)
