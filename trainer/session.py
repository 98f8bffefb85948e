"""One training core (arch §5): what the built-in loop (:mod:`trainer.loop`) and script mode
(:mod:`trainer.script`) both run around the model's own forward and backward.

A :class:`TrainSession` is one attempt of the train function in this process (a new one after
each in-process restart), called in order: ``init_process_group``, ``resume``, then per step
``step_start``, ``micro_batches``, ``step_end``, and ``finish``. Each micro-batch's dropout stream
is seeded by (seed, step, micro-batch), never by rank: a smaller world computes the same
micro-batches, so an elastic run is bitwise exact.
"""

from __future__ import annotations

import datetime
import hashlib
import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from trainer import checkpointing, notice
from trainer.checkpointing.manager import CheckpointManager
from trainer.digest import params_sha256
from trainer.elastic import micro_batches, node_id
from trainer.errors import ExitCode
from trainer.event_types import Handoff, Restart, TrainEnd, TrainStart, WorldChange
from trainer.faults import FaultKind
from trainer.gray_drills import GrayDrills
from trainer.hooks import FaultDrills, Hooks, StepEnd
from trainer.process import ProcessContext, build_hooks, init_process_group
from trainer.rundir import RunDir, RunResult
from trainer.step_check import StepChecker

if TYPE_CHECKING:
    from torch import nn
    from torch.optim import Optimizer


def step_seed(seed: int, step: int, index: int) -> int:
    """The RNG seed of one micro-batch (or, in a plain script, one rank) of one step."""
    digest = hashlib.sha256(f"{seed}:{step}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@dataclass(frozen=True)
class Share:
    """This rank's share of a step's global batch (trainer.elastic): ``count`` micro-batches
    in all, ``mine`` computed here in ``passes`` forward/backward passes."""

    count: int
    mine: range
    # Passes every rank runs: the largest share (shares differ by one when the world does not
    # divide the micro-batches).
    passes: int
    # FSDP averages the gradient over the world: scaled, it is the mean over the global batch.
    scale: float

    @classmethod
    def of(cls, rank: int, world: int, count: int) -> Share:
        return cls(count, micro_batches(rank, world, count), -(-count // world), world / count)

    def plan(self) -> list[tuple[int, float]]:
        """(micro-batch, weight) per pass. FSDP all-gathers parameters in each pass, collectives
        every rank must join, so a rank whose share is smaller pads with passes over its last
        micro-batch weighted 0: their gradient is exactly 0.0, which leaves the accumulated
        gradient bitwise unchanged."""
        plan = [(m, self.scale) for m in self.mine]
        return plan + [(self.mine[-1], 0.0)] * max(0, self.passes - len(self.mine))


@dataclass
class MicroBatch:
    """One forward/backward pass of a step: ``index`` among ``count`` micro-batches picks the
    data (the same on any world); :meth:`backward` weights its loss."""

    index: int
    count: int
    weight: float
    _session: TrainSession

    def backward(self, loss: torch.Tensor) -> None:
        (loss if self.weight == 1 else loss * self.weight).backward()
        if self.weight != 0:  # a padding pass adds nothing to the step's loss either
            self._session._add_loss(loss.detach())


class TrainSession:
    """One attempt of the train function in this process."""

    def __init__(self, ctx: ProcessContext, call_wrapper: Any = None) -> None:
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.call_wrapper = call_wrapper
        self.iteration = int(getattr(call_wrapper, "iteration", 0))
        # When this incarnation began: only faults recorded before it are ones it recovers from.
        self.began = time.time()
        self.rank = int(os.environ.get("RANK", "0"))
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.share: Share | None = None
        self.ckpt_group: Any = None
        self.peer_group: Any = None
        self.ckpt: CheckpointManager | None = None
        self.hooks: Hooks | None = None
        self.loss: float | None = None  # the newest step's loss (all ranks), or the resumed one
        self.result: RunResult | None = None  # set by finish()
        self.checker: StepChecker | None = None  # set by resume()
        self._t0 = 0.0
        self._busy_t0 = 0.0  # the step's (or its replay's) start: the check's busy time
        self._step = 0
        self._step_loss: torch.Tensor | None = None  # micro-batch losses of the step so far

    # -- the attempt ---------------------------------------------------------------------------
    def init_process_group(self) -> tuple[int, int]:
        self.rank, self.world_size = init_process_group(self.ctx, self.iteration)
        # Checkpoint collectives get their own gloo group: its timeout covers checkpoint I/O, and
        # async-save traffic never collides with FSDP's.
        timeout = datetime.timedelta(seconds=self.cfg.checkpoint.durable.timeout_s)
        self.ckpt_group = dist.new_group(backend="gloo", timeout=timeout)
        # The peer copies' own (issue 29, item 2), out of the training collectives' way; made by
        # every rank (a group is collective), used by those with node memory.
        if self.world_size > 1 and self.cfg.checkpoint.memory.enabled:
            self.peer_group = dist.new_group(backend="gloo", timeout=timeout)
        if self.rank == 0 and self.iteration > 0:
            self.ctx.events.emit(Restart(layer="inprocess", iteration=self.iteration))
        self.share = Share.of(
            self.rank, self.world_size, self.cfg.micro_batch_count(self.world_size)
        )
        return self.rank, self.world_size

    def resume(self, model: nn.Module, optim: Optimizer, **start: Any) -> int:
        """Load the newest valid commit; returns the first step to run. ``start``: more fields
        of the ``train_start`` event (the built-in loop's batch shape)."""
        if self.ckpt_group is None:
            raise RuntimeError("call session.init_process_group() before session.resume()")
        ctx, cfg, rank, world = self.ctx, self.cfg, self.rank, self.world_size
        self.ckpt = ckpt = CheckpointManager(
            cfg,
            ctx.saver,
            ctx.events,
            rank=rank,
            world_size=world,
            group=self.ckpt_group,
            sections=ctx.heartbeat,
            node=ctx.node_memory,
            peer_group=self.peer_group,
        )
        if any(spec.kind is FaultKind.CORRUPT_PEER for spec in cfg.faults):
            # The one drill a resume itself fires (before the loop's hooks exist).
            ckpt.on_offer = FaultDrills(
                cfg.faults, cfg.run_root, ctx.events, rank=rank, node_memory=ctx.node_memory
            ).on_offer
        resumed = ckpt.resume(model, optim, ctx.sampler)
        self.loss = resumed.loss
        first = resumed.step + 1
        self.hooks = build_hooks(
            ctx,
            rank=rank,
            first_step=first,
            layer=ctx.origin.layer(self.iteration, world),
            began=self.began,
        )
        ckpt.on_commit = self.hooks.on_commit
        self.checker = self._step_checker()
        nodes = world_nodes(world, self.ckpt_group)
        if rank != 0:
            return first
        prior = ctx.origin.prior
        if prior is not None and self.iteration == 0 and prior.world_size != world:
            ctx.events.emit(
                WorldChange(
                    from_world=prior.world_size,
                    to_world=world,
                    from_nodes=list(prior.nodes),
                    nodes=nodes,
                    step=first,
                    cause="shrink" if world < prior.world_size else "grow",
                )
            )
        job_id = os.environ.get("TORCHELASTIC_RUN_ID")
        ctx.events.emit(
            TrainStart(
                start_step=first,
                steps=cfg.steps,
                world_size=world,
                micro_batches=self._share().count,
                accumulation=len(self._share().mine),
                nodes=nodes,
                iteration=self.iteration,
                restart_count=ctx.restart_count,
                job_id=job_id,
                **{"workload": cfg.workload, **start},
            )
        )
        with ckpt.fence.hold("record the launch"):
            RunDir(cfg.run_root).record_launch(job_id=job_id, world_size=world, nodes=nodes)
        return first

    def step_start(self, step: int) -> None:
        self._hooks().on_step_start(step)
        self._step_loss = None
        self._step = step
        self._t0 = self._busy_t0 = time.perf_counter()

    def micro_batches(self, step: int, model: nn.Module) -> Iterator[MicroBatch]:
        """This rank's passes of ``step``, each with its dropout stream seeded by (seed, step,
        micro-batch), and ``model``'s (the FSDP root's) gradient reduced once, after the last.
        ``mb.backward(loss)`` weights each; ``step_end(step, None, ...)`` takes their sum."""
        share = self._share()
        plan = share.plan()
        sync = getattr(model, "set_requires_gradient_sync", None)
        for i, (m, weight) in enumerate(plan):
            if sync is not None and len(plan) > 1:
                sync(i == len(plan) - 1)
            torch.manual_seed(step_seed(self.cfg.seed, step, m))
            yield MicroBatch(m, share.count, weight, self)

    def check_step(
        self, step: int, model: nn.Module, loss: torch.Tensor | float | None = None
    ) -> bool:
        """Every rank, after backward and before ``optimizer.step()`` (trainer.step_check):
        True to apply the update. False: the step was rejected, its gradients are cleared and
        nothing was applied; compute the same step again (its micro-batches are seeded by
        (seed, step, micro-batch), so a clean replay is bitwise the step it replaces). A replay
        that fails again raises :class:`~trainer.step_check.StepCheckFailed`. ``loss``: this
        rank's (None: the sum :meth:`micro_batches` kept, if any)."""
        checker = self._checker()
        if not checker.cfg.enabled:
            return True
        if loss is None:
            loss = self._step_loss
        if isinstance(loss, torch.Tensor):
            loss = loss.detach()
        count = self._share().count
        if checker.check(step, model, loss, count=count, started=self._busy_t0):
            return True
        model.zero_grad(set_to_none=True)
        self._step_loss = None
        self._busy_t0 = time.perf_counter()
        return False

    def _step_checker(self) -> StepChecker:
        ctx, rank = self.ctx, self.rank
        node = node_id()
        drills = GrayDrills(
            self.cfg.faults,
            self.cfg.run_root,
            ctx.events,
            rank=rank,
            node=node,
            guard=RunDir.from_env(self.cfg.run_root).fence(ctx.events).hold,
        )
        beat = getattr(ctx.heartbeat, "beat", None)
        return StepChecker(
            self.cfg.step_check,
            rank,
            self.world_size,
            node,
            ctx.events if rank == 0 else None,
            ctx.placement.device,
            corrupt=drills.corrupt,
            slow=drills.slow,
            beat=beat if beat is not None else (lambda: None),
        )

    def _checker(self) -> StepChecker:
        if self.checker is None:
            raise RuntimeError("call session.resume(model, optim) before the training loop")
        return self.checker

    def _add_loss(self, loss: torch.Tensor) -> None:
        self._step_loss = loss if self._step_loss is None else self._step_loss + loss

    def step_end(
        self,
        step: int,
        loss: torch.Tensor | float | None,
        model: nn.Module,
        optim: Optimizer,
        *,
        tokens: int = 0,
    ) -> float:
        """After the optimizer step: ``loss`` is the sum of this rank's micro-batch losses
        (a plain script's one loss per rank; None: the sum :meth:`micro_batches` kept);
        ``tokens``: the step's global batch's, for tokens/s (optional). One all-reduce carries
        the loss and whether the save in flight is done on every rank; returns the step's loss
        over the global batch."""
        hooks, ckpt = self._hooks(), self.ckpt
        assert ckpt is not None
        if loss is None:
            if self._step_loss is None:
                raise RuntimeError("step_end(loss=None) needs session.micro_batches(step) first")
            loss = self._step_loss
        value = torch.as_tensor(loss).detach().float().reshape(1)
        device = value.device
        # gloo has no AVG: sum, then divide by the micro-batches of the global batch. The last
        # slot counts the ranks whose node was told to go (trainer.notice).
        told = torch.tensor([1.0 if notice.given() else 0.0])
        reduced = torch.cat([value, ckpt.save_flags().to(device), told.to(device)])
        dist.all_reduce(reduced)
        reduced = reduced.cpu()
        leaving = int(reduced[-1].item())
        reduced = reduced[:-1]
        self.loss = float(reduced[0].item() / self._share().count)
        checker = self._checker()
        checked = checker.cfg.enabled and checker.checked == step
        if checker.cfg.enabled and not checked and not math.isfinite(self.loss):
            checker.refuse(step, self.loss)  # raises: the update is never saved
        step_s = time.perf_counter() - self._t0
        blocking = ckpt.maybe_save(step, model, optim, self.ctx.sampler, self.loss, step_s)
        if blocking is not None:  # a durable save started at this step
            hooks.on_save_started(step)
        ckpt.poll(reduced=reduced[1:] if blocking is None else None)
        # What the step waited on, a durable save's hand-off and a memory save's copy alike.
        memory = ckpt.take_memory_blocking()
        if memory is not None:
            blocking = (blocking or 0.0) + memory
        nodes = checker.last.node_times() if checked and checker.last is not None else None
        hooks.on_step_end(StepEnd(step, self.loss, step_s, tokens, blocking, nodes))
        if leaving:
            self._hand_off(step, leaving, self.loss, model, optim)
        return self.loss

    def _hand_off(
        self, step: int, leaving: int, loss: float, model: nn.Module, optim: Optimizer
    ) -> None:
        """Every rank, at the step where they all heard that a node must go (an eviction's
        notice): that step saved durably and committed, then the ranks told to go leave
        (:func:`trainer.notice.leave`). The others train on and meet the loss at their next
        collective, as after any node loss; whichever way the job goes on (a spare, an elastic
        shrink, a stage retry), it resumes here: nothing before the step in flight is lost."""
        ckpt = self.ckpt
        assert ckpt is not None
        t0 = time.perf_counter()
        path = ckpt.save_now(step, model, optim, self.ctx.sampler, loss)
        if self.rank == 0:
            self.ctx.events.emit(
                Handoff(
                    step=step,
                    leaving=leaving,
                    path=str(path) if path is not None else None,
                    save_s=round(time.perf_counter() - t0, 3),
                )
            )
        saved = f"step {step} is saved and committed"
        if notice.given():
            why = f"node {node_id()} was told to go (an eviction's notice): {saved}; leaving"
            notice.leave(why, self.ctx.saver, ExitCode.LEFT)
        why = f"{leaving} rank(s) left with notice: {saved}; restarting without them"
        notice.leave(why, self.ctx.saver, ExitCode.REFORM)

    def finish(self, model: nn.Module) -> RunResult:
        ckpt = self.ckpt
        if ckpt is None:
            raise RuntimeError("call session.resume() first")
        ckpt.finish()
        result = RunResult(
            status="completed",
            final_step=self.cfg.steps,
            final_loss=self.loss,
            params_sha256=params_sha256(model, rank=self.rank),
            world_size=self.world_size,
            latest_checkpoint=checkpointing.read_latest(self.cfg.run_root),
            config_hash=self.cfg.fingerprint(),
        )
        if self.rank == 0:
            RunDir.from_env(self.cfg.run_root).write_result(result, self.ctx.events)
            end = result.model_dump(exclude={"status", "error", "requeue", "epoch"})
            self.ctx.events.emit(TrainEnd(**end))
        dist.barrier(group=ckpt.group)
        dist.destroy_process_group()
        self.result = result
        return result

    def _hooks(self) -> Hooks:
        if self.hooks is None:
            raise RuntimeError("call session.resume(model, optim) before the training loop")
        return self.hooks

    def _share(self) -> Share:
        if self.share is None:
            raise RuntimeError("call session.init_process_group() first")
        return self.share


def world_nodes(world: int, group: Any) -> list[int]:
    """The nodes this world's ranks run on (trainer.elastic.node_id), once per start: what the
    watcher reads to tell a training node from a waiting spare."""
    mine = torch.tensor([node_id()], dtype=torch.int64)
    if world == 1:
        return [int(mine.item())]
    every = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    return sorted({int(t.item()) for t in every})
