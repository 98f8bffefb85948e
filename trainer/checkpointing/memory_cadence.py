"""How often a memory save runs (issue 40, item 4): ``checkpoint.memory.interval: auto``.

A memory save every step is what a resume wants, but it costs: the copy blocks the step, and the
checksum, header and peer copy run beside training on the same cores (at 2 MB on this machine a
save every step cost more than it saved: fault-free ETTR 0.924-0.942 against 0.978 without). So
each incarnation measures it: a save follows every step for ``SAMPLE`` steps; then every rank
offers its median step time, blocking and background seconds, one all-reduce takes the worst of
each (a step waits for the slowest rank), and the interval is the smallest whose cost per step
stays within the budget, ``ceil((blocking + background) / (budget x step))`` (:func:`choose`),
between 1 and the durable interval (a rarer memory save is worth nothing). Rank 0 says what it
chose (a ``memory_interval`` event). A number in the config is honoured as it is.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from trainer.checkpointing.config import MemoryConfig

SAMPLE = 3  # memory saves measured before the choice


@dataclass(frozen=True)
class Cadence:
    """The chosen interval and what it was chosen from (seconds: the worst rank's medians)."""

    interval: int
    step_s: float
    blocking_s: float
    background_s: float
    budget: float
    samples: int
    clamped: str = ""  # "durable": capped at the durable interval

    def describe(self) -> str:
        cost = self.blocking_s + self.background_s
        why = (
            f"every {self.interval} step(s): a save costs {cost:.3f} s ({self.blocking_s:.3f} s "
            f"blocking + {self.background_s:.3f} s beside training), a step {self.step_s:.3f} s, "
            f"a budget of {self.budget:.0%} of a step"
        )
        return why + (", capped at the durable interval" if self.clamped else "")


def choose(
    step_s: float,
    blocking_s: float,
    background_s: float,
    *,
    budget: float,
    durable_interval: int,
    samples: int = SAMPLE,
) -> Cadence:
    """The smallest interval whose save cost per step is within ``budget`` of the step time."""
    cost = max(0.0, blocking_s) + max(0.0, background_s)
    step = max(step_s, 1e-9)
    raw = max(1, math.ceil(cost / (budget * step) - 1e-9))
    interval = min(raw, max(1, durable_interval))
    clamped = "durable" if raw > interval else ""
    return Cadence(
        interval, round(step_s, 4), round(blocking_s, 4), round(background_s, 4), budget,
        samples, clamped,
    )  # fmt: skip


@dataclass
class MemoryCadence:
    """One incarnation's memory saves (from ``first_step``): when one is due, and (auto) the
    measurement and the choice."""

    config: MemoryConfig
    durable_interval: int
    first_step: int
    chosen: Cadence | None = None
    _step: list[float] = field(default_factory=list)
    _blocking: list[float] = field(default_factory=list)
    _background: list[float] = field(default_factory=list)

    @property
    def decision_step(self) -> int | None:
        """The step after which every rank agrees on the interval (auto, not yet chosen)."""
        if not self.config.auto or self.chosen is not None:
            return None
        return self.first_step + SAMPLE

    def due(self, step: int, last_step: int) -> bool:
        """A memory save follows this step: every interval steps (every step while auto
        measures) but the last (nothing resumes after it)."""
        if not self.config.enabled or step >= last_step:
            return False
        if self.config.auto:
            every = 1 if self.chosen is None else self.chosen.interval
        else:
            every = int(self.config.interval)
        return step % every == 0

    def observe(
        self, *, step_s: float, blocking_s: float | None, background_s: float | None
    ) -> None:
        """A step's time, and what its memory save cost (None: no save, or not known yet)."""
        if self.chosen is not None or not self.config.auto:
            return
        self._step.append(step_s)
        if blocking_s is not None:
            self._blocking.append(blocking_s)
        if background_s is not None:
            self._background.append(background_s)

    def offer(self) -> tuple[float, float, float]:
        """This rank's medians (step, blocking, background), for the all-reduce."""
        return (_median(self._step), _median(self._blocking), _median(self._background))

    def decide(self, worst: tuple[float, float, float]) -> Cadence:
        """Every rank, with the all-reduced worst of every rank's :meth:`offer`."""
        step_s, blocking_s, background_s = worst
        self.chosen = choose(
            step_s, blocking_s, background_s,
            budget=self.config.budget, durable_interval=self.durable_interval,
            samples=len(self._blocking),
        )  # fmt: skip
        return self.chosen


def _median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else 0.0
