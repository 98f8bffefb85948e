"""The start-up facts under ``control/`` (trainer.run_state): written atomically, read in O(1),
and ignored when malformed, as any file of the shared filesystem must be."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from trainer import run_state
from trainer.elastic import PriorWorld
from trainer.event_types import Fault, Resume
from trainer.events import EventLog
from trainer.history import RunHistory
from trainer.hooks import emit_recoveries


def test_commit_fact(tmp_path: Path):
    assert run_state.recorded_commit(tmp_path) is None
    run_state.record_commit(tmp_path, 20)
    assert run_state.recorded_commit(tmp_path) == 20
    run_state.record_commit(tmp_path, None)  # an explicit fresh start expects none
    assert run_state.recorded_commit(tmp_path) is None
    run_state.record_commit(tmp_path, 5)  # commits since the fresh start count again
    assert run_state.recorded_commit(tmp_path) == 5


def test_launch_fact_and_open_node_loss(tmp_path: Path):
    assert run_state.prior_world(tmp_path, "j1") is None
    run_state.record_launch(tmp_path, job_id="j1", world_size=4, nodes=[0, 1])
    assert run_state.prior_world(tmp_path, "j1") == PriorWorld(4, (0, 1), False)
    assert run_state.prior_world(tmp_path, "j2") is None  # another launcher job: no respawn
    assert run_state.prior_world(tmp_path, None) is None
    log = EventLog(tmp_path)
    loss = log.emit(Fault(fault="node-loss@node=1", fault_kind="node-loss", node=1))
    run_state.open_fault(tmp_path, loss)
    assert run_state.prior_world(tmp_path, "j1") == PriorWorld(4, (0, 1), True)
    ((_, fault),) = run_state.open_faults(tmp_path)
    assert fault.fault_kind == "node-loss"
    emit_recoveries(log, "spare", 3, began=time.time())  # closed: no longer open after it
    assert run_state.open_faults(tmp_path) == []
    assert run_state.prior_world(tmp_path, "j1") == PriorWorld(4, (0, 1), False)


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
    (tmp_path / run_state.COMMIT).write_bytes(content)
    assert run_state.recorded_commit(tmp_path) is None
    (tmp_path / run_state.LAUNCH).write_bytes(content)
    assert run_state.prior_world(tmp_path, "j") is None


def test_a_fifo_fact_does_not_block(tmp_path: Path):
    (tmp_path / "control").mkdir()
    os.mkfifo(tmp_path / run_state.COMMIT)
    assert run_state.recorded_commit(tmp_path) is None


def test_recoveries_close_the_open_faults_once(tmp_path: Path):
    log = EventLog(tmp_path)
    f1 = log.emit(Fault(fault="exception@step=3", fault_kind="exception", step=3, rank=1))
    run_state.open_fault(tmp_path, f1)
    (tmp_path / run_state.FAULTS / "zz-forged.json").write_text(json.dumps({"t": 1, "kind": "x"}))
    emit_recoveries(log, "inprocess", 4, began=time.time())
    emit_recoveries(log, "inprocess", 5, began=time.time())  # nothing open any more
    h = RunHistory.read(tmp_path)
    ((fault),) = h.fault_records()
    assert fault.recovered_by == "inprocess" and fault.step == 3
    assert not h.restarts  # emit_recoveries records recoveries, never restarts
    assert [p.name for p in (tmp_path / run_state.FAULTS).iterdir()] == ["zz-forged.json"]


def test_a_fault_fired_after_the_incarnation_began_stays_open(tmp_path: Path):
    """The race seen in a fresh-clone drill: rank 1 fires its next drill (a stall at step 12)
    while rank 0 is still closing the previous fault after the restart's first step (11). The
    stall is not recovered yet: its own restart's first step closes it, with that load."""
    log = EventLog(tmp_path)
    f1 = log.emit(Fault(fault="exception@step=11,rank=1", fault_kind="exception", step=11))
    run_state.open_fault(tmp_path, f1)
    began = time.time()
    log.emit(Resume(action="loaded", step=10, source="memory", bytes=8))
    f2 = log.emit(Fault(fault="stall@step=12,rank=1", fault_kind="stall", step=12))
    run_state.open_fault(tmp_path, f2)
    emit_recoveries(log, "inprocess", 11, began=began)
    h = RunHistory.read(tmp_path)
    assert [f.recovered_by for f in h.fault_records()] == ["inprocess", "none"]
    second = time.time()
    log.emit(Resume(action="loaded", step=10, source="memory", bytes=8))
    emit_recoveries(log, "inprocess", 11, began=second)
    records = {f.fault: f for f in RunHistory.read(tmp_path).fault_records()}
    stall = records["stall@step=12,rank=1"]
    assert (stall.recovered_by, stall.resume_source) == ("inprocess", "memory"), stall
    assert list((tmp_path / run_state.FAULTS).iterdir()) == []


def test_a_fault_from_before_the_retry_is_the_stage_retrys(tmp_path: Path):
    log = EventLog(tmp_path)
    f1 = log.emit(Fault(fault="node-loss@step=6", fault_kind="node-loss", step=6))
    run_state.open_fault(tmp_path, f1)
    run_state.record_retry(tmp_path, 1)  # a first attempt is no retry
    assert run_state.retry_began(tmp_path) == 0.0
    run_state.record_retry(tmp_path, 2)
    emit_recoveries(log, "injob", 5, began=time.time())
    (fault,) = RunHistory.read(tmp_path).fault_records()
    assert fault.recovered_by == "stage-retry"
