"""The train function: build, resume, step, save. Re-entered by the in-process Wrapper after a
fault, so everything it builds (process groups, model, optimizer) is built again each time;
what outlives a restart (sampler, async writer, heartbeat client) is passed in."""

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

from trainer import manifest
from trainer.async_ckpt import AsyncCheckpointer
from trainer.checkpoint import CheckpointManager
from trainer.config import TrainConfig
from trainer.data import StepSampler
from trainer.digest import params_sha256
from trainer.events import EventLog, read_events
from trainer.faults import FaultInjector, FaultSpec
from trainer.model import GPT
from trainer.parallel import Placement, shard_model


@dataclass
class ProcessContext:
    """What one worker process keeps across in-process restarts."""

    cfg: TrainConfig
    placement: Placement
    sampler: StepSampler
    saver: AsyncCheckpointer
    events: EventLog
    heartbeat: Any
    restart_count: int = 0  # ft_launcher's TORCHELASTIC_RESTART_COUNT (this agent's restarts)
    respawned: bool = False  # this worker replaces an earlier one of the same launcher job
    stage_attempt: int = 1  # the pipeline's train-stage attempt (NVRX_STAGE_ATTEMPT)
    base_store: Any = None  # long-lived store for per-iteration process groups (in-process mode)
    started: float = field(default_factory=time.time)


def step_seed(seed: int, step: int, rank: int) -> int:
    digest = hashlib.sha256(f"{seed}:{step}:{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _init_process_group(ctx: ProcessContext, iteration: int) -> tuple[int, int]:
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
    its TORCHELASTIC_RESTART_COUNT, so the restart count alone misses those respawns."""
    return bool(job_id) and any(
        e["kind"] == "train_start" and e.get("job_id") == job_id for e in events
    )


def _recovery_layer(ctx: ProcessContext, iteration: int) -> str | None:
    if iteration > 0:
        return "inprocess"
    if ctx.restart_count > 0 or ctx.respawned:
        return "injob"
    if ctx.stage_attempt > 1:
        return "stage-retry"
    return None


def _emit_recoveries(ctx: ProcessContext, layer: str, step: int) -> None:
    """Rank 0, after the first step completed since a restart: close every open fault."""
    events = read_events(ctx.cfg.run_root)
    last_recovered = max((e["t"] for e in events if e["kind"] == "recovered"), default=0.0)
    now = time.time()
    for e in events:
        if (
            e["kind"] == "fault"
            and e["t"] > last_recovered
            and e.get("fault_kind") != "corrupt-checkpoint"
        ):
            ctx.events.emit(
                "recovered",
                layer=layer,
                fault=e.get("fault"),
                fault_kind=e.get("fault_kind"),
                fault_step=e.get("step"),
                rank=e.get("rank"),
                step=step,
                recovery_s=round(now - e["t"], 3),
            )


def train(ctx: ProcessContext, call_wrapper: Any = None) -> dict[str, Any]:
    """One attempt of the whole training run in this process (all ranks)."""
    cfg = ctx.cfg
    iteration = getattr(call_wrapper, "iteration", 0)
    rank, world = _init_process_group(ctx, iteration)
    # Checkpoint collectives (resume decision, commit, DCP finalize) get their own gloo group:
    # its timeout covers checkpoint I/O, and async-save traffic never collides with FSDP's.
    ckpt_group = dist.new_group(
        backend="gloo", timeout=datetime.timedelta(seconds=cfg.ckpt_timeout_s)
    )
    layer = _recovery_layer(ctx, iteration)
    if rank == 0 and iteration > 0:
        ctx.events.emit("restart", layer="inprocess", iteration=iteration)

    def on_fault(spec: FaultSpec) -> None:
        ctx.events.emit("fault", fault=str(spec), fault_kind=spec.kind, step=spec.step, rank=rank)

    faults = FaultInjector(cfg.faults, cfg.run_root, rank=rank, on_fire=on_fault)
    per_rank = cfg.per_rank_batch(world)

    torch.manual_seed(cfg.seed)  # identical initial weights on every rank and every restart
    model = shard_model(GPT(cfg.model).to(ctx.placement.device), ctx.placement, world)
    optim = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    ckpt = CheckpointManager(
        cfg, ctx.saver, ctx.events, faults, rank=rank, world_size=world, group=ckpt_group
    )
    resumed = ckpt.resume(model, optim, ctx.sampler)
    loss_value = resumed.loss
    tokens_per_step = cfg.global_batch * cfg.model.seq_len
    first_step = resumed.step + 1
    if rank == 0:
        ctx.events.emit(
            "train_start",
            start_step=first_step,
            steps=cfg.steps,
            world_size=world,
            per_rank_batch=per_rank,
            iteration=iteration,
            restart_count=ctx.restart_count,
            job_id=os.environ.get("TORCHELASTIC_RUN_ID"),
        )

    for step in range(first_step, cfg.steps + 1):
        t0 = time.perf_counter()
        faults.maybe_fire(step)
        torch.manual_seed(step_seed(cfg.seed, step, rank))  # dropout RNG: exact on resume
        x, y = ctx.sampler.batch(step, rank, world)
        inputs = torch.from_numpy(x).to(ctx.placement.device)
        targets = torch.from_numpy(y).to(ctx.placement.device)
        loss = model(inputs, targets)
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        reduced = loss.detach().clone()
        dist.all_reduce(reduced)  # gloo has no AVG: sum, then divide
        loss_value = float(reduced.item() / world)
        step_s = time.perf_counter() - t0

        blocking = ckpt.maybe_save(step, model, optim, ctx.sampler, loss_value)
        if blocking is not None:
            faults.maybe_fire(step, phase="checkpoint")
        ckpt.poll()
        ctx.heartbeat.beat()
        if call_wrapper is not None:
            call_wrapper.ping()
        if rank == 0:
            ctx.events.emit(
                "step",
                step=step,
                loss=round(loss_value, 6),
                step_s=round(step_s, 4),
                tokens_per_s=round(tokens_per_step / step_s, 1),
                ckpt_blocking_s=None if blocking is None else round(blocking, 4),
            )
            if step == first_step and layer is not None:
                _emit_recoveries(ctx, layer, step)

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
        _write_result(cfg, result)
        ctx.events.emit("train_end", **{k: v for k, v in result.items() if k != "status"})
    dist.barrier(group=ckpt_group)
    dist.destroy_process_group()
    return result


def _write_result(cfg: TrainConfig, result: dict[str, Any]) -> None:
    path = cfg.run_root / "result.json"
    tmp = path.with_name(".result.json.tmp")
    tmp.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)
