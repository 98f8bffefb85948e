"""Asynchronous DCP checkpoint saves through NVRx's async machinery, with an explicit CPU path.

``save()`` snapshots this rank's state into CPU staging buffers (``staging``), plans the DCP
save and hands the write to NVRx's persistent writer process (``writer``), which writes and
digests the shard while training goes on. ``poll()`` (every step, every rank) finalizes the save
once every rank's writer is done (``async_commit.SaveFlags``): the write results are
gathered on the training thread (one small collective), and the coordinator writes DCP's
``.metadata`` and runs the caller's commit on a commit thread of its own. A later ``poll`` learns
from every rank's flags whether that commit is done or failed, and only then returns the
``SaveResult``: a result means committed.

What blocks training:

- **CPU**: the staging copy (synchronous and required, see ``staging``), the DCP plan
  (cached after the first save) and the hand-off; the writes, fsync and digests overlap.
- **CUDA**: only enqueuing the device-to-host copies on a side stream (which first waits on the
  current stream, so it copies the state as of the finished optimizer step), recording an event
  behind them, and the plan; no ``torch.cuda.synchronize()``. Before the next
  ``optimizer.step()`` (which mutates what is being copied) ``before_optimizer_step()`` makes the
  current stream wait on that event (the host does not block) and hands the write over if the
  copy is done; otherwise the first ``poll()`` that sees it done does (the writer must never read
  a buffer still being filled). A global optimizer step pre-hook calls it too while a copy is in
  flight; any *other* in-place change of the state before the next step must call it first.

Why the explicit CPU path (NVRx 0.4.1 hard-codes CUDA in three places; no monkeypatching here):
no ``preload_fn`` (NVRx's calls ``torch.cuda.synchronize()``; our staging copy *is* the snapshot,
in CPU tensors as the writer asserts); NVRx calls are always finalized with ``no_dist=True`` (its
distributed check allocates on ``torch.cuda.current_device()``), the ranks agreeing with a CPU
all-reduce on a gloo group before the DCP finalize; and NVRx's blocking finalize hangs forever
on a save that raised in the writer, so we only poll without blocking and check that the writer
lives: a dead or stuck writer raises instead of hanging.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import shutil
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook

from trainer import nvrx_compat
from trainer.checkpointing.async_commit import (
    CommitFor,
    CommitTask,
    Committer,
    SaveFlags,
    SaveResult,
    gather_write_results,
)
from trainer.checkpointing.errors import (
    CheckpointTimeout,
    CheckpointWorkerDied,
    CheckpointWriteError,
)
from trainer.checkpointing.process_copy import ProcessCopy
from trainer.checkpointing.staging import Staging
from trainer.checkpointing.writer import PersistentWriter, plan_write

log = logging.getLogger(__name__)

WARMUP_STEP = -1  # the step of the writer's warm-up write (never committed)


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


class AsyncCheckpointer:
    """One per process; survives in-process restarts (re-``bind`` to each new process group).
    Per save, every rank: ``save()``, ``before_optimizer_step()``, ``poll()`` every step until it
    returns the ``SaveResult`` (or ``wait()``)."""

    def __init__(self, *, device: torch.device, timeout_s: float = 300.0, cache_plan: bool = True):
        self.device = device
        self.timeout_s = timeout_s
        self.cache_plan = cache_plan
        self.staging = Staging(device)
        self.writer = PersistentWriter()
        # The last save's snapshot, kept by the staging buffers until the next save refills
        # them: what an in-process restart reloads from (trainer.checkpointing.process_copy).
        self._own_copy: ProcessCopy | None = None
        self.group: dist.ProcessGroup | None = None
        self.pending: _Pending | None = None
        self._md_cache: Any = None
        self._step_hook: Any = None
        self.commits = Committer(timeout_s)

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self, *, rank: int = 0, fork: bool = False) -> bool:
        """Start the writer process now without waiting for it; whether a new one was started
        (not while the writer lives). A save of a replaced writer is forgotten."""
        if self.writer.queue is not None and self.writer.alive():
            return False
        self._forget_pending()
        self.writer.start(rank=rank, fork=fork)
        return True

    def ensure_started(self, *, rank: int = 0) -> None:
        """Start the first writer if none was started yet (cheap: called every step). A dead
        writer is replaced only by ``bind``: mid-run, the ranks' agreement reports the death."""
        if self.writer.queue is None:
            self.start(rank=rank)

    def bind(self, group: dist.ProcessGroup, *, warmup_dir: Path | None = None) -> None:
        """Attach to this restart iteration's checkpoint group; replace the writer if one was
        started and has died (never waits for it). With ``warmup_dir`` (the same, or None, on
        every rank) a new writer also writes a one-element checkpoint there in the background:
        a fresh writer's first write costs ~0.6 s more (measured on CPU, whatever the state's
        size), which would otherwise delay the next commit. ``poll`` finalizes it unreported."""
        self.group = group
        self._md_cache = nvrx_compat.new_metadata_cache() if self.cache_plan else None
        self.commits.settle_quietly()  # a resume must not read the checkpoints while one commits
        if self.writer.queue is not None:
            self.start(rank=dist.get_rank())
        if warmup_dir is not None:
            # Collective (a save plans across ranks): all warm up if any rank's writer is new and
            # every rank's results queue is up (waiting for it would block the start-up). Else
            # (always for a process's first writer) the first real save pays the extra cost.
            waiting = self.writer.queue is None or not nvrx_compat.write_results_queue_ready()
            flags = torch.tensor([0 if self.writer.warmed else 1, 1 if waiting else 0])
            dist.all_reduce(flags, group=group)
            if int(flags[0]) > 0 and int(flags[1]) == 0:
                self._warm_up(Path(warmup_dir))

    def _warm_up(self, directory: Path) -> None:
        if dist.get_rank(self.group) == 0:
            shutil.rmtree(directory, ignore_errors=True)
            directory.mkdir(parents=True)
        dist.barrier(group=self.group)
        self.save({"writer_warmup": torch.zeros(1)}, directory, WARMUP_STEP)

    def close(self) -> None:
        """Idempotent. A save in flight is not waited for (call ``wait``); a commit already
        running is let finish (a finished commit is not lost work)."""
        self._wait_copy_quietly()
        self._remove_step_hook()
        self.commits.close()
        self.writer.close()

    # -- saving --------------------------------------------------------------------------------
    def own_copy(self) -> ProcessCopy | None:
        """The last save's snapshot, if it is complete (its staging copy done)."""
        return None if self.staging.copier.in_flight else self._own_copy

    def save(
        self,
        state_dict: dict[str, Any],
        directory: Path,
        step: int,
        *,
        info: dict[str, Any] | None = None,
    ) -> float:
        """Every rank: start an async save of this rank's shard (the previous one finalized);
        returns the seconds training was blocked (module doc)."""
        assert self.group is not None, "bind() first"
        if self.pending is not None:
            raise CheckpointWriteError("previous save not finalized: call wait() first")
        self.ensure_started(rank=dist.get_rank())
        t0 = time.perf_counter()
        # The buffers are about to be refilled. (The writer's warm-up stages a layout of its
        # own, into new buffers: the last save's copy keeps its buffers, and stays.)
        real = step != WARMUP_STEP
        if real:
            self._own_copy = None
        self.writer.results_queue_ready()
        try:
            staged = self.staging.stage(state_dict)
            if self.staging.reallocated and self.cache_plan:
                # NVRx reuses a validated cached plan without re-checking tensor sizes: a new
                # state layout must start a new cache.
                self._md_cache = nvrx_compat.new_metadata_cache()
            planned = plan_write(staged, directory, self.group, self._md_cache)
        except BaseException:
            self.staging.copier.synchronize()  # nothing may still be copying into the buffers
            raise
        if real:
            self._own_copy = ProcessCopy(step, staged, dict(info or {}))
        request, writer, metadata, dist_wrapper = planned
        self.pending = _Pending(
            step, Path(directory), writer, metadata, dist_wrapper, t0, 0.0, request, state_dict
        )
        if self.staging.copier.query():  # CPU: always (the copy is synchronous)
            self._hand_off()
        else:
            self._install_step_hook()
        blocking = time.perf_counter() - t0
        self.pending.blocking_s = blocking
        self.writer.warmed = True
        return blocking

    def before_optimizer_step(self) -> None:
        """Right before every ``optimizer.step()`` (all ranks; cheap when idle; module doc)."""
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
        self.writer.schedule(request)

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

    def _locally_done(self, *, block: bool) -> bool:
        """Whether this rank's writer has finished the save, once handed the request (when its
        copy is complete; ``block``: waited for)."""
        p = self.pending
        assert p is not None
        if p.request is not None:
            copier = self.staging.copier
            if not block and not copier.query():
                return False
            t0 = time.perf_counter()
            if block:
                copier.synchronize()
            self._hand_off()
            p.deferred_s += time.perf_counter() - t0
        if not p.locally_done:
            p.locally_done = self.writer.finished_all()
        return p.locally_done

    def local_flags(self) -> torch.Tensor:
        """This rank's share of the next ``poll``'s agreement (:class:`SaveFlags`; the commit
        flags only on the coordinator): the loop sums it in its loss all-reduce and hands the
        sums to ``poll(reduced=...)``, so a save in flight costs the step no collective."""
        not_done = writer_dead = 0
        if self.pending is not None:
            done = self._locally_done(block=False)
            not_done = 0 if done else 1
            writer_dead = 1 if not done and not self.writer.alive() else 0
        commit_running, commit_failed = self.commits.flags()
        return SaveFlags(not_done, writer_dead, commit_running, commit_failed).to_tensor()

    def poll(
        self,
        *,
        block: bool = False,
        section: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext,
        reduced: torch.Tensor | None = None,
        commit: CommitFor | None = None,
    ) -> SaveResult | None:
        """Every rank, every step: finalize the save in flight once all ranks' writers are done,
        and return its ``SaveResult`` once the coordinator's commit of it is done.

        ``commit(result)`` (the coordinator's) builds what the commit thread runs after DCP's
        ``.metadata``; its return value comes back as ``SaveResult.committed``. Non-blocking by
        default (one tiny CPU all-reduce while a save or a commit is in flight, none with
        ``reduced``). ``block=True`` waits for the copy, the writers, then the commit, bounded
        by ``timeout_s``, the gather inside ``section`` (a slow write is not a stalled step); a
        dead writer or a failed commit on any rank raises on all.
        """
        if self.pending is None and self.commits.current is None:
            self.writer.note_ready()
            return None
        deadline = time.monotonic() + self.timeout_s
        while True:
            if reduced is not None and not block:
                # Every rank's local_flags(), summed by the caller's collective: the same
                # decision on every rank without one of ours.
                flags = SaveFlags.from_tensor(reduced)
                reduced = None
            else:
                if block and self.pending is not None:
                    self._locally_done(block=True)  # CUDA: wait for the copy and hand it over
                summed = self.local_flags()
                dist.all_reduce(summed, group=self.group)
                flags = SaveFlags.from_tensor(summed)
            if self.commits.current is not None and flags.commit_running == 0:
                result = self.commits.settle(failed=flags.commit_failed > 0, group=self.group)
                return None if result.step == WARMUP_STEP else result
            if self.pending is not None:
                if flags.writer_dead > 0:
                    self._forget_pending()
                    self.writer.reset()
                    raise CheckpointWorkerDied(
                        f"async checkpoint writer died on {flags.writer_dead} rank(s); the save in "
                        "flight is lost, the last committed checkpoint is intact"
                    )
                if flags.not_done == 0:
                    with section():  # the gather of write results: storage-bound collective
                        self._finalize(commit)
                    if not block:
                        return None  # the commit thread has it; a later poll collects it
                    continue  # block: the commit's outcome is agreed on by the next rounds
            if not block:
                return None
            if time.monotonic() > deadline:
                if self.pending is None and self.commits.current is not None:
                    # The storage is stuck under the commit thread; the restart this error
                    # leads to waits for it once more (abandon), then resumes from the disk.
                    raise CheckpointTimeout(
                        f"commit of step {self.commits.current.step} not done after "
                        f"{self.timeout_s} s"
                    )
                self._forget_pending()
                self.writer.reset()
                raise CheckpointTimeout(f"checkpoint write not done after {self.timeout_s} s")
            time.sleep(0.005)

    def wait(
        self,
        section: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext,
        commit: CommitFor | None = None,
    ) -> SaveResult | None:
        return self.poll(block=True, section=section, commit=commit)

    def _finalize(self, commit: CommitFor | None) -> None:
        """DCP finalize on all ranks: gather the write results (a rank's failed write fails
        every rank now); the coordinator's ``.metadata`` and commit go to the commit thread."""
        p = self.pending
        assert p is not None
        self.pending = None
        gathered = gather_write_results(p.writer, p.dist_wrapper, self.group, p.step, p.directory)
        coordinator = p.dist_wrapper.coordinator_rank
        result = SaveResult(
            p.step,
            p.directory,
            p.blocking_s + p.deferred_s,
            time.perf_counter() - p.started,
            p.deferred_s,
        )
        task: CommitTask | None = None
        if p.dist_wrapper.is_coordinator:  # the warm-up commits nothing: its files go
            if p.step == WARMUP_STEP:
                task = functools.partial(shutil.rmtree, p.directory, ignore_errors=True)
            else:
                task = commit(result) if commit is not None else lambda: None
        self.commits.start(
            result, coordinator, task, writer=p.writer, metadata=p.metadata, gathered=gathered
        )

    def drop_group(self) -> None:
        """After a fault, before ``abandon``: forget this iteration's checkpoint group, so that
        nothing here keeps its gloo connections open (``trainer.gloo_release``)."""
        self.group = None
        self._md_cache = None
        if self.pending is not None:
            self.pending.dist_wrapper = None

    def abandon(self) -> None:
        """After a fault (no collectives): let this rank's writer finish what it writes, then
        forget the save (it never commits; its ``.partial`` goes later) and its write results.
        A write whose staging copy had not completed is never handed over."""
        self._wait_copy_quietly()
        self._remove_step_hook()
        self.commits.settle_quietly()
        if self.writer.queue is not None:
            try:
                self.writer.drain(time.monotonic() + self.timeout_s, what="the abandoned save")
            except CheckpointWriteError as e:
                log.warning("%s; writer restarted on the next bind", e)
        self.pending = None
        # After the drain: the writer has put everything it will put.
        self._discard_results()
