"""The train-stage end classification and the retry decision (pure)."""

from __future__ import annotations

import pytest

from tasks.classify import EndKind, EndSnapshot, classify
from tasks.errors import (
    DoNotRequeue,
    InJobExhausted,
    NodeLost,
    PreflightFailed,
    TrainTimeout,
)
from tasks.retry_policy import prefect_retry_condition, stage_retry_allowed

DONE = {"status": "completed", "final_step": 20}

CASES = [
    ("completed", EndSnapshot({0: 0, 1: 0}, result=DONE, target_steps=20), EndKind.COMPLETED),
    ("exit0-no-result", EndSnapshot({0: 0, 1: 0}, target_steps=20), EndKind.BUG),
    (
        "short-result",
        EndSnapshot({0: 0}, result={**DONE, "final_step": 10}, target_steps=20),
        EndKind.BUG,
    ),
    (
        "node-lost",
        EndSnapshot({0: None, 1: -9}, lost_nodes=frozenset({1}), target_steps=20),
        EndKind.NODE_LOSS,
    ),
    ("agent-killed-unprompted", EndSnapshot({0: 1, 1: -9}, target_steps=20), EndKind.NODE_LOSS),
    ("injob-exhausted", EndSnapshot({0: 1, 1: 1}, target_steps=20), EndKind.INJOB_EXHAUSTED),
    (
        "fatal",
        EndSnapshot({0: 1, 1: 1}, fatal="NoValidCheckpoint: ...", target_steps=20),
        EndKind.DO_NOT_REQUEUE,
    ),
    ("exit-93", EndSnapshot({0: 93, 1: 1}, target_steps=20), EndKind.DO_NOT_REQUEUE),
    # One node finished cleanly, the other said "do not requeue": not a completion.
    ("exit-0-93", EndSnapshot({0: 0, 1: 93}, target_steps=20), EndKind.DO_NOT_REQUEUE),
    # The first peer's 93 tears the step down and the others are signalled (NVRx PR #397):
    # one node's code alone would read as a node loss.
    ("exit-93-masked", EndSnapshot({0: 143, 1: 93}, target_steps=20), EndKind.DO_NOT_REQUEUE),
    (
        "93-beside-a-killed-peer",
        EndSnapshot({0: -15, 1: 93}, target_steps=20),
        EndKind.DO_NOT_REQUEUE,
    ),
    # NVRx 0.4.1: the no-restart request closes the rendezvous and every launcher exits 1, which
    # alone looks like exhausted restarts; the marker says otherwise.
    (
        "marker-with-exit-1",
        EndSnapshot({0: 1, 1: 1}, no_restart="ConfigError: global_batch", target_steps=20),
        EndKind.DO_NOT_REQUEUE,
    ),
    (
        "marker-then-lingering",
        EndSnapshot({0: None}, no_restart="DataError: x", timed_out=True, target_steps=20),
        EndKind.DO_NOT_REQUEUE,
    ),
    ("timeout", EndSnapshot({0: None, 1: None}, timed_out=True, target_steps=20), EndKind.TIMEOUT),
    ("odd-code", EndSnapshot({0: 7}, target_steps=20), EndKind.BUG),
]


@pytest.mark.parametrize(("name", "snap", "kind"), CASES, ids=[c[0] for c in CASES])
def test_classify(name, snap, kind):
    outcome = classify(snap)
    assert outcome.kind == kind
    assert outcome.message
    assert (outcome.error() is None) == (kind == EndKind.COMPLETED)


def test_do_not_requeue_names_every_cause_once():
    snap = EndSnapshot(
        {0: 1, 1: 93},
        fatal="ConfigError: global_batch: 3 is not divisible",
        no_restart="ConfigError: global_batch: 3 is not divisible",
        target_steps=20,
    )
    outcome = classify(snap)
    assert outcome.message.count("global_batch") == 1
    assert "node(s) [1] exited 93" in outcome.message
    assert outcome.details["exit_codes"] == {0: 1, 1: 93}
    assert isinstance(outcome.error(), DoNotRequeue)
    assert not stage_retry_allowed(outcome.error())


def test_only_node_loss_is_retried():
    assert stage_retry_allowed(NodeLost("x"))
    for e in (
        InJobExhausted("x"),
        DoNotRequeue("x"),
        TrainTimeout("x"),
        PreflightFailed("x"),
        RuntimeError("x"),
        None,
    ):
        assert not stage_retry_allowed(e)


class _State:
    def __init__(self, exc: BaseException | None) -> None:
        self.exc = exc

    def result(self):
        if self.exc is not None:
            raise self.exc
        return 1


def test_prefect_hook_reads_the_failed_state():
    assert prefect_retry_condition(None, None, _State(NodeLost("lost")))
    assert not prefect_retry_condition(None, None, _State(InJobExhausted("nope")))
    assert not prefect_retry_condition(None, None, _State(None))
