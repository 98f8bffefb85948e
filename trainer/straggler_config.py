"""The straggler detector's settings (issue 42): how a slow node is told from the job's median,
how long it must stay slow before it is confirmed, and what a confirmed one costs it
(``policy``). The watcher judges (:mod:`tasks.straggler`); the section travels with
:class:`trainer.config.TrainConfig` (``--set straggler.policy=replace``)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from trainer.errors import require


class StragglerPolicy(enum.StrEnum):
    OFF = "off"  # not judged at all
    REPORT = "report"  # events, metrics and a report line; the node trains on
    REPLACE = "replace"  # a confirmed node is taken away as lost (spare, elastic or retry)


@dataclass(frozen=True, kw_only=True)
class StragglerConfig:
    """A node is scored once per ``window`` measured steps: the median, over the window, of its
    busy time divided by the median over the job's nodes of that step. It is *suspect* from a
    window scored ``>= enter``, *confirmed* after ``confirm_windows`` consecutive such windows
    that also span ``confirm_s`` seconds, and cleared only by a window scored ``< leave``
    (hysteresis). ``warmup_steps`` after every (re)start are not judged; a step whose save
    blocked more than ``ckpt_share`` of its median busy time is not measured. ``replace``
    evicts at most ``ceil(max_evict_share x nodes)`` nodes per ``evict_period_s``: past that a
    confirmed node is only reported (``rate-limited``): a detector gone wrong must not empty the
    job."""

    policy: StragglerPolicy = StragglerPolicy.REPORT
    enter: float = 1.10  # a change of at least 10 %
    leave: float = 1.05
    window: int = 10
    confirm_windows: int = 3
    # Shorter slowdowns cost less than a replacement (a restart: tens of seconds).
    confirm_s: float = 30.0
    warmup_steps: int = 5
    ckpt_share: float = 0.25
    max_evict_share: float = 0.25
    evict_period_s: float = 3600.0

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "policy", StragglerPolicy(self.policy))
        except ValueError:
            require(
                False,
                "straggler.policy",
                f"{self.policy!r} is not one; use off, report or replace",
            )
        require(
            self.enter >= 1.10,
            "straggler.enter",
            f"must be >= 1.10 (a change of at least 10 % over the job's median), got {self.enter}",
        )
        require(
            1.0 <= self.leave < self.enter,
            "straggler.leave",
            f"must be in [1.0, straggler.enter={self.enter}) so that a node clears below it "
            f"(hysteresis), got {self.leave}",
        )
        for name in ("window", "confirm_windows"):
            value = getattr(self, name)
            require(
                isinstance(value, int) and value >= 1,
                f"straggler.{name}",
                f"must be a whole number >= 1, got {value!r}",
            )
        require(
            isinstance(self.warmup_steps, int) and self.warmup_steps >= 0,
            "straggler.warmup_steps",
            f"must be a whole number >= 0, got {self.warmup_steps!r}",
        )
        require(self.confirm_s >= 0, "straggler.confirm_s", f"must be >= 0 s, got {self.confirm_s}")
        require(self.ckpt_share > 0, "straggler.ckpt_share", f"must be > 0, got {self.ckpt_share}")
        require(
            0 < self.max_evict_share <= 1,
            "straggler.max_evict_share",
            f"must be in (0, 1] (a share of the job's nodes), got {self.max_evict_share}; "
            "set straggler.policy=report to evict none",
        )
        require(
            self.evict_period_s > 0,
            "straggler.evict_period_s",
            f"must be > 0 s, got {self.evict_period_s}",
        )

    def detection_bound(self, step_s: float) -> tuple[int, float]:
        """The most measured steps (and seconds, at ``step_s`` a step while the node is slow)
        from a node's slowdown to its confirmation, once warm: the window it starts in may not
        count (fewer than half its steps slow), then ``confirm_windows`` windows, or as many as
        ``confirm_s`` takes. Checkpoint steps and a restart's warm-up come on top."""
        per_window = self.window * max(step_s, 1e-9)
        windows = max(self.confirm_windows, -(-self.confirm_s // per_window))
        steps = self.window * (1 + int(windows))
        return steps, steps * step_s
