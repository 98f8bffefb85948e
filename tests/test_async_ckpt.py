"""The async checkpointer in-process, on a real single-rank gloo group."""

from __future__ import annotations

import datetime
import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from tests.helpers import free_port
from trainer.async_ckpt import AsyncCheckpointer, CheckpointWorkerDied


@pytest.fixture(scope="module")
def group():
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
    yield dist.new_group(backend="gloo")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def saver(group):
    s = AsyncCheckpointer(device=torch.device("cpu"), timeout_s=60)
    s.bind(group)
    yield s
    s.close()


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(256, 1024, generator=g),
        "b": torch.randn(1024, generator=g),
        "step": torch.tensor(3.0),
        "lr": 0.1,
    }


def test_writer_started_at_bind(saver: AsyncCheckpointer):
    pid = saver.writer_pid()
    assert pid is not None and saver._worker_alive()


def test_snapshot_is_taken_at_save_time(saver: AsyncCheckpointer, tmp_path: Path):
    """On CPU the writer would otherwise read live tensors while training mutates them."""
    live = _state(0)
    expected = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in live.items()}
    blocking = saver.save(live, tmp_path / "ckpt", step=1)
    for v in live.values():  # what optimizer.step() does right after the save returns
        if isinstance(v, torch.Tensor):
            v.add_(1.0)
    result = saver.wait()
    assert result is not None and result.step == 1 and blocking < result.total_s
    loaded = _state(99)
    dcp.load(loaded, checkpoint_id=str(tmp_path / "ckpt"))
    for k, v in expected.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(loaded[k], v), k
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        ".digests-rank0.json",
        ".metadata",
        "__0_0.distcp",
    ]


def test_buffers_are_reused_between_saves(saver: AsyncCheckpointer, tmp_path: Path):
    saver.save(_state(1), tmp_path / "a", step=1)
    saver.wait()
    first = [b.data_ptr() for b in saver.staging.buffers]
    saver.save(_state(2), tmp_path / "b", step=2)
    saver.wait()
    assert [b.data_ptr() for b in saver.staging.buffers] == first
    loaded = _state(99)
    dcp.load(loaded, checkpoint_id=str(tmp_path / "b"))
    assert torch.equal(loaded["w"], _state(2)["w"])


def test_poll_does_not_block(saver: AsyncCheckpointer, tmp_path: Path):
    big = {"w": torch.randn(4096, 4096)}  # 64 MiB: written with fsync, takes a while
    saver.save(big, tmp_path / "big", step=1)
    t0 = time.perf_counter()
    first = saver.poll()
    assert time.perf_counter() - t0 < 1.0
    deadline = time.time() + 60
    result = first
    while result is None and time.time() < deadline:
        time.sleep(0.05)
        result = saver.poll()
    assert result is not None and result.step == 1


def test_dead_writer_fails_instead_of_hanging(saver: AsyncCheckpointer, tmp_path: Path):
    pid = saver.writer_pid()
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    time.sleep(0.5)
    saver.save(_state(3), tmp_path / "c", step=3)
    t0 = time.perf_counter()
    with pytest.raises(CheckpointWorkerDied, match="writer died"):
        saver.wait()
    assert time.perf_counter() - t0 < 30
    # The next bind (e.g. after an in-process restart) starts a fresh writer.
    saver.bind(saver.group)  # type: ignore[arg-type]
    assert saver.writer_pid() not in (None, pid)
    saver.save(_state(4), tmp_path / "d", step=4)
    assert saver.wait() is not None


def test_save_requires_previous_finalized(saver: AsyncCheckpointer, tmp_path: Path):
    saver.save(_state(5), tmp_path / "e", step=5)
    with pytest.raises(Exception, match="previous save not finalized"):
        saver.save(_state(6), tmp_path / "f", step=6)
    saver.wait()
