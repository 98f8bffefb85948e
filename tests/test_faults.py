from __future__ import annotations

from pathlib import Path

import pytest

from trainer.faults import FaultInjector, FaultSpec, FaultSpecError, InjectedFault, parse_fault


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("exception@step=3", FaultSpec("exception", 3)),
        ("sigkill@step=7,rank=1", FaultSpec("sigkill", 7, rank=1)),
        ("node-loss@step=9,node=1", FaultSpec("node-loss", 9, node=1)),
        ("sigkill@step=10,phase=checkpoint", FaultSpec("sigkill", 10, phase="checkpoint")),
        ("corrupt-checkpoint@step=5", FaultSpec("corrupt-checkpoint", 5)),
    ],
)
def test_parse_round_trips(spec: str, expected: FaultSpec):
    parsed = parse_fault(spec)
    assert parsed == expected
    assert parse_fault(str(parsed)) == parsed


@pytest.mark.parametrize(
    "spec",
    [
        "boom@step=1",
        "exception",
        "exception@rank=1",
        "exception@step=0",
        "exception@step=x",
        "exception@step=1,rank=-1",
        "hang@step=2,phase=checkpoint",
        "node-loss@step=2,rank=1",
        "exception@step=1,step=2",
    ],
)
def test_invalid_specs(spec: str):
    with pytest.raises(FaultSpecError, match="invalid fault spec"):
        parse_fault(spec)


def test_fires_once_per_run_across_restarts(tmp_path: Path):
    fired: list[str] = []
    first_life = FaultInjector(
        ["exception@step=3,rank=1"], tmp_path, rank=1, on_fire=lambda s: fired.append(str(s))
    )
    first_life.maybe_fire(2)
    with pytest.raises(InjectedFault):
        first_life.maybe_fire(3)
    # The restarted process (new injector, same run root) passes step 3 again: no second fault.
    second_life = FaultInjector(["exception@step=3,rank=1"], tmp_path, rank=1)
    second_life.maybe_fire(3)
    assert fired == ["exception@step=3,rank=1"]


def test_other_ranks_do_not_fire(tmp_path: Path):
    FaultInjector(["exception@step=3,rank=1"], tmp_path, rank=0).maybe_fire(3)
    assert not (tmp_path / "faults").exists() or not any((tmp_path / "faults").iterdir())
