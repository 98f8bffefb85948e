"""The worker process (arch §5): how it came to be (:class:`Origin`, the one place a restart is
attributed to a layer), what it keeps across in-process restarts (:class:`ProcessContext`), and
what each restart iteration of the training core (:class:`trainer.session.TrainSession`) sets up
from it: the process group and the fault-tolerance hooks."""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

from trainer.checkpointing.async_save import AsyncCheckpointer
from trainer.config import TrainConfig
from trainer.elastic import PriorWorld
from trainer.events import EventLog
from trainer.hooks import FaultDrills, Heartbeats, Hooks, StepEvents
from trainer.parallel import Placement
from trainer.rundir import RunDir, RunResult
from trainer.workload import DataSource


@dataclass(frozen=True, kw_only=True)
class Origin:
    """How this worker process came to be, read once at its start: the one attribution of a
    restart to the layer that recovered the run."""

    restart_count: int = 0  # ft_launcher's TORCHELASTIC_RESTART_COUNT (this agent's restarts)
    # The previous incarnation of this launcher job (an elastic job's world may change); None
    # when this worker is the job's first.
    prior: PriorWorld | None = None
    stage_attempt: int = 1  # the pipeline's train-stage attempt (NVRX_STAGE_ATTEMPT)

    @classmethod
    def of(cls, run_root: Path, environ: Mapping[str, str] = os.environ) -> Origin:
        # From control/ (trainer.rundir), never a scan of the event log: O(1) at any length.
        return cls(
            restart_count=int(environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            prior=RunDir(run_root).prior_world(environ.get("TORCHELASTIC_RUN_ID")),
            stage_attempt=int(environ.get("NVRX_STAGE_ATTEMPT", "1")),
        )

    @property
    def respawned(self) -> bool:
        """The launcher started this worker again (a restart of it, or of its job's world)."""
        return self.restart_count > 0 or self.prior is not None

    def layer(self, iteration: int, world_size: int) -> str | None:
        """Which layer recovered the run at ``iteration`` of this process (None: a run's very
        first start). A respawn is ``elastic`` if the world shrank, ``spare`` if a node was lost
        and the world kept its size, else ``injob`` (a crash, a hang, a returning node)."""
        if iteration > 0:
            return "inprocess"
        if self.respawned:
            prior = self.prior
            if prior is not None and world_size < prior.world_size:
                return "elastic"
            if prior is not None and prior.open_node_loss:
                return "spare"
            return "injob"
        if self.stage_attempt > 1:
            return "stage-retry"
        return None


@dataclass(frozen=True, kw_only=True)
class ProcessContext:
    """What one worker process keeps across in-process restarts: set once, never reassigned."""

    cfg: TrainConfig
    placement: Placement
    sampler: DataSource
    saver: AsyncCheckpointer
    events: EventLog
    heartbeat: Any
    origin: Origin = field(default_factory=Origin)
    base_store: Any = None  # long-lived store for per-iteration process groups (in-process mode)
    # This rank's node memory (trainer.checkpointing.node_copy.NodeMemory), kept across
    # in-process restarts: its files outlive the process too.
    node_memory: Any = None
    started: float = field(default_factory=time.time)

    @property
    def restart_count(self) -> int:
        return self.origin.restart_count


# One attempt of the training run, re-entered by the in-process layer after a fault.
Body = Callable[[ProcessContext, Any], RunResult]


def init_process_group(ctx: ProcessContext, iteration: int) -> tuple[int, int]:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(seconds=ctx.cfg.inprocess.pg_timeout_s)
    if ctx.base_store is not None:
        # A fresh prefix per restart iteration: keys of the aborted group must not leak in.
        store = dist.PrefixStore(f"pg-iter{iteration}", ctx.base_store)
        dist.init_process_group(
            ctx.placement.backend, store=store, rank=rank, world_size=world, timeout=timeout
        )
    else:
        dist.init_process_group(ctx.placement.backend, timeout=timeout)
    return rank, world


def build_hooks(
    ctx: ProcessContext,
    *,
    rank: int,
    first_step: int,
    layer: str | None,
    began: float,
) -> Hooks:
    """The fault-tolerance hooks of this worker, in the order they run at each point."""
    hooks: list[Any] = [
        FaultDrills(
            ctx.cfg.faults,
            ctx.cfg.run_root,
            ctx.events,
            rank=rank,
            step_timeout=lambda: getattr(ctx.heartbeat, "step_timeout_s", None),
            node_memory=ctx.node_memory,
        )
    ]
    hooks.append(Heartbeats(ctx.heartbeat))
    # No manual ping of the in-process Wrapper (issue 40, item 0): its first ping arms the soft
    # timeout (8 s) between steps, which interrupted every second healthy 35 s gpt-100m step.
    # Its automatic watchdog stays; a stalled collective trips the peers' process-group timeout
    # and a slow step the learned in-job step timeout.
    if rank == 0:
        launcher_drills = any(spec.is_node_fault for spec in ctx.cfg.faults)
        hooks.append(
            StepEvents(
                ctx.events,
                first_step=first_step,
                recovery_layer=layer,
                began=began,
                buffered=not launcher_drills,
            )
        )
    return Hooks(*hooks)
