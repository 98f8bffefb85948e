"""The train function: build, resume, step, save. Re-entered by the in-process Wrapper after a
fault, so everything it builds (process groups, model, optimizer) is built again each time;
what outlives a restart (data source, async writer, heartbeat client) is passed in.

The loop is training only: what the workload computes, the checkpoint manager's save/poll, and
four hook points (:mod:`trainer.hooks`) where drills, heartbeats, the Wrapper's ping and events
attach."""

from __future__ import annotations

import datetime
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from trainer.checkpointing.async_save import AsyncCheckpointer
from trainer.config import TrainConfig
from trainer.elastic import PriorWorld, restart_layer
from trainer.events import EventLog
from trainer.faults import NODE_KINDS
from trainer.fence import Fence
from trainer.hooks import FaultDrills, Heartbeats, Hooks, StepEvents
from trainer.parallel import Placement
from trainer.session import TrainSession
from trainer.workload import DataSource, OptimSettings


@dataclass
class ProcessContext:
    """What one worker process keeps across in-process restarts."""

    cfg: TrainConfig
    placement: Placement
    sampler: DataSource
    saver: AsyncCheckpointer
    events: EventLog
    heartbeat: Any
    restart_count: int = 0  # ft_launcher's TORCHELASTIC_RESTART_COUNT (this agent's restarts)
    # The previous incarnation of this launcher job (an elastic job's world may change).
    prior: PriorWorld | None = None
    respawned: bool = False  # this worker replaces an earlier one of the same launcher job
    stage_attempt: int = 1  # the pipeline's train-stage attempt (NVRX_STAGE_ATTEMPT)
    base_store: Any = None  # long-lived store for per-iteration process groups (in-process mode)
    # This rank's node memory (trainer.checkpointing.node_copy.NodeMemory), kept across
    # in-process restarts: its files outlive the process too.
    node_memory: Any = None
    started: float = field(default_factory=time.time)


class _Phases:
    """Rank 0: a ``phase`` event per start-up phase of this incarnation, with its seconds since
    the previous one (trainer.timeline splits a recovery with them)."""

    def __init__(self, events: EventLog | None, *, since: float) -> None:
        self.events = events
        self.t = since

    def __call__(self, name: str) -> None:
        now = time.time()
        if self.events is not None:
            self.events.emit("phase", phase=name, s=round(now - self.t, 4))
        self.t = now


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


def recovery_layer(ctx: ProcessContext, iteration: int, world: int) -> str | None:
    if iteration > 0:
        return "inprocess"
    if ctx.restart_count > 0 or ctx.respawned:
        return restart_layer(ctx.prior, world)
    if ctx.stage_attempt > 1:
        return "stage-retry"
    return None


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
    # No manual ping of the in-process Wrapper (issue 40, item 0): its first ping arms a manual
    # progress timeout, the soft timeout (8 s here) from each step's end to the next, so a
    # healthy 35 s step of gpt-100m was interrupted at every second step of an incarnation.
    # The Wrapper's automatic watchdog (the main thread running Python) stays; a rank wedged in
    # a C call still trips it, a stalled collective its peers' process-group timeout, and a
    # step slower than the learned bound the in-job step timeout (trainer.timeouts).
    if rank == 0:
        launcher_drills = any(spec.startswith(NODE_KINDS) for spec in ctx.cfg.faults)
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


def train(ctx: ProcessContext, call_wrapper: Any = None) -> dict[str, Any]:
    """One attempt of the whole training run in this process (all ranks): the workload's model,
    data and loss around the one training core (:class:`trainer.session.TrainSession`)."""
    cfg, wl = ctx.cfg, ctx.cfg.wl
    device = ctx.placement.device
    session = TrainSession(ctx, call_wrapper)
    entered = time.time()
    rank, world = session.init_process_group()
    phase = _Phases(ctx.events if rank == 0 else None, since=entered)
    phase("process_group")

    torch.manual_seed(cfg.seed)  # identical initial weights on every rank and every restart
    model = wl.shard(wl.build_model(device), device=device, world_size=world)
    optim = wl.build_optimizer(model, OptimSettings(lr=cfg.lr, weight_decay=cfg.weight_decay))
    phase("model_built")
    share = session.share
    assert share is not None
    first_step = session.resume(
        model,
        optim,
        per_rank_batch=cfg.micro_batch_size(world) * len(share.mine),
        workload=wl.ref,
    )
    tokens_per_step = cfg.global_batch * wl.seq_len
    for step in range(first_step, cfg.steps + 1):
        session.step_start(step)
        for mb in session.micro_batches(step, model):
            x, y = ctx.sampler.batch(step, mb.index, mb.count)
            mb.backward(
                wl.loss(model, torch.from_numpy(x).to(device), torch.from_numpy(y).to(device))
            )
        ctx.saver.before_optimizer_step()  # a save's device-to-host copy must see this step's
        optim.step()  # parameters, not the next one's
        optim.zero_grad(set_to_none=True)
        session.step_end(step, None, model, optim, tokens=tokens_per_step)
    return session.finish(model)


def write_result(cfg: TrainConfig, result: dict[str, Any]) -> None:
    """``result.json``, carrying this worker's epoch: the watcher takes only its own attempt's
    result, and a writer whose attempt was replaced writes none (trainer.fence)."""
    fence = Fence.from_env(cfg.run_root, EventLog(cfg.run_root))
    if fence.epoch is not None:
        result = {**result, "epoch": fence.epoch}
    path = cfg.run_root / "result.json"
    with fence.hold("write result.json"):
        tmp = path.with_name(f".result.json.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, path)
