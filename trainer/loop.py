"""The train function: build, resume, step, save. Re-entered by the in-process Wrapper after a
fault, so everything it builds (process groups, model, optimizer) is built again each time;
what outlives a restart (data source, async writer, heartbeat client) is passed in.

The loop is training only: what the workload computes, the checkpoint manager's save/poll, and
four hook points (:mod:`trainer.hooks`) where drills, heartbeats, the Wrapper's ping and events
attach."""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from trainer import manifest, run_state
from trainer.async_ckpt import AsyncCheckpointer
from trainer.checkpoint import CheckpointManager
from trainer.config import TrainConfig
from trainer.digest import params_sha256
from trainer.elastic import PriorWorld, micro_batches, node_id, restart_layer
from trainer.events import EventLog
from trainer.faults import NODE_KINDS
from trainer.fence import Fence
from trainer.hooks import FaultDrills, Heartbeats, Hooks, StepEnd, StepEvents, WrapperPing
from trainer.parallel import Placement
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


def step_seed(seed: int, step: int, rank: int) -> int:
    digest = hashlib.sha256(f"{seed}:{step}:{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


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


def is_respawn(events: list[dict[str, Any]], job_id: str | None) -> bool:
    """Was a worker of this launcher job (same rendezvous id) already training? With several
    nodes, an agent that restarts because *another* node's workers failed does not count it in
    its TORCHELASTIC_RESTART_COUNT, so the restart count alone misses those respawns. (Of
    recorded events; a worker asks its run's fold, :meth:`RunHistory.is_respawn`.)"""
    from trainer.history import RunHistory

    return RunHistory.of(events).is_respawn(job_id)


def recovery_layer(ctx: ProcessContext, iteration: int, world: int) -> str | None:
    if iteration > 0:
        return "inprocess"
    if ctx.restart_count > 0 or ctx.respawned:
        return restart_layer(ctx.prior, world)
    if ctx.stage_attempt > 1:
        return "stage-retry"
    return None


def build_hooks(
    ctx: ProcessContext, *, rank: int, call_wrapper: Any, first_step: int, layer: str | None
) -> Hooks:
    """The fault-tolerance hooks of this worker, in the order they run at each point."""
    hooks: list[Any] = [FaultDrills(ctx.cfg.faults, ctx.cfg.run_root, ctx.events, rank=rank)]
    hooks.append(Heartbeats(ctx.heartbeat))
    if call_wrapper is not None:
        hooks.append(WrapperPing(call_wrapper))
    if rank == 0:
        launcher_drills = any(spec.startswith(NODE_KINDS) for spec in ctx.cfg.faults)
        hooks.append(
            StepEvents(
                ctx.events,
                first_step=first_step,
                recovery_layer=layer,
                buffered=not launcher_drills,
            )
        )
    return Hooks(*hooks)


def train(ctx: ProcessContext, call_wrapper: Any = None) -> dict[str, Any]:
    """One attempt of the whole training run in this process (all ranks)."""
    cfg, wl = ctx.cfg, ctx.cfg.wl
    device = ctx.placement.device
    iteration = getattr(call_wrapper, "iteration", 0)
    entered = time.time()
    rank, world = init_process_group(ctx, iteration)
    # Checkpoint collectives (resume decision, commit, DCP finalize) get their own gloo group:
    # its timeout covers checkpoint I/O, and async-save traffic never collides with FSDP's.
    ckpt_group = dist.new_group(
        backend="gloo", timeout=datetime.timedelta(seconds=cfg.ckpt_timeout_s)
    )
    if rank == 0 and iteration > 0:
        ctx.events.emit("restart", layer="inprocess", iteration=iteration)
    count = cfg.micro_batch_count(world)
    mine = micro_batches(rank, world, count)
    # Passes every rank runs per step: the largest share (shares differ by one when the world
    # does not divide the micro-batches, e.g. 3 on 2 ranks after a 2:3 job lost a node).
    passes = -(-count // world)
    # FSDP averages the gradient over the world; a rank's micro-batches are scaled so that the
    # average is their mean over the whole global batch (1 on a full world: nothing to scale).
    scale = world / count
    phase = _Phases(ctx.events if rank == 0 else None, since=entered)
    phase("process_group")

    torch.manual_seed(cfg.seed)  # identical initial weights on every rank and every restart
    model = wl.shard(wl.build_model(device), device=device, world_size=world)
    optim = wl.build_optimizer(model, OptimSettings(lr=cfg.lr, weight_decay=cfg.weight_decay))
    phase("model_built")
    ckpt = CheckpointManager(
        cfg,
        ctx.saver,
        ctx.events,
        rank=rank,
        world_size=world,
        group=ckpt_group,
        sections=ctx.heartbeat,
    )
    resumed = ckpt.resume(model, optim, ctx.sampler)
    first_step = resumed.step + 1
    hooks = build_hooks(
        ctx,
        rank=rank,
        call_wrapper=call_wrapper,
        first_step=first_step,
        layer=recovery_layer(ctx, iteration, world),
    )
    ckpt.on_commit = hooks.on_commit
    if call_wrapper is not None:
        ckpt.progress = call_wrapper.ping
    nodes = world_nodes(world, ckpt_group)
    if rank == 0 and ctx.prior is not None and iteration == 0 and ctx.prior.world_size != world:
        ctx.events.emit(
            "world_change",
            from_world=ctx.prior.world_size,
            to_world=world,
            from_nodes=list(ctx.prior.nodes),
            nodes=nodes,
            step=first_step,
            cause="shrink" if world < ctx.prior.world_size else "grow",
        )
    if rank == 0:
        ctx.events.emit(
            "train_start",
            start_step=first_step,
            steps=cfg.steps,
            world_size=world,
            per_rank_batch=cfg.micro_batch_size(world) * len(mine),
            micro_batches=count,
            accumulation=len(mine),
            nodes=nodes,
            iteration=iteration,
            restart_count=ctx.restart_count,
            job_id=os.environ.get("TORCHELASTIC_RUN_ID"),
            workload=wl.ref,
        )
        with ckpt.fence.hold("record the launch"):
            run_state.record_launch(
                cfg.run_root,
                job_id=os.environ.get("TORCHELASTIC_RUN_ID"),
                world_size=world,
                nodes=nodes,
            )

    loss_value = resumed.loss
    tokens_per_step = cfg.global_batch * wl.seq_len
    for step in range(first_step, cfg.steps + 1):
        t0 = time.perf_counter()
        hooks.on_step_start(step)
        loss = _accumulate(ctx, model, step, mine, count, scale, passes)
        ctx.saver.before_optimizer_step()  # a save's device-to-host copy must see this step's
        optim.step()  # parameters, not the next one's
        optim.zero_grad(set_to_none=True)
        # One all-reduce a step: the loss (gloo has no AVG: sum, then divide) and whether the
        # save in flight is done on every rank.
        reduced = torch.cat([loss.detach().float().reshape(1), ckpt.save_flags().to(device)])
        dist.all_reduce(reduced)
        reduced = reduced.cpu()
        loss_value = float(reduced[0].item() / count)
        step_s = time.perf_counter() - t0

        blocking = ckpt.maybe_save(step, model, optim, ctx.sampler, loss_value)
        if blocking is not None:
            hooks.on_save_started(step)
        ckpt.poll(reduced=reduced[1:] if blocking is None else None)
        hooks.on_step_end(StepEnd(step, loss_value, step_s, tokens_per_step, blocking))

    ckpt.finish()
    digest = params_sha256(model, rank=rank)
    result = {
        "status": "completed",
        "final_step": cfg.steps,
        "final_loss": loss_value,
        "params_sha256": digest,
        "world_size": world,
        "latest_checkpoint": manifest.read_latest(cfg.run_root),
        "config_hash": cfg.fingerprint(),
    }
    if rank == 0:
        write_result(cfg, result)
        ctx.events.emit("train_end", **{k: v for k, v in result.items() if k != "status"})
    dist.barrier(group=ckpt_group)
    dist.destroy_process_group()
    return result


def world_nodes(world: int, group: Any) -> list[int]:
    """The nodes this world's ranks run on (trainer.elastic.node_id), once per start: what the
    watcher reads to tell a training node from a waiting spare."""
    mine = torch.tensor([node_id()], dtype=torch.int64)
    if world == 1:
        return [int(mine.item())]
    every = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    return sorted({int(t.item()) for t in every})


def _accumulate(
    ctx: ProcessContext,
    model: Any,
    step: int,
    mine: range,
    count: int,
    scale: float,
    passes: int | None = None,
) -> torch.Tensor:
    """Forward and backward of this rank's micro-batches of ``step``; the sum of their losses.

    Each micro-batch has its own data slice and dropout stream, keyed by its index among
    ``count``, not by the rank that trains it: a smaller world computes the same micro-batches.
    FSDP reduces the gradient once, after the last of them.

    ``passes``: how many forward/backward passes every rank runs. FSDP all-gathers parameters
    in each one, collectives every rank must join, so a rank whose share is smaller (the world
    does not divide the micro-batches) pads with passes over its last micro-batch weighted 0:
    their gradient is exactly 0.0, which leaves the accumulated gradient bitwise unchanged."""
    cfg, wl, device = ctx.cfg, ctx.cfg.wl, ctx.placement.device
    sync = getattr(model, "set_requires_gradient_sync", None)
    plan = [(m, scale) for m in mine]
    plan += [(mine[-1], 0.0)] * max(0, (passes or len(mine)) - len(mine))
    total: torch.Tensor | None = None
    for i, (m, weight) in enumerate(plan):
        if sync is not None and len(plan) > 1:
            sync(i == len(plan) - 1)
        torch.manual_seed(step_seed(cfg.seed, step, m))  # dropout RNG: exact on resume
        x, y = ctx.sampler.batch(step, m, count)
        loss = wl.loss(model, torch.from_numpy(x).to(device), torch.from_numpy(y).to(device))
        (loss if weight == 1 else loss * weight).backward()
        if weight != 0:
            total = loss.detach() if total is None else total + loss.detach()
    assert total is not None  # micro_batches() gives every rank at least one
    return total


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
