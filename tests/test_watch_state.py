"""The watcher's decisions (tasks.watch_state) as pure code over recorded histories, on a fake
clock: node waits, losses only a stage retry recovers, the deadline, drills coming due, and
silent nodes. No process, no file, no sleep: a history that took a minute runs in microseconds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest

from tasks.loss_policy import LossDecision, LossPath
from tasks.off_loop import OffLoop, Stuck, bounded
from tasks.watch_state import (
    Tick,
    WatchState,
    beat,
    condemned,
    drop,
    due,
    leaving,
    lost,
    mine,
    observe,
    quiet,
    returned,
    silent,
    tick,
)
from trainer.event_types import Event, Fatal, Handoff, Step, StepCheck, TrainStart
from trainer.faults import parse_fault

T0 = 1000.0  # the watcher's monotonic clock when the watch began


def start(*nodes: int, t: float = 1.0) -> Event:
    return TrainStart(t=t, nodes=list(nodes), world_size=len(nodes))


def step(n: int) -> Event:
    return Step(t=1.0, step=n)


# A history: (the watcher's clock, what it saw). What it saw is an event, a beat read
# (node -> token), or a loss with the path its decision took (and, for an eviction with notice,
# how long the notice is).
Seen = Event | dict[int, str] | tuple[str, int, LossPath] | tuple[str, int, LossPath, float]


def replay(s: WatchState, history: list[tuple[float, Seen]]) -> WatchState:
    for now, seen in history:
        if isinstance(seen, tuple):
            node, path = seen[1], seen[2]
            notice = seen[3] if len(seen) > 3 else None
            decision = LossDecision(path, "recorded")
            s = lost(s, node, decision, drilled=True, now=T0 + now, wall=now, notice_s=notice)
        elif isinstance(seen, dict):
            s = beat(s, seen, T0 + now)
        else:
            s = observe(s, seen, T0 + now)
    return s


BASE = WatchState(started=T0, deadline_s=600.0, loss_grace_s=2.0, wait_s=20.0, min_nodes=2)

# (case, the state's settings, the history, when the watcher ticks, what it decides)
TICKS: list[tuple[str, dict[str, Any], list[tuple[float, Seen]], float, Tick]] = [
    ("training", {}, [(1, start(0, 1)), (2, step(1))], 30, Tick.CONTINUE),
    ("deadline", {}, [(1, start(0, 1))], 601, Tick.TIMED_OUT),
    ("no-deadline", {"deadline_s": None}, [(1, start(0, 1))], 10**6, Tick.CONTINUE),
    # A loss only a stage retry recovers: the survivors would only wait in rendezvous.
    ("stage-retry-within-grace", {}, [(1, start(0, 1)), (5, ("loss", 1, LossPath.STAGE_RETRY))],
     6.9, Tick.CONTINUE),
    ("stage-retry-after-grace", {}, [(1, start(0, 1)), (5, ("loss", 1, LossPath.STAGE_RETRY))],
     7.0, Tick.STOP_LOST),
    # Survivors below the minimum wait their join timeout (20 s) and a grace (10 s).
    ("node-wait-within", {}, [(1, start(0, 1)), (5, ("loss", 1, LossPath.NODE_WAIT))], 34.9,
     Tick.CONTINUE),
    ("node-wait-over", {}, [(1, start(0, 1)), (5, ("loss", 1, LossPath.NODE_WAIT))], 35.1,
     Tick.STOP_WAITED),
    # A node returned in time: the world re-formed (a train_start after the wait began).
    ("node-wait-ended-by-return", {},
     [(1, start(0, 1)), (5, ("loss", 1, LossPath.NODE_WAIT)), (20, start(0, 1, t=9.0))], 40,
     Tick.CONTINUE),
    # A train_start written before the wait began (read late) ends nothing.
    ("node-wait-old-start", {},
     [(1, start(0, 1)), (5, ("loss", 1, LossPath.NODE_WAIT)), (6, start(0, 1, t=4.0))], 40,
     Tick.STOP_WAITED),
    ("elastic-shrink-goes-on", {}, [(1, start(0, 1, 2)), (5, ("loss", 2, LossPath.ELASTIC))],
     300, Tick.CONTINUE),
    # Evicted with 30 s of notice: its workers save the step in flight (trainer.notice); the
    # stop waits for that hand-off, or for the notice to run out, never longer.
    ("evicted-waits-for-its-handoff", {},
     [(1, start(0, 1)), (5, ("evict", 1, LossPath.STAGE_RETRY, 30.0))], 34.9, Tick.CONTINUE),
    ("evicted-stops-once-handed-off", {},
     [(1, start(0, 1)), (5, ("evict", 1, LossPath.STAGE_RETRY, 30.0)),
      (8, Handoff(t=1.0, step=9, leaving=1))], 8.0, Tick.STOP_LOST),
    ("evicted-handoff-still-gets-the-grace", {},
     [(1, start(0, 1)), (5, ("evict", 1, LossPath.STAGE_RETRY, 30.0)),
      (5.5, Handoff(t=1.0, step=9, leaving=1))], 6.9, Tick.CONTINUE),
    ("evicted-notice-ran-out", {},
     [(1, start(0, 1)), (5, ("evict", 1, LossPath.STAGE_RETRY, 30.0))], 35.0, Tick.STOP_LOST),
    ("another-epochs-handoff-ends-no-wait", {"epoch": 2},
     [(1, start(0, 1)), (5, ("evict", 1, LossPath.STAGE_RETRY, 30.0)),
      (8, Handoff(t=1.0, step=9, leaving=1, epoch=1))], 8.0, Tick.CONTINUE),
]  # fmt: skip


@pytest.mark.parametrize(("case", "settings", "history", "at", "verdict"), TICKS,
                         ids=[c[0] for c in TICKS])  # fmt: skip
def test_tick_decides_from_the_history(
    case: str, settings: dict[str, Any], history: list[tuple[float, Seen]], at: float,
    verdict: Tick,
):  # fmt: skip
    s = replay(replace(BASE, **settings), history)
    s2, got = tick(s, T0 + at, running=True)
    assert got == verdict
    assert s2.timed_out == (verdict == Tick.TIMED_OUT)


def test_an_ended_job_is_judged_whatever_else_is_due():
    s = replay(BASE, [(1, start(0, 1)), (5, ("loss", 1, LossPath.STAGE_RETRY))])
    assert tick(s, T0 + 10_000, running=False)[1] == Tick.ENDED


def test_only_the_attempts_own_fatal_error_counts():
    s = replace(BASE, epoch=7)
    s = observe(s, Fatal(t=1.0, error="other", epoch=6), T0)
    assert s.fatal is None
    s = observe(s, Fatal(t=1.0, error="mine", epoch=7), T0)
    s = observe(s, Fatal(t=1.0, error="later", epoch=7), T0)
    assert s.fatal == "mine"


def test_another_epochs_world_and_steps_change_nothing():
    """A zombie's train_start and steps (issue 41): no world, no progress, no spare start."""
    s = replace(BASE, epoch=7)
    for e in (start(0, 1), step(40), Fatal(t=1.0, error="none")):
        other = e.model_copy(update={"epoch": 6})
        assert not mine(s, e) and observe(s, other, T0) == s and observe(s, e, T0) == s
    assert observe(s, step(3).model_copy(update={"epoch": 7}), T0).last_step == 3


def test_drills_come_due_in_order_and_a_return_waits_for_the_reformed_world():
    drills = tuple(parse_fault(f) for f in ("node-loss@step=3,node=2", "node-return@step=5,node=2"))
    s = replace(BASE, drills=drills)
    s = replay(s, [(1, start(0, 1, 2)), (2, step(2))])
    assert due(s, 2) is None
    s = observe(s, step(3), T0 + 3)
    spec = due(s, 3)
    assert spec == drills[0]
    s = drop(s, spec)
    s = lost(s, 2, LossDecision(LossPath.ELASTIC, ""), drilled=True, now=T0 + 3, wall=3.0)
    # Steps of the dying world read after the loss do not bring the return on.
    s = observe(s, step(6), T0 + 4)
    assert due(s, 6) is None
    s = observe(s, start(0, 1), T0 + 5)  # the survivors re-formed without node 2
    assert due(s) is None  # its steps count from here
    s = observe(s, step(4), T0 + 6)  # resumed from the checkpoint at step 3
    assert due(s, 4) is None
    s = observe(s, step(5), T0 + 7)
    assert due(s, 5) == drills[1]
    s = returned(drop(s, drills[1]), 2)
    assert 2 not in s.lost and due(s, 5) is None


def test_a_return_is_due_at_once_while_the_survivors_wait():
    drills = (parse_fault("node-return@step=50,node=1"),)
    s = replay(replace(BASE, drills=drills), [(1, start(0, 1)), (2, step(4))])
    s = lost(s, 1, LossDecision(LossPath.NODE_WAIT, ""), drilled=True, now=T0 + 3, wall=3.0)
    assert due(s) == drills[0]  # no world trains: no step would ever reach 50


# -- silent nodes -------------------------------------------------------------------------------
SILENT = replace(BASE, silence_s=10.0)


def beats(t: float, **tokens: int) -> list[tuple[float, Seen]]:
    return [(t, {int(k[1:]): str(v) for k, v in tokens.items()})]


def finished(t: float, node: int) -> list[tuple[float, Seen]]:
    """The node's agent's last beat (trainer.node_beat: a normal exit)."""
    return [(t, {node: f"{node} 9 {t} done"})]


def every_second(until: float, **nodes: int) -> list[tuple[float, Seen]]:
    """Beat reads each second up to ``until``; node N's token changes while the second is
    below its value in ``nodes`` (n2=30: node 2 beats until t=30, then stays silent)."""
    out: list[tuple[float, Seen]] = []
    for t in range(2, int(until) + 1):
        out += beats(t, **{k: min(t, stop) for k, stop in nodes.items()})
    return out


# (case, settings, history, when the watcher asks, the nodes it finds silent)
SILENCES: list[tuple[str, dict[str, Any], list[tuple[float, Seen]], float, list[int]]] = [
    ("all-beating", {}, [(1, start(0, 1, 2)), *every_second(60, n0=99, n1=99, n2=99)], 60, []),
    ("one-frozen", {}, [(1, start(0, 1, 2)), *every_second(60, n0=99, n1=99, n2=30)], 60, [2]),
    ("one-frozen-within-bound", {}, [(1, start(0, 1, 2)), *every_second(40, n0=99, n1=99, n2=30)],
     40, []),
    # Every node silent at once: a job-wide stall or every worker restarting: not a node's.
    ("all-silent", {}, [(1, start(0, 1)), *every_second(60, n0=30, n1=30)], 60, []),
    # A node that never beat is judged from its world's start.
    ("never-beat", {}, [(1, start(0, 1)), *every_second(20, n0=99)], 20, [1]),
    # The beat files could not be read lately (a hung mount): no verdict on stale knowledge.
    ("reads-stuck", {}, [(1, start(0, 1)), *every_second(40, n0=99, n1=30)], 60, []),
    # A new world (after a respawn) starts everyone's silence afresh.
    ("respawned", {}, [(1, start(0, 1)), *every_second(38, n0=99, n1=30), (39, start(0, 1)),
                      *beats(40, n0=40, n1=30)], 40, []),
    ("one-node-world", {}, [(1, start(0)), *every_second(60, n0=10)], 60, []),
    ("not-judged", {"silence_s": None}, [(1, start(0, 1)), *every_second(60, n0=99, n1=5)], 60,
     []),
    ("no-world-yet", {}, every_second(60, n0=99, n1=5), 60, []),
    # While a loss is being recovered the survivors' workers are gone for good reasons.
    ("during-a-wait", {}, [(1, start(0, 1, 2)), *every_second(20, n0=99, n1=99, n2=99),
                           (20, ("loss", 2, LossPath.NODE_WAIT)),
                           *every_second(60, n0=20, n1=99)], 60, []),
    # Issue 42: the beat is the agent's, so a finished node says so and is never silent...
    ("finished-not-silent", {}, [(1, start(0, 1)), *every_second(30, n0=99, n1=99),
                                 *finished(30.5, 0), *every_second(60, n1=99)], 60, []),
    # ... even when the nodes stop a beat apart, each judged on its own poll.
    ("finished-apart", {}, [(1, start(0, 1, 2)), *every_second(30, n0=99, n1=99, n2=99),
                            *finished(30.1, 0), *finished(31, 1), *finished(32, 2)], 45, []),
    # A frozen node the rendezvous already dropped from the world is still judged and ended.
    ("frozen-outside-the-world", {},
     [(1, start(0, 1)), *every_second(15, n0=99, n1=99, n2=99), (16, start(0, 2)),
      *every_second(40, n0=99, n1=15, n2=99)], 40, [1]),
    # A waiting hot spare that froze is found too (its loss is an idle spare's).
    ("frozen-spare", {}, [(1, start(0, 1)), *every_second(40, n0=99, n1=99, n2=20)], 40, [2]),
    ("spare-turned-away", {}, [(1, start(0, 1)), *every_second(20, n0=99, n1=99, n2=99),
                               *finished(20.5, 2), *every_second(40, n0=99, n1=99)], 40, []),
    # A lost node is not judged again.
    ("lost-not-judged", {}, [(1, start(0, 1, 2)), (2, ("loss", 2, LossPath.ELASTIC)),
                             *every_second(60, n0=99, n1=99)], 60, []),
]  # fmt: skip


@pytest.mark.parametrize(("case", "settings", "history", "at", "nodes"), SILENCES,
                         ids=[c[0] for c in SILENCES])  # fmt: skip
def test_silent_nodes_are_found_from_their_beats(
    case: str, settings: dict[str, Any], history: list[tuple[float, Seen]], at: float,
    nodes: list[int],
):  # fmt: skip
    s = replay(replace(SILENT, **settings), history)
    assert silent(s, T0 + at) == nodes


def test_a_frozen_node_is_no_spare_even_when_every_node_is_quiet():
    # silent() gives no verdict when every node is quiet, but none of them is a live spare.
    s = replay(SILENT, [(1, start(0, 1)), *every_second(60, n0=30, n1=30, n2=30)])
    assert silent(s, T0 + 60) == [] and quiet(s, T0 + 60) == {0, 1, 2}
    s = replay(SILENT, [(1, start(0, 1)), *every_second(60, n0=99, n1=99, n2=30)])
    assert quiet(s, T0 + 60) == {2}


# -- reads off the loop ---------------------------------------------------------------------------
def blocking(gate: Any, value: Any) -> Callable[[], Any]:
    def read() -> Any:
        gate.wait()
        return value

    return read


def test_a_blocked_read_answers_stuck_and_delivers_its_result_later():
    import threading

    gate = threading.Event()
    calls: list[int] = []

    def read() -> list[int]:
        calls.append(1)
        gate.wait()
        return [len(calls)]

    reader = OffLoop("a hung mount", read)
    for _ in range(3):
        with pytest.raises(Stuck):
            reader.call(0.05)
    assert reader.stuck and len(calls) == 1  # not started again while blocked
    gate.set()
    assert reader.call(1.0) == [1]  # the blocked read's own result: nothing read is lost
    assert reader.call(1.0) == [2] and not reader.stuck


def test_a_reads_error_reaches_the_caller_and_bounded_gives_the_default():
    import threading

    def broken() -> None:
        raise OSError("EIO")

    with pytest.raises(OSError, match="EIO"):
        OffLoop("broken", broken).call(1.0)
    gate = threading.Event()
    assert bounded("hung", blocking(gate, "late"), 0.05, "default") == "default"
    gate.set()


# -- nodes a step check condemned ---------------------------------------------------------------
def test_a_repeated_step_check_failure_condemns_its_nodes_once():
    def check(verdict: str, nodes: list[int], epoch: int | None = None) -> Event:
        return StepCheck(t=1.0, step=8, verdict=verdict, reason="non-finite", nodes=nodes,
                         epoch=epoch)  # type: ignore[arg-type]  # fmt: skip

    s = replay(replace(BASE, epoch=3), [(1, start(0, 1, 2))])
    assert condemned(s, check("repeat", [1], epoch=3)) == [1]
    # A first rejection (replaying) or a transient one condemns nothing; nor another attempt's
    # verdict, a node no backend named, or one lost already.
    assert condemned(s, check("rejected", [1], epoch=3)) == []
    assert condemned(s, check("transient", [1], epoch=3)) == []
    assert condemned(s, check("repeat", [1], epoch=2)) == []
    assert condemned(s, check("repeat", [-1], epoch=3)) == []
    s = replay(s, [(2, ("loss", 1, LossPath.SPARE))])
    assert condemned(s, check("repeat", [1, 2], epoch=3)) == [2]


def test_a_node_told_to_go_is_named_once_until_taken_away():
    """A beat saying ``leaving`` (its agent got an eviction's SIGTERM: trainer.node_beat) is an
    eviction to record, once: a node lost already, or one that finished, is not."""
    s = replay(BASE, [(1, start(0, 1, 2)), (2, {0: "7 1 1.0 up", 1: "8 4 2.0 leaving"})])
    assert leaving(s) == [1]
    s = lost(s, 1, LossDecision(LossPath.SPARE, "spare"), drilled=True, now=T0 + 3, wall=3.0)
    assert leaving(s) == []
    s = beat(s, {2: "9 2 3.0 leaving", 0: "7 2 3.0 done"}, T0 + 4)
    assert leaving(s) == [2]
