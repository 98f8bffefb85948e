"""The train function: build, resume, step, save. Re-entered by the in-process Wrapper after a
fault, so everything it builds (process groups, model, optimizer) is built again each time;
what outlives a restart (data source, async writer, heartbeat client) is passed in.

The loop is training only: what the workload computes, the checkpoint manager's save/poll, and
four hook points (:mod:`trainer.hooks`) where drills, heartbeats, the Wrapper's ping and events
attach."""

from __future__ import annotations

import time
from typing import Any

import torch

from trainer.event_types import Phase
from trainer.events import EventLog
from trainer.process import ProcessContext
from trainer.rundir import RunResult
from trainer.session import TrainSession
from trainer.workload import OptimSettings


class _Phases:
    """Rank 0: a ``phase`` event per start-up phase of this incarnation, with its seconds since
    the previous one (trainer.timeline splits a recovery with them)."""

    def __init__(self, events: EventLog | None, *, since: float) -> None:
        self.events = events
        self.t = since

    def __call__(self, name: str) -> None:
        now = time.time()
        if self.events is not None:
            self.events.emit(Phase(phase=name, s=round(now - self.t, 4)))
        self.t = now


def train(ctx: ProcessContext, call_wrapper: Any = None) -> RunResult:
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
        applied = False
        while not applied:  # a step the check rejects is computed again, nothing applied
            for mb in session.micro_batches(step, model):
                x, y = ctx.sampler.batch(step, mb.index, mb.count)
                mb.backward(
                    wl.loss(model, torch.from_numpy(x).to(device), torch.from_numpy(y).to(device))
                )
            applied = session.check_step(step, model)
        ctx.saver.before_optimizer_step()  # a save's device-to-host copy must see this step's
        optim.step()  # parameters, not the next one's
        optim.zero_grad(set_to_none=True)
        session.step_end(step, None, model, optim, tokens=tokens_per_step)
    return session.finish(model)
