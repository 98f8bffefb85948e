"""In-job timeouts derived from what an incarnation measures (trainer.timeouts), as pure tables
over recorded section histories: what each history gives, when the learner decides, what a pin
keeps, and the config's bounds on them."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer.config import ConfigError, InJobConfig, InProcessConfig, TrainConfig
from trainer.timeouts import TimeoutLearner, TimeoutPolicy

BASE = dict(run_root=Path("r"), data_dir=Path("d"), local_paths=False)


def policy(**injob: object) -> TimeoutPolicy:
    return TimeoutPolicy.of(TrainConfig(**BASE, injob=InJobConfig(**injob)))  # type: ignore[arg-type]


def replay(p: TimeoutPolicy, history: list[tuple[str, float]]) -> list[dict[str, float]]:
    """Every change of the timeouts in force along ``history`` (section kind, seconds)."""
    learner = TimeoutLearner(p)
    out = []
    for kind, seconds in history:
        new = learner.observe(kind, seconds)
        if new is not None:
            oos, hb = new.out_of_section.seconds, new.heartbeat.seconds
            out.append({"step": new.step.seconds, **new.sections(), "oos": oos, "hb": hb})
    return out


# Local defaults: allowance 600 s, multiple 5, learn after 10 steps past 1 warm-up, step floor
# 4.5 s (the in-process layer's window: pg 3 + beat 1 + 0.5), section floor 30 s, out-of-section
# floor 76 s (in-process hard 16 + barrier 60).
START = [("out_of_section", 8.0), ("load", 2.0)]


@pytest.mark.parametrize(
    ("history", "injob", "want"),
    [
        # gpt-tiny: ~1 s step sections (a beat a second); the warm-up section (1.4 s, the
        # first after start-up) is not in the sample; the start-up's 8 s out of section.
        (
            [*START, ("step", 9.0), *[("step", 1.0)] * 9, ("step", 1.1)],
            {},
            [{"step": 5.5, "checkpoint": 600.0, "load": 30.0, "oos": 76.0, "hb": 676.0}],
        ),
        # gpt-100m on 2 cores: 35 s steps, a 60 s first step, a 40 s first save: nothing like
        # the 30 s constant that killed it; a hang is still caught at 5 steps.
        (
            [*START, ("step", 60.0), *[("step", 35.0)] * 9, ("step", 36.0), ("checkpoint", 40.0)],
            {},
            [
                {"step": 180.0, "checkpoint": 600.0, "load": 30.0, "oos": 76.0, "hb": 676.0},
                {"step": 180.0, "checkpoint": 200.0, "load": 30.0, "oos": 76.0, "hb": 276.0},
            ],
        ),
        # A step of 200 s: 5 x is past the allowance: capped there.
        (
            [*START, *[("step", 200.0)] * 11],
            {},
            [{"step": 600.0, "checkpoint": 600.0, "load": 30.0, "oos": 76.0, "hb": 676.0}],
        ),
        # Timeouts only rise after the sample: a longer save raises the checkpoint's, a shorter
        # one changes nothing; a longer out-of-section stretch (an in-process restart) raises it.
        (
            [
                *START,
                *[("step", 1.0)] * 11,
                ("checkpoint", 10.0),
                ("checkpoint", 2.0),
                ("out_of_section", 30.0),
            ],
            {},
            [
                {"step": 5.0, "checkpoint": 600.0, "load": 30.0, "oos": 76.0, "hb": 676.0},
                {"step": 5.0, "checkpoint": 50.0, "load": 30.0, "oos": 76.0, "hb": 126.0},
                {"step": 5.0, "checkpoint": 50.0, "load": 30.0, "oos": 150.0, "hb": 200.0},
            ],
        ),
        # Pinned: the checkpoint and the backstop stay; the step's pin caps the learned one.
        (
            [*START, *[("step", 3.0)] * 11, ("checkpoint", 100.0)],
            {"checkpoint_timeout_s": 45.0, "heartbeat_timeout_s": 700.0, "step_timeout_s": 12.0},
            [{"step": 12.0, "checkpoint": 45.0, "load": 30.0, "oos": 76.0, "hb": 700.0}],
        ),
        # learn_after_sections 0: nothing learned, the launch values stay.
        ([*START, *[("step", 1.0)] * 30], {"learn_after_sections": 0}, []),
    ],
    ids=["gpt-tiny", "gpt-100m", "capped", "rising", "pinned", "never"],
)
def test_what_a_history_gives(history, injob, want):
    assert replay(policy(**injob), history) == want


def test_the_launch_values_and_why():
    p = policy()
    start = p.at_start()
    assert (start.step.seconds, start.checkpoint.seconds, start.out_of_section.seconds) == (
        600.0,
        600.0,
        600.0,
    )
    assert start.heartbeat.seconds == 1200.0 == InJobConfig().seconds("heartbeat_timeout_s")
    assert start.describe()["step"] == "600.00 s: start-up allowance"
    pinned = policy(step_timeout_s=20.0, startup_allowance_s=30.0).at_start()
    assert pinned.step.why == "pinned" and pinned.load.seconds == 30.0
    learned = replay(p, [*START, *[("step", 1.0)] * 11])
    assert learned and TimeoutLearner(p).in_force == start


def test_why_says_how_each_was_learned():
    learner = TimeoutLearner(policy())
    for kind, s in [*START, ("step", 5.0), *[("step", 0.2)] * 10]:
        new = learner.observe(kind, s)
    assert new is not None
    said = new.describe()
    assert (
        said["step"] == "4.50 s: 5 x the longest of 10 step sections (0.200 s), raised to the floor"
    )
    assert said["out_of_section"].startswith("76.00 s: 5 x the longest of the out-of-section")
    assert said["checkpoint"] == "600.00 s: start-up allowance"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"learn_after_sections": -1}, "injob.learn_after_sections: must be a whole number >= 0"),
        ({"timeout_multiple": 1.5}, "injob.timeout_multiple: must be >= 2"),
        ({"step_timeout_floor_s": 0.5}, "injob.step_timeout_floor_s: must exceed"),
        (
            {"step_timeout_s": 4.5, "step_timeout_floor_s": 6.0},
            r"at most injob.step_timeout_s \(4.5 s\)",
        ),
        ({"step_timeout_s": "soon"}, "injob.step_timeout_s: must be 'auto' or a number"),
        ({"node_silence_s": 0}, "injob.node_silence_s: must be 'auto' or a number of seconds > 0"),
        ({"heartbeat_timeout_s": 100.0}, r"injob.heartbeat_timeout_s: must be >= every section"),
    ],
)
def test_bad_timeout_settings_name_the_field(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        InJobConfig(**kwargs)


def test_the_floors_leave_a_stall_and_a_restart_to_the_in_process_layer():
    """With both layers on, a learned step timeout stays above the in-process layer's window
    for a stalled step (its peers' collectives time out after pg_timeout_s), and a learned
    out-of-section one above an in-process restart (hard timeout + barrier): a stall must be
    restarted in place, not turned into a respawn by a tight learned bound."""
    both = TrainConfig(**BASE, inprocess=InProcessConfig(pg_timeout_s=3.0))  # type: ignore[arg-type]
    assert both.step_timeout_floor() == 4.5  # 3.0 + 1.0 interval + 0.5, above the 3.0 floor
    assert both.out_of_section_floor() == 76.0  # 16 + 60
    alone = TrainConfig(**BASE, inprocess=InProcessConfig(enabled=False))  # type: ignore[arg-type]
    assert alone.step_timeout_floor() == 3.0 and alone.out_of_section_floor() == 30.0
