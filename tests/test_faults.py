from __future__ import annotations

from pathlib import Path

import pytest

from trainer.faults import (
    FaultInjector,
    FaultKind,
    FaultSpec,
    FaultSpecError,
    InjectedFault,
    Phase,
    parse_fault,
    parse_faults,
)


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("exception@step=3", FaultSpec(FaultKind.EXCEPTION, 3)),
        ("sigkill@step=7,rank=1", FaultSpec(FaultKind.SIGKILL, 7, rank=1)),
        ("node-loss@step=9,node=1", FaultSpec(FaultKind.NODE_LOSS, 9, node=1)),
        (
            "sigkill@step=10,phase=checkpoint",
            FaultSpec(FaultKind.SIGKILL, 10, phase=Phase.CHECKPOINT),
        ),
        ("corrupt-checkpoint@step=5", FaultSpec(FaultKind.CORRUPT_CHECKPOINT, 5)),
        ("node-evict@step=4,node=1", FaultSpec(FaultKind.NODE_EVICT, 4, node=1)),
        ("slow@step=20,node=1,factor=3", FaultSpec(FaultKind.SLOW, 20, node=1, factor=3.0)),
        ("slow@step=2,node=0,factor=1.5", FaultSpec(FaultKind.SLOW, 2, node=0, factor=1.5)),
        ("corrupt-grad@step=6,rank=1", FaultSpec(FaultKind.CORRUPT_GRAD, 6, rank=1)),
        (
            "corrupt-grad@step=6,node=1,every",
            FaultSpec(FaultKind.CORRUPT_GRAD, 6, node=1, every=True),
        ),
    ],
)
def test_parse_round_trips(spec: str, expected: FaultSpec):
    parsed = parse_fault(spec)
    assert parsed == expected
    assert parse_fault(str(parsed)) == parsed


# (spec, the field its error names, words of the fix)
INVALID = [
    ("boom@step=1", "kind", "use one of exception, stall"),
    ("exception", "step", "add @step=N"),
    ("exception@rank=1", "step", "add step=N"),
    ("exception@step=0", "step", "must be 1 or more"),
    ("exception@step=x", "step", "must be an integer"),
    ("exception@step=1,rank=-1", "rank", "ranks count from 0"),
    ("exception@step=1,when=3", "when", "the fields are step, rank, node, phase, factor, every"),
    ("slow@step=5,node=1", "factor", "add factor=F"),
    ("slow@step=5,factor=3", "node", "slow needs node=K"),
    ("slow@step=5,node=1,factor=1", "factor", "more than 1, at most 100"),
    ("slow@step=5,node=1,factor=nan", "factor", "more than 1"),
    ("slow@step=5,node=1,factor=x", "factor", "must be a number"),
    ("exception@step=1,factor=2", "factor", "applies to slow only"),
    ("exception@step=1,every", "every", "applies to corrupt-grad only"),
    ("corrupt-grad@step=1,every=1", "every", "bare flag"),
    ("corrupt-grad@step=1,rank=0,node=1", "node", "rank=R or node=K, not both"),
    ("node-evict@step=2,rank=1", "rank", "takes node=K, not rank=R"),
    ("hang@step=2,phase=checkpoint", "phase", "applies to sigkill only"),
    ("sigkill@step=2,phase=later", "phase", "must be step or checkpoint"),
    ("node-loss@step=2,rank=1", "rank", "takes node=K, not rank=R"),
    ("exception@step=1,step=2", "step", "give it once"),
]


@pytest.mark.parametrize(("spec", "field", "fix"), INVALID, ids=[i[0] for i in INVALID])
def test_invalid_specs_name_the_field_and_the_fix(spec: str, field: str, fix: str):
    with pytest.raises(FaultSpecError) as err:
        parse_fault(spec)
    assert str(err.value).startswith(f"invalid fault spec {spec!r}: {field}: ")
    assert fix in str(err.value)


def test_predicates_say_what_each_reader_asks():
    loss, back, freeze, peer, kill = parse_faults(
        [
            "node-loss@step=3,node=1",
            "node-return@step=5,node=1",
            "node-freeze@step=4",
            "corrupt-peer@step=2,rank=3",
            "sigkill@step=6",
        ]
    )
    assert [s.is_node_fault for s in (loss, back, freeze, peer, kill)] == [1, 1, 1, 0, 0]
    assert loss.kills_node and loss.takes_node_away and not loss.needs_other_nodes
    assert back.returns_node and not back.takes_node_away
    assert freeze.takes_node_away and freeze.needs_other_nodes and freeze.target_node == 0
    assert peer.is_damage and peer.at_resume and peer.needs_node_memory and peer.target_rank == 3
    assert not kill.is_damage and not kill.needs_node_memory and kill.target_rank == 0
    assert parse_faults([loss]) == (loss,)  # a parsed spec passes through as it is
    evict, slow, once, every = parse_faults(
        [
            "node-evict@step=3,node=1",
            "slow@step=4,node=1,factor=3",
            "corrupt-grad@step=5,rank=1",
            "corrupt-grad@step=5,node=1,every",
        ]
    )
    assert evict.is_node_fault and evict.evicts_node and evict.takes_node_away
    assert slow.is_gray and slow.slows and slow.needs_other_nodes and not slow.is_node_fault
    assert once.corrupts_grad and not once.every and every.every
    # A node's gray fault plays on each of its ranks; a rank's on that rank only.
    assert slow.targets(rank=5, node=1) and not slow.targets(rank=1, node=0)
    assert once.targets(rank=1, node=0) and not once.targets(rank=0, node=1)


def test_fires_once_per_run_across_restarts(tmp_path: Path):
    fired: list[str] = []
    first_life = FaultInjector(
        parse_faults(["exception@step=3,rank=1"]),
        tmp_path,
        rank=1,
        on_fire=lambda s: fired.append(str(s)),
    )
    first_life.maybe_fire(2)
    with pytest.raises(InjectedFault):
        first_life.maybe_fire(3)
    # The restarted process (new injector, same run root) passes step 3 again: no second fault.
    second_life = FaultInjector(parse_faults(["exception@step=3,rank=1"]), tmp_path, rank=1)
    second_life.maybe_fire(3)
    assert fired == ["exception@step=3,rank=1"]


def test_other_ranks_do_not_fire(tmp_path: Path):
    FaultInjector(parse_faults(["exception@step=3,rank=1"]), tmp_path, rank=0).maybe_fire(3)
    assert not (tmp_path / "faults").exists() or not any((tmp_path / "faults").iterdir())
