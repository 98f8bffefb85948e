"""Asynchronous DCP checkpoint saves through NVRx's async machinery, with an explicit CPU path.

What blocks training: copying the state into staging buffers that are allocated once (in shared
memory, pinned as well on CUDA) and reused, the DCP save plan (cached after the first save), and
handing the request to NVRx's persistent writer process. The writer process (an
``AsyncCallsQueue(persistent=True)`` worker, started when the checkpointer is bound to its first
process group, not at the first save) writes this rank's DCP shard with NVRx's
``FileSystemWriterAsync`` (fsync included) and digests it, while training goes on.

Why the explicit CPU path (NVRx 0.4.1 hard-codes CUDA in three places; no monkeypatching here):
- we never pass a ``preload_fn``: NVRx's preload calls ``torch.cuda.synchronize()``. Our own staging
  copy *is* the snapshot: on CPU "moving to CPU" is a no-op, so without it the writer would pickle
  the live parameters while ``optimizer.step()`` mutates them (corrupt checkpoints, measured).
- we always finalize NVRx calls with ``no_dist=True`` (its distributed check allocates on
  ``torch.cuda.current_device()``), and agree across ranks ourselves with a CPU all-reduce on a
  dedicated gloo group, then run the DCP finalize (gather write results, write ``.metadata``).
- a save that raises inside the writer would make NVRx's blocking finalize hang forever: we only
  poll without blocking and check that the writer process is alive; a dead or stuck writer
  raises instead of hanging.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.tensor import DTensor

from trainer import nvrx_compat
from trainer.manifest import write_digest_sidecar

log = logging.getLogger(__name__)


class CheckpointWriteError(RuntimeError):
    pass


class CheckpointWorkerDied(CheckpointWriteError):
    """The async writer process died: the save in flight is lost (the previous commit is not)."""


class CheckpointTimeout(CheckpointWriteError):
    pass


def _noop() -> None:
    """First request: makes the persistent worker start (and import torch) at init."""


def _write_shard(
    save_fn: Callable[..., None] | None,
    directory: str,
    rank: int,
    write_buckets: list[Any],
    results_queue: Any,
) -> None:
    """Runs in NVRx's persistent writer process: write this rank's files, then digest them."""
    if save_fn is not None:
        save_fn(rank, write_buckets, results_queue)
    try:
        files = [Path(bucket[0]) for bucket in write_buckets]
        write_digest_sidecar(Path(directory), rank, files)
    except OSError:
        # A failed write is reported by the DCP finalize from the results queue; without a
        # sidecar the commit simply has nothing to trust.
        pass


@dataclass
class _Pending:
    step: int
    directory: Path
    writer: Any
    metadata: Any
    dist_wrapper: Any
    started: float
    blocking_s: float
    locally_done: bool = False


@dataclass
class SaveResult:
    step: int
    directory: Path
    blocking_s: float
    total_s: float


class _Staging:
    """Buffers the size of this rank's state, allocated once and refilled on every save."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.key: tuple[Any, ...] | None = None
        self.buffers: list[torch.Tensor] = []
        self.reallocated = False

    @staticmethod
    def _leaves(obj: Any, out: list[torch.Tensor]) -> None:
        if isinstance(obj, torch.Tensor):
            out.append(obj)
        elif isinstance(obj, dict):
            for k in obj:
                _Staging._leaves(obj[k], out)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                _Staging._leaves(v, out)

    def _alloc(self, t: torch.Tensor) -> torch.Tensor:
        local = t.to_local() if isinstance(t, DTensor) else t
        buf = torch.empty(local.shape, dtype=local.dtype, device="cpu")
        # Shared memory: the writer process receives a handle, not a copy of the bytes.
        buf.share_memory_()
        if self.device.type == "cuda" and buf.numel() > 0:
            # Page-lock the shared buffer so the device-to-host copy runs at full speed.
            torch.cuda.cudart().cudaHostRegister(
                buf.data_ptr(), buf.numel() * buf.element_size(), 0
            )
        if isinstance(t, DTensor):
            return DTensor.from_local(
                buf, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride()
            )
        return buf

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        leaves: list[torch.Tensor] = []
        self._leaves(state_dict, leaves)
        key = tuple((tuple(t.shape), t.dtype, type(t)) for t in leaves)
        self.reallocated = key != self.key
        if self.reallocated:
            self.buffers = [self._alloc(t) for t in leaves]
            self.key = key
        it = iter(self.buffers)

        def fill(obj: Any) -> Any:
            if isinstance(obj, torch.Tensor):
                buf = next(it)
                src = obj.to_local() if isinstance(obj, DTensor) else obj
                dst = buf.to_local() if isinstance(buf, DTensor) else buf
                dst.copy_(src.detach(), non_blocking=self.device.type == "cuda")
                return buf
            if isinstance(obj, dict):
                return {k: fill(v) for k, v in obj.items()}
            if isinstance(obj, list):
                return [fill(v) for v in obj]
            if isinstance(obj, tuple):
                return tuple(fill(v) for v in obj)
            return obj

        staged = fill(state_dict)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return staged


class AsyncCheckpointer:
    """One per process; survives in-process restarts (re-``bind`` to each new process group)."""

    def __init__(self, *, device: torch.device, timeout_s: float = 300.0, cache_plan: bool = True):
        self.device = device
        self.timeout_s = timeout_s
        self.cache_plan = cache_plan
        self.staging = _Staging(device)
        self.queue: Any = None
        self.group: dist.ProcessGroup | None = None
        self.pending: _Pending | None = None
        self._md_cache: Any = None

    # -- lifecycle -----------------------------------------------------------------------------
    def bind(self, group: dist.ProcessGroup) -> None:
        """Attach to this restart iteration's checkpoint group; start the writer if needed."""
        self.group = group
        self._md_cache = nvrx_compat.new_metadata_cache() if self.cache_plan else None
        if self.queue is None or not self._worker_alive():
            self._reset_queue()
            self.queue = nvrx_compat.AsyncCallsQueue(persistent=True)
            nvrx_compat.warm_write_results_queue()
            self.queue.schedule_async_request(nvrx_compat.AsyncRequest(_noop, (), []))
            self.pending = None
            self._drain_local(time.monotonic() + self.timeout_s, what="writer start-up")

    def _worker_process(self) -> Any:
        caller = getattr(self.queue, "persistent_caller", None)
        return getattr(caller, "process", None)

    def writer_pid(self) -> int | None:
        proc = self._worker_process()
        return None if proc is None else proc.pid

    def _worker_alive(self) -> bool:
        proc = self._worker_process()
        return proc is not None and proc.is_alive()

    def _reset_queue(self) -> None:
        if self.queue is None:
            return
        proc = self._worker_process()
        if proc is not None:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
            # NVRx's caller.__del__ would put 'DONE' and join a queue nobody serves: disarm it.
            self.queue.persistent_caller.process = None
        self.queue.async_calls.clear()
        self.queue = None

    def close(self) -> None:
        """Idempotent. Waits for (and commits) a save in flight only if ``wait`` was called."""
        if self.queue is None:
            return
        if self.pending is None and self._worker_alive() and not self.queue.async_calls:
            self.queue.persistent_caller.close()  # 'DONE' -> clean exit of the writer
        else:
            self._reset_queue()
        self.queue = None

    # -- saving --------------------------------------------------------------------------------
    def save(self, state_dict: dict[str, Any], directory: Path, step: int) -> float:
        """Start an async save of this rank's shard; returns the seconds training was blocked.
        Every rank calls it; the previous save must have been finalized (``wait``/``poll``)."""
        assert self.group is not None, "bind() first"
        if self.pending is not None:
            raise CheckpointWriteError("previous save not finalized: call wait() first")
        t0 = time.perf_counter()
        staged = self.staging.stage(state_dict)
        if self.staging.reallocated and self.cache_plan:
            # NVRx reuses a validated cached plan without re-checking tensor sizes: a new state
            # layout must start a new cache.
            self._md_cache = nvrx_compat.new_metadata_cache()
        writer = nvrx_compat.FileSystemWriterAsync(str(directory), thread_count=1)
        writer, metadata, dist_wrapper = nvrx_compat.save_state_dict_async_plan(
            staged,
            writer,
            process_group=self.group,
            planner=DefaultSavePlanner(),
            enable_cache=self._md_cache is not None,
            metadata_cache=self._md_cache,
        )
        save_fn, _cuda_preload, args = writer.get_save_function_and_args()
        rank = dist.get_rank()
        buckets, results_queue = (args[1], args[2]) if args else ([], None)
        request = nvrx_compat.AsyncRequest(
            _write_shard, (save_fn, str(directory), rank, buckets, results_queue), []
        )
        self.queue.schedule_async_request(request)
        blocking = time.perf_counter() - t0
        self.pending = _Pending(step, Path(directory), writer, metadata, dist_wrapper, t0, blocking)
        return blocking

    def _drain_local(self, deadline: float, *, what: str) -> None:
        """Wait until this rank's writer has finished everything it was given."""
        while self.queue.get_num_unfinalized_calls():
            self.queue.maybe_finalize_async_calls(blocking=False, no_dist=True)
            if not self.queue.get_num_unfinalized_calls():
                break
            if not self._worker_alive():
                self._reset_queue()
                raise CheckpointWorkerDied(f"async checkpoint writer died during {what}")
            if time.monotonic() > deadline:
                self._reset_queue()
                raise CheckpointTimeout(f"async checkpoint writer did not finish {what} in time")
            time.sleep(0.005)

    def _locally_done(self) -> bool:
        assert self.pending is not None
        if not self.pending.locally_done:
            self.queue.maybe_finalize_async_calls(blocking=False, no_dist=True)
            self.pending.locally_done = self.queue.get_num_unfinalized_calls() == 0
        return self.pending.locally_done

    def poll(self, *, block: bool = False) -> SaveResult | None:
        """Every rank, every step: finalize the save in flight once all ranks' writers are done.

        Non-blocking by default (one tiny CPU all-reduce while a save is in flight). With
        ``block=True`` waits, bounded by ``timeout_s``; a dead writer on any rank raises on all.
        """
        if self.pending is None:
            return None
        deadline = time.monotonic() + self.timeout_s
        while True:
            done = self._locally_done()
            dead = not done and not self._worker_alive()
            flags = torch.tensor([0 if done else 1, 1 if dead else 0], dtype=torch.int64)
            dist.all_reduce(flags, group=self.group)
            if flags[1] > 0:
                self.pending = None
                self._reset_queue()
                raise CheckpointWorkerDied(
                    f"async checkpoint writer died on {int(flags[1])} rank(s); the save in flight "
                    "is lost, the last committed checkpoint is intact"
                )
            if flags[0] == 0:
                return self._finalize()
            if not block:
                return None
            if time.monotonic() > deadline:
                self.pending = None
                self._reset_queue()
                raise CheckpointTimeout(f"checkpoint write not done after {self.timeout_s} s")
            time.sleep(0.005)

    def wait(self) -> SaveResult | None:
        return self.poll(block=True)

    def _finalize(self) -> SaveResult:
        """DCP finalize on all ranks: gather write results, coordinator writes ``.metadata``."""
        p = self.pending
        assert p is not None
        self.pending = None
        try:
            results: Any = p.writer.retrieve_write_results()
        except Exception as e:  # reported through the gather so every rank fails together
            results = e
        gathered = p.dist_wrapper.gather_object(results)
        outcome: list[Any] = [""]
        if p.dist_wrapper.is_coordinator:
            failures = [r for r in gathered if isinstance(r, BaseException)]
            if failures:
                outcome[0] = f"{len(failures)} rank(s) failed to write: {failures[0]}"
            else:
                try:
                    p.writer.finish(p.metadata, gathered)
                except Exception as e:
                    outcome[0] = f"writing DCP metadata failed: {e}"
        dist.broadcast_object_list(
            outcome, group_src=p.dist_wrapper.coordinator_rank, group=self.group
        )
        if outcome[0]:
            raise CheckpointWriteError(f"checkpoint step {p.step} in {p.directory}: {outcome[0]}")
        return SaveResult(p.step, p.directory, p.blocking_s, time.perf_counter() - p.started)

    def abandon(self) -> None:
        """After a fault (no collectives possible): let this rank's writer finish whatever it is
        writing, then forget the save; it never commits, and its ``.partial`` is removed later."""
        if self.queue is None:
            self.pending = None
            return
        try:
            self._drain_local(time.monotonic() + self.timeout_s, what="the abandoned save")
        except CheckpointWriteError as e:
            log.warning("%s; writer restarted on the next bind", e)
        self.pending = None
