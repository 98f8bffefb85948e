"""Epoch fencing of the run root (trainer.fence) at the storage level: a writer of a replaced
attempt changes nothing and says so; the current one commits; publishing waits for a mutation
in progress. Real files, real flock, the real commit (trainer.checkpointing.manager._Commit)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from trainer import checkpointing, fence
from trainer.checkpointing.manager import _Commit
from trainer.event_read import EventReader
from trainer.event_types import FencedEvent, StageAttempt
from trainer.events import EventLog
from trainer.rundir import Layout, RunDir, RunResult

FP = "cfg-hash"


def _fence(run_root: Path, epoch: int | None) -> fence.Fence:
    def refuse() -> None:  # a worker exits here; the test goes on
        pass

    return RunDir(run_root, epoch).fence(EventLog(run_root, epoch=epoch), on_fenced=refuse)


def _write_partial(run_root: Path, step: int, epoch: int | None, content: bytes) -> Path:
    partial = checkpointing.partial_path(run_root, step, epoch)
    partial.mkdir(parents=True)
    (partial / "__0_0.distcp").write_bytes(content)
    (partial / checkpointing.DCP_METADATA).write_bytes(b"meta" + content)
    return partial


def _commit(run_root: Path, step: int, f: fence.Fence) -> _Commit:
    return _Commit(
        run_root=run_root,
        step=step,
        world_size=1,
        keep_last=2,
        info={"config_hash": FP},
        events=f.events,  # type: ignore[arg-type]
        fence=f,
        blocking_s=0.1,
        written_s=1.0,
    )


def test_publish_counts_up_and_a_malformed_epoch_is_none(tmp_path: Path):
    assert fence.current(RunDir(tmp_path)) is None
    assert RunDir(tmp_path).publish(invocation="a", attempt=1).epoch == 1
    e2 = fence.publish(RunDir(tmp_path), invocation="b", attempt=2)
    assert (e2.epoch, e2.invocation, e2.attempt) == (2, "b", 2)
    assert fence.current(RunDir(tmp_path)) == e2
    (tmp_path / Layout.EPOCH).write_text('{"epoch": "3"}')
    assert fence.current(RunDir(tmp_path)) is None
    # No other record of an epoch (no event yet): nothing to count from.
    assert RunDir(tmp_path).publish(invocation="c", attempt=1).epoch == 1


def _attempts(root: Path, n: int) -> None:
    """``n`` attempts published, each saying so in the event log first, as the watcher does."""
    for attempt in range(1, n + 1):
        epoch = RunDir(root).publish(invocation="w", attempt=attempt).epoch
        EventLog(root, epoch=epoch).emit(StageAttempt(stage="train", attempt=attempt))


@pytest.mark.parametrize("damage", ["lost", "corrupt", "not-an-epoch"])
def test_a_damaged_epoch_json_passes_no_zombie_and_fences_no_live_writer(tmp_path: Path, damage):
    _attempts(tmp_path, 3)
    path = tmp_path / Layout.EPOCH
    path.unlink() if damage == "lost" else path.write_text(
        "\x00garbage" if damage == "corrupt" else '{"epoch": 1, "t": 0}'
    )
    zombie, live = _fence(tmp_path, 1), _fence(tmp_path, 3)
    assert not zombie.still_current() and live.still_current()
    ran = []
    with pytest.raises(fence.Fenced, match="epoch 1 is not the run's"), zombie.hold("commit"):
        ran.append("zombie")
    with live.hold("commit"):  # repairs the record, under the lock
        ran.append("live")
    assert ran == ["live"]
    now = fence.current(RunDir(tmp_path))
    assert now is not None and now.epoch == 3
    path.unlink()
    assert RunDir(tmp_path).publish(invocation="x", attempt=4).epoch == 4  # never back to 1
    with pytest.raises(fence.Fenced), live.hold("commit"):
        pass


@pytest.mark.parametrize("value", ["", "0", "-1", "x", "1.5"])
def test_no_epoch_in_the_environment_is_unfenced(value: str):
    assert fence.epoch_from_env({fence.EPOCH_ENV: value}) is None
    assert fence.epoch_from_env({fence.EPOCH_ENV: "7"}) == 7


def test_a_zombie_commits_nothing_and_the_new_attempt_commits(tmp_path: Path):
    """The reproduction of issue 26 at the storage level: attempt 1's rank 0 paused before its
    commit of step 10; attempt 2 (a new epoch) writes its own step 10; attempt 1 wakes."""
    root = tmp_path
    old = RunDir(root).publish(invocation="a", attempt=1).epoch
    zombie = _fence(root, old)
    _write_partial(root, 10, old, b"old")
    new = RunDir(root).publish(invocation="b", attempt=2).epoch
    current = _fence(root, new)
    mine = _write_partial(root, 10, new, b"new")  # half-written: no commit yet

    with pytest.raises(fence.Fenced, match=f"epoch {old} is not the run's"):
        _commit(root, 10, zombie).run()
    assert checkpointing.committed_steps(root) == [] and mine.exists()
    assert not (root / Layout.COMMIT).exists()  # the zombie recorded nothing
    (ev,) = [e for e in EventReader(root / "events.jsonl").read_new() if e.kind == "fenced"]
    assert isinstance(ev, FencedEvent)
    assert ev.epoch == old and ev.current == new and "commit step 10" in ev.action

    path = _commit(root, 10, current).run()
    assert path == checkpointing.committed_path(root, 10)
    assert (path / "__0_0.distcp").read_bytes() == b"new"
    assert checkpointing.read_latest(root) == 10 and RunDir(root).recorded_commit() == 10
    # The zombie's own partial is left for the current attempt's recovery to settle.
    assert checkpointing.partial_path(root, 10, old).exists()
    settled = checkpointing.recover(root, fingerprint=FP)
    assert [(r.action, r.dir) for r in settled] == [
        ("removed-partial", f"step_000000010.e{old}.partial")
    ]


def test_every_fenced_mutation_is_refused(tmp_path: Path):
    old = RunDir(tmp_path).publish(invocation="a", attempt=1).epoch
    RunDir(tmp_path).publish(invocation="b", attempt=2)
    zombie = _fence(tmp_path, old)
    ran = []
    for action in ("write result.json", "settle", "start fresh"):
        with pytest.raises(fence.Fenced), zombie.hold(action):
            ran.append(action)
    assert ran == [] and not zombie.still_current()
    unfenced = _fence(tmp_path, None)
    with unfenced.hold("anything"):
        ran.append("unfenced")
    assert ran == ["unfenced"]


def test_publishing_waits_for_a_mutation_in_progress(tmp_path: Path):
    epoch = RunDir(tmp_path).publish(invocation="a", attempt=1).epoch
    f = _fence(tmp_path, epoch)
    order: list[str] = []
    inside = threading.Event()

    def mutate() -> None:
        with f.hold("commit"):
            inside.set()
            time.sleep(0.3)
            order.append("mutated")

    t = threading.Thread(target=mutate)
    t.start()
    inside.wait(5)
    RunDir(tmp_path).publish(invocation="b", attempt=2)
    order.append("published")
    t.join()
    assert order == ["mutated", "published"]


def test_a_stale_result_and_marker_carry_their_epoch(tmp_path: Path, monkeypatch):
    epoch = RunDir(tmp_path).publish(invocation="a", attempt=1).epoch
    monkeypatch.setenv(fence.EPOCH_ENV, str(epoch))
    worker = RunDir.from_env(tmp_path)  # a worker's view: its launch's epoch
    worker.write_result(RunResult(status="completed"), EventLog(tmp_path))
    assert json.loads((tmp_path / Layout.RESULT).read_text())["epoch"] == epoch
    worker.write_no_restart(rank=0, reason="bad data", events=EventLog(tmp_path))
    assert RunDir(tmp_path, epoch).no_restart() == "bad data"
    assert RunDir(tmp_path, epoch + 1).no_restart() is None  # another attempt's verdict
