"""The straggler judge (tasks.straggler) over recorded histories: step events with per-node busy
times, as rank 0 writes them, and the watcher's train_start events. Pure: no process, no file,
no clock; a history of an hour runs in milliseconds."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from tasks.straggler import (
    Kind,
    Sample,
    StragglerState,
    Unmeasured,
    Verdict,
    judge,
    recorded_evictions,
    restarted,
)
from trainer.errors import ConfigError
from trainer.event_types import Event, NodeTime, StageAttempt, Step, Straggler, TrainStart
from trainer.straggler_config import StragglerConfig, StragglerPolicy

# Windows of 5 steps of 1 s: three windows (the confirmation) span 15 s >= confirm_s.
CFG = StragglerConfig(
    policy=StragglerPolicy.REPLACE, window=5, confirm_windows=3, confirm_s=10.0, warmup_steps=5
)
W = CFG.window


class Clock:
    """The writer's clock and step counter across a recorded history."""

    def __init__(self) -> None:
        self.t, self.step = 1000.0, 0

    def tick(self, step_s: float) -> tuple[float, int]:
        self.t += step_s
        self.step += 1
        return self.t, self.step


def steps(
    clock: Clock,
    factors: dict[int, float],
    n: int = W,
    *,
    busy_s: float = 1.0,
    ckpt_s: float = 0.0,
    times: bool = True,
    drop: int | None = None,
) -> list[Event]:
    """``n`` step events in which node k took ``factors[k] x busy_s`` (the job waits for the
    slowest); ``drop``: a node missing from the times; ``times`` False: none at all."""
    out: list[Event] = []
    for _ in range(n):
        step_s = busy_s * max(factors.values())
        t, step = clock.tick(step_s)
        nodes = [NodeTime(node=k, busy_s=busy_s * f) for k, f in factors.items() if k != drop]
        out.append(
            Step(
                t=t, step=step, step_s=step_s, ckpt_blocking_s=ckpt_s,
                nodes=nodes if times else None,
            )
        )  # fmt: skip
    return out


def windows(clock: Clock, nodes: int, slow: dict[int, list[float]], count: int) -> list[Event]:
    """``count`` windows on ``nodes`` nodes; ``slow[k]``: node k's factor per window (1.0 past
    the list's end, or its last value if the list ends with ``...``)."""
    out: list[Event] = []
    for w in range(count):
        factors = {k: 1.0 for k in range(nodes)}
        for k, fs in slow.items():
            factors[k] = fs[w] if w < len(fs) else fs[-1]
        out += steps(clock, factors)
    return out


def warm(clock: Clock, nodes: int) -> list[Event]:
    """The warm-up after a start: steps of a healthy job, not judged."""
    return [
        TrainStart(t=clock.t, world_size=nodes, nodes=list(range(nodes))),
        *steps(clock, {k: 1.0 for k in range(nodes)}, n=CFG.warmup_steps),
    ]


def replay(
    history: list[Event],
    cfg: StragglerConfig = CFG,
    nodes_total: int = 4,
    start: StragglerState | None = None,
) -> tuple[StragglerState, list[tuple[int, Verdict]]]:
    """Feed a history as the watcher does, from ``start`` (a new one by default): every
    train_start restarts the judge, every step event is judged. Returns the state and (window
    number since the first start, verdict)."""
    s, said = start or StragglerState(), []
    for e in history:
        if isinstance(e, TrainStart):
            s = restarted(s, e.nodes)
        elif isinstance(e, Step):
            s, verdicts = judge(s, Sample.of(e), e.t, cfg, nodes_total=nodes_total)
            said += [(e.step, v) for v in verdicts]
    return s, said


def brief(said: list[tuple[int, Verdict]]) -> list[tuple[int, int, str]]:
    """(window index after the warm-up, node, verdict) per verdict."""
    return [((step - CFG.warmup_steps) // W - 1, v.node, v.kind.value) for step, v in said]


def case(nodes: int, slow: dict[int, list[float]], count: int) -> list[Event]:
    clock = Clock()
    return warm(clock, nodes) + windows(clock, nodes, slow, count)


def _spiky() -> list[Event]:
    clock = Clock()
    out = warm(clock, 4)
    for _ in range(10):
        out += steps(clock, {0: 1.0, 1: 5.0, 2: 1.0, 3: 1.0}, n=1)
        out += steps(clock, {k: 1.0 for k in range(4)}, n=W - 1)
    return out


def _untimed() -> list[Event]:
    clock = Clock()
    return warm(clock, 4) + steps(clock, {0: 1.0, 1: 1.0, 2: 3.0, 3: 1.0}, n=50, times=False)


SLOW_FROM_5 = [1.0] * 5 + [3.0]
# (case, history, config changes, nodes_total, expected (window, node, verdict))
TABLE: list[tuple[str, list[Event], dict[str, Any], int, list[tuple[int, int, str]]]] = [
    # 1. A healthy job's jitter (within 3 %) says nothing for 30 windows.
    ("healthy-jitter",
     case(4, {0: [1.0, 0.97, 1.03], 1: [1.03, 1.0, 0.97], 2: [0.97, 1.03, 1.0]} , 30), {}, 4, []),
    # 2. A 3x node from window 5: suspect at once, replaced at its third window (15 s >= 10 s).
    ("slow-from-window-5", case(4, {2: SLOW_FROM_5}, 12), {}, 4,
     [(5, 2, "suspect"), (7, 2, "replaced")]),
    # 3. Below `leave` clears it; the count starts over.
    ("cleared-below-leave", case(4, {2: [1.12, 1.12, 1.04, 1.12, 1.12, 1.0]}, 6), {}, 4,
     [(0, 2, "suspect"), (2, 2, "cleared"), (3, 2, "suspect"), (5, 2, "cleared")]),
    # 4. Between leave and enter: still suspect (no second "suspect"), but the consecutive count
    # breaks; three windows in a row after it confirm.
    ("between-leave-and-enter", case(4, {2: [1.12, 1.07, 1.12, 1.12, 1.12]}, 5), {}, 4,
     [(0, 2, "suspect"), (4, 2, "replaced")]),
    # 6. No per-node times at all (no step check): nothing measured, nothing said.
    ("no-times", _untimed(), {}, 4, []),
    # 7. Two 3x nodes in one hour, 4 nodes, share 0.25: one eviction, the other rate-limited.
    ("rate-limited", case(4, {1: [3.0], 2: [3.0]}, 4), {}, 4,
     [(0, 1, "suspect"), (0, 2, "suspect"), (2, 1, "replaced"), (2, 2, "rate-limited")]),
    # 9. A 2-node world: the median is the mean, a 3x node scores 1.5 (the other 0.5).
    ("two-nodes-3x", case(2, {1: [3.0]}, 3), {}, 2, [(0, 1, "suspect"), (2, 1, "replaced")]),
    # ... while 1.2x scores only 1.2 / 1.1 = 1.09: a 2-node world does not see it (stated).
    ("two-nodes-1.2x-unseen", case(2, {1: [1.2]}, 10), {}, 2, []),
    # 10. Every node 2x slower together (a job-wide slowdown): the median moves with them.
    ("job-wide-slowdown", case(4, {k: [1.0] * 3 + [2.0] for k in range(4)}, 10), {}, 4, []),
    # policy report: confirmed once (not every window after), cleared when it recovers.
    ("report-once-then-cleared", case(4, {3: [2.0] * 6 + [1.0]}, 8),
     {"policy": StragglerPolicy.REPORT}, 4,
     [(0, 3, "suspect"), (2, 3, "confirmed"), (6, 3, "cleared")]),
    # confirm_s longer than three windows: confirmed only once the slowdown lasted that long
    # (windows of 5 steps at 3 s a step: 15 s each; 50 s needs four).
    ("confirm-needs-seconds", case(4, {0: [3.0]}, 6), {"confirm_s": 50.0}, 4,
     [(0, 0, "suspect"), (3, 0, "replaced")]),
    ("policy-off", case(4, {2: [3.0]}, 10), {"policy": StragglerPolicy.OFF}, 4, []),
    # One slow step per window (a GC pause, a page fault): the window's median ignores it.
    ("one-slow-step-per-window", _spiky(), {}, 4, []),
]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "history", "changes", "nodes_total", "expected"), TABLE, ids=[c[0] for c in TABLE]
)
def test_recorded_histories(
    name: str,
    history: list[Event],
    changes: dict[str, Any],
    nodes_total: int,
    expected: list[tuple[int, int, str]],
) -> None:
    _, said = replay(history, replace(CFG, **changes), nodes_total)
    assert brief(said) == expected


def test_checkpoint_steps_measure_nothing() -> None:
    """5. Node 2 is 3x only on steps whose save blocked (a checkpoint step): never judged;
    healthy steps between keep it at 1.0."""
    clock = Clock()
    history = warm(clock, 4)
    for _ in range(10):
        history += steps(clock, {0: 1.0, 1: 1.0, 2: 3.0, 3: 1.0}, n=3, ckpt_s=2.0)
        history += steps(clock, {k: 1.0 for k in range(4)}, n=2)
    s, said = replay(history)
    assert said == [] and s.unmeasured[Unmeasured.CHECKPOINT] == 30


def test_a_missing_node_measures_nothing() -> None:
    """6. One node without a time (its ranks said nothing): fail open, however slow the other."""
    clock = Clock()
    history = warm(clock, 4) + steps(clock, {0: 1.0, 1: 1.0, 2: 3.0, 3: 1.0}, n=60, drop=3)
    s, said = replay(history)
    assert said == [] and s.unmeasured[Unmeasured.MISSING_NODE] == 60
    s, said = replay(_untimed())
    assert said == [] and s.unmeasured[Unmeasured.NO_TIMES] == 50


def test_a_restart_is_a_new_median() -> None:
    """8. The world re-forms mid-suspicion: the warm-up is not judged and the suspicion starts
    over, so two windows before and two after confirm nothing."""
    clock = Clock()
    history = warm(clock, 4) + windows(clock, 4, {2: [1.5]}, 2)
    history += warm(clock, 4) + windows(clock, 4, {2: [1.5]}, 2)
    _, said = replay(history)
    assert [(v.node, v.kind) for _, v in said] == [(2, Kind.SUSPECT), (2, Kind.SUSPECT)]


def test_a_replay_without_a_train_start_restarts_the_judge() -> None:
    """Steps going back (a restart the watcher read no train_start of) start it over too."""
    clock = Clock()
    history = warm(clock, 4) + windows(clock, 4, {2: [1.5]}, 2)
    clock.step -= 8  # resumed from an earlier checkpoint
    history += steps(clock, {k: 1.0 for k in range(4)}, n=CFG.warmup_steps)
    history += windows(clock, 4, {2: [1.5]}, 2)
    s, said = replay(history)
    assert [v.kind for _, v in said] == [Kind.SUSPECT, Kind.SUSPECT]
    assert s.unmeasured[Unmeasured.WARM_UP] == 2 * CFG.warmup_steps


def test_the_rate_limit_spans_restarts_and_lapses() -> None:
    """7, continued. Node 1 is replaced; the world re-forms without it (a spare, node 4); node 2
    then slows within the period: reported rate-limited, and replaced once the period lapsed
    if it is still slow then."""
    cfg = replace(CFG, evict_period_s=100.0)
    clock = Clock()
    history = warm(clock, 4) + windows(clock, 4, {1: [3.0]}, 3)
    history.append(TrainStart(t=clock.t, world_size=4, nodes=[0, 2, 3, 4]))
    history += steps(clock, {0: 1.0, 2: 1.0, 3: 1.0, 4: 1.0}, n=cfg.warmup_steps)
    for _ in range(12):  # 60 steps of 3 s: past the period
        history += steps(clock, {0: 1.0, 2: 3.0, 3: 1.0, 4: 1.0})
    _, said = replay(history, cfg)
    assert [(v.node, v.kind) for _, v in said] == [
        (1, Kind.SUSPECT), (1, Kind.REPLACED),
        (2, Kind.SUSPECT), (2, Kind.RATE_LIMITED), (2, Kind.REPLACED),
    ]  # fmt: skip
    first, last = said[1][1], said[-1][1]
    assert last.seconds > 0 and first.steps[0] <= first.steps[1]


def said(t: float, node: int, verdict: str) -> Straggler:
    """A ``straggler`` event as the watcher records it (its own unix time)."""
    return Straggler(t=t, node=node, verdict=verdict, score=3.0, window=W, policy="replace",
                     evidence="")  # fmt: skip


def attempt(t: float, n: int) -> StageAttempt:
    return StageAttempt(t=t, stage="train", attempt=n, nodes=4, nproc_per_node=1, backend="local")


HOUR = CFG.evict_period_s


@pytest.mark.parametrize(
    ("record", "cfg", "expected"),
    [
        ([], CFG, ()),
        ([attempt(1000, 1), *steps(Clock(), {0: 1.0, 1: 1.0})], CFG, ()),
        # Only evictions count: what was reported, rate-limited or cleared took nobody away.
        ([said(1010, 1, "suspect"), said(1020, 1, "confirmed"), said(1030, 2, "rate-limited"),
          said(1040, 1, "cleared")], CFG, ()),
        ([attempt(1000, 1), said(1050, 1, "replaced"), attempt(1100, 2)], CFG, (1050.0,)),
        # Every attempt's, oldest first, whatever order the record holds them in.
        ([said(1900, 2, "replaced"), attempt(2000, 3), said(1050, 1, "replaced")], CFG,
         (1050.0, 1900.0)),
        # An eviction a period before the newest event on record can never count again.
        ([said(1000, 1, "replaced"), said(1500, 2, "replaced"), attempt(1000 + HOUR, 2)], CFG,
         (1500.0,)),
        ([said(1000, 1, "replaced"), attempt(1000 + HOUR - 1, 2)], CFG, (1000.0,)),
        # A policy that evicts nothing needs no budget (and reads no record).
        ([said(1050, 1, "replaced")], replace(CFG, policy=StragglerPolicy.REPORT), ()),
        ([said(1050, 1, "replaced")], replace(CFG, policy=StragglerPolicy.OFF), ()),
    ],
)  # fmt: skip
def test_recorded_evictions(
    record: list[Event], cfg: StragglerConfig, expected: tuple[float, ...]
) -> None:
    assert recorded_evictions(record, cfg) == expected


def test_a_new_attempt_keeps_the_budget_of_the_last() -> None:
    """Attempt 1 replaced node 1 (budget: one per period on 4 nodes); its stage retry's watcher,
    seeded from the record, reports node 2 rate-limited within the period and replaces it once
    the period lapsed. Unseeded, it would have replaced node 2 at once."""
    cfg = replace(CFG, evict_period_s=100.0)
    clock = Clock()
    first, said_first = replay(warm(clock, 4) + windows(clock, 4, {1: [3.0]}, 3), cfg)
    assert [(v.node, v.kind) for _, v in said_first][-1] == (1, Kind.REPLACED)
    # As the watcher records it: its own time, a poll after the step the judge read.
    record = [said(t + 0.5, 1, "replaced") for t in first.evicted_at]
    retry = warm(clock, 4)
    for _ in range(12):  # 60 steps of 3 s: past the period
        retry += steps(clock, {0: 1.0, 1: 1.0, 2: 3.0, 3: 1.0})
    for seed, expected in (
        (recorded_evictions(record, cfg), [Kind.SUSPECT, Kind.RATE_LIMITED, Kind.REPLACED]),
        ((), [Kind.SUSPECT, Kind.REPLACED]),
    ):
        _, out = replay(retry, cfg, start=StragglerState(evicted_at=seed))
        assert [v.kind for _, v in out] == expected


def test_a_verdict_names_the_node_its_score_and_the_evidence() -> None:
    _, said = replay(case(4, {2: SLOW_FROM_5}, 12))
    replaced = next(v for _, v in said if v.kind == Kind.REPLACED)
    assert replaced.node == 2 and replaced.score == 3.0 and replaced.scores == (3.0, 3.0, 3.0)
    assert replaced.seconds == 45.0  # three windows of five 3 s steps
    assert "node 2 took 3.00x the median busy time of 4 nodes" in replaced.evidence
    assert "3 window(s) of 5 steps" in replaced.evidence
    assert "the stated bound at this pace:" in replaced.evidence


@pytest.mark.parametrize("onset", range(W))
@pytest.mark.parametrize("factor", [1.5, 3.0])
def test_the_stated_bound_holds(onset: int, factor: float) -> None:
    """A node slowed ``factor``x at any step of a window is confirmed within
    StragglerConfig.detection_bound (what docs/architecture.md states), on 2 and 4 nodes."""
    for nodes in (2, 4):
        for cfg in (CFG, replace(CFG, confirm_s=60.0)):
            clock = Clock()
            history = warm(clock, nodes) + windows(clock, nodes, {}, 2)
            history += steps(clock, {k: 1.0 for k in range(nodes)}, n=onset)
            slowed_at = clock.step + 1
            history += steps(clock, {**{k: 1.0 for k in range(nodes)}, 1: factor}, n=20 * W)
            _, said = replay(history, cfg, nodes)
            at = next(step for step, v in said if v.kind == Kind.REPLACED)
            step_s = factor  # the job waits for the slow node
            bound_steps, bound_s = cfg.detection_bound(step_s)
            assert at - slowed_at + 1 <= bound_steps
            assert (at - slowed_at + 1) * step_s <= bound_s


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"enter": 1.05}, "straggler.enter"),
        ({"leave": 1.2}, "straggler.leave"),
        ({"window": 0}, "straggler.window"),
        ({"confirm_windows": 0}, "straggler.confirm_windows"),
        ({"warmup_steps": -1}, "straggler.warmup_steps"),
        ({"confirm_s": -1.0}, "straggler.confirm_s"),
        ({"max_evict_share": 0.0}, "straggler.max_evict_share"),
        ({"policy": "evict"}, "straggler.policy"),
    ],
)
def test_bad_settings_name_the_field(changes: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        StragglerConfig(**changes)


def test_policy_text_is_accepted() -> None:
    assert StragglerConfig(policy="replace").policy == StragglerPolicy.REPLACE  # type: ignore[arg-type]


def test_the_section_travels_with_the_trainer_config(tmp_path) -> None:
    """``--set straggler.KEY=VALUE`` reaches TrainConfig, survives its JSON, and a bad value is
    refused naming the field; the run form's section builds the same config."""
    from flows.models import PipelineParams
    from trainer.config import TrainConfig
    from trainer.worker_cli import build_parser, config_from_args

    paths = ["--set", f"run_root={tmp_path}", "--set", f"data_dir={tmp_path}"]
    args = build_parser().parse_args(
        [*paths, "--set", "straggler.policy=replace", "--set", "straggler.confirm_s=5"]
    )
    cfg = config_from_args(args)
    assert cfg.straggler == StragglerConfig(policy=StragglerPolicy.REPLACE, confirm_s=5.0)
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg
    assert TrainConfig(run_root=tmp_path, data_dir=tmp_path).straggler.policy == "report"
    bad = build_parser().parse_args([*paths, "--set", "straggler.polcy=replace"])
    with pytest.raises(ConfigError, match=r"straggler\.polcy: unknown field"):
        config_from_args(bad)
    form = PipelineParams(straggler={"policy": "replace", "window": 4})
    assert form.straggler.config() == StragglerConfig(policy=StragglerPolicy.REPLACE, window=4)
