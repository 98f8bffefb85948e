"""How much notice a node evicted with notice gets (docs/architecture.md §4, "Evictions with
notice"): the pods' ``terminationGracePeriodSeconds`` on EKS and every launcher's
``--term-timeout`` (``EVICT_MARGIN_S`` less), sized at each attempt's launch.

In that time the node's workers finish the step in flight, save it durably with every other rank
and leave (:mod:`trainer.notice`). So the grace must hold a step and a durable save, as this run
measured them (its ``step`` and ``checkpoint`` events, and earlier hand-offs'), with headroom; it
never goes below the configured ``injob.evict_grace_s``. A run with nothing measured yet (its first
attempt) gets the configured value, and says so. The fold keeps three maxima, never the events.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from trainer.event_types import Checkpoint, Event, Handoff, Step
from trainer.layer_config import EVICT_MARGIN_S

# Of the measured step plus save: a save under an eviction competes with the drained node's
# other pods and with every other node's save at once.
HEADROOM = 1.5
# A cloud's own notice does not wait for a longer grace (an EC2 spot reclaim gives 120 s).
SPOT_NOTICE_S = 120.0


@dataclass(frozen=True)
class Measured:
    """The longest step and the longest durable save (or hand-off) this run recorded."""

    step_s: float | None = None
    save_s: float | None = None

    def with_event(self, e: Event) -> Measured:
        if isinstance(e, Step) and e.step_s > 0:
            return Measured(max(self.step_s or 0.0, e.step_s), self.save_s)
        if isinstance(e, Checkpoint) and (e.total_s or e.blocking_s):
            save = e.total_s if e.total_s is not None else e.blocking_s
            return Measured(self.step_s, max(self.save_s or 0.0, save))
        if isinstance(e, Handoff) and e.save_s > 0:
            return Measured(self.step_s, max(self.save_s or 0.0, e.save_s))
        return self


def measured(record: Iterable[Event]) -> Measured:
    m = Measured()
    for e in record:
        m = m.with_event(e)
    return m


@dataclass(frozen=True)
class Grace:
    seconds: float
    why: str


def size(configured: float, m: Measured) -> Grace:
    """The grace for the next attempt (see the module's docstring)."""
    if m.step_s is None or m.save_s is None:
        return Grace(configured, f"{configured:g} s as configured: no step and save measured yet")
    need = EVICT_MARGIN_S + HEADROOM * (m.step_s + m.save_s)
    basis = (
        f"a step ({m.step_s:.2f} s) and a durable save ({m.save_s:.2f} s) as this run measured "
        f"them, x{HEADROOM:g}, + {EVICT_MARGIN_S:g} s = {need:.1f} s"
    )
    if need <= configured:
        return Grace(configured, f"{configured:g} s as configured, which holds {basis}")
    seconds = float(math.ceil(need))
    why = f"{seconds:g} s, sized for {basis} (configured {configured:g} s)"
    if seconds > SPOT_NOTICE_S:
        why += f"; a spot reclaim gives {SPOT_NOTICE_S:g} s whatever the grace"
    return Grace(seconds, why)
