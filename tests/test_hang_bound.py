"""The step section's learned timeout (trainer.hang_bound), as pure tables: what a sample of
step-section lengths gives, when the learner decides, and the config's bounds on it."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer.config import ConfigError, InJobConfig, InProcessConfig, TrainConfig
from trainer.hang_bound import StepBound, StepBoundLearner, learn


@pytest.mark.parametrize(
    ("sections", "floor", "ceiling", "timeout", "clamped"),
    [
        ([1.0, 1.2, 1.1], 3.0, 300.0, 6.0, ""),  # 5 x the slowest: a 1 s step on EKS
        ([2.0, 2.4], 3.0, 300.0, 12.0, ""),  # slower steps, a looser bound
        ([0.2, 0.3], 3.0, 300.0, 3.0, "floor"),  # never below the floor
        ([1.0, 1.1], 3.0, 4.5, 4.5, "ceiling"),  # never above the configured timeout
        ([80.0], 3.0, 300.0, 300.0, "ceiling"),  # a step of 80 s: the operator's bound holds
    ],
)
def test_what_a_sample_gives(sections, floor, ceiling, timeout, clamped):
    bound = learn(sections, multiple=5.0, floor_s=floor, ceiling_s=ceiling)
    assert (bound.timeout_s, bound.clamped) == (timeout, clamped)
    assert bound.slowest_s == max(sections) and bound.sections == len(sections)
    assert bound.describe().startswith(f"{timeout:.2f} s: 5 x the slowest of {len(sections)}")


def test_the_learner_decides_once_after_its_sample():
    learner = StepBoundLearner(multiple=5.0, floor_s=3.0, ceiling_s=300.0, after=3)
    assert learner.observe(1.0) is None and learner.observe(1.4) is None
    bound = learner.observe(1.2)
    assert bound == StepBound(7.0, 1.4, 3, 5.0, "")
    assert learner.observe(50.0) is None and learner.bound == bound  # decided: no drift
    with pytest.raises(ValueError, match="no step section observed"):
        learn([], multiple=5.0, floor_s=3.0, ceiling_s=300.0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"learn_after_sections": -1}, "injob.learn_after_sections: must be a whole number >= 0"),
        ({"step_timeout_multiple": 1.5}, "injob.step_timeout_multiple: must be >= 2"),
        ({"step_timeout_floor_s": 0.5}, "injob.step_timeout_floor_s: must exceed"),
        ({"step_timeout_floor_s": 6.0}, r"at most injob.step_timeout_s \(4.5 s\)"),
    ],
)
def test_bad_learning_settings_name_the_field(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        InJobConfig(**kwargs)


def test_the_floor_leaves_a_stalled_step_to_the_in_process_layer():
    """With both layers on, a learned timeout stays above the in-process layer's window for a
    stalled step (its peers' collectives time out after pg_timeout_s): a stall must be restarted
    in place, not turned into a respawn by a tight learned bound."""
    base = dict(run_root=Path("r"), data_dir=Path("d"), local_paths=False)
    both = TrainConfig(**base, inprocess=InProcessConfig(pg_timeout_s=3.0))
    assert both.step_timeout_floor() == 4.5  # 3.0 + 1.0 interval + 0.5, above the 3.0 floor
    alone = TrainConfig(**base, inprocess=InProcessConfig(enabled=False))
    assert alone.step_timeout_floor() == 3.0
    eks_injob = InJobConfig(
        step_timeout_s=300.0, heartbeat_timeout_s=300.0, initial_heartbeat_timeout_s=900.0
    )
    eks = TrainConfig(**base, injob=eks_injob)
    assert eks.step_timeout_floor() == 4.5
