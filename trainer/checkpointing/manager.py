"""Checkpoint manager: when to save, the commit, and resume with fallback.

Public ``resume`` / ``maybe_save`` / ``poll`` / ``finish`` own the guards; the async mechanics
live in :mod:`trainer.checkpointing.async_save`, the layout, manifest, commit and resume choice
in the package's other modules.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, Protocol, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.optim import Optimizer

from trainer import __version__, checkpointing
from trainer.checkpointing import coordination, node_format, tiers
from trainer.checkpointing.async_commit import CommitTask, SaveResult
from trainer.checkpointing.async_save import WARMUP_STEP, AsyncCheckpointer
from trainer.checkpointing.errors import (
    CheckpointCommitError,
    CheckpointError,
    CheckpointStorageError,
)
from trainer.checkpointing.live_state import LiveState
from trainer.checkpointing.memory_cadence import MemoryCadence
from trainer.checkpointing.node_copy import NodeMemory
from trainer.checkpointing.process_copy import OwnCopyRestorer, ProcessCopy
from trainer.checkpointing.restore_durable import DurableRestorer
from trainer.checkpointing.restore_node import NodeRestorer
from trainer.checkpointing.restoring import FatalError, RestoreContext, Resumed
from trainer.config import TrainConfig
from trainer.elastic import node_id
from trainer.event_types import (
    Checkpoint,
    CheckpointFailed,
    MemoryInterval,
    Phase,
    PruneRefused,
    Resume,
)
from trainer.events import EventLog
from trainer.fence import Fence
from trainer.layer_config import CHECKPOINT_SECTION, LOAD_SECTION
from trainer.rundir import RunDir
from trainer.workload import DataSource

log = logging.getLogger(__name__)


class Sections(Protocol):
    """Timed sections of the in-job layer (``trainer.resilience.Heartbeat``)."""

    def section(self, name: str) -> contextlib.AbstractContextManager[None]: ...


class CheckpointManager:
    def __init__(
        self,
        cfg: TrainConfig,
        saver: AsyncCheckpointer,
        events: EventLog,
        *,
        rank: int,
        world_size: int,
        group: dist.ProcessGroup,
        sections: Sections | None = None,
        fence: Fence | None = None,
        node: NodeMemory | None = None,
        peer_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.cfg = cfg
        # This rank's node-memory tier (trainer.checkpointing.node_copy), where the node has one.
        self.node = node
        # The peer copy's own gloo group (trainer.session), for the memory saves' thread.
        self.peer_group = peer_group
        self._node_headers: dict[int, node_format.Header] = {}
        self._peer_headers: dict[int, dict[int, node_format.Header]] = {}
        self._offers: list[tiers.Offer] = []  # every rank's, gathered at the resume
        self._memory_blocking: float | None = None  # this step's memory save (maybe_save)
        self.cadence: MemoryCadence | None = None  # how often a memory save runs (at resume)
        # The state dicts the memory saves copy from, kept while their structure holds.
        self._live = LiveState()
        # Every change rank 0 makes to the run root runs under it (trainer.fence).
        self.fence = fence or RunDir.from_env(cfg.run_root).fence(events)
        self.saver = saver
        self.events = events
        self.sections = sections
        # Rank 0, after each commit (step, committed directory): the loop's hooks.
        self.on_commit: Callable[[int, Path], None] = lambda step, path: None
        # Every rank at a resume, once the peer copies its node holds are listed (by the rank
        # that wrote them, by step): the corrupt-peer drill (trainer.hooks.FaultDrills).
        self.on_offer: Callable[[dict[int, dict[int, node_format.Header]]], None] = lambda h: None
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.fingerprint = cfg.fingerprint()
        self._inflight: dict[str, Any] = {}
        self._started_step: int | None = None  # the newest durable save started (_save)
        saver.bind(group, warmup_dir=checkpointing.checkpoints_dir(cfg.run_root) / ".writer-warmup")

    # -- resume --------------------------------------------------------------------------------
    def resume(self, model: nn.Module, optim: Optimizer, sampler: DataSource) -> Resumed:
        """All ranks: the newest state every rank can restore, from the tier chosen
        (:meth:`_choose_tier`), else the next, at last the durable checkpoint."""
        self._live.forget()  # a restore replaces the optimizer's state: its state dicts anew
        with self._section(LOAD_SECTION):
            resumed = self._resume(model, optim, sampler)
        # Each incarnation measures its own memory saves (a shrunk world, another node).
        self.cadence = MemoryCadence(
            self.cfg.checkpoint.memory,
            durable_interval=self.cfg.checkpoint.durable.interval,
            first_step=resumed.step + 1,
        )
        return resumed

    def _resume(self, model: nn.Module, optim: Optimizer, sampler: DataSource) -> Resumed:
        choice, copy = self._choose_tier()
        ctx = RestoreContext(
            self.cfg, self.rank, self.world_size, self.group, self.events, self.fence
        )
        # A restore that fails on some rank (said in a skipped event) removes its candidate and
        # the choice is made again over what is left, by every rank alike (the offers were
        # gathered by all, the newest commit came with the choice): an older generation,
        # another tier, at last the durable checkpoint, which overwrites whatever was copied.
        while choice.tier != "durable":
            restorer: OwnCopyRestorer | NodeRestorer
            if choice.tier == "memory":
                restorer = OwnCopyRestorer(ctx, copy, sum(o.own_bytes for o in self._offers))
            else:
                assert self.node is not None  # node and peer steps come from node memory
                restorer = NodeRestorer(ctx, self.node, self._node_headers, self._peer_headers)
            resumed = restorer.restore(model, optim, sampler, choice)
            if resumed is not None:
                if choice.tier == "memory" and resumed.step > choice.newest_committed:
                    # The copy's own save never committed (the fault came while it was in
                    # flight): write it again now, or the durable tier, which a respawn or a
                    # lost node falls back to, would stay behind what training resumed from.
                    with self._section():
                        self._save(resumed.step, model, optim, sampler, resumed.loss or 0.0)
                return resumed
            self._offers = tiers.without(
                self._offers, choice.tier, choice.step, "restoring it failed"
            )
            # What the first choice did not use was said then; the failure just now too.
            choice = replace(tiers.choose(self._offers, choice.newest_committed), skipped=())
        return DurableRestorer(ctx, self.fingerprint).restore(model, optim, sampler, choice)

    def _choose_tier(self) -> tuple[tiers.Choice, ProcessCopy | None]:
        """All ranks: every rank's offer gathered, rank 0's choice (:func:`tiers.choose`, with the
        newest committed step) broadcast, every tier held but not used said in a ``skipped``
        event. The durable tier when the run reads no memory tier."""
        if self.node is not None:
            self.node.unbind()  # an earlier incarnation's peer copy writes nothing more
        if not self.cfg.checkpoint.reads_memory_tiers:
            self._bind_peers(None)  # this run's peer copies
            return tiers.Choice("durable", 0), None
        copy = self.saver.own_copy()
        problem = tiers.NO_COPY if copy is None else copy.problem()
        self._node_headers, node_why = self.node.headers() if self.node is not None else ({}, None)
        if self.node is not None:
            self._peer_headers = self.node.peer_headers()
            self.on_offer(self._peer_headers)
        offer = tiers.Offer(
            own_step=copy.step if copy is not None and problem is None else -1,
            own_problem=problem,
            own_bytes=copy.nbytes() if copy is not None else 0,
            node_steps=tuple(sorted(self._node_headers)),
            node_problem=node_why,
            peer_holds=tuple(
                (src, step)
                for src, by_step in sorted(self._peer_headers.items())
                for step in by_step
            ),
        )
        offers = self._bind_peers(offer)
        # Only the newest commit is rank 0's (it reads the run root): with every offer on every
        # rank, each makes the same pure choice, as at every fallback after it.
        newest = torch.tensor([0], dtype=torch.int64)
        if self.rank == 0:
            newest[0] = max(checkpointing.committed_steps(self.cfg.run_root), default=0)
        dist.broadcast(newest, group_src=0, group=self.group)
        choice = tiers.choose(offers, int(newest[0]))
        if self.rank == 0:
            for s in choice.skipped:
                self.events.emit(
                    Resume(action="skipped", step=s.step, source=s.tier,
                    reason=f"not from {tiers.DESCRIBED[s.tier]}: {s.why}",
                ))  # fmt: skip
        self._offers = offers
        return choice, copy

    def _bind_peers(self, offer: tiers.Offer | None) -> list[tiers.Offer]:
        """All ranks: gather this rank's offer with the node each rank runs on, where it has
        node memory and a peer group, draw the ring of peer copies among those
        (:func:`tiers.peer_ring`) and bind this rank's part; returns the offers by rank."""
        mine = node_id() if self.node is not None and self.peer_group is not None else None
        sent = coordination.OfferMessage(
            offer=None if offer is None else coordination.TierOffer.of(offer), node=mine
        )
        gathered = coordination.gather(sent, self.group, limit=coordination.OFFER_LIMIT)
        ring = tiers.peer_ring([m.node for m in gathered])
        if self.node is not None and self.peer_group is not None:
            self.node.bind_peers(
                self.peer_group,
                ring[self.rank],
                tuple(q for q, p in enumerate(ring) if p == self.rank),
            )
        return [m.offer.offer() if m.offer is not None else tiers.Offer() for m in gathered]

    # -- saving --------------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        return self.cfg.checkpoint.durable.due(step, self.cfg.steps)

    def maybe_save(
        self,
        step: int,
        model: nn.Module,
        optim: Optimizer,
        sampler: DataSource,
        loss: float,
        step_s: float | None = None,
    ) -> float | None:
        """Every rank after ``step`` (which took ``step_s``): the seconds training was blocked by
        a durable save this step started, None when none did (the caller's poll depends on it);
        a memory save's are :meth:`take_memory_blocking`'s."""
        # The first call of an incarnation starts the writer (see AsyncCheckpointer.start).
        self.saver.ensure_started(rank=self.rank)
        blocked: float | None = None
        if self.due(step):
            with self._section():
                blocked = self._save(step, model, optim, sampler, loss)
        if self.node is not None and self.memory_due(step):
            t0 = time.perf_counter()
            state = self._live.get(model, optim)
            info = {"loss": loss, "data_loader": sampler.state_at(step).to_dict()}
            self.node.save(step, state, info, version=self._live.version)
            # What it blocked training, the state dicts' walk (or its reuse) included.
            self._memory_blocking = time.perf_counter() - t0
            failed = self.node.take_failure()
            if failed:  # that step is missing from the tier: a resume says so, and reads another
                log.warning("rank %d: %s", self.rank, failed)
        self._measure_cadence(step, step_s)
        return blocked

    def _measure_cadence(self, step: int, step_s: float | None) -> None:
        """Memory interval auto: this step's measurements, and at the agreed step the choice
        (one all-reduce, on every rank, node memory or not)."""
        cadence = self.cadence
        if cadence is None or cadence.decision_step is None:
            return
        # A save first waits for the one before it: its background is known by now.
        background = self.node.take_background() if self.node is not None else None
        cadence.observe(
            step_s=step_s or 0.0, blocking_s=self._memory_blocking, background_s=background
        )
        if step != cadence.decision_step:
            return
        worst = torch.tensor(cadence.offer(), dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=self.group)
        chosen = cadence.decide((float(worst[0]), float(worst[1]), float(worst[2])))
        if self.rank == 0:
            self.events.emit(
                MemoryInterval(
                    step=step,
                    interval=chosen.interval,
                    step_s=chosen.step_s,
                    blocking_s=chosen.blocking_s,
                    background_s=chosen.background_s,
                    budget=chosen.budget,
                    samples=chosen.samples,
                    detail=chosen.describe(),
                )
            )

    def take_memory_blocking(self) -> float | None:
        """The seconds this step's memory save blocked training (None: none was made)."""
        taken, self._memory_blocking = self._memory_blocking, None
        return taken

    def memory_due(self, step: int) -> bool:
        """A memory save (node memory) follows this step (``MemoryCadence.due``)."""
        cadence = self.cadence
        return cadence is not None and cadence.due(step, self.cfg.steps)

    def save_now(
        self, step: int, model: nn.Module, optim: Optimizer, sampler: DataSource, loss: float
    ) -> Path | None:
        """Every rank: ``step`` saved durably and committed before this returns (an eviction's
        hand-off, trainer.notice), started now unless this step's save already was. Rank 0:
        the committed directory (None where this poll did not learn of the commit)."""
        with self._section():
            if self._started_step != step:
                self._save(step, model, optim, sampler, loss)
            result = self.poll(block=True)
        committed = result.committed if result is not None else None
        return committed if isinstance(committed, Path) else None

    def _save(
        self, step: int, model: nn.Module, optim: Optimizer, sampler: DataSource, loss: float
    ) -> float:
        self.poll(block=True)  # the previous save is committed before the next starts
        self._started_step = step
        partial = checkpointing.partial_path(self.cfg.run_root, step, self.fence.epoch)
        if self.rank == 0:
            with self.fence.hold(f"start writing step {step}"):
                if partial.exists():
                    shutil.rmtree(partial)
                partial.mkdir(parents=True)
        dist.barrier(group=self.group)
        model_sd, optim_sd = get_state_dict(model, optim)
        self._inflight = {
            "loss": loss,
            "data_loader": sampler.state_at(step).to_dict(),
        }
        # The same facts travel with the process's own copy of this save (process_copy).
        return self.saver.save(
            {"model": model_sd, "optim": optim_sd}, partial, step, info=self._inflight
        )

    def save_flags(self) -> Any:
        """This rank's share of the next poll's agreement (see ``AsyncCheckpointer.local_flags``):
        the loop carries it in its loss all-reduce."""
        return self.saver.local_flags()

    def poll(self, *, block: bool = False, reduced: Any = None) -> SaveResult | None:
        """``reduced``: the sum over ranks of ``save_flags()`` taken *before* this step's
        ``maybe_save`` (the caller passes None when that started a save: the sums were of the
        save before it). Returns the save whose commit this poll learnt of, on every rank."""
        try:
            result = self.saver.poll(
                block=block,
                section=self._section,
                reduced=reduced,
                commit=self._commit_task,
            )
        except CheckpointStorageError as e:
            if e.step == WARMUP_STEP:  # not a checkpoint; a real save reports a real problem
                log.warning("the writer's warm-up write failed: %s", e)
                return None
            raise self._storage_failure(e.step, e.directory, e) from e
        except CheckpointCommitError as e:
            raise CheckpointError(str(e)) from e
        if result is not None and isinstance(result.committed, Path):
            self.on_commit(result.step, result.committed)  # rank 0, on the training thread
        ready_s = self.saver.writer.take_ready()
        if ready_s is not None and self.rank == 0:
            # Off the critical path since the writer starts after the first step: this says
            # how long it took all the same (a first save before it is ready queues for it).
            self.events.emit(
                Phase(
                    phase="writer_ready",
                    s=round(ready_s, 3),
                    how=cast("Literal['fork', 'spawn'] | None", self.saver.writer.start_method),
                )
            )
        return result

    def _section(self, name: str = CHECKPOINT_SECTION) -> contextlib.AbstractContextManager[None]:
        """A load, and a save with its commit, each run under their own hang timeout."""
        return contextlib.nullcontext() if self.sections is None else self.sections.section(name)

    def finish(self) -> None:
        """Every rank, after the last step: wait for the save in flight and its commit, in the
        checkpoint section (a writer still starting or writing is not a stalled step)."""
        with self._section():
            self.poll(block=True)

    def _commit_task(self, result: SaveResult) -> CommitTask:
        """Rank 0's commit of ``result``, built here from plain values: the commit thread holds
        neither this manager nor its group (which must close at a fault, ``gloo_release``)."""
        commit = _Commit(
            run_root=self.cfg.run_root,
            step=result.step,
            world_size=self.world_size,
            keep_last=self.cfg.checkpoint.durable.keep_last,
            info={
                "config_hash": self.fingerprint,
                "trainer_version": __version__,
                # What produced it, whole: validation and export rebuild the model from this.
                "workload": self.cfg.workload_record(),
                "config": self.cfg.to_dict(),
                "rng": {"seed": self.cfg.seed, "scheme": "reseeded per (seed, step, rank)"},
                **self._inflight,
            },
            events=self.events,
            fence=self.fence,
            blocking_s=result.blocking_s,
            written_s=result.total_s,
        )
        return commit.run

    def _storage_failure(self, step: int, directory: Path, error: object) -> FatalError:
        """The storage refused a save (a full disk, most often). Fatal, not restarted: every
        restart would fail the same way until someone frees space. The partial is discarded; the
        last commit stays valid and the next run resumes from it."""
        ckdir = checkpointing.checkpoints_dir(self.cfg.run_root)
        mount, free = _disk(ckdir)
        # The directories, not LATEST: a failure right after the rename leaves LATEST behind.
        steps = checkpointing.committed_steps(self.cfg.run_root)
        last = steps[-1] if steps else None
        message = (
            f"the save of step {step} failed: {error}. Disk: {mount} (holding {ckdir}; "
            f"{free} bytes free). The partial save was discarded; the last "
            f"committed checkpoint (step {last}) is intact. "
            f"Free space on {mount} (or fix the storage), then run again to resume."
        )
        if self.rank == 0 and self.fence.still_current():
            shutil.rmtree(directory, ignore_errors=True)
            # Best effort: on a full disk this event may not fit either.
            with contextlib.suppress(OSError):
                self.events.emit(
                    CheckpointFailed(
                        step=step,
                        error=str(error),
                        path=str(ckdir),
                        disk=mount,
                        free_bytes=free,
                        last_committed=last,
                    )
                )
        return FatalError(message)


@dataclass(frozen=True)
class _Commit:
    """Rank 0's commit of one written save (manifest, fsyncs, rename, prune) and its
    ``checkpoint`` event, run on the saver's commit thread while training goes on."""

    run_root: Path
    step: int
    world_size: int
    keep_last: int
    info: dict[str, Any]
    events: EventLog
    fence: Fence
    blocking_s: float
    written_s: float  # from save() until every rank's writer was done
    finalized_at: float = field(default_factory=time.perf_counter)

    def run(self) -> Path:
        t0 = time.perf_counter()
        # The commit, the prune and the recorded fact as one fenced change: a writer whose
        # attempt was replaced while it wrote commits nothing (trainer.fence).
        with self.fence.hold(f"commit step {self.step}"):
            path = checkpointing.commit(
                self.run_root,
                self.step,
                world_size=self.world_size,
                info=self.info,
                epoch=self.fence.epoch,
            )
            pruned = checkpointing.prune(self.run_root, self.keep_last)
            RunDir(self.run_root).record_commit(self.step)
        if pruned.refused:
            self.events.emit(PruneRefused(step=self.step, reason=pruned.refused))
        commit_s = time.perf_counter() - t0
        self.events.emit(
            Checkpoint(
                step=self.step,
                path=str(path),
                blocking_s=round(self.blocking_s, 4),
                # save() until committed (DCP's .metadata and this commit on the commit thread).
                total_s=round(self.written_s + time.perf_counter() - self.finalized_at, 4),
                # The commit's own time (manifest, fsyncs, rename, prune), off the training thread.
                commit_s=round(commit_s, 4),
                pruned=pruned.removed,
            )
        )
        return path


def _disk(path: Path) -> tuple[str, int | None]:
    """The mount point holding ``path`` and its free bytes (None where it cannot be read)."""
    probe = Path(path)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    mount = probe.resolve()
    while not os.path.ismount(mount) and mount != mount.parent:
        mount = mount.parent
    try:
        st = os.statvfs(probe)
        free: int | None = st.f_bavail * st.f_frsize
    except OSError:
        free = None
    return str(mount), free
