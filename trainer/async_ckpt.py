"""Asynchronous DCP checkpoint saves through NVRx's async machinery, with an explicit CPU path.

A save takes a snapshot of this rank's state into CPU staging buffers, plans the DCP save, and
hands the write to NVRx's persistent writer process (an ``AsyncCallsQueue(persistent=True)``
worker). On CPU the worker forks it, and NVRx's results-queue Manager, at its start, before any
other thread runs (``start(fork=True)``, see ``nvrx_compat.start_persistent_writer``): ready at
once, with nothing to import. Where that cannot be (CUDA, threads already running) it is spawned
by ``ensure_started()`` after the first training step and never waited for: its interpreter's
start-up overlaps training, not the restart's model build and load. The writer writes this
rank's DCP shard with NVRx's ``FileSystemWriterAsync`` (fsync included) and digests it while
training goes on. ``poll()`` (every step, every rank) finalizes the save once every rank's writer
is done: the write results are gathered on the training thread (one small collective), and the
coordinator writes DCP's ``.metadata`` and runs the caller's commit (``poll(commit=...)``: the
manifest, fsyncs, rename, prune) on a persistent commit thread of its own, while training goes
on. A later ``poll`` learns from every rank's flags whether that commit is done and whether it
failed, and returns the ``SaveResult`` only then: a result means committed.

Staging buffers: one CPU tensor per state tensor, allocated once (in shared memory, so the writer
process receives a handle, not the bytes; page-locked once as well when the source is on CUDA)
and refilled on every save while the state layout is unchanged. A ``DTensor`` is staged as
``DTensor(cpu_buffer, source._spec)``: same global shape, placements and mesh (so the DCP planner
makes the same plan, and the cached plan stays valid), but its local tensor stays on the CPU.

What blocks training, and what overlaps:

- **CPU** (``device.type == "cpu"``): ``save()`` blocks for the staging copy (synchronous; it is
  required: "moving to CPU" is a no-op for CPU tensors, so without it the writer would read the
  live parameters while ``optimizer.step()`` mutates them: measured corrupt checkpoints), the DCP
  plan (cached after the first save) and the hand-off of the request to the writer. The file
  writes, fsync and digests overlap training. ``before_optimizer_step()`` is a no-op.
- **CUDA**: ``save()`` blocks only while the device-to-host copies are *enqueued* on a side CUDA
  stream (which first waits on the current stream, so it copies the state as of the finished
  optimizer step), a ``torch.cuda.Event`` is recorded behind them, and the DCP plan is made; no
  ``torch.cuda.synchronize()``. The copy overlaps the next step's forward and backward. Before
  the next ``optimizer.step()`` (which mutates the parameters and optimizer state being copied)
  the training loop calls ``before_optimizer_step()``: it makes the current stream wait on that
  event (a GPU-side wait; the host does not block) and, if the copy has already completed, hands
  the write request to the writer. Otherwise the request is handed over by the first ``poll()``
  that sees the event completed (the writer must never read a buffer the copy is still filling).
  As a safety net the checkpointer also registers a global optimizer step pre-hook while a copy
  is in flight (``torch.optim.optimizer.register_optimizer_step_pre_hook``) that calls
  ``before_optimizer_step()``; any *other* in-place change of parameters or optimizer state
  between ``save()`` and the next optimizer step must call ``before_optimizer_step()`` first.
  The writes overlap training as on CPU. ``poll(block=True)``/``wait()`` wait for the copy on the
  host first.

Why the explicit CPU path (NVRx 0.4.1 hard-codes CUDA in three places; no monkeypatching here):
- we never pass a ``preload_fn``: NVRx's preload calls ``torch.cuda.synchronize()``; our own
  staging copy *is* the snapshot, and its buffers are CPU tensors as the writer asserts.
- we always finalize NVRx calls with ``no_dist=True`` (its distributed check allocates on
  ``torch.cuda.current_device()``), and agree across ranks ourselves with a CPU all-reduce on a
  dedicated gloo group, then run the DCP finalize (gather write results, write ``.metadata``).
- a save that raises inside the writer would make NVRx's blocking finalize hang forever: we only
  poll without blocking and check that the writer process is alive; a dead or stuck writer
  raises instead of hanging.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed._state_dict_utils import (
    _copy_state_dict,
    _identity_func,
    _iterate_state_dict,
)
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from trainer import nvrx_compat
from trainer.errors import TrainerError
from trainer.manifest import write_digest_sidecar

log = logging.getLogger(__name__)


WARMUP_STEP = -1  # the step of the writer's warm-up write (never committed)


class CheckpointWriteError(TrainerError, RuntimeError):
    pass


class CheckpointWorkerDied(CheckpointWriteError):
    """The async writer process died: the save in flight is lost (the previous commit is not)."""


class CheckpointTimeout(CheckpointWriteError):
    pass


class CheckpointCommitError(CheckpointWriteError):
    """The coordinator's commit of a written save failed for a reason that is not the storage's
    (a bug, a refused manifest): every rank raises it; the last commit stays valid."""


class CheckpointStorageError(CheckpointWriteError):
    """A rank's write (or the DCP ``.metadata``) failed, e.g. ENOSPC: the storage refused this
    save. Raised on every rank; the save in flight is lost, the last commit is not."""

    def __init__(self, message: str, *, step: int, directory: Path) -> None:
        super().__init__(message)
        self.step = step
        self.directory = directory


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


def _write_metadata_then(
    writer: Any, metadata: Any, gathered: list[Any], task: CommitTask, *, step: int, directory: Path
) -> Any:
    """The commit thread: DCP finalize's second half (the coordinator writes ``.metadata``),
    then the caller's commit. A failed ``.metadata`` is the storage's failure, as is an
    ``OSError`` of the commit (a full disk)."""
    try:
        writer.finish(metadata, gathered)
    except Exception as e:
        raise CheckpointStorageError(
            f"writing DCP metadata failed: {e}", step=step, directory=directory
        ) from e
    return task()


def _remover(directory: Path) -> CommitTask:
    def remove() -> None:
        shutil.rmtree(directory, ignore_errors=True)

    return remove


def _nothing() -> None:
    return None


@dataclass
class _Pending:
    step: int
    directory: Path
    writer: Any
    metadata: Any
    dist_wrapper: Any
    started: float
    blocking_s: float
    # The write request, until it is handed to the writer (CUDA: once the copy has completed).
    request: Any = None
    # The source state, kept alive until the device-to-host copy has completed: the caching
    # allocator must not hand its memory to anything else while the side stream reads it.
    sources: Any = None
    # Training-thread seconds spent on this save after ``save()`` returned (deferred hand-off).
    deferred_s: float = 0.0
    locally_done: bool = False


@dataclass
class SaveResult:
    step: int
    directory: Path
    # Seconds the training thread spent on this save: ``save()`` plus any deferred hand-off.
    blocking_s: float
    # From ``save()`` until every rank's writer was done (the commit follows on its thread).
    total_s: float
    deferred_s: float = 0.0
    # On the coordinator, what the commit returned (the committed directory); None elsewhere.
    committed: Any = None


# The coordinator's commit of one save, run on the commit thread: built on the training thread
# from the finalized save, it must hold no process group (see ``trainer.gloo_release``).
CommitTask = Callable[[], Any]
CommitFor = Callable[[SaveResult], CommitTask]


@dataclass
class _Committing:
    """A finalized save whose commit runs on the coordinator's commit thread (every rank holds
    one, so that every rank polls for its outcome; only the coordinator has the future)."""

    result: SaveResult
    coordinator_rank: int
    future: Future[Any] | None = None


class _SyncCopy:
    """CPU: the staging copy runs on the calling thread and is complete when ``copy_`` returns,
    so nothing is ever in flight and every method is a no-op."""

    non_blocking = False

    @contextlib.contextmanager
    def copying(self) -> Iterator[None]:
        yield

    @property
    def in_flight(self) -> bool:
        return False

    def query(self) -> bool:
        """Whether the last copy has completed (and forget it if so)."""
        return True

    def order_current_stream(self) -> None:
        """Make work queued after this call on the current stream run after the copy."""

    def synchronize(self) -> None:
        """Block the host until the copy has completed."""


class _CudaSideStreamCopy(_SyncCopy):
    """CUDA: device-to-host copies on a side stream that first waits on the current stream (so
    it sees the finished optimizer step); an event recorded behind them tells when they are
    done. Nothing here synchronizes the device."""

    non_blocking = True

    def __init__(self, device: torch.device) -> None:
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        # Created on the training thread after its current stream is set up (as DCP's
        # DefaultStager does), never the default stream.
        self.stream = torch.cuda.Stream(device=device)
        self.event: torch.cuda.Event | None = None

    @contextlib.contextmanager
    def copying(self) -> Iterator[None]:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        try:
            with torch.cuda.stream(self.stream):
                yield
        finally:  # even after a failed copy: whatever was enqueued must be waited for
            event = torch.cuda.Event()
            event.record(self.stream)
            self.event = event

    @property
    def in_flight(self) -> bool:
        return self.event is not None

    def query(self) -> bool:
        if self.event is None:
            return True
        if self.event.query():
            self.event = None
            return True
        return False

    def order_current_stream(self) -> None:
        if self.event is not None:
            torch.cuda.current_stream(self.device).wait_event(self.event)

    def synchronize(self) -> None:
        if self.event is not None:
            self.event.synchronize()
            self.event = None


def _make_copier(device: torch.device) -> _SyncCopy:
    return _CudaSideStreamCopy(device) if device.type == "cuda" else _SyncCopy()


def _signature(obj: Any) -> Any:
    """The state layout that the staging buffers (and the cached DCP plan) depend on: structure,
    and per tensor its local shape, dtype, device type and, for a DTensor, its global shape and
    placements. Values of non-tensor entries (a learning rate) are not part of it."""
    if isinstance(obj, ShardedTensor):
        raise TypeError("ShardedTensor (FSDP1) state is not supported: use FSDP2 (DTensor)")
    if isinstance(obj, DTensor):
        local = obj._local_tensor
        return (
            "D",
            tuple(local.shape),
            local.dtype,
            local.device.type,
            tuple(obj.shape),
            tuple(obj.placements),
        )
    if isinstance(obj, torch.Tensor):
        return ("T", tuple(obj.shape), obj.dtype, obj.device.type)
    if isinstance(obj, dict):
        return ("{", tuple((k, _signature(v)) for k, v in obj.items()))
    if isinstance(obj, (list, tuple)):
        return ("[" if isinstance(obj, list) else "(", tuple(_signature(v) for v in obj))
    return type(obj).__name__


class _Staging:
    """CPU buffers the size of this rank's state, allocated once and refilled on every save.

    Built with torch's own state-dict helpers (``torch.distributed._state_dict_utils``):
    ``_iterate_state_dict`` to build the staged state around the buffers, ``_copy_state_dict`` to
    fill them. Not ``_create_cpu_state_dict``: it gives 0-dim tensors a buffer that is neither
    shared nor pinned (on CUDA a copy into pageable memory makes the host wait for the stream)
    and returns a 0-dim DTensor itself, i.e. the live device tensor.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.key: Any = None
        self.buffers: list[torch.Tensor] = []  # local CPU tensors, in traversal order
        self.reallocated = False
        self._copier: _SyncCopy | None = None

    @property
    def copier(self) -> _SyncCopy:
        if self._copier is None:
            self._copier = _make_copier(self.device)
        return self._copier

    @staticmethod
    def _alloc(src: torch.Tensor) -> torch.Tensor:
        buf = torch.empty(tuple(src.shape), dtype=src.dtype, device="cpu")
        # Shared memory: the writer process receives a handle, not a copy of the bytes.
        buf.share_memory_()
        nbytes = buf.numel() * buf.element_size()
        if src.device.type == "cuda" and nbytes > 0:
            # Page-lock the shared buffer once (cudaHostRegister, as torch's own
            # _create_cpu_state_dict(pin_memory=True, share_memory=True) does) so the
            # device-to-host copy is truly asynchronous and runs at full speed.
            from torch.cuda import _pin_memory_utils

            _pin_memory_utils.pin_memory(buf.data_ptr(), nbytes)
            weakref.finalize(buf, _pin_memory_utils.unpin_memory, buf.data_ptr())
        return buf

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Copy ``state_dict`` into the buffers; returns the staged state (CPU tensors only).

        On CUDA the copy may still be in flight when this returns (see ``copier``)."""
        key = _signature(state_dict)
        self.reallocated = key != self.key
        if self.reallocated:
            self.key = None
            self.buffers = []
        reuse = iter(self.buffers)
        fresh: list[torch.Tensor] = []

        def buffer_for(local: torch.Tensor) -> torch.Tensor:
            if self.reallocated:
                buf = self._alloc(local)
                fresh.append(buf)
                return buf
            return next(reuse)

        def tensor_func(obj: torch.Tensor, _pg: Any, _device: Any, _c: Any) -> torch.Tensor:
            return buffer_for(obj)

        def dtensor_func(obj: DTensor, _pg: Any, _device: Any, _c: Any) -> DTensor:
            # Same spec (mesh, placements, global shape and stride), CPU local tensor. Never
            # DTensor.from_local(buf, mesh): that moves the buffer to the mesh's device.
            return DTensor(buffer_for(obj._local_tensor), obj._spec, requires_grad=False)

        with torch.no_grad():
            target = _iterate_state_dict(
                state_dict, _identity_func, dtensor_func, tensor_func, type_check=False
            )
            if self.reallocated:
                self.buffers = fresh
                self.key = key
            with self.copier.copying():
                staged = _copy_state_dict(
                    state_dict, target, non_blocking=self.copier.non_blocking, type_check=False
                )
        return staged


class AsyncCheckpointer:
    """One per process; survives in-process restarts (re-``bind`` to each new process group).

    Per save, every rank: ``save()`` after an optimizer step; ``before_optimizer_step()`` right
    before the next ``optimizer.step()`` (a no-op on CPU); ``poll()`` every step until it returns
    the ``SaveResult`` (or ``wait()``). See the module docstring for what blocks on CPU and CUDA.
    """

    def __init__(self, *, device: torch.device, timeout_s: float = 300.0, cache_plan: bool = True):
        self.device = device
        self.timeout_s = timeout_s
        self.cache_plan = cache_plan
        self.staging = _Staging(device)
        self.queue: Any = None
        self.group: dist.ProcessGroup | None = None
        self.pending: _Pending | None = None
        self._md_cache: Any = None
        self._step_hook: Any = None
        self._results_queue_thread: threading.Thread | None = None
        # When the current writer was started and when it first answered (time.time()).
        self.writer_started_at: float | None = None
        self.writer_ready_at: float | None = None
        self.writer_start_method: str | None = None  # "fork" or "spawn"
        self._warmed = False  # the current writer has written once (warm-up or a save)
        self._ready_taken = False
        self.committing: _Committing | None = None
        self._commit_thread: ThreadPoolExecutor | None = None

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self, *, rank: int = 0, fork: bool = False) -> bool:
        """Start the writer process now without waiting for it; whether a new one was started.

        ``fork``: fork this process instead (the caller's word that no other thread runs yet and
        CUDA is not in use: the worker's start on CPU), and NVRx's results-queue Manager with it;
        both are ready at once. Otherwise, as follows.

        The writer is a spawned interpreter that imports torch (~1–2 s here), and NVRx's
        results-queue Manager another (light when the worker runs as ``-m trainer``). Started
        once training runs (``ensure_started``), their start-up overlaps the steps before the
        first save instead of the restart's model build and load (measured: the build took
        1.0–1.4 s beside them, 0.7 s without, on 2 cores); the first ``poll`` that finds the
        writer's no-op done records ``writer_ready_at``. Idempotent while the writer lives
        (``bind`` calls it, at a restart, to replace a writer that died)."""
        if self.queue is not None and self._worker_alive():
            return False
        self._reset_queue()
        self._forget_pending()
        if fork:  # before the writer: its queue's feeder thread starts with the first request
            nvrx_compat.fork_write_results_queue()
        self.queue = nvrx_compat.AsyncCallsQueue(persistent=True)
        self.writer_start_method = nvrx_compat.start_persistent_writer(
            self.queue, nvrx_compat.AsyncRequest(_noop, (), []), rank=rank, fork=fork
        )
        self.writer_started_at, self.writer_ready_at = time.time(), None
        self._warmed = self._ready_taken = False
        if self._results_queue_thread is None and not nvrx_compat.write_results_queue_ready():
            self._results_queue_thread = threading.Thread(
                target=nvrx_compat.warm_write_results_queue, name="nvrx-results-queue", daemon=True
            )
            self._results_queue_thread.start()
        return True

    def ensure_started(self, *, rank: int = 0) -> None:
        """Start the first writer if none was started yet (cheap: called every step). A writer
        that died is replaced only by ``bind``, at a restart: mid-run its save is still being
        agreed on by every rank, and that agreement reports the death."""
        if self.queue is None:
            self.start(rank=rank)

    def _results_queue_ready(self) -> None:
        """No save may plan before the Manager exists (NVRx would start a second one)."""
        if self._results_queue_thread is not None:
            self._results_queue_thread.join()

    def take_ready(self) -> float | None:
        """Seconds the current writer took from ``start`` to ready, once per writer (then
        None): for the ``writer_ready`` phase event."""
        if self.writer_ready_at is None or self.writer_started_at is None or self._ready_taken:
            return None
        self._ready_taken = True
        return self.writer_ready_at - self.writer_started_at

    def _note_ready(self) -> None:
        """Record when the writer has done everything it was given so far (its start-up no-op,
        the warm-up write): from then on a save's write starts at once."""
        if self.writer_ready_at is None and self.queue is not None:
            self.queue.maybe_finalize_async_calls(blocking=False, no_dist=True)
            if not self.queue.get_num_unfinalized_calls():
                self.writer_ready_at = time.time()

    def bind(self, group: dist.ProcessGroup, *, warmup_dir: Path | None = None) -> None:
        """Attach to this restart iteration's checkpoint group; replace the writer if one was
        started and has died (never waits for it: see ``start``).

        With ``warmup_dir`` (every rank the same directory, or None on every rank), a writer
        replaced here also writes a one-element checkpoint there in the background: the first
        write of a fresh writer costs ~0.6 s more than later ones (measured on CPU, whatever the
        state's size), and that would otherwise delay the commit of the next checkpoint. The
        warm-up is finalized by the normal ``poll`` and never reported as a save."""
        self.group = group
        self._md_cache = nvrx_compat.new_metadata_cache() if self.cache_plan else None
        self._settle_quietly()  # a resume must not read the checkpoints while one commits
        if self.queue is not None:
            self.start(rank=dist.get_rank())
        if warmup_dir is not None:
            # Collective: a save plans across ranks, so all warm up if any rank's writer is new,
            # and only if every rank's results queue is up already: a save plans only after it
            # is, and waiting for it here would block the worker's start-up. Skipped (always
            # for a process's first writer, which starts after the first step), the first real
            # save's write pays the fresh writer's extra cost instead (in the background).
            waiting = self.queue is None or not nvrx_compat.write_results_queue_ready()
            flags = torch.tensor([0 if self._warmed else 1, 1 if waiting else 0])
            dist.all_reduce(flags, group=group)
            if int(flags[0]) > 0 and int(flags[1]) == 0:
                self._warm_up(Path(warmup_dir))

    def _warm_up(self, directory: Path) -> None:
        if dist.get_rank(self.group) == 0:
            shutil.rmtree(directory, ignore_errors=True)
            directory.mkdir(parents=True)
        dist.barrier(group=self.group)
        self.save({"writer_warmup": torch.zeros(1)}, directory, WARMUP_STEP)

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
        """Idempotent. Waits for (and commits) a save in flight only if ``wait`` was called; a
        commit already running on the commit thread is let finish (nothing half-done is left
        that a reader could trust either way, but a finished commit is not lost work)."""
        self._wait_copy_quietly()
        self._remove_step_hook()
        self._settle_quietly()
        if self._commit_thread is not None:
            self._commit_thread.shutdown(wait=True)
            self._commit_thread = None
        if self._results_queue_thread is not None:
            # A Manager still starting has no exit finalizer yet: the interpreter's exit would
            # wait for its process forever (a worker that fails in its first second).
            self._results_queue_thread.join(timeout=60)
            self._results_queue_thread = None
        if self.queue is None:
            return
        # Killed, not asked to exit ('DONE' and a join waited ~0.7 s for the writer's
        # interpreter to wind down, at the end of every worker): it writes nothing once every
        # call is finalized, and a save still in flight is abandoned either way. The same for
        # NVRx's results-queue Manager (its exit finalizer waited ~1 s).
        self._reset_queue()
        nvrx_compat.stop_write_results_queue()

    # -- saving --------------------------------------------------------------------------------
    def save(self, state_dict: dict[str, Any], directory: Path, step: int) -> float:
        """Start an async save of this rank's shard; returns the seconds training was blocked.
        Every rank calls it; the previous save must have been finalized (``wait``/``poll``).

        On CUDA the device-to-host copy may still be running when this returns: call
        ``before_optimizer_step()`` before anything modifies the state in place."""
        assert self.group is not None, "bind() first"
        if self.pending is not None:
            raise CheckpointWriteError("previous save not finalized: call wait() first")
        self.ensure_started(rank=dist.get_rank())
        t0 = time.perf_counter()
        try:
            request, writer, metadata, dist_wrapper = self._stage_and_plan(state_dict, directory)
        except BaseException:
            self.staging.copier.synchronize()  # nothing may still be copying into the buffers
            raise
        self.pending = _Pending(
            step,
            Path(directory),
            writer,
            metadata,
            dist_wrapper,
            t0,
            0.0,
            request=request,
            sources=state_dict,
        )
        if self.staging.copier.query():  # CPU: always (the copy is synchronous)
            self._hand_off()
        else:
            self._install_step_hook()
        blocking = time.perf_counter() - t0
        self.pending.blocking_s = blocking
        self._warmed = True
        return blocking

    def _stage_and_plan(self, state_dict: dict[str, Any], directory: Path) -> tuple[Any, ...]:
        self._results_queue_ready()
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
        return request, writer, metadata, dist_wrapper

    def before_optimizer_step(self) -> None:
        """Call right before every ``optimizer.step()`` (all ranks; cheap when idle).

        While a device-to-host copy of the last ``save()`` is in flight (CUDA only), makes the
        current CUDA stream wait for it, so the step cannot modify what is still being copied
        (a GPU-side wait: the host does not block), and hands the write to the writer process
        if the copy has already completed (otherwise the next ``poll()`` does). A no-op on CPU
        and when no copy is pending."""
        p = self.pending
        if p is None or p.request is None:
            return
        t0 = time.perf_counter()
        copier = self.staging.copier
        copier.order_current_stream()
        if copier.query():
            self._hand_off()
        p.deferred_s += time.perf_counter() - t0

    def _hand_off(self) -> None:
        """Give the write request to the writer process; the staging copy must be complete."""
        p = self.pending
        assert p is not None and p.request is not None
        request, p.request, p.sources = p.request, None, None
        self._remove_step_hook()
        self.queue.schedule_async_request(request)

    def _try_hand_off(self, *, block: bool) -> bool:
        """Hand the pending request over once its copy is complete; whether it has been."""
        p = self.pending
        assert p is not None
        if p.request is None:
            return True
        copier = self.staging.copier
        if block:
            t0 = time.perf_counter()
            copier.synchronize()
            self._hand_off()
            p.deferred_s += time.perf_counter() - t0
            return True
        if copier.query():
            t0 = time.perf_counter()
            self._hand_off()
            p.deferred_s += time.perf_counter() - t0
            return True
        return False

    def _install_step_hook(self) -> None:
        """Safety net while a copy is in flight: every optimizer's ``step()`` first calls
        ``before_optimizer_step()`` (torch's global optimizer step pre-hook)."""
        if self._step_hook is None:
            ref = weakref.ref(self)

            def hook(_optimizer: Any, _args: Any, _kwargs: Any) -> None:
                saver = ref()
                if saver is not None:
                    saver.before_optimizer_step()

            self._step_hook = register_optimizer_step_pre_hook(hook)

    def _remove_step_hook(self) -> None:
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None

    def _wait_copy_quietly(self) -> None:
        """Before forgetting a save whose copy may be in flight (fault paths): let the copy end
        so no stream still reads the sources or writes the buffers."""
        if self.pending is None or self.pending.request is None:
            return
        try:
            self.staging.copier.synchronize()
        except Exception as e:  # a failed device: nothing to protect any more
            log.warning("waiting for the staging copy failed: %s", e)
        self.pending.request = None
        self.pending.sources = None

    def _forget_pending(self) -> None:
        self._wait_copy_quietly()
        self._remove_step_hook()
        self.pending = None
        self._discard_results()

    def _discard_results(self) -> None:
        """A forgotten save's write results must not become the next save's (see
        ``nvrx_compat.discard_write_results``)."""
        dropped = nvrx_compat.discard_write_results()
        if dropped:
            log.info("discarded %d write result(s) of a save that will not commit", dropped)

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

    def _locally_done(self, *, block: bool) -> bool:
        assert self.pending is not None
        if not self.pending.locally_done:
            if not self._try_hand_off(block=block):
                return False
            self.queue.maybe_finalize_async_calls(blocking=False, no_dist=True)
            self.pending.locally_done = self.queue.get_num_unfinalized_calls() == 0
            if self.pending.locally_done and self.writer_ready_at is None:
                self.writer_ready_at = time.time()
        return self.pending.locally_done

    def local_flags(self) -> torch.Tensor:
        """This rank's share of the next ``poll``'s agreement, ``[not done, writer dead, commit
        running, commit failed]`` (float, zeros when nothing is pending; the commit flags only
        on the coordinator): the loop sums it with the loss in its own all-reduce and hands the
        sums to ``poll(reduced=...)``, so a save in flight costs the step no collective of its
        own."""
        flags = torch.zeros(4)
        if self.pending is not None:
            done = self._locally_done(block=False)
            flags[0] = 0.0 if done else 1.0
            flags[1] = 1.0 if not done and not self._worker_alive() else 0.0
        c = self.committing
        if c is not None and c.future is not None:
            finished = c.future.done()  # one look: running and failed must agree
            flags[2] = 0.0 if finished else 1.0
            flags[3] = 1.0 if finished and c.future.exception() is not None else 0.0
        return flags

    def poll(
        self,
        *,
        block: bool = False,
        section: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext,
        reduced: torch.Tensor | None = None,
        progress: Callable[[], None] | None = None,
        commit: CommitFor | None = None,
    ) -> SaveResult | None:
        """Every rank, every step: finalize the save in flight once all ranks' writers are done,
        and return its ``SaveResult`` once the coordinator's commit of it is done.

        ``commit(result)`` (the coordinator's; the same call on every rank) builds what the
        commit thread runs after writing DCP's ``.metadata``; its return value comes back as
        ``SaveResult.committed``. Non-blocking by default (one tiny CPU all-reduce while a save
        or a commit is in flight, none with ``reduced``; on CUDA it also hands the write to the
        writer once the staging copy has completed). With ``block=True`` waits (for the copy,
        the writers, then the commit), bounded by ``timeout_s``, calling ``progress`` between
        rounds (a wait for a slow write is not a stalled step: the checkpoint section's timeout
        bounds it instead); a dead writer or a failed commit on any rank raises on all.
        """
        if self.pending is None and self.committing is None:
            self._note_ready()
            return None
        deadline = time.monotonic() + self.timeout_s
        while True:
            if reduced is not None and not block:
                # Every rank's local_flags(), summed by the caller's collective: the same
                # decision on every rank without one of ours.
                flags = reduced.to(torch.int64)
                reduced = None
            else:
                if block and self.pending is not None:
                    self._locally_done(block=True)  # CUDA: wait for the copy and hand it over
                flags = self.local_flags().to(torch.int64)
                dist.all_reduce(flags, group=self.group)
            if self.committing is not None and flags[2] == 0:
                return self._settle(failed=bool(flags[3] > 0))
            if self.pending is not None:
                if flags[1] > 0:
                    self._forget_pending()
                    self._reset_queue()
                    raise CheckpointWorkerDied(
                        f"async checkpoint writer died on {int(flags[1])} rank(s); the save in "
                        "flight is lost, the last committed checkpoint is intact"
                    )
                if flags[0] == 0:
                    with section():  # the gather of write results: storage-bound collective
                        self._finalize(commit)
                    if not block:
                        return None  # the commit thread has it; a later poll collects it
                    continue  # block: the commit's outcome is agreed on by the next rounds
            if not block:
                return None
            if time.monotonic() > deadline:
                if self.pending is None and self.committing is not None:
                    # The storage is stuck under the commit thread; the restart this error
                    # leads to waits for it once more (abandon), then resumes from the disk.
                    raise CheckpointTimeout(
                        f"commit of step {self.committing.result.step} not done after "
                        f"{self.timeout_s} s"
                    )
                self._forget_pending()
                self._reset_queue()
                raise CheckpointTimeout(f"checkpoint write not done after {self.timeout_s} s")
            if progress is not None:
                progress()
            time.sleep(0.005)

    def wait(
        self,
        section: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext,
        commit: CommitFor | None = None,
    ) -> SaveResult | None:
        return self.poll(block=True, section=section, commit=commit)

    def _finalize(self, commit: CommitFor | None) -> None:
        """DCP finalize, first half, on all ranks: gather the write results; a rank's failed
        write fails every rank now. The second half, the coordinator's ``.metadata`` and the
        commit, goes to the commit thread (``self.committing``)."""
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
        coordinator = p.dist_wrapper.coordinator_rank
        dist.broadcast_object_list(outcome, group_src=coordinator, group=self.group)
        if outcome[0]:
            raise CheckpointStorageError(
                f"checkpoint step {p.step} in {p.directory}: {outcome[0]}",
                step=p.step,
                directory=p.directory,
            )
        result = SaveResult(
            p.step,
            p.directory,
            p.blocking_s + p.deferred_s,
            time.perf_counter() - p.started,
            p.deferred_s,
        )
        self.committing = _Committing(result, coordinator)
        if p.dist_wrapper.is_coordinator:
            if p.step == WARMUP_STEP:  # nothing to commit: the warm-up's files go
                task: CommitTask = _remover(p.directory)
            else:
                task = commit(result) if commit is not None else _nothing
            if self._commit_thread is None:
                self._commit_thread = ThreadPoolExecutor(1, thread_name_prefix="nvrx-commit")
            self.committing.future = self._commit_thread.submit(
                _write_metadata_then,
                p.writer,
                p.metadata,
                gathered,
                task,
                step=p.step,
                directory=p.directory,
            )

    def _settle(self, *, failed: bool) -> SaveResult | None:
        """Every rank, once the coordinator's commit is over (the flags say so on every rank):
        its result, or the same error on every rank."""
        c = self.committing
        assert c is not None
        self.committing = None
        step, directory = c.result.step, c.result.directory
        if failed:
            error = c.future.exception() if c.future is not None else None
            message: list[Any] = [None]
            if error is not None:
                storage = isinstance(error, (OSError, CheckpointStorageError))
                message[0] = (storage, f"{type(error).__name__}: {error}")
            dist.broadcast_object_list(message, group_src=c.coordinator_rank, group=self.group)
            storage, text = message[0]
            if storage:
                raise CheckpointStorageError(
                    f"checkpoint step {step} in {directory}: {text}", step=step, directory=directory
                ) from error
            if error is not None:
                raise error
            raise CheckpointCommitError(f"the coordinator could not commit step {step}: {text}")
        if step == WARMUP_STEP:
            return None
        if c.future is not None:
            c.result.committed = c.future.result()
        return c.result

    def _settle_quietly(self) -> None:
        """Fault paths (no collectives): let a running commit finish, and forget it; whether it
        committed is for the next resume to find on disk."""
        c, self.committing = self.committing, None
        if c is None or c.future is None:
            return
        try:
            c.future.result(timeout=self.timeout_s)
        except FutureTimeout:
            log.warning("commit of step %d not done after %s s", c.result.step, self.timeout_s)
        except Exception as e:
            log.warning("the commit of step %d failed: %s", c.result.step, e)

    def drop_group(self) -> None:
        """After a fault, before ``abandon``: forget this iteration's checkpoint group, so that
        nothing here keeps its gloo connections open (see ``trainer.gloo_release``). The save in
        flight, if any, can only be abandoned from now on."""
        self.group = None
        self._md_cache = None
        if self.pending is not None:
            self.pending.dist_wrapper = None

    def abandon(self) -> None:
        """After a fault (no collectives possible): let this rank's writer finish whatever it is
        writing, then forget the save and its write results; it never commits, and its
        ``.partial`` is removed later. A write whose staging copy had not completed is never
        handed to the writer."""
        self._wait_copy_quietly()
        self._remove_step_hook()
        self._settle_quietly()
        if self.queue is not None:
            try:
                self._drain_local(time.monotonic() + self.timeout_s, what="the abandoned save")
            except CheckpointWriteError as e:
                log.warning("%s; writer restarted on the next bind", e)
        self.pending = None
        # After the drain: the writer has put everything it will put.
        self._discard_results()
