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

from tests.helpers import REPO, free_port
from trainer.checkpointing import CheckpointStorageError, CheckpointTimeout, CheckpointWorkerDied
from trainer.checkpointing.async_save import WARMUP_STEP, AsyncCheckpointer


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
    s.ensure_started()
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


def test_writer_starts_with_training_not_at_bind(group, tmp_path: Path):
    """bind (before the model build and the load) starts nothing; the first ensure_started
    (the loop's first step) or save does, once."""
    s = AsyncCheckpointer(device=torch.device("cpu"), timeout_s=60)
    try:
        s.bind(group, warmup_dir=tmp_path / ".writer-warmup")
        assert s.writer.pid() is None and s.pending is None
        s.ensure_started()
        pid = s.writer.pid()
        assert pid is not None and s.writer.alive()
        s.ensure_started()
        assert s.writer.pid() == pid
        s.save(_state(6), tmp_path / "f", step=6)
        assert s.writer.pid() == pid and s.wait() is not None
    finally:
        s.close()
    other = AsyncCheckpointer(device=torch.device("cpu"), timeout_s=60)
    try:  # a save is enough on its own
        other.bind(group)
        other.save(_state(7), tmp_path / "g", step=7)
        assert other.writer.pid() is not None and other.wait() is not None
    finally:
        other.close()


_FORKED = """
import datetime, json, os, sys, threading
import torch, torch.distributed as dist
from trainer.checkpointing.async_save import AsyncCheckpointer
from trainer.digest import tensor_dict_sha256

def main():
    assert threading.active_count() == 1
    s = AsyncCheckpointer(device=torch.device("cpu"), timeout_s=60)
    s.start(rank=0, fork=True)  # as a worker does at its start, before any thread
    try:
        dist.init_process_group("gloo", rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=60))
        s.bind(dist.new_group(backend="gloo"))
        g = torch.Generator().manual_seed(5)
        state = {"w": torch.randn(64, 128, generator=g), "step": torch.tensor(2.0)}
        s.save(state, sys.argv[1], step=2)
        done = s.wait()
        print(json.dumps({"how": s.writer.start_method, "writer": s.writer.pid(),
                          "me": os.getpid(), "step": done.step,
                          "digest": tensor_dict_sha256({"w": state["w"]})}))
    finally:
        s.close()  # its processes are not daemons: the interpreter's exit would wait for them
    dist.destroy_process_group()

if __name__ == "__main__":
    main()
"""


def test_a_writer_forked_at_the_start_writes_what_a_spawned_one_does(tmp_path: Path):
    """``start(fork=True)`` in a fresh process (a worker's start): the writer and NVRx's
    results-queue Manager are forks, the save commits, and the shard loads back bitwise."""
    import json
    import subprocess
    import sys

    from tests.helpers import REPO, worker_env
    from trainer.digest import tensor_dict_sha256

    script = tmp_path / "forked.py"
    script.write_text(_FORKED)
    env = {**worker_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "ckpt")],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["how"] == "fork" and out["writer"] != out["me"] and out["step"] == 2
    g = torch.Generator().manual_seed(5)
    loaded = {"w": torch.empty(64, 128), "step": torch.tensor(0.0)}
    dcp.load(loaded, checkpoint_id=str(tmp_path / "ckpt"))
    assert tensor_dict_sha256({"w": loaded["w"]}) == out["digest"] and loaded["step"] == 2.0
    assert torch.equal(loaded["w"], torch.randn(64, 128, generator=g))


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


def test_the_shard_digest_is_taken_as_nvrx_writes_it(group, tmp_path: Path, monkeypatch):
    """NVRx's own write path (the child it forks per file, torch's ``_write_item``) sends every
    byte of the shard through the tap: the sidecar's digest is the streamed one (nothing is read
    back) and it is the xxh3-128 of the file as written."""
    import json

    import xxhash
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from trainer import nvrx_compat
    from trainer.checkpointing import manifest, shard_digest
    from trainer.checkpointing.writer import write_shard

    writer = nvrx_compat.FileSystemWriterAsync(str(tmp_path), thread_count=1)
    assert shard_digest.install(writer)
    writer, _metadata, _wrapper = nvrx_compat.save_state_dict_async_plan(
        _state(4), writer, process_group=group, planner=DefaultSavePlanner()
    )
    save_fn, _preload, args = writer.get_save_function_and_args()

    def read_back(*args, **kwargs):
        raise AssertionError("the shard was read back")

    monkeypatch.setattr(manifest, "file_digest", read_back)
    write_shard(save_fn, str(tmp_path), 0, args[1], args[2])
    assert len(writer.retrieve_write_results()) == 4  # the write itself succeeded
    [entry] = json.loads((tmp_path / ".digests-rank0.json").read_text())
    shard = tmp_path / entry["name"]
    assert entry["bytes"] == shard.stat().st_size > 256 * 1024 * 4
    assert entry["xxh3_128"] == xxhash.xxh3_128_hexdigest(shard.read_bytes())


def test_a_committed_save_lists_the_xxh3_of_its_files(saver: AsyncCheckpointer, tmp_path: Path):
    """A real asynchronous save and commit: manifest v2, every entry the xxh3-128 of its file."""
    import xxhash

    from trainer import checkpointing

    root = tmp_path / "run"
    partial = checkpointing.partial_path(root, 7)
    partial.mkdir(parents=True)

    def commit_for(result):
        return lambda: checkpointing.commit(root, 7, world_size=1, info={"config_hash": "t"})

    saver.save(_state(7), partial, step=7)
    assert saver.wait(commit=commit_for) is not None
    ckpt = checkpointing.committed_path(root, 7)
    man = checkpointing.read_manifest(ckpt)
    assert (man.raw["format"], man.digest) == ("nvrx-ckpt-v2", "xxh3_128")
    assert sorted(e.name for e in man.files) == [".metadata", "__0_0.distcp"]
    for e, raw in zip(man.files, man.raw["files"], strict=True):
        data = (ckpt / e.name).read_bytes()
        assert set(raw) == {"name", "bytes", "xxh3_128"}
        assert e == checkpointing.FileEntry(e.name, len(data), xxhash.xxh3_128_hexdigest(data))
    assert checkpointing.verify_checkpoint(ckpt).ok


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
    pid = saver.writer.pid()
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    time.sleep(0.5)
    saver.save(_state(3), tmp_path / "c", step=3)
    t0 = time.perf_counter()
    with pytest.raises(CheckpointWorkerDied, match="writer died"):
        saver.wait()
    assert time.perf_counter() - t0 < 30
    # After the restart's bind, the next save starts a fresh writer.
    saver.bind(saver.group)  # type: ignore[arg-type]
    saver.save(_state(4), tmp_path / "d", step=4)
    assert saver.writer.pid() not in (None, pid)
    assert saver.wait() is not None


def test_a_replaced_writer_warms_up_in_the_background(group, tmp_path: Path):
    """A writer that a restart's bind replaces writes once at bind, in the background; that
    write is finalized by poll like a save but never reported as one, and its directory goes
    away; an already running writer (an in-process restart's re-bind) does not warm up again."""
    s = AsyncCheckpointer(device=torch.device("cpu"), timeout_s=60)
    try:
        s.bind(group, warmup_dir=tmp_path / ".writer-warmup")
        s.ensure_started()
        dead = s.writer.pid()
        assert dead is not None
        os.kill(dead, signal.SIGKILL)
        deadline = time.time() + 10
        while s.writer.alive() and time.time() < deadline:
            time.sleep(0.05)
        s.bind(group, warmup_dir=tmp_path / ".writer-warmup")
        assert s.writer.pid() not in (None, dead)
        assert s.pending is not None and s.pending.step == WARMUP_STEP
        assert s.wait() is None and s.pending is None
        assert not (tmp_path / ".writer-warmup").exists()
        s.bind(group, warmup_dir=tmp_path / ".writer-warmup")
        assert s.pending is None
        s.save(_state(5), tmp_path / "e", step=5)
        result = s.wait()
        assert result is not None and result.step == 5
    finally:
        s.close()


def test_save_requires_previous_finalized(saver: AsyncCheckpointer, tmp_path: Path):
    saver.save(_state(5), tmp_path / "e", step=5)
    with pytest.raises(Exception, match="previous save not finalized"):
        saver.save(_state(6), tmp_path / "f", step=6)
    saver.wait()


# -- FSDP2 (DTensor) state: staging keeps CPU buffers, layout and plan ---------------------------
def _fsdp_model(device: torch.device, world: int, seed: int = 0):
    """A small FSDP2 model (uneven first dim: padded shards at 2 ranks) and its AdamW."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(24, 37), torch.nn.LayerNorm(37), torch.nn.Linear(37, 5)
    ).to(device)
    mesh = init_device_mesh(device.type, (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optim


def _train_step(model, optim, device: torch.device, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 24, generator=g).to(device)
    model(x).square().mean().backward()
    optim.step()
    optim.zero_grad(set_to_none=True)


def _state_of(model, optim) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optim)
    return {"model": model_sd, "optim": optim_sd}


def _leaves(obj, prefix: str = ""):
    """(path, value) of every tensor, DTensors as themselves."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _leaves(v, f"{prefix}/{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _leaves(v, f"{prefix}/{i}")


def _local_snapshot(state: dict) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {
        p: (t._local_tensor if isinstance(t, DTensor) else t).detach().to("cpu", copy=True)
        for p, t in _leaves(state)
    }


def _assert_bitwise(state: dict, expected: dict[str, torch.Tensor]) -> None:
    got = _local_snapshot(state)
    assert got.keys() == expected.keys()
    for p, t in expected.items():
        assert got[p].dtype == t.dtype and torch.equal(got[p], t), p


def _capture_stage(saver: AsyncCheckpointer) -> list[dict]:
    """Record what ``save`` hands to the DCP planner (this test's saver only)."""
    seen: list[dict] = []
    inner = saver.staging.stage

    def stage(state_dict):
        staged = inner(state_dict)
        seen.append(staged)
        return staged

    saver.staging.stage = stage  # type: ignore[method-assign]
    return seen


def _check_staged(staged: dict, source: dict) -> None:
    """Every staged tensor is CPU (DTensor: its local tensor), no staged tensor aliases the
    source, and a DTensor keeps its global shape, stride, placements and mesh."""
    from torch.distributed.tensor import DTensor

    src = dict(_leaves(source))
    out = dict(_leaves(staged))
    assert out.keys() == src.keys()
    for p, t in out.items():
        s = src[p]
        local = t._local_tensor if isinstance(t, DTensor) else t
        assert local.device.type == "cpu", p
        assert local.is_shared(), p
        assert isinstance(t, DTensor) == isinstance(s, DTensor), p
        if isinstance(t, DTensor):
            assert t.device.type == "cpu", p
            assert t.shape == s.shape and t.stride() == s.stride(), p
            assert t.placements == s.placements and t.device_mesh is s.device_mesh, p
            assert local.shape == s._local_tensor.shape, p
            assert local.data_ptr() != s._local_tensor.data_ptr() or local.numel() == 0, p
        else:
            assert t.shape == s.shape and t.dtype == s.dtype, p
            assert t.data_ptr() != s.data_ptr() or t.numel() == 0, p


def _fsdp_round_trip(saver: AsyncCheckpointer, root: Path, device: torch.device, world: int):
    """Two saves of an FSDP2 model's state, each followed by an optimizer step before the write
    is finalized; the first checkpoint loads back bitwise equal, buffers are reused."""
    model, optim = _fsdp_model(device, world)
    rank = dist.get_rank()
    _train_step(model, optim, device, seed=rank)
    seen = _capture_stage(saver)

    state = _state_of(model, optim)
    expected = _local_snapshot(state)
    saver.save(state, root / "a", step=1)
    assert saver.staging.reallocated
    _check_staged(seen[-1], state)
    first = [b.data_ptr() for b in saver.staging.buffers]
    _train_step(model, optim, device, seed=100 + rank)  # mutates what was just saved
    result = saver.wait()
    assert result is not None and result.step == 1

    state = _state_of(model, optim)
    expected_b = _local_snapshot(state)
    saver.save(state, root / "b", step=2)
    assert not saver.staging.reallocated
    assert [b.data_ptr() for b in saver.staging.buffers] == first
    _check_staged(seen[-1], state)
    _train_step(model, optim, device, seed=200 + rank)
    assert saver.wait() is not None

    for name, want in (("a", expected), ("b", expected_b)):
        fresh_model, fresh_optim = _fsdp_model(device, world, seed=7)
        _train_step(fresh_model, fresh_optim, device, seed=999)  # optimizer state exists
        target = _state_of(fresh_model, fresh_optim)
        dcp.load(target, checkpoint_id=str(root / name))
        _assert_bitwise(target, want)


def test_fsdp2_state_staged_on_cpu_round_trip(saver: AsyncCheckpointer, tmp_path: Path):
    _fsdp_round_trip(saver, tmp_path, torch.device("cpu"), world=1)


def test_before_optimizer_step_is_a_noop_on_cpu(saver: AsyncCheckpointer, tmp_path: Path):
    saver.before_optimizer_step()  # nothing pending
    saver.save(_state(7), tmp_path / "g", step=7)
    assert saver.pending is not None and saver.pending.request is None  # handed over at once
    assert saver._step_hook is None and not saver.staging.copier.in_flight
    saver.before_optimizer_step()
    result = saver.wait()
    assert result is not None and result.deferred_s == 0.0
    saver.before_optimizer_step()


def test_device_mesh_dtensor_is_staged_on_cpu(saver: AsyncCheckpointer, tmp_path: Path):
    """A DTensor whose mesh is a CUDA mesh (built without CUDA: no process group, no device
    memory) is staged, planned and written with a CPU local tensor. ``DTensor.from_local`` of
    the buffer on that mesh (the old staging) moves it to the mesh's device: fails here."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    cuda_mesh = DeviceMesh("cuda", torch.arange(1), _init_backend=False)
    local = torch.randn(6, 4, generator=torch.Generator().manual_seed(5))
    spec = DTensorSpec(cuda_mesh, (Shard(0),), TensorMeta(local.shape, local.stride(), local.dtype))
    source = {"x": DTensor(local, spec, requires_grad=False), "n": 3}
    seen = _capture_stage(saver)
    saver.save(source, tmp_path / "mesh", step=1)
    staged = seen[-1]["x"]
    assert staged.device_mesh.device_type == "cuda" and staged._local_tensor.device.type == "cpu"
    assert staged.device.type == "cpu" and staged._local_tensor.is_shared()
    assert staged.placements == (Shard(0),) and staged.shape == local.shape
    assert saver.wait() is not None
    target = {"x": distribute_tensor(torch.zeros(6, 4), init_device_mesh("cpu", (1,)), [Shard(0)])}
    dcp.load(target, checkpoint_id=str(tmp_path / "mesh"))
    assert torch.equal(target["x"].to_local(), local)


def test_layout_change_reallocates(saver: AsyncCheckpointer, tmp_path: Path):
    saver.save(_state(1), tmp_path / "h", step=1)
    saver.wait()
    changed = _state(1)
    changed["w"] = torch.randn(128, 1024)  # same key, other shape: new buffers, new plan cache
    saver.save(changed, tmp_path / "i", step=2)
    assert saver.staging.reallocated
    assert saver.wait() is not None
    loaded = {"w": torch.zeros(128, 1024)}
    dcp.load(loaded, checkpoint_id=str(tmp_path / "i"))
    assert torch.equal(loaded["w"], changed["w"])


# -- the deferred hand-off of the CUDA path, driven on CPU ---------------------------------------
class _FakeInFlightCopy:
    """Stands in for the CUDA side-stream copy: the copy itself runs synchronously, but it
    reports "in flight" until ``finish()``, so the checkpointer's CUDA control flow (deferred
    hand-off, step hook, GPU-side ordering) runs on CPU."""

    non_blocking = False

    def __init__(self) -> None:
        self.done = True
        self.ordered = 0
        self.synchronized = 0

    def copying(self):
        import contextlib

        @contextlib.contextmanager
        def ctx():
            yield
            self.done = False

        return ctx()

    @property
    def in_flight(self) -> bool:
        return not self.done

    def query(self) -> bool:
        return self.done

    def order_current_stream(self) -> None:
        self.ordered += 1

    def synchronize(self) -> None:
        self.synchronized += 1
        self.done = True


def _handed_over(saver: AsyncCheckpointer) -> bool:
    return saver.pending is not None and saver.pending.request is None


def test_write_waits_for_the_copy(saver, tmp_path: Path, monkeypatch):
    fake = _FakeInFlightCopy()
    monkeypatch.setattr(saver.staging, "_copier", fake)
    saver.save(_state(11), tmp_path / "j", step=1)
    assert not _handed_over(saver) and saver.writer.queue.get_num_unfinalized_calls() == 0
    assert saver._step_hook is not None  # the optimizer safety net is armed
    assert saver.poll() is None and not _handed_over(saver)  # copy "running": not handed over
    saver.before_optimizer_step()  # still running: ordered on the stream, not handed over
    assert fake.ordered == 1 and not _handed_over(saver)
    fake.done = True  # the copy completes
    deadline = time.time() + 60
    result = saver.poll()
    assert _handed_over(saver) or result is not None
    assert saver._step_hook is None
    while result is None and time.time() < deadline:
        time.sleep(0.05)
        result = saver.poll()
    assert result is not None and result.step == 1 and fake.synchronized == 0
    loaded = _state(99)
    dcp.load(loaded, checkpoint_id=str(tmp_path / "j"))
    assert torch.equal(loaded["w"], _state(11)["w"])


def test_optimizer_step_hook_and_blocking_wait(saver, tmp_path: Path, monkeypatch):
    fake = _FakeInFlightCopy()
    monkeypatch.setattr(saver.staging, "_copier", fake)
    param = torch.nn.Parameter(torch.ones(3))
    optim = torch.optim.SGD([param], lr=0.1)
    param.grad = torch.ones(3)

    saver.save(_state(12), tmp_path / "k", step=1)
    optim.step()  # the global pre-hook calls before_optimizer_step()
    assert fake.ordered == 1 and not _handed_over(saver)
    result = saver.wait()  # blocks for the copy, hands over, waits for the writer
    assert result is not None and fake.synchronized == 1 and saver._step_hook is None
    optim.step()
    assert fake.ordered == 1  # hook removed

    saver.save(_state(13), tmp_path / "l", step=2)
    fake.done = True
    saver.before_optimizer_step()  # copy done: handed over right here
    assert _handed_over(saver) and saver._step_hook is None
    assert saver.wait() is not None


def test_abandon_never_hands_over_an_unfinished_copy(saver, tmp_path: Path, monkeypatch):
    fake = _FakeInFlightCopy()
    monkeypatch.setattr(saver.staging, "_copier", fake)
    saver.save(_state(14), tmp_path / "m", step=1)
    saver.abandon()
    assert saver.pending is None and fake.synchronized == 1 and saver._step_hook is None
    assert saver.writer.queue.get_num_unfinalized_calls() == 0
    assert not (tmp_path / "m" / "__0_0.distcp").exists()
    saver.save(_state(15), tmp_path / "n", step=2)  # usable afterwards
    fake.done = True
    assert saver.wait() is not None


def test_an_abandoned_save_leaves_no_result_for_the_next(saver, tmp_path: Path):
    """The writer reports write results through NVRx's process-wide results queue, which only a
    finalize reads: an abandoned save's results must not be taken for the next save's (a
    different layout here, as after a warm-up write; the same layout would only hide it)."""
    saver.save({"only": torch.arange(8.0)}, tmp_path / "abandoned", step=1)
    saver.abandon()
    state = _state(16)
    saver.save(state, tmp_path / "next", step=2)
    result = saver.wait()
    assert result is not None and result.step == 2
    loaded = _state(99)
    dcp.load(loaded, checkpoint_id=str(tmp_path / "next"))
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(loaded[k], v), k


# -- several ranks, and CUDA (separate processes) ------------------------------------------------
def _rank_main(rank: int, world: int, port: int, root: str, device_type: str, check: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = device_type == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
    timeout = datetime.timedelta(seconds=120)
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    saver = AsyncCheckpointer(device=device, timeout_s=120)
    try:
        saver.bind(dist.new_group(backend="gloo", timeout=timeout))
        if check == "round_trip":
            _fsdp_round_trip(saver, Path(root), device, world)
        elif check == "save_returns_before_copy":
            _save_returns_before_copy(saver, Path(root), device)
        else:
            raise ValueError(check)
    finally:
        saver.close()
        dist.destroy_process_group()


def _spawn(world: int, root: Path, device_type: str, check: str) -> None:
    import torch.multiprocessing as mp

    mp.start_processes(
        _rank_main,
        args=(world, free_port(), str(root), device_type, check),
        nprocs=world,
        start_method="spawn",
    )


def test_fsdp2_two_ranks_round_trip(tmp_path: Path):
    _spawn(2, tmp_path, "cpu", "round_trip")


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_cuda
def test_cuda_fsdp2_round_trip(tmp_path: Path):
    """CUDA FSDP2, 1 rank: staged on CPU, reused, the optimizer step right after ``save`` (via
    the global step hook, the loop not calling ``before_optimizer_step``) does not leak into
    the checkpoint, which loads back bitwise equal."""
    _spawn(1, tmp_path, "cuda", "round_trip")


def _save_returns_before_copy(saver: AsyncCheckpointer, root: Path, device: torch.device):
    state = {"w": torch.randn(64 << 20, device=device), "step": torch.tensor(3.0)}  # 256 MiB
    saver.save(state, root / "warm", step=0)  # allocates and pins the buffers
    assert saver.wait() is not None
    assert all(b.is_pinned() for b in saver.staging.buffers if b.numel() > 1)
    expected = state["w"].cpu()
    torch.cuda._sleep(4_000_000_000)  # >= 1 s of GPU work queued before the save
    t0 = time.perf_counter()
    blocking = saver.save(state, root / "a", step=1)
    assert time.perf_counter() - t0 < 0.5 and blocking < 0.5
    assert saver.staging.copier.in_flight and not _handed_over(saver)
    assert saver.poll() is None and not _handed_over(saver)
    t1 = time.perf_counter()
    saver.before_optimizer_step()  # a GPU-side wait: the host goes on
    assert time.perf_counter() - t1 < 0.2
    state["w"].add_(1.0)  # "optimizer step": queued after the copy
    result = saver.wait()
    assert result is not None and result.blocking_s >= blocking
    torch.cuda.synchronize()
    loaded = {"w": torch.zeros(64 << 20), "step": torch.tensor(0.0)}
    dcp.load(loaded, checkpoint_id=str(root / "a"))
    assert torch.equal(loaded["w"], expected)
    assert torch.equal(state["w"].cpu(), expected + 1.0)


@needs_cuda
def test_cuda_save_returns_before_the_copy_finishes(tmp_path: Path):
    _spawn(1, tmp_path, "cuda", "save_returns_before_copy")


# -- benchmarks/gpu_check.py: its CPU-only parts ---------------------------------------------------
def test_gpu_check_dry_run(tmp_path: Path):
    import json
    import subprocess
    import sys

    from tests.helpers import REPO, worker_env

    out = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "gpu_check.py"),
            "--dry-run",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=worker_env(),
        check=True,
    )
    plan = json.loads(out.stdout)
    assert list(plan["parts"]) == ["env", "ckpt", "drills", "summary"]
    models = plan["parts"]["ckpt"]["models"]
    assert 100e6 < models["gpt-100m"]["params"] < 120e6
    assert 1.1e9 < models["llama-1b"]["params"] < 1.4e9
    runs = plan["parts"]["drills"]["runs"]
    drills = {"baseline", "repeat", "exception", "sigkill"}
    assert set(runs) == drills | {f"det_{d}" for d in drills}
    assert "--inject" not in runs["baseline"] and "--inject" not in runs["det_repeat"]
    assert runs["exception"][-2:] == ["--inject", "exception@step=12,rank=0"]
    assert "--set=device=cuda" in runs["sigkill"]
    # each mode's runs differ only in the kernels flag (and their run directories)
    det_flag = "--set=deterministic=true"
    for d in drills:
        assert det_flag not in runs[d]
        det = [a for a in runs[f"det_{d}"] if a != det_flag]
        at = next(i for i, a in enumerate(runs[d]) if a.startswith("--set=run_root="))
        assert det[at].endswith(f"det_{d}") and det[:at] + det[at + 1 :] == (
            runs[d][:at] + runs[d][at + 1 :]
        )
    assert not list(tmp_path.iterdir())  # a dry run writes nothing


def test_gpu_check_summary_of_partial_results(tmp_path: Path):
    """A part killed by its timeout leaves the earlier parts' files; the summary says so."""
    import json

    from benchmarks import gpu_check

    (tmp_path / "env.json").write_text(json.dumps({"torch": "x", "cuda_available": True}))
    (tmp_path / "rc_env").write_text("0\n")
    (tmp_path / "rc_ckpt").write_text("124\n")
    s = gpu_check.part_summary(tmp_path, None)  # type: ignore[arg-type]
    assert s["part_rc"] == {"env": "0", "ckpt": "124", "drills": None}
    assert s["ckpt"] is None and s["ok"] == {"ckpt_bitwise": False}
    assert json.loads((tmp_path / "summary.json").read_text()) == s


def test_gpu_check_compares_each_run_with_its_own_modes_baseline():
    """On a GPU the default kernels differ run to run (gpu_check_h200.json): a deterministic
    drill is judged against the deterministic fault-free run, never the other mode's."""
    from benchmarks import gpu_check

    runs = {
        "baseline": {"mode": "default", "params_sha256": "a"},
        "repeat": {"mode": "default", "params_sha256": "b"},
        "det_baseline": {"mode": "deterministic", "params_sha256": "c"},
        "det_sigkill": {"mode": "deterministic", "params_sha256": "c"},
        "det_exception": {"mode": "deterministic", "params_sha256": "a"},
        "det_repeat": {"mode": "deterministic", "params_sha256": None},  # did not finish
        "sigkill": {"mode": "default", "skipped": "deadline"},
    }
    gpu_check._compare_to_baselines(runs)
    got = {name: r.get("matches_baseline") for name, r in runs.items()}
    assert got == {
        "baseline": True,
        "repeat": False,
        "det_baseline": True,
        "det_sigkill": True,
        "det_exception": False,
        "det_repeat": False,
        "sigkill": None,
    }


def test_failed_write_fails_that_save_only(saver: AsyncCheckpointer, tmp_path: Path):
    """An OSError in the writer (ENOSPC in production; here the shard's name is taken by a
    directory) comes back as a CheckpointStorageError naming the step and directory, and the
    next save works."""
    doomed = tmp_path / "doomed"
    (doomed / "__0_0.distcp").mkdir(parents=True)
    saver.save(_state(5), doomed, step=5)
    with pytest.raises(CheckpointStorageError, match="1 rank.s. failed to write") as err:
        saver.wait()
    assert err.value.step == 5 and err.value.directory == doomed
    saver.save(_state(6), tmp_path / "ok", step=6)
    assert saver.wait() is not None


# -- the commit runs on the coordinator's commit thread ------------------------------------------
def _poll_until(saver: AsyncCheckpointer, commit, *, timeout_s: float = 60.0):
    """Non-blocking polls, as the loop makes them once a step, until one returns the result."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = saver.poll(commit=commit)
        if result is not None:
            return result
        time.sleep(0.01)
    raise AssertionError("no result")


def test_the_commit_runs_off_the_training_thread(saver: AsyncCheckpointer, tmp_path: Path):
    """Training goes on while the commit runs: the polls return at once, the commit runs on a
    thread of its own after DCP's .metadata, and the result (with what the commit returned)
    comes back only once it is done."""
    import threading

    release = threading.Event()
    seen: dict = {}

    def commit_for(result):
        seen["built_on"] = threading.current_thread().name

        def run():
            seen["ran_on"] = threading.current_thread().name
            seen["metadata_first"] = (tmp_path / "c" / ".metadata").is_file()
            release.wait(30)
            return tmp_path / "committed"

        return run

    saver.save(_state(8), tmp_path / "c", step=8)
    deadline = time.monotonic() + 60
    while "ran_on" not in seen and time.monotonic() < deadline:
        assert saver.poll(commit=commit_for) is None
        time.sleep(0.01)
    for _ in range(5):  # the commit is held: polls return at once, with nothing
        t0 = time.perf_counter()
        assert saver.poll(commit=commit_for) is None
        assert time.perf_counter() - t0 < 0.5
    assert saver.local_flags().tolist() == [0.0, 0.0, 1.0, 0.0]  # commit running
    release.set()
    result = _poll_until(saver, commit_for)
    assert result.step == 8 and result.committed == tmp_path / "committed"
    assert seen["built_on"] == threading.current_thread().name
    assert seen["ran_on"] != seen["built_on"] and seen["ran_on"].startswith("nvrx-commit")
    assert seen["metadata_first"]
    assert saver.commits.current is None and saver.poll() is None


def test_a_failed_commit_fails_the_next_poll(saver: AsyncCheckpointer, tmp_path: Path):
    """A storage error of the commit (ENOSPC in production) reaches the training thread at the
    poll that learns of it, as the same CheckpointStorageError as a failed write; the next save
    works."""

    def commit_for(result):
        def run():
            raise OSError(28, "No space left on device")

        return run

    saver.save(_state(9), tmp_path / "d", step=9)
    with pytest.raises(CheckpointStorageError, match="No space left") as err:
        saver.wait(commit=commit_for)
    assert err.value.step == 9 and err.value.directory == tmp_path / "d"
    saver.save(_state(10), tmp_path / "e", step=10)
    assert saver.wait() is not None


def test_abandon_lets_a_running_commit_finish(saver: AsyncCheckpointer, tmp_path: Path):
    """A fault while the commit runs (no collectives possible): abandon waits for it and forgets
    it, so the next incarnation's resume never reads a directory being renamed."""
    done = []

    def commit_for(result):
        def run():
            time.sleep(0.5)
            done.append(result.step)

        return run

    saver.save(_state(11), tmp_path / "f", step=11)
    while saver.commits.current is None:
        saver.poll(commit=commit_for)
        time.sleep(0.01)
    saver.abandon()
    assert done == [11] and saver.commits.current is None and saver.pending is None
    assert saver.poll() is None


def test_a_stuck_commit_times_out_naming_it(group, tmp_path: Path):
    """Storage that hangs under the commit thread: the blocking wait gives up after timeout_s
    with an error that names the commit, and the restart that follows (abandon) lets it end."""
    import threading

    release = threading.Event()

    def commit_for(result):
        def run():
            release.wait(30)

        return run

    s = AsyncCheckpointer(device=torch.device("cpu"), timeout_s=1.0)
    try:
        s.bind(group)
        s.save(_state(12), tmp_path / "g", step=12)
        with pytest.raises(CheckpointTimeout, match="commit of step 12 not done after 1.0 s"):
            deadline = time.monotonic() + 60
            while s.commits.current is None and time.monotonic() < deadline:  # writer starting
                s.poll(commit=commit_for)
                time.sleep(0.01)
            s.wait(commit=commit_for)
        release.set()
        s.abandon()
        assert s.commits.current is None and s.poll() is None
    finally:
        s.close()


# A helper forked as the persistent writer is (trainer.nvrx_compat._with_parent) forks a process
# of its own, as NVRx's writer does per write; then the worker above them dies (SIGKILL).
_ORPHANS = r"""
import multiprocessing as mp, os, sys, time
from trainer import nvrx_compat

def write(out):
    with open(out, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)  # blocked, as an orphaned write process was on a dead queue's lock

def writer(out):
    p = mp.get_context("fork").Process(target=write, args=(out,))
    p.start()
    p.join()

if __name__ == "__main__":
    w = mp.get_context("fork").Process(target=nvrx_compat._with_parent(writer), args=(sys.argv[1],))
    w.start()
    while not os.path.exists(sys.argv[1]) or not open(sys.argv[1]).read():
        time.sleep(0.01)
    print(w.pid, flush=True)
    time.sleep(600)
"""


def test_a_killed_worker_leaves_no_writer_or_write_process(tmp_path: Path):
    """The writer dies with its worker, and so does every process the writer forked."""
    import subprocess
    import sys

    out = tmp_path / "write.pid"
    proc = subprocess.Popen(
        [sys.executable, "-c", _ORPHANS, str(out)], stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    try:
        assert proc.stdout is not None
        writer = int(proc.stdout.readline())
        write = int(out.read_text())
        proc.kill()  # the worker, as ft_launcher kills a hung one
        proc.wait()
        deadline = time.monotonic() + 10
        alive = {writer, write}
        while alive and time.monotonic() < deadline:
            alive = {pid for pid in alive if _running(pid)}
            time.sleep(0.05)
        assert not alive, f"left behind: {alive} (writer {writer}, write {write})"
    finally:
        proc.kill()
        for pid in (locals().get("writer"), locals().get("write")):
            if isinstance(pid, int) and _running(pid):
                os.kill(pid, signal.SIGKILL)


def _running(pid: int) -> bool:
    """Alive and not a zombie (a reaped child's pid reads as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
