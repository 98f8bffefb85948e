"""The run directory (trainer.rundir): the start-up facts, the result, the markers, the beats and
the claims, each written atomically and read as untrusted input: bounded, schema-checked, and
ignored when malformed, as any file of the shared filesystem must be."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from trainer.elastic import PriorWorld
from trainer.event_types import Fault, Resume
from trainer.events import EventLog
from trainer.history import RunHistory
from trainer.hooks import emit_recoveries
from trainer.rundir import Layout, RunDir, RunResult


def test_commit_fact(tmp_path: Path):
    assert RunDir(tmp_path).recorded_commit() is None
    RunDir(tmp_path).record_commit(20)
    assert RunDir(tmp_path).recorded_commit() == 20
    RunDir(tmp_path).record_commit(None)  # an explicit fresh start expects none
    assert RunDir(tmp_path).recorded_commit() is None
    RunDir(tmp_path).record_commit(5)  # commits since the fresh start count again
    assert RunDir(tmp_path).recorded_commit() == 5


def test_launch_fact_and_open_node_loss(tmp_path: Path):
    assert RunDir(tmp_path).prior_world("j1") is None
    RunDir(tmp_path).record_launch(job_id="j1", world_size=4, nodes=[0, 1])
    assert RunDir(tmp_path).prior_world("j1") == PriorWorld(4, (0, 1), False)
    assert RunDir(tmp_path).prior_world("j2") is None  # another launcher job: no respawn
    assert RunDir(tmp_path).prior_world(None) is None
    log = EventLog(tmp_path)
    loss = log.emit(Fault(fault="node-loss@node=1", fault_kind="node-loss", node=1))
    RunDir(tmp_path).open_fault(loss)
    assert RunDir(tmp_path).prior_world("j1") == PriorWorld(4, (0, 1), True)
    ((_, fault),) = RunDir(tmp_path).open_faults()
    assert fault.fault_kind == "node-loss"
    emit_recoveries(log, "spare", 3, began=time.time())  # closed: no longer open after it
    assert RunDir(tmp_path).open_faults() == []
    assert RunDir(tmp_path).prior_world("j1") == PriorWorld(4, (0, 1), False)


MALFORMED = [
    b"not json",
    b"[]",
    b'{"step": "20", "t": 1.0}',
    b'{"step": -1, "t": 1.0}',
    b'{"step": 20}',
    b'{"step": 20, "t": 1.0, "epoch": 3}',  # a field not of this version
]


@pytest.mark.parametrize("content", MALFORMED)
def test_a_malformed_fact_is_no_fact(tmp_path: Path, content: bytes):
    (tmp_path / "control").mkdir()
    (tmp_path / Layout.COMMIT).write_bytes(content)
    assert RunDir(tmp_path).recorded_commit() is None
    (tmp_path / Layout.LAUNCH).write_bytes(content)
    assert RunDir(tmp_path).prior_world("j") is None


def test_a_fifo_fact_does_not_block(tmp_path: Path):
    (tmp_path / "control").mkdir()
    os.mkfifo(tmp_path / Layout.COMMIT)
    assert RunDir(tmp_path).recorded_commit() is None


def test_recoveries_close_the_open_faults_once(tmp_path: Path):
    log = EventLog(tmp_path)
    f1 = log.emit(Fault(fault="exception@step=3", fault_kind="exception", step=3, rank=1))
    RunDir(tmp_path).open_fault(f1)
    (tmp_path / Layout.OPEN_FAULTS / "zz-forged.json").write_text(json.dumps({"t": 1, "kind": "x"}))
    emit_recoveries(log, "inprocess", 4, began=time.time())
    emit_recoveries(log, "inprocess", 5, began=time.time())  # nothing open any more
    h = RunHistory.read(tmp_path)
    ((fault),) = h.fault_records()
    assert fault.recovered_by == "inprocess" and fault.step == 3
    assert not h.restarts  # emit_recoveries records recoveries, never restarts
    assert [p.name for p in (tmp_path / Layout.OPEN_FAULTS).iterdir()] == ["zz-forged.json"]


def test_a_fault_fired_after_the_incarnation_began_stays_open(tmp_path: Path):
    """The race seen in a fresh-clone drill: rank 1 fires its next drill (a stall at step 12)
    while rank 0 is still closing the previous fault after the restart's first step (11). The
    stall is not recovered yet: its own restart's first step closes it, with that load."""
    log = EventLog(tmp_path)
    f1 = log.emit(Fault(fault="exception@step=11,rank=1", fault_kind="exception", step=11))
    RunDir(tmp_path).open_fault(f1)
    began = time.time()
    log.emit(Resume(action="loaded", step=10, source="memory", bytes=8))
    f2 = log.emit(Fault(fault="stall@step=12,rank=1", fault_kind="stall", step=12))
    RunDir(tmp_path).open_fault(f2)
    emit_recoveries(log, "inprocess", 11, began=began)
    h = RunHistory.read(tmp_path)
    assert [f.recovered_by for f in h.fault_records()] == ["inprocess", "none"]
    second = time.time()
    log.emit(Resume(action="loaded", step=10, source="memory", bytes=8))
    emit_recoveries(log, "inprocess", 11, began=second)
    records = {f.fault: f for f in RunHistory.read(tmp_path).fault_records()}
    stall = records["stall@step=12,rank=1"]
    assert (stall.recovered_by, stall.resume_source) == ("inprocess", "memory"), stall
    assert list((tmp_path / Layout.OPEN_FAULTS).iterdir()) == []


def test_a_fault_from_before_the_retry_is_the_stage_retrys(tmp_path: Path):
    log = EventLog(tmp_path)
    f1 = log.emit(Fault(fault="node-loss@step=6", fault_kind="node-loss", step=6))
    RunDir(tmp_path).open_fault(f1)
    RunDir(tmp_path).record_retry(1)  # a first attempt is no retry
    assert RunDir(tmp_path).retry_began() == 0.0
    RunDir(tmp_path).record_retry(2)
    emit_recoveries(log, "injob", 5, began=time.time())
    (fault,) = RunHistory.read(tmp_path).fault_records()
    assert fault.recovered_by == "stage-retry"


def test_the_result_is_this_epochs_and_of_the_schema(tmp_path: Path):
    unfenced, mine = RunDir(tmp_path), RunDir(tmp_path, 3)
    assert mine.result() is None
    done = RunResult(status="completed", final_step=8, final_loss=1.5, world_size=2)
    RunDir(tmp_path, 3).write_result(done, None)  # the highest epoch on record: it may
    assert json.loads((tmp_path / Layout.RESULT).read_text())["epoch"] == 3
    assert mine.result() == done.model_copy(update={"epoch": 3})
    assert RunDir(tmp_path, 4).result() is None  # another attempt's
    assert unfenced.result() is not None  # an unfenced watcher takes any
    mine.clear_result()
    assert mine.result() is None


BAD_RESULTS = [
    b"\x00garbage",
    b'["completed"]',
    b'{"status": "done"}',
    b'{"status": "completed", "final_step": "8"}',
    b'{"status": "completed", "final_step": true}',
    b'{"status": "completed", "params_sha256": "not hex"}',
    b'{"status": "completed", "epoch": 0}',
    b'{"status": "completed", "pad": "' + b"x" * (2 << 20) + b'"}',  # over the size bound
]


@pytest.mark.parametrize("content", BAD_RESULTS)
def test_a_bad_result_is_no_result(tmp_path: Path, content: bytes):
    (tmp_path / Layout.RESULT).write_bytes(content)
    assert RunDir(tmp_path).result() is None


def test_an_unknown_result_field_is_ignored(tmp_path: Path):
    (tmp_path / Layout.RESULT).write_text('{"status": "failed", "error": "x", "new": 1}')
    assert RunDir(tmp_path).result() == RunResult(status="failed", error="x")


def test_markers_carry_their_epoch_and_block_nothing(tmp_path: Path):
    (tmp_path / "control").mkdir()
    os.mkfifo(tmp_path / Layout.NO_RESTART)
    assert RunDir(tmp_path).no_restart() is None
    os.unlink(tmp_path / Layout.NO_RESTART)
    # Only ours are markers (NVRx asks over its IPC socket): not JSON, or no epoch, is none.
    (tmp_path / Layout.NO_RESTART).write_text("garbage")
    assert RunDir(tmp_path).no_restart() is None
    (tmp_path / Layout.NO_RESTART).write_text('{"t": 1.0, "rank": 0, "reason": "bad data"}')
    assert RunDir(tmp_path).no_restart() == "bad data"  # an unfenced run's (no epoch) is its own
    assert RunDir(tmp_path, 3).no_restart() is None
    RunDir(tmp_path, 3).write_no_restart(rank=1, reason="bad config", events=None)
    assert RunDir(tmp_path, 3).no_restart() == "bad config"
    assert RunDir(tmp_path, 4).no_restart() is None  # another attempt's verdict
    os.mkfifo(tmp_path / Layout.NODE_LOST)
    assert RunDir(tmp_path).node_lost_since(0.0) is False
    os.unlink(tmp_path / Layout.NODE_LOST)
    RunDir(tmp_path).write_node_lost(node=1, t=10.0)
    assert RunDir(tmp_path).node_lost_since(9.0) and not RunDir(tmp_path).node_lost_since(10.0)
    RunDir(tmp_path).clear_markers()
    assert not any((tmp_path / rel).exists() for rel in (Layout.NO_RESTART, Layout.NODE_LOST))


def test_a_terminal_error_is_recorded_once_per_worker_group_by_whichever_rank_is_first(
    tmp_path: Path,
):
    """Rank 1 finds the bad config first (its launcher may stop rank 0 before rank 0 gets
    anywhere): the marker, one ``fatal`` event and result.json are its; rank 0 adds nothing.
    The group's restart (a new incarnation), or a run not under a launcher, records again."""
    from tests.helpers import read_events

    events = EventLog(tmp_path, epoch=2)
    run = RunDir(tmp_path, 2)
    group = "run-attempt1-abc/0"
    assert run.record_terminal(rank=1, reason="bad batch", events=events, incarnation=group)
    assert not run.record_terminal(rank=0, reason="bad batch", events=events, incarnation=group)
    result = run.result()
    assert result is not None and result.status == "failed" and result.requeue is False
    assert result.error == "bad batch" and result.epoch == 2
    assert run.no_restart() == "bad batch"
    assert json.loads((tmp_path / Layout.NO_RESTART).read_text())["rank"] == 1
    assert [e["error"] for e in read_events(tmp_path) if e["kind"] == "fatal"] == ["bad batch"]
    assert run.record_terminal(rank=0, reason="again", events=events, incarnation="run/1")
    assert run.record_terminal(rank=0, reason="by hand", events=events, incarnation=None)
    fatal = [e["error"] for e in read_events(tmp_path) if e["kind"] == "fatal"]
    assert fatal == ["bad batch", "again", "by hand"]


def test_only_the_epochs_small_regular_beat_files_are_read(tmp_path: Path):
    beats = tmp_path / Layout.BEATS
    beats.mkdir(parents=True)
    (tmp_path / Layout.beat(5, 0)).write_text("1 1\n")
    (tmp_path / Layout.beat(4, 1)).write_text("stale\n")  # a zombie of the attempt before
    os.mkfifo(tmp_path / Layout.beat(5, 2))  # would block a plain open
    (tmp_path / Layout.beat(5, 3)).write_text("x" * 10_000)  # too large to be a beat
    (beats / "e5-node4.tmp").write_text("not a beat name\n")
    (beats / "e5-node\u00b2").write_text("not a node number\n")
    os.symlink(tmp_path / Layout.beat(5, 0), tmp_path / Layout.beat(5, 5))
    assert RunDir(tmp_path, 5).beats() == {0: "1 1\n"}
    RunDir(tmp_path, 5).clear_other_beats()
    assert not (tmp_path / Layout.beat(4, 1)).exists()
    assert (tmp_path / Layout.beat(5, 0)).exists()
    assert RunDir(tmp_path / "absent", 5).beats() == {}


def test_a_drill_is_claimed_once_per_run(tmp_path: Path):
    assert RunDir(tmp_path, 1).claim("crash-step-3")
    assert not RunDir(tmp_path, 2).claim("crash-step-3")  # a later attempt: already fired
    assert RunDir(tmp_path).claim("crash-step-4")
