"""The train-stage end classification and the retry decision (pure)."""

from __future__ import annotations

import dataclasses

import pytest

from tasks.classify import Blocked, Blocker, EndKind, Evidence, Observation, judge
from tasks.errors import (
    DoNotRequeue,
    InJobExhausted,
    NodeLost,
    PreflightFailed,
    TrainTimeout,
)
from tasks.retry_policy import prefect_retry_condition, stage_retry_allowed
from trainer.rundir import RunResult

DONE = RunResult(status="completed", final_step=20)


def end(
    codes: dict[int, int | None],
    *,
    lost_nodes: frozenset[int] = frozenset(),
    timed_out: bool = False,
    result: dict | None = None,
    fatal: str | None = None,
    no_restart: str | None = None,
    world_nodes: frozenset[int] = frozenset(),
) -> tuple[Observation, Evidence]:
    """A recorded end of the local backend: every launcher's exit code (None: stopped by the
    watcher), with what the watcher gathered."""
    facts = Evidence(
        lost_nodes=lost_nodes,
        timed_out=timed_out,
        result=result,
        fatal=fatal,
        no_restart=no_restart,
        target_steps=20,
        world_nodes=world_nodes,
    )
    return Observation(exit_codes=codes, where="logs: x"), facts


CASES = [
    ("completed", end({0: 0, 1: 0}, result=DONE), EndKind.COMPLETED),
    ("exit0-no-result", end({0: 0, 1: 0}), EndKind.BUG),
    ("short-result", end({0: 0}, result=DONE.model_copy(update={"final_step": 10})), EndKind.BUG),
    ("node-lost", end({0: None, 1: -9}, lost_nodes=frozenset({1})), EndKind.NODE_LOSS),
    ("agent-killed-unprompted", end({0: 1, 1: -9}), EndKind.NODE_LOSS),
    ("injob-exhausted", end({0: 1, 1: 1}), EndKind.INJOB_EXHAUSTED),
    ("fatal", end({0: 1, 1: 1}, fatal="NoValidCheckpoint: ..."), EndKind.DO_NOT_REQUEUE),
    ("exit-93", end({0: 93, 1: 1}), EndKind.DO_NOT_REQUEUE),
    # One node finished cleanly, the other said "do not requeue": not a completion.
    ("exit-0-93", end({0: 0, 1: 93}), EndKind.DO_NOT_REQUEUE),
    # The first peer's 93 tears the step down and the others are signalled (NVRx PR #397):
    # one node's code alone would read as a node loss.
    ("exit-93-masked", end({0: 143, 1: 93}), EndKind.DO_NOT_REQUEUE),
    ("93-beside-a-killed-peer", end({0: -15, 1: 93}), EndKind.DO_NOT_REQUEUE),
    # NVRx 0.4.1: the no-restart request closes the rendezvous and every launcher exits 1, which
    # alone looks like exhausted restarts; the marker says otherwise.
    (
        "marker-with-exit-1",
        end({0: 1, 1: 1}, no_restart="ConfigError: global_batch"),
        EndKind.DO_NOT_REQUEUE,
    ),
    (
        "marker-then-lingering",
        end({0: None}, no_restart="DataError: x", timed_out=True),
        EndKind.DO_NOT_REQUEUE,
    ),
    ("timeout", end({0: None, 1: None}, timed_out=True), EndKind.TIMEOUT),
    ("odd-code", end({0: 7}), EndKind.BUG),
    # An elastic job or a hot spare carried on without the lost node, in-job.
    ("completed-after-a-loss", end({0: 0, 1: -9}, lost_nodes=frozenset({1}), result=DONE),
     EndKind.COMPLETED),
    # A survivor that did not exit 0 is not a completion, whatever result.json says.
    ("survivor-failed-after-a-loss", end({0: 1, 1: -9}, lost_nodes=frozenset({1}), result=DONE),
     EndKind.NODE_LOSS),
    # Seen in a full run: node 1 returned during the last steps of the 1-node world, and its
    # agent found the rendezvous closed by the job's end (RendezvousClosedError, exit 1).
    ("turned-away-at-the-end", end({0: 0, 1: 1}, result=DONE, world_nodes=frozenset({0})),
     EndKind.COMPLETED),
    # The same exit from a node of the world that trained is the exhausted launcher it says.
    ("exit-1-in-the-world", end({0: 0, 1: 1}, result=DONE, world_nodes=frozenset({0, 1})),
     EndKind.INJOB_EXHAUSTED),
    # Without a completed result an idle node's failure is not excused either.
    ("turned-away-unfinished", end({0: 0, 1: 1}, world_nodes=frozenset({0})),
     EndKind.INJOB_EXHAUSTED),
    # Nodes no backend named (-1 on the EKS harness): the old rules.
    ("unnamed-world", end({0: 0, 1: 1}, result=DONE, world_nodes=frozenset({-1})),
     EndKind.INJOB_EXHAUSTED),
]  # fmt: skip


@pytest.mark.parametrize(("name", "seen", "kind"), CASES, ids=[c[0] for c in CASES])
def test_judge(name, seen, kind):
    outcome = judge(*seen)
    assert outcome.kind == kind, outcome
    assert outcome.message
    assert (outcome.error() is None) == (kind == EndKind.COMPLETED)


def test_what_the_judge_records():
    lost = judge(*end({0: 0, 1: -9}, lost_nodes=frozenset({1}), result=DONE))
    assert lost.details["lost_nodes"] == [1] and "[1] lost and recovered in-job" in lost.message
    late = judge(*end({0: 0, 1: 1}, result=DONE, world_nodes=frozenset({0})))
    assert "turned away" in late.message and late.details["idle_nodes"] == [1]
    gone = judge(*end({0: None, 1: -9}))
    assert gone.details["lost_nodes"] == [1] and "(logs: x)" in gone.message


def test_do_not_requeue_names_every_cause_once():
    outcome = judge(
        *end(
            {0: 1, 1: 93},
            fatal="ConfigError: global_batch: 3 is not divisible",
            no_restart="ConfigError: global_batch: 3 is not divisible",
        )
    )
    assert outcome.message.count("global_batch") == 1
    assert "node(s) [1] exited 93" in outcome.message
    assert outcome.details["exit_codes"] == {0: 1, 1: 93}
    assert isinstance(outcome.error(), DoNotRequeue)
    assert not stage_retry_allowed(outcome.error())


def test_a_backends_own_reason_decides_after_loss_and_before_exit_codes():
    """A reason only the backend can see (EKS: an image that cannot be pulled, a pod left
    unschedulable) is the verdict unless a node was lost; the deadline and the markers still
    come first."""
    stuck = Blocker(Blocked.UNSCHEDULABLE, "pod p unschedulable for 700 s")
    obs, facts = end({0: None, 1: 1})
    blocked = dataclasses.replace(obs, blocker=stuck)
    assert judge(blocked, facts).kind == EndKind.TIMEOUT
    assert judge(blocked, facts).message == "pod p unschedulable for 700 s"
    pull = dataclasses.replace(obs, blocker=Blocker(Blocked.CANNOT_START, "image pull failure"))
    assert judge(pull, facts).kind == EndKind.BUG
    _, drilled = end({}, lost_nodes=frozenset({0}))
    assert judge(blocked, drilled).kind == EndKind.NODE_LOSS
    _, marked = end({}, no_restart="DataError: x")
    assert judge(blocked, marked).kind == EndKind.DO_NOT_REQUEUE
    # The watcher stopped it before the backend saw an end, and nothing else says why.
    assert judge(Observation(ended=False, where="Job j"), facts).kind == EndKind.BUG


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
