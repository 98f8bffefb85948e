"""The step section's timeout, learned from the steps this incarnation has made (issue 29, item 6).

A hang is detected when the ``step`` section stays open past its timeout (trainer.resilience).
A fixed timeout must cover the slowest step of any job it may ever run (300 s on EKS), so a hang
of a 2-second step goes unnoticed for minutes. Instead, once an incarnation has closed
``after`` step sections, its timeout becomes ``multiple`` times the longest of them, bounded
below by ``floor_s`` (a section spans at least the heartbeat interval, and scheduling noise on a
loaded host must not read as a hang) and above by the configured ``step_timeout_s`` (never
looser than the operator's bound). Pure: :class:`StepBoundLearner` sees section lengths and
decides; the heartbeat applies the result to the node's rank monitor and says so in an event.

Each incarnation learns afresh, starting from the configured timeout: a world that shrank (an
elastic job) or a node that slowed down has other steps than the one before it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepBound:
    """A learned step-section timeout and what it was learned from."""

    timeout_s: float
    slowest_s: float  # the longest step section observed
    sections: int  # how many were observed
    multiple: float
    clamped: str = ""  # "floor" or "ceiling" when a bound decided instead of the multiple

    def describe(self) -> str:
        why = f"{self.multiple:g} x the slowest of {self.sections} step sections"
        why += f" ({self.slowest_s:.3f} s)"
        if self.clamped:
            why += ", raised to the floor" if self.clamped == "floor" else ", capped at the ceiling"
        return f"{self.timeout_s:.2f} s: {why}"


def learn(
    sections_s: list[float], *, multiple: float, floor_s: float, ceiling_s: float
) -> StepBound:
    """The bound for these observed step-section lengths (at least one)."""
    if not sections_s:
        raise ValueError("no step section observed")
    slowest = max(sections_s)
    raw = multiple * slowest
    timeout, clamped = raw, ""
    if raw < floor_s:
        timeout, clamped = floor_s, "floor"
    elif raw > ceiling_s:
        timeout, clamped = ceiling_s, "ceiling"
    return StepBound(round(timeout, 3), round(slowest, 4), len(sections_s), multiple, clamped)


class StepBoundLearner:
    """Sees each closed step section's length; returns the bound once, after ``after`` of them.
    A section cut short by a checkpoint or load section is seen too (it only ever lowers the
    sample, and the floor, above the heartbeat interval, covers a full section); one a fault
    ended is not."""

    def __init__(self, *, multiple: float, floor_s: float, ceiling_s: float, after: int) -> None:
        if after < 1:
            raise ValueError(f"after must be >= 1, got {after}")
        self.multiple, self.floor_s, self.ceiling_s, self.after = (
            multiple,
            floor_s,
            ceiling_s,
            after,
        )
        self.seen: list[float] = []
        self.bound: StepBound | None = None

    def observe(self, section_s: float) -> StepBound | None:
        """The bound when this observation completes the sample, else None (also after)."""
        if self.bound is not None:
            return None
        self.seen.append(max(0.0, section_s))
        if len(self.seen) < self.after:
            return None
        self.bound = learn(
            self.seen, multiple=self.multiple, floor_s=self.floor_s, ceiling_s=self.ceiling_s
        )
        return self.bound
