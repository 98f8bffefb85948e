"""The grace an evicted node gets (tasks.evict_grace), sized from what the run measured: pure
code over recorded histories."""

from __future__ import annotations

import pytest

from tasks.evict_grace import Measured, measured, size
from trainer.event_types import Checkpoint, Event, Handoff, Step, StepCheck


def test_the_fold_keeps_the_longest_step_and_save():
    record: list[Event] = [
        Step(t=1.0, step=1, step_s=0.8),
        Step(t=2.0, step=2, step_s=2.5),
        Checkpoint(t=3.0, step=2, blocking_s=0.1, total_s=4.0),
        Checkpoint(t=4.0, step=4, blocking_s=0.2),  # no total: what it blocked
        Handoff(t=5.0, step=5, leaving=1, save_s=6.5),  # an earlier eviction's own save
        StepCheck(t=6.0, step=6, verdict="rejected", reason="nan"),
        Step(t=7.0, step=0),  # nothing measured: no step time
    ]
    assert measured(record) == Measured(step_s=2.5, save_s=6.5)
    assert measured([]) == Measured()


@pytest.mark.parametrize(
    ("configured", "m", "seconds", "says"),
    [
        # Nothing measured yet (a run's first attempt): as configured, and said.
        (30.0, Measured(), 30.0, "no step and save measured yet"),
        (30.0, Measured(step_s=1.0), 30.0, "no step and save measured yet"),
        # A small model: the configured grace holds it (3 + 1.5 x (0.1 + 0.4) = 3.75 s).
        (30.0, Measured(step_s=0.1, save_s=0.4), 30.0, "as configured, which holds"),
        # gpt-100m here: 35 s steps and 6 s saves need 3 + 1.5 x 41 = 64.5 s: 65.
        (30.0, Measured(step_s=35.0, save_s=6.0), 65.0, "sized for"),
        # Past what a spot reclaim gives: sized, and said that the cloud will not wait.
        (30.0, Measured(step_s=60.0, save_s=40.0), 153.0, "a spot reclaim gives 120 s"),
        # Never below the configured grace.
        (300.0, Measured(step_s=60.0, save_s=40.0), 300.0, "as configured"),
    ],
)
def test_the_grace_holds_a_step_and_a_save_and_never_less_than_configured(
    configured: float, m: Measured, seconds: float, says: str
):
    grace = size(configured, m)
    assert grace.seconds == seconds and says in grace.why, grace
