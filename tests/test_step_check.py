"""The step check (trainer.step_check) as pure decisions over recorded readings, its config's
errors, the gray drills it plays (trainer.gray_drills), and the replay protocol on one process
(world 1: no collective). The real-process drills are in tests/test_fault_drills.py."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from trainer.config import TrainConfig
from trainer.errors import ConfigError
from trainer.event_types import NodeTime
from trainer.events import EventLog
from trainer.faults import parse_faults
from trainer.gray_drills import GrayDrills
from trainer.rundir import read_events
from trainer.step_check import (
    SLOTS,
    Judgement,
    Reading,
    StepCheckConfig,
    StepChecker,
    StepCheckFailed,
    Window,
    bound,
    judge,
    next_action,
    repeat_ranks,
    sum_of_squares,
)

NAN, INF = math.nan, math.inf
CFG = StepCheckConfig(window=8, sigma=6.0, min_samples=4)


def reading(
    losses: list[float],
    sumsqs: list[float],
    *,
    nodes: list[int] | None = None,
    busy: list[float] | None = None,
    count: int | None = None,
    loss_known: bool = True,
) -> Reading:
    n = len(losses)
    values: list[float] = []
    for r in range(n):
        values += [losses[r], sumsqs[r], (busy or [1.0] * n)[r], (nodes or list(range(n)))[r]]
    return Reading.of(values, count or n, loss_known=loss_known)


def filled(losses: list[float], norms: list[float]) -> Window:
    w = Window()
    for lo, no in zip(losses, norms, strict=True):
        w = w.push(lo, no, CFG.window)
    return w


# -- the window ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "pushed, expected_losses, expected_norms",
    [
        ([(1.0, 2.0)], (1.0,), (2.0,)),
        # A non-finite value never enters (the other one of the step still does).
        ([(1.0, 2.0), (NAN, 3.0), (2.0, INF), (3.0, 4.0)], (1.0, 2.0, 3.0), (2.0, 3.0, 4.0)),
        # No loss (a script that gives none): only the norm.
        ([(None, 1.0), (None, 2.0)], (), (1.0, 2.0)),
        # Bounded: the oldest go first.
        ([(float(i), float(i)) for i in range(12)], tuple(range(4, 12)), tuple(range(4, 12))),
    ],
    ids=["one", "non-finite-excluded", "no-loss", "bounded"],
)
def test_window_keeps_only_finite_values(pushed, expected_losses, expected_norms):
    w = Window()
    for lo, no in pushed:
        w = w.push(lo, no, CFG.window)
    assert w.losses == tuple(map(float, expected_losses))
    assert w.norms == tuple(map(float, expected_norms))


@pytest.mark.parametrize(
    "values, expected",
    [
        ([1.0, 1.0, 1.0], None),  # warm-up: fewer than min_samples
        ([1.0, 1.0, 1.0, 1.0], 1.0 + 6 * 0.05),  # σ 0: floored at 5 % of the mean
        ([1.0, 3.0, 1.0, 3.0], 2.0 + 6 * 1.0),  # mean 2, σ 1
    ],
    ids=["warm-up", "sigma-floor", "mean-plus-k-sigma"],
)
def test_bound(values, expected):
    got = bound(values, CFG)
    assert got == (None if expected is None else pytest.approx(expected))


# -- the decision -----------------------------------------------------------------------------
STEADY = filled([2.0, 2.1, 1.9, 2.0, 2.05, 1.95], [1.0, 1.1, 0.9, 1.0, 1.05, 0.95])


@pytest.mark.parametrize(
    "r, window, ok, ranks, reason",
    [
        # Fault-free, warm or not.
        (reading([1.0, 1.0], [0.5, 0.5]), Window(), True, (), ""),
        (reading([1.0, 1.0], [0.5, 0.5]), STEADY, True, (), ""),
        # A NaN in rank 1's own grad shard: attributable to rank 1 (its slot), warm-up or not.
        (reading([1.0, 1.0], [0.5, NAN]), Window(), False, (1,), "non-finite loss or gradient"),
        # Inf loss on rank 0, NaN grad on rank 2.
        (reading([INF, 1, 1], [0.1, 0.1, NAN]), STEADY, False, (0, 2), "on rank 0, 2"),
        # No loss given: a NaN "loss" slot is not read, the gradient is.
        (reading([NAN, 0.0], [0.5, 0.5], loss_known=False), STEADY, True, (), ""),
        (reading([0.0, 0.0], [INF, 0.5], loss_known=False), STEADY, False, (0,), "gradient"),
        # A grad-norm spike: sqrt(50+50) = 10 > 1 + 6·0.0577. Not attributable to a rank.
        (reading([1.0, 1.0], [50.0, 50.0]), STEADY, False, (), "grad norm spike"),
        # The same spike during warm-up: not judged.
        (reading([1.0, 1.0], [50.0, 50.0]), filled([2.0] * 3, [1.0] * 3), True, (), ""),
        # A loss spike: (10+10)/2 = 10 > 2 + 6·0.1.
        (reading([10.0, 10.0], [0.5, 0.5]), STEADY, False, (), "loss spike"),
        # Just under the bound: passes (mean 1.0, σ 0.0577 → bound 1.346 on the norm).
        (reading([1.0, 1.0], [0.6, 0.6]), STEADY, True, (), ""),
        # A falling loss is never a spike.
        (reading([0.1, 0.1], [0.5, 0.5]), STEADY, True, (), ""),
    ],
    ids=[
        "clean-cold",
        "clean-warm",
        "nan-grad-rank1",
        "inf-loss-and-nan-grad",
        "no-loss-nan-slot-ignored",
        "no-loss-inf-grad",
        "norm-spike",
        "norm-spike-in-warm-up",
        "loss-spike",
        "under-bound",
        "loss-falls",
    ],
)
def test_judge(r: Reading, window: Window, ok: bool, ranks: tuple[int, ...], reason: str):
    j = judge(r, window, CFG)
    assert (j.ok, j.ranks) == (ok, ranks), j
    assert reason in j.reason
    if "spike" in reason:
        assert j.bound is not None and j.bound < (j.grad_norm if "norm" in reason else j.loss)


def test_reading_global_values_and_node_times():
    # FSDP2 shards partition the parameters: the global norm is sqrt of the summed sums.
    r = reading([3.0, 5.0, 4.0, 4.0], [9.0, 16.0, 0.0, 0.0], nodes=[0, 0, 1, 1], count=8,
                busy=[1.0, 1.5, 3.0, 2.0])  # fmt: skip
    assert r.loss == 2.0 and r.grad_norm == 5.0
    assert r.node_times() == [NodeTime(node=0, busy_s=1.5), NodeTime(node=1, busy_s=3.0)]
    assert len(r.losses) == 4 and SLOTS == 4


@pytest.mark.parametrize(
    "ok, replaying, action",
    [
        (True, False, "apply"),
        (True, True, "transient"),
        (False, False, "rejected"),
        (False, True, "repeat"),
    ],
)
def test_next_action(ok: bool, replaying: bool, action: str):
    assert next_action(Judgement(ok), replaying=replaying) == action


@pytest.mark.parametrize(
    "first, again, expected",
    [
        ((1,), (1,), (1,)),  # the same rank twice: it
        ((2, 3), (3,), (3,)),
        ((1,), (0,), ()),  # moved: nothing attributable
        ((), (), ()),  # a spike twice: no rank
    ],
)
def test_repeat_is_attributed_to_ranks_that_failed_both_times(first, again, expected):
    assert repeat_ranks(Judgement(False, ranks=first), Judgement(False, ranks=again)) == expected


# -- config errors ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "fields, field",
    [
        ({"window": 1}, "step_check.window"),
        ({"window": 8.5}, "step_check.window"),
        ({"min_samples": 1}, "step_check.min_samples"),
        ({"window": 16, "min_samples": 32}, "step_check.min_samples"),
        ({"sigma": 0}, "step_check.sigma"),
        ({"sigma": math.nan}, "step_check.sigma"),
        ({"repeat_wait_s": -1}, "step_check.repeat_wait_s"),
    ],
)
def test_config_errors_name_the_field(fields, field):
    with pytest.raises(ConfigError) as e:
        StepCheckConfig(**fields)
    assert e.value.field == field


def test_train_config_carries_the_check(dataset: Path, tmp_path: Path):
    cfg = TrainConfig(run_root=tmp_path, data_dir=dataset)
    assert cfg.step_check == StepCheckConfig() and cfg.step_check.enabled
    data = cfg.to_dict()
    data["step_check"]["sigma"] = 8.0
    assert TrainConfig.from_dict(data).step_check.sigma == 8.0
    data["step_check"]["sigmaa"] = 8.0
    with pytest.raises(ConfigError, match=r"step_check\.sigmaa: unknown field"):
        TrainConfig.from_dict(data)
    # A gray drill is played inside the check: refused with the check off.
    off = replace(cfg.step_check, enabled=False)
    with pytest.raises(ConfigError, match="step_check.enabled is false") as e:
        replace(cfg, step_check=off, faults=parse_faults(["corrupt-grad@step=3,rank=1"]))
    assert e.value.field == "faults"


def test_worker_cli_sets_the_check(dataset: Path, tmp_path: Path):
    from trainer.worker_cli import build_parser, config_from_args

    args = build_parser().parse_args(
        ["--set", f"run_root={tmp_path}", "--set", f"data_dir={dataset}",
         "--set", "step_check.window=64", "--set", "step_check.enabled=false"]
    )  # fmt: skip
    cfg = config_from_args(args)
    assert (cfg.step_check.window, cfg.step_check.enabled) == (64, False)


# -- the run form (flows.step_check_params) ----------------------------------------------------
@pytest.mark.parametrize(
    "form, expected",
    [
        ({}, StepCheckConfig()),
        ({"enabled": False}, StepCheckConfig(enabled=False)),
        ({"window": 16, "min_samples": 16}, StepCheckConfig(window=16, min_samples=16)),
        ({"sigma": 4, "repeat_wait_s": 0}, StepCheckConfig(sigma=4.0, repeat_wait_s=0.0)),
    ],
)
def test_the_form_builds_the_config(form, expected):
    from flows.models import PipelineParams

    assert PipelineParams(step_check=form).step_check.config() == expected


@pytest.mark.parametrize(
    "form, field",
    [
        ({"window": 1}, "step_check.window"),
        ({"window": 8.5}, "step_check.window"),
        ({"min_samples": 1}, "step_check.min_samples"),
        # the cross-field rule is the config's, and its error names the field too
        ({"window": 16, "min_samples": 32}, "step_check.min_samples"),
        ({"sigma": 0}, "step_check.sigma"),
        ({"sigma": "nan"}, "step_check.sigma"),
        ({"repeat_wait_s": -1}, "step_check.repeat_wait_s"),
        ({"repeat_wait_s": 3601}, "step_check.repeat_wait_s"),
        ({"sigmaa": 8}, "step_check.sigmaa"),
    ],
)
def test_bad_form_values_name_the_field(form, field):
    from pydantic import ValidationError

    from flows.models import PipelineParams

    with pytest.raises(ValidationError) as e:
        PipelineParams(step_check=form)
    assert field in str(e.value)


@pytest.mark.parametrize(
    "enabled, faults, refused",
    [
        (False, ["corrupt-grad@step=3,rank=1"], True),
        (False, ["slow@step=3,node=1,factor=3"], True),
        (False, ["exception@step=3"], False),
        (True, ["corrupt-grad@step=3,rank=1"], False),
    ],
)
def test_the_form_refuses_a_gray_drill_without_the_check(enabled, faults, refused):
    """At the form, not when the workers' config is built after hydration."""
    from pydantic import ValidationError

    from flows.models import PipelineParams

    def build() -> PipelineParams:
        return PipelineParams(step_check={"enabled": enabled}, drills={"faults": faults})

    if not refused:
        assert build().step_check.enabled is enabled
        return
    with pytest.raises(ValidationError, match=r"step_check\.enabled is false"):
        build()


def test_the_form_reaches_the_workers_config(tmp_path: Path):
    from flows.context import train_config
    from flows.models import PipelineParams
    from tasks.backends.base import Placement

    params = PipelineParams(step_check={"sigma": 8, "repeat_wait_s": 5})
    where = Placement(shared_root=tmp_path, local_paths=False)
    cfg = train_config(params, where, tmp_path / "r", tmp_path / "d")
    assert cfg.step_check == StepCheckConfig(sigma=8.0, repeat_wait_s=5.0)


# -- the gray drills --------------------------------------------------------------------------
def drills(tmp_path: Path, spec: str, *, rank: int, node: int, slept: list[float]) -> GrayDrills:
    events = EventLog(tmp_path)
    return GrayDrills(parse_faults([spec]), tmp_path, events, rank=rank, node=node,
                      sleep=slept.append)  # fmt: skip


def nan_count(grads: list[torch.Tensor]) -> int:
    return sum(int(torch.isnan(g).sum()) for g in grads)


@pytest.mark.parametrize(
    "spec, rank, node, steps, corrupted",
    [
        # Once per run, on the rank named: not its replay, not another rank.
        ("corrupt-grad@step=3,rank=1", 1, 0, [2, 3, 3, 4], [0, 1, 0, 0]),
        ("corrupt-grad@step=3,rank=1", 0, 0, [3], [0]),
        # Every step from N on, every rank of the node, replays included.
        ("corrupt-grad@step=3,node=1,every", 2, 1, [2, 3, 3, 4], [0, 1, 1, 1]),
        ("corrupt-grad@step=3,node=1,every", 0, 0, [3, 4], [0, 0]),
    ],
    ids=["once", "once-other-rank", "every", "every-other-node"],
)
def test_corrupt_grad_drill(tmp_path: Path, spec, rank, node, steps, corrupted):
    d = drills(tmp_path, spec, rank=rank, node=node, slept=[])
    got = []
    for step in steps:
        grads = [torch.zeros(0), torch.ones(3)]  # an empty shard is skipped
        d.corrupt(step, grads)
        got.append(nan_count(grads))
    assert got == corrupted
    faults = [e for e in read_events(tmp_path) if e.kind == "fault"]
    assert [f.fault for f in faults] == ([spec] if any(corrupted) else [])  # said once


def test_slow_drill_stretches_the_busy_time(tmp_path: Path):
    slept: list[float] = []
    d = drills(tmp_path, "slow@step=2,node=1,factor=3", rank=1, node=1, slept=slept)
    for step in (1, 2, 3):
        d.slow(step, 0.5)
    assert slept == [1.0, 1.0]  # (3 - 1) × 0.5, from step 2 on
    assert [e.fault for e in read_events(tmp_path) if e.kind == "fault"] == [
        "slow@step=2,node=1,factor=3"
    ]
    other: list[float] = []
    drills(tmp_path, "slow@step=2,node=1,factor=3", rank=0, node=0, slept=other).slow(3, 0.5)
    assert other == []


# -- the replay protocol on one process --------------------------------------------------------
def test_sum_of_squares_matches_the_norm():
    grads = [torch.randn(5, 3), torch.randn(7), torch.zeros(0)]
    want = torch.nn.utils.get_total_norm(grads, 2.0).double() ** 2
    assert sum_of_squares(grads) == pytest.approx(float(want), rel=1e-6)
    assert math.isnan(sum_of_squares([torch.tensor([1.0, NAN])]))
    assert sum_of_squares([]) == 0.0


def checker(tmp_path: Path, spec: str | None = None, **cfg: float) -> StepChecker:
    events = EventLog(tmp_path)
    d = GrayDrills(parse_faults([spec] if spec else []), tmp_path, events, rank=0, node=0)
    return StepChecker(StepCheckConfig(**cfg), 0, 1, 0, events, corrupt=d.corrupt, slow=d.slow)


def backward(model: nn.Module) -> torch.Tensor:
    torch.manual_seed(0)
    loss = model(torch.randn(4, 3)).pow(2).mean()
    loss.backward()
    return loss.detach()


@pytest.mark.parametrize(
    "spec, verdicts",
    [
        (None, []),
        ("corrupt-grad@step=2,rank=0", ["rejected", "transient"]),
    ],
    ids=["clean", "transient"],
)
def test_a_rejected_step_replays_in_place(tmp_path: Path, spec, verdicts):
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    c = checker(tmp_path, spec)
    tries = []
    for step in (1, 2, 3):
        while True:
            loss = backward(model)
            ok = c.check(step, model, loss, count=1, started=0.0)
            tries.append(step)
            if ok:
                break
            model.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
    assert tries == ([1, 2, 3] if spec is None else [1, 2, 2, 3])
    checks = [e for e in read_events(tmp_path) if e.kind == "step_check"]
    assert [e.verdict for e in checks] == verdicts
    if verdicts:
        assert checks[0].ranks == [0] and checks[0].nodes == [0] and checks[0].step == 2
        assert "non-finite" in checks[0].reason and checks[0].grad_norm is None
    assert len(c.window.norms) == 3 and c.checked == 3


def test_a_repeat_raises_after_its_wait(tmp_path: Path):
    model = nn.Linear(3, 2)
    c = checker(tmp_path, "corrupt-grad@step=1,node=0,every", repeat_wait_s=0)
    assert not c.check(1, model, backward(model), count=1, started=0.0)
    model.zero_grad(set_to_none=True)
    with pytest.raises(StepCheckFailed, match="step 1 failed its check again"):
        c.check(1, model, backward(model), count=1, started=0.0)
    checks = [e for e in read_events(tmp_path) if e.kind == "step_check"]
    assert [(e.verdict, e.nodes) for e in checks] == [("rejected", [0]), ("repeat", [0])]
    assert c.checked is None and not c.window.norms  # nothing from it was let through


def test_an_unchecked_non_finite_step_is_refused(tmp_path: Path):
    """A script that never passes its model: step_end's fallback, before any save."""
    c = checker(tmp_path)
    with pytest.raises(StepCheckFailed, match="not saved"):
        c.refuse(7, math.nan)
    [event] = [e for e in read_events(tmp_path) if e.kind == "step_check"]
    assert (event.step, event.verdict, event.loss) == (7, "rejected", None)
    assert "unchecked update" in event.reason
