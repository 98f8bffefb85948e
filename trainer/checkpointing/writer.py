"""NVRx's persistent writer process, one per training process: its lifecycle and what runs in it.

An ``AsyncCallsQueue(persistent=True)`` worker that writes the rank's DCP shard with NVRx's
``FileSystemWriterAsync`` (fsync included), digesting the bytes as they are written, while
training goes on. On CPU the training process forks it, and NVRx's results-queue Manager, before
any other thread runs (``start(fork=True)``): ready at once. Otherwise (CUDA, threads running) it
is spawned once training runs and never waited for: its start-up (~1–2 s of importing torch)
overlaps training, not the restart's build and load (the build took 1.0–1.4 s beside it, 0.7 s
without, on 2 cores). A dead writer is replaced only at a restart's ``bind`` (mid-run the ranks'
agreement reports it), and NVRx's blocking finalize is never used: the caller polls
(:meth:`~PersistentWriter.finished_all`) and checks :meth:`~PersistentWriter.alive`.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainer import nvrx_compat
from trainer.checkpointing import shard_digest
from trainer.checkpointing.errors import CheckpointTimeout, CheckpointWorkerDied
from trainer.checkpointing.manifest import write_digest_sidecar


def noop() -> None:
    """First request: makes the persistent worker start (and import torch) at once."""


def write_shard(
    save_fn: Callable[..., None] | None,
    directory: str,
    rank: int,
    write_buckets: list[Any],
    results_queue: Any,
) -> None:
    """In the writer process: write this rank's files, digesting them as they are written
    (:mod:`~trainer.checkpointing.shard_digest`), then list them in the rank's sidecar."""
    files = [Path(bucket[0]) for bucket in write_buckets]
    with shard_digest.capture(files) as captured:
        if save_fn is not None:
            save_fn(rank, write_buckets, results_queue)
        streamed = captured.streamed()
    # A failed write is reported by the DCP finalize from the results queue; without a sidecar
    # the commit hashes the files itself.
    with contextlib.suppress(OSError):
        write_digest_sidecar(Path(directory), rank, files, streamed=streamed)


def plan_write(
    staged: dict[str, Any], directory: Path, group: Any, md_cache: Any
) -> tuple[Any, Any, Any, Any]:
    """DCP's save plan of a staged state (across ``group``; ``md_cache``: NVRx's cached plan,
    or None) and the writer process's request: (request, writer, metadata, dist_wrapper)."""
    # Here, not at the top: the writer process imports this module and needs neither.
    import torch.distributed as dist
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    writer = nvrx_compat.FileSystemWriterAsync(str(directory), thread_count=1)
    shard_digest.install(writer)  # the shard's digest taken as it is written, not re-read
    writer, metadata, dist_wrapper = nvrx_compat.save_state_dict_async_plan(
        staged,
        writer,
        process_group=group,
        planner=DefaultSavePlanner(),
        enable_cache=md_cache is not None,
        metadata_cache=md_cache,
    )
    save_fn, _cuda_preload, args = writer.get_save_function_and_args()
    buckets, results_queue = (args[1], args[2]) if args else ([], None)
    rank = dist.get_rank()
    request = nvrx_compat.AsyncRequest(
        write_shard, (save_fn, str(directory), rank, buckets, results_queue), []
    )
    return request, writer, metadata, dist_wrapper


class PersistentWriter:
    """The current writer process of this training process (none before :meth:`start`)."""

    def __init__(self) -> None:
        self.queue: Any = None
        # When the current writer was started and when it first answered (time.time()).
        self.started_at: float | None = None
        self.ready_at: float | None = None
        self.start_method: str | None = None  # "fork" or "spawn"
        self.warmed = False  # the current writer has written once (warm-up or a save)
        self._ready_taken = False
        self._results_queue_thread: threading.Thread | None = None

    def start(self, *, rank: int = 0, fork: bool = False) -> None:
        """Start a new writer now, replacing the current one, without waiting for it. ``fork``:
        the caller's word that no other thread runs yet and CUDA is not in use (the Manager is
        forked too); otherwise both are spawned, the Manager from a thread of its own."""
        self.reset()
        if fork:  # before the writer: its queue's feeder thread starts with the first request
            nvrx_compat.fork_write_results_queue()
        self.queue = nvrx_compat.AsyncCallsQueue(persistent=True)
        self.start_method = nvrx_compat.start_persistent_writer(
            self.queue, nvrx_compat.AsyncRequest(noop, (), []), rank=rank, fork=fork
        )
        self.started_at, self.ready_at = time.time(), None
        self.warmed = self._ready_taken = False
        if self._results_queue_thread is None and not nvrx_compat.write_results_queue_ready():
            self._results_queue_thread = threading.Thread(
                target=nvrx_compat.warm_write_results_queue, name="nvrx-results-queue", daemon=True
            )
            self._results_queue_thread.start()

    def results_queue_ready(self) -> None:
        """No save may plan before the Manager exists (NVRx would start a second one)."""
        if self._results_queue_thread is not None:
            self._results_queue_thread.join()

    def take_ready(self) -> float | None:
        """Seconds from ``start`` to ready, once per writer (the ``writer_ready`` event)."""
        if self.ready_at is None or self.started_at is None or self._ready_taken:
            return None
        self._ready_taken = True
        return self.ready_at - self.started_at

    def finished_all(self) -> bool:
        """Has the writer done everything it was given (finalized without blocking)? The first
        time it has, it is ready."""
        if self.queue is None:
            return True
        self.queue.maybe_finalize_async_calls(blocking=False, no_dist=True)
        done = self.queue.get_num_unfinalized_calls() == 0
        if done and self.ready_at is None:
            self.ready_at = time.time()
        return bool(done)

    def note_ready(self) -> None:
        """While no save is pending: note when the writer is first idle (ready)."""
        if self.ready_at is None and self.queue is not None:
            self.finished_all()

    def schedule(self, request: Any) -> None:
        """Give the writer a write request (its staging copy must be complete)."""
        self.queue.schedule_async_request(request)

    def process(self) -> Any:
        caller = getattr(self.queue, "persistent_caller", None)
        return getattr(caller, "process", None)

    def pid(self) -> int | None:
        proc = self.process()
        return None if proc is None else proc.pid

    def alive(self) -> bool:
        proc = self.process()
        return proc is not None and proc.is_alive()

    def reset(self) -> None:
        """Kill the current writer, if any, and forget it (and what it was given)."""
        if self.queue is None:
            return
        proc = self.process()
        if proc is not None:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
            # NVRx's caller.__del__ would put 'DONE' and join a queue nobody serves: disarm it.
            self.queue.persistent_caller.process = None
        self.queue.async_calls.clear()
        self.queue = None

    def drain(self, deadline: float, *, what: str) -> None:
        """Wait until the writer has finished everything it was given; a writer that dies or
        passes ``deadline`` (time.monotonic()) is reset and raises."""
        while self.queue.get_num_unfinalized_calls():
            self.queue.maybe_finalize_async_calls(blocking=False, no_dist=True)
            if not self.queue.get_num_unfinalized_calls():
                break
            if not self.alive():
                self.reset()
                raise CheckpointWorkerDied(f"async checkpoint writer died during {what}")
            if time.monotonic() > deadline:
                self.reset()
                raise CheckpointTimeout(f"async checkpoint writer did not finish {what} in time")
            time.sleep(0.005)

    def close(self) -> None:
        """Idempotent. Killed, not asked to exit ('DONE' and a join waited ~0.7 s for the
        writer's interpreter to wind down, at the end of every worker): it writes nothing once
        every call is finalized, and a save still in flight is abandoned either way. The same
        for NVRx's results-queue Manager (its exit finalizer waited ~1 s)."""
        if self._results_queue_thread is not None:
            # A Manager still starting has no exit finalizer yet: the interpreter's exit would
            # wait for its process forever (a worker that fails in its first second).
            self._results_queue_thread.join(timeout=60)
            self._results_queue_thread = None
        if self.queue is None:
            return
        self.reset()
        nvrx_compat.stop_write_results_queue()
