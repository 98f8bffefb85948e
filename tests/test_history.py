"""The run's fold (trainer.history.RunHistory) over recorded histories: what every reader
reports, and a live state that does not grow with steps."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from tasks.run_status import fold_status
from trainer.event_types import Event, decode_obj
from trainer.events import EventLog
from trainer.history import RunHistory


def ev(t: float, kind: str, **fields: Any) -> Event:
    return decode_obj({"t": t, "kind": kind, **fields})


def step(t: float, n: int, s: float = 1.0, **fields: Any) -> Event:
    return ev(t, "step", step=n, loss=1.0 / n, step_s=s, **fields)


# A recorded run: attempt 1 trains steps 1-6 (checkpoints at 2 and 4), an exception at step 5 is
# recovered in-process from the step-4 checkpoint (steps 5-6 replayed at 2 s each), a node loss
# at step 6 ends the attempt, attempt 2 resumes from step 4 and finishes at step 8.
HISTORY = [
    ev(1, "stage_attempt", stage="train", attempt=1, backend="local", nodes=2),
    ev(2, "train_start", world_size=2, nodes=[0, 1], job_id="a1", start_step=1, steps=8),
    step(3, 1),
    step(4, 2),
    ev(4.1, "checkpoint", step=2, blocking_s=0.2),
    step(5, 3),
    step(6, 4),
    ev(6.1, "checkpoint", step=4, blocking_s=0.4, pruned=[]),
    step(7, 5),
    ev(7.5, "fault", fault="exception@step=5,rank=1", fault_kind="exception", step=5, rank=1),
    ev(8, "restart", layer="inprocess", iteration=1),
    ev(8.1, "resume", action="loaded", step=4),
    step(9, 5, 2.0),
    ev(9.1, "recovered", layer="inprocess", fault="exception@step=5,rank=1", fault_step=5,
       step=5, recovery_s=1.6),
    step(10, 6, 2.0),
    ev(10.5, "fault", fault="node-loss@step=6,node=1", fault_kind="node-loss", step=6, node=1,
       path="stage-retry", detail="fixed size"),
    ev(11, "stage_attempt_end", stage="train", attempt=1, outcome="node-loss", message="lost",
       wall_s=10.0),
    ev(12, "stage_attempt", stage="train", attempt=2, backend="local", nodes=2),
    ev(13, "train_start", world_size=2, nodes=[0, 1], job_id="a2", start_step=5, steps=8),
    ev(13.1, "resume", action="loaded", step=4, source="durable", bytes=2_200_000, load_s=0.4),
    step(14, 5),
    ev(14.1, "recovered", layer="stage-retry", fault="node-loss@step=6,node=1", fault_step=6,
       step=5, recovery_s=3.6),
    step(15, 6),
    ev(15.1, "checkpoint", step=6, blocking_s=0.3, pruned=[2]),
    step(16, 7),
    step(17, 8),
    ev(17.1, "checkpoint", step=8, blocking_s=0.1, pruned=[4]),
    ev(18, "train_end", final_step=8, final_loss=0.125, params_sha256="abc"),
    ev(19, "stage_attempt_end", stage="train", attempt=2, outcome="completed", message="done",
       wall_s=8.0),
]  # fmt: skip


def test_the_fold_reports_a_recorded_run():
    h = RunHistory.of(HISTORY)
    faults = h.fault_records()
    assert [(f.kind, f.recovered_by, f.recovery_s) for f in faults] == [
        ("exception", "inprocess", 1.6),
        ("node-loss", "stage-retry", 3.6),
    ]
    assert faults[1].path == "stage-retry" and faults[1].node == 1
    assert h.stage_attempts() == 2 and h.train_wall_s() == 18.0
    # Each step's last execution: steps 1-8 at 1 s (the replays of 5 and 6 at 2 s were lost
    # to the node loss and run again at 1 s).
    assert h.productive_s() == 8.0 and h.ettr() == round(8.0 / 18.0, 4)
    assert h.progress() == 8 and h.last_checkpoint is not None and h.last_checkpoint.step == 8
    assert h.last_attempt_cause() == "done"
    s = h.summary()
    assert s.outcome == "completed" and s.params_sha256 == "abc"
    assert s.checkpoints == 4 and s.ckpt_blocking_s_max == 0.4
    assert s.steps_run == 11 and s.final_step == 8
    assert s.restart_layers == ["inprocess"]
    st = fold_status(h)
    assert [a.outcome for a in st.train_attempts] == ["node-loss", "completed"]
    assert st.latest_checkpoint_step == 8 and st.state.startswith("trained")


def test_since_keeps_one_invocations_share():
    h = RunHistory.of(HISTORY, since=12)
    assert h.stage_attempts() == 1 and [f.kind for f in h.fault_records()] == []
    assert h.train_wall_s() == 8.0


def test_a_zombie_of_an_older_epoch_counts_for_nothing():
    """Attempt 1 (epoch 1) is replaced by attempt 2 (epoch 2) while one of its workers, frozen,
    wakes and appends: its steps, fault and checkpoint are not the run's."""
    recorded = [
        ev(1, "stage_attempt", stage="train", attempt=1, epoch=1),
        step(2, 1, epoch=1),
        step(3, 2, epoch=1),
        ev(4, "stage_attempt", stage="train", attempt=2, epoch=2),
        step(5, 3, epoch=2),
        step(5.5, 9, epoch=1),  # the zombie, ahead of the run
        ev(5.6, "fault", fault="exception@step=9", fault_kind="exception", step=9, epoch=1),
        ev(5.7, "checkpoint", step=9, blocking_s=0.1, epoch=1),
        ev(5.8, "stage_attempt_end", stage="x", attempt=1, outcome="completed"),  # unfenced
        step(6, 4, epoch=2),
    ]
    h = RunHistory.of(recorded)
    assert h.max_step == 4 and h.last_step is not None and h.last_step.step == 4
    assert h.faults == [] and h.checkpoints == 0
    assert h.stale_events == 3 and h.epoch == 2
    assert h.stage_attempts() == 2


def test_a_fresh_start_forgets_earlier_steps():
    h = RunHistory.of(
        [
            *(step(1, 1), step(2, 2), ev(2.1, "checkpoint", step=2, blocking_s=0.1)),
            *(ev(3, "resume", action="fresh"), step(4, 1, 3.0)),
        ]
    )
    assert h.productive_s() == 3.0


def test_the_live_state_does_not_grow_with_steps():
    def fold(steps: int) -> RunHistory:
        h = RunHistory()
        for e in [
            ev(0, "stage_attempt", stage="train", attempt=1),
            ev(0.5, "train_start", world_size=2, nodes=[0, 1], job_id="j"),
        ]:
            h.observe(e)
        for n in range(1, steps + 1):
            h.observe(step(n, n, 0.5))
            if n % 10 == 0:  # a commit every 10 steps, keeping the newest 2
                h.observe(ev(n + 0.1, "checkpoint", step=n, blocking_s=0.1,
                             pruned=[n - 20] if n > 20 else []))  # fmt: skip
        return h

    small, large = fold(1_000), fold(100_000)
    assert large.productive_s() == 0.5 * 100_000
    assert _state_size(large) == _state_size(small)


def _state_size(h: RunHistory) -> int:
    """Entries held, container by container (scalars count once)."""
    return sum(len(v) if isinstance(v, list | dict | set) else 1 for v in vars(h).values())


def test_read_streams_the_file(tmp_path: Path):
    log = EventLog(tmp_path)
    for e in HISTORY:
        log.emit(e)
    with open(log.path, "a") as f:
        f.write('1\nnull\n{"t": 1, "kind": "step", "step": "9"}\n')
    h = RunHistory.read(tmp_path)
    assert h.events_seen == len(HISTORY) and h.progress() == 8
    assert sys.getsizeof(h) < 1024


def test_where_the_train_stages_time_went():
    """The breakdown of the recorded run (issue 27): every part measured from the events, the
    parts adding up to the train stage's wall time (10 s + 8 s)."""
    t = RunHistory.of(HISTORY).time_breakdown()
    assert t is not None
    parts = t.model_dump()
    assert parts == {
        "wall_s": 18.0,
        "startup": 2.0,  # 1 s to each attempt's first step
        "productive": 8.0,  # steps 1-8, each last execution 1 s
        "replayed": 5.0,  # steps 5-6 in-process (2 s each) and 5 lost to the node loss (1 s)
        "checkpoint_blocking": 0.0,  # no step waited on a save here
        "recovery": 1.0,  # the node loss to attempt 1's end
        "end": 2.0,  # attempt 2's last step to its end
        "other": 0.0,
    }
    assert sum(v for k, v in parts.items() if k != "wall_s") == parts["wall_s"]
    # Each fault: the step training went back to, and the completed steps that ran again.
    got = [
        (f.fault, f.resume_step, f.replayed_steps) for f in RunHistory.of(HISTORY).fault_records()
    ]
    assert got == [("exception@step=5,rank=1", 4, 1), ("node-loss@step=6,node=1", 4, 2)]
    # ... and what the load read: its tier, bytes and seconds (a load written before loads
    # named their tier was the durable one; none since the fault: started over).
    read = [
        (f.resume_source, f.load_bytes, f.load_s) for f in RunHistory.of(HISTORY).fault_records()
    ]
    assert read == [("durable", None, None), ("durable", 2_200_000, 0.4)]
    fresh_start = [e for e in HISTORY if not (e.kind == "resume" and e.t == 8.1)]
    assert RunHistory.of(fresh_start).fault_records()[0].resume_source is None


def test_time_breakdown_blocking_gaps_and_a_start_that_never_trained():
    history = [
        ev(0, "stage_attempt", stage="train", attempt=1, backend="local", nodes=1),
        ev(5, "stage_attempt_end", stage="train", attempt=1, outcome="bug", message="x", wall_s=5),
        ev(10, "stage_attempt", stage="train", attempt=2, backend="local", nodes=1),
        step(13, 1),  # began at 12: 2 s of start-up
        step(14.5, 2, ckpt_blocking_s=0.5),  # began at 13: the save blocked 0.5 s
        step(16, 3),  # began at 15: 0.5 s between steps without a fault
        ev(16.2, "restart", layer="inprocess", iteration=1),
        step(18, 4),  # began at 17: 1 s after the restart
        ev(18.5, "recovered", layer="inprocess", fault=None, fault_step=None, step=4,
           recovery_s=1.8),
        ev(20, "stage_attempt_end", stage="train", attempt=2, outcome="completed", message="ok",
           wall_s=10.5),
    ]  # fmt: skip
    t = RunHistory.of(history).time_breakdown()
    assert t is not None
    assert (t.startup, t.checkpoint_blocking, t.recovery, t.end) == (7.0, 0.5, 1.0, 2.0)
    assert t.productive == 4.0 and t.replayed == 0.0
    assert round(t.other, 6) == round(15.5 - 14.5, 6)  # the 0.5 s gap, and 0.5 s of wall unseen
    assert RunHistory().time_breakdown() is None  # no train attempt ended yet


def test_a_wall_clock_that_ran_ahead_still_adds_up():
    """Seen in a fresh-clone run: attempt 1's events spanned 20.8 s of wall clock while its
    monotonic wall_s was 19.4 s (the VM's clock stepped), and the parts summed past the wall
    time ("other" -1.05 s). The attempt's event-time parts are scaled to its wall time."""
    history = [
        ev(0, "stage_attempt", stage="train", attempt=1, backend="local", nodes=1),
        step(3, 1),  # 2 s of start-up by the event clock
        step(4, 2),
        ev(8, "stage_attempt_end", stage="train", attempt=1, outcome="completed", message="ok",
           wall_s=6.0),  # 8 s of events in 6 s of monotonic time
    ]  # fmt: skip
    t = RunHistory.of(history).time_breakdown()
    assert t is not None and t.wall_s == 6.0
    assert (t.startup, t.end) == (1.333, 2.667)  # 2 s and 4 s, x (6 - 2 of steps) / (8 - 2)
    assert min(t.model_dump().values()) >= 0
    assert abs(sum(v for k, v in t.model_dump().items() if k != "wall_s") - 6.0) < 1e-6


def test_a_second_fault_recorded_before_the_firsts_recovery_keeps_their_loads_apart():
    """Recorded in a full run: rank 1's next fault (a stall at step 12) was written between
    rank 0's load after the first fault and its recovered event. Each fault's recovery still
    names the load that followed it."""
    history = [
        step(1, 10),
        ev(2, "fault", fault="exception@step=11,rank=1", fault_kind="exception", step=11, rank=1),
        ev(3, "restart", layer="inprocess", iteration=1),
        ev(3.1, "resume", action="loaded", step=10, source="memory", bytes=100, load_s=0.01),
        ev(3.5, "fault", fault="stall@step=12,rank=1", fault_kind="stall", step=12, rank=1),
        step(3.6, 11),
        ev(3.7, "recovered", layer="inprocess", fault="exception@step=11,rank=1", fault_step=11,
           step=11, recovery_s=1.7),
        ev(5, "restart", layer="inprocess", iteration=2),
        ev(5.1, "resume", action="loaded", step=10, source="durable", bytes=900, load_s=0.2),
        step(6, 11),
        ev(6.1, "recovered", layer="inprocess", fault="stall@step=12,rank=1", fault_step=12,
           step=11, recovery_s=2.6),
    ]  # fmt: skip
    got = [
        (f.fault.split("@")[0], f.resume_source, f.load_bytes)
        for f in RunHistory.of(history).fault_records()
    ]
    assert got == [("exception", "memory", 100), ("stall", "durable", 900)]


def test_the_report_prints_the_folds_summary(tmp_path: Path, capsys: Any):
    """``python -m trainer.report``: the typed summary, as text and as JSON."""
    import json

    from trainer import report

    log = EventLog(tmp_path)
    for e in HISTORY:
        log.emit(e)
    assert report.main([str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "outcome: completed  final step: 8" in text and "recovered by inprocess" in text
    assert report.main([str(tmp_path), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["restart_layers"] == ["inprocess"] and len(got["faults"]) == 2
    assert report.main([str(tmp_path / "none")]) == 2
