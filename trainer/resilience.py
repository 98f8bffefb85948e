"""NVRx glue: ft_launcher heartbeats and timed sections (the in-process Wrapper is
:mod:`trainer.inprocess_layer`).

Both layers are switchable by config and each works without the other:
- in-process (``inprocess.Wrapper``) restarts the train function in every rank of the same
  interpreters after an exception or a timed-out collective;
- in-job (``ft_launcher`` + ``RankMonitorClient``) kills and respawns the workers when a rank dies
  or stops sending heartbeats.

NVRx is imported only inside the functions that need it (importing it costs seconds).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

from trainer.layer_config import STEP_SECTION
from trainer.timeouts import OUT_OF_SECTION, STEP, TimeoutLearner, Timeouts

log = logging.getLogger(__name__)

FT_RANK_MONITOR_SOCKET_ENV = "FT_RANK_MONITOR_IPC_SOCKET"


class Heartbeat:
    """``RankMonitorClient`` heartbeats and timed sections under ft_launcher, no-op otherwise;
    one per process (it survives in-process restarts).

    Hang detection is by section (arch §2): ``step``, a save and commit, a load; start-up and
    in-process restarts are out of section. Every message is a synchronous round trip to the
    rank monitor, so the step section is closed and reopened (with a heartbeat, the backstop)
    at most once per ``interval_s``, never per step: a hang is detected between ``step timeout
    - interval`` and ``step timeout`` after it starts. A heartbeat also ends every other section.

    The ``learner`` (trainer.timeouts) sees each closed section's length; what it derives goes
    to the rank monitor and to ``on_timeouts`` (with whether the monitor took it).
    """

    def __init__(
        self,
        enabled: bool = True,
        interval_s: float = 1.0,
        *,
        learner: TimeoutLearner | None = None,
        on_timeouts: Callable[[Timeouts, bool], None] | None = None,
    ) -> None:
        self.client: Any = None
        self.interval_s = interval_s
        self._last = 0.0  # monotonic time of the last round of messages
        self._open: dict[str, int] = {}  # open sections -> nesting depth
        self._step_opened = 0.0  # monotonic time the open step section was opened
        self._out_since = time.monotonic()  # when the last section closed (or the connection)
        self.learner = learner
        self.on_timeouts = on_timeouts
        self.step_timeout_s: float | None = None  # in force at the rank monitor; None: unknown
        if enabled and os.environ.get(FT_RANK_MONITOR_SOCKET_ENV):
            from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient

            self.client = RankMonitorClient()
            self.client.init_workload_monitoring()
            # Beat at once: NVRx 0.4.1's rank monitor server turns permanently ABORTED (every
            # later heartbeat of this node's rank fails) if a respawned worker's connection is
            # lost before its first heartbeat. Keep that window as short as possible.
            self.client.send_heartbeat()
            self._last = self._out_since = time.monotonic()
            from trainer import nvrx_compat

            self.step_timeout_s = nvrx_compat.step_section_timeout(self.client)
            # The rank monitor outlives the workers and may hold the previous incarnation's
            # learned timeouts: each incarnation starts afresh from the launch values (said).
            if learner is not None:
                self._apply(learner.in_force)

    @property
    def active(self) -> bool:
        return self.client is not None

    def beat(self) -> None:
        """After a step: prove progress, at most once per ``interval_s``."""
        if self.client is None:
            return
        now = time.monotonic()
        if STEP_SECTION in self._open and now - self._last < self.interval_s:
            return
        self._leave_step(now)
        if not self._open:  # never inside a checkpoint or load section
            self.client.start_section(STEP_SECTION)
            self._open[STEP_SECTION] = 1
            self._step_opened = now
        self.client.send_heartbeat()
        self._last = now

    def _leave_step(self, now: float) -> None:
        """Close the open step section, or end the out-of-section stretch (start-up, a restart,
        another section), learning its length."""
        if STEP_SECTION in self._open:
            self.client.end_section(STEP_SECTION)
            del self._open[STEP_SECTION]
            self._learn(STEP, now - self._step_opened)
        elif not self._open:
            self._learn(OUT_OF_SECTION, now - self._out_since)

    def _learn(self, kind: str, seconds: float) -> None:
        """A section (or an out-of-section stretch) closed normally (never one a fault ended):
        the learner may now have new timeouts, which the rank monitor applies at once."""
        if self.learner is None:
            return
        new = self.learner.observe(kind, seconds)
        if new is not None:
            log.info("in-job timeouts %s (applied: %s)", new.describe(), self._apply(new))

    def _apply(self, timeouts: Timeouts) -> bool:
        """Send ``timeouts`` to the rank monitor (applied at once) and say them."""
        from trainer import nvrx_compat

        applied = nvrx_compat.set_timeouts(self.client, timeouts)
        if applied:
            self.step_timeout_s = timeouts.step.seconds
        if self.on_timeouts is not None:
            self.on_timeouts(timeouts, applied)
        return applied

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        """Run a checkpoint save/commit or a load under its own timeout (reentrant). The step
        section is closed first (its tight timeout must not run during I/O) and reopened by the
        next step's ``beat``. On an exception the section is closed: the in-process restart
        that follows runs out of section."""
        if self.client is None:
            yield
            return
        if name not in self._open:
            self._leave_step(time.monotonic())
            self.client.start_section(name)
        self._open[name] = self._open.get(name, 0) + 1
        opened = time.monotonic()
        ok = False
        try:
            yield
            ok = True
        finally:
            self._open[name] -= 1
            if not self._open[name]:
                del self._open[name]
                self.client.end_section(name)
                now = time.monotonic()
                if ok:
                    self._learn(name, now - opened)
                    # A beat at the section's end: the backstop's gap spans one section and
                    # the out-of-section stretch before it, never a section and a step.
                    self.client.send_heartbeat()
                self._last = self._out_since = now

    def end_sections(self) -> None:
        """A fault is being handled in-process: what follows (the restart, the new
        incarnation's start-up) is out of section. Never raises: it runs on fault paths, where
        the monitor's connection may be gone too (the fault being handled is what matters)."""
        if self.client is not None and self._open:
            self._open.clear()
            self._out_since = time.monotonic()
            try:
                self.client.end_all_sections()
            except Exception as e:
                log.warning("could not close the ft_launcher sections: %s", e)

    def close(self) -> None:
        if self.client is not None:
            self.end_sections()
            try:
                self.client.shutdown_workload_monitoring()
            except Exception as e:  # the same: never mask the error this process ends with
                log.warning("could not shut the rank monitor connection down: %s", e)
            self.client = None
