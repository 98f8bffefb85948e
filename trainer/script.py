"""Script mode: an existing FSDP training script adopts the layers through a small API (public).

The script keeps its model, optimizer, data and loop. It adds: a ``Session`` handed to its train
function, three calls in the loop, and the launch at the bottom::

    from trainer import script as nvrx

    def train(session: nvrx.Session) -> None:
        session.init_process_group()            # instead of dist.init_process_group()
        model, optim = build()                  # the script's own, FSDP2-sharded
        start = session.resume(model, optim)    # exact position: 1 on a fresh run
        for step in range(start, args.steps + 1):
            session.step_start(step)            # drills; per-(seed, step, rank) RNG
            loss = ...                          # the script's own step; its data must be a
            session.step_end(step, loss, model, optim)  # function of the step (exact resume)
        session.finish(model)

    if __name__ == "__main__":
        sys.exit(nvrx.launch(train, run_root=args.run_root, data_dir=args.data_dir,
                             steps=args.steps))

What each call does:
- ``init_process_group``: the process group of this restart iteration (a fresh prefix on a
  long-lived store under in-process restart, so it can be re-created after a fault);
- ``resume``: loads the newest valid committed checkpoint into the model and optimizer (DCP,
  resharding across world sizes); returns the first step to run;
- ``step_start``: fault drills; reseeds torch's RNG from (seed, step, rank);
- ``step_end``: the step's loss averaged over ranks into ``events.jsonl`` (the pipeline's
  progress), the ft_launcher heartbeat, the in-process Wrapper's ping, and an async checkpoint
  when one is due, committed with the manifest protocol;
- ``finish``: waits for the last commit and writes ``result.json`` with the parameters' digest;
- ``launch``: runs ``train`` under in-process restart when the installed NVRx has it and the
  config enables it, sends heartbeats under ft_launcher, and returns the exit code (0 done,
  2 bad configuration, 3 fatal). Under the pipeline the config comes from ``NVRX_CONFIG``
  (the keyword arguments are then ignored); standalone, they make one.

Each layer stays optional: without ft_launcher there are no heartbeats, with
``inprocess.enabled=False`` (or NVRx >= 0.7, which deprecates it) the function runs once.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from trainer import manifest, run_state
from trainer.checkpoint import CheckpointManager
from trainer.config import TrainConfig, load_config
from trainer.digest import params_sha256
from trainer.hooks import Hooks, StepEnd
from trainer.launch import CONFIG_ENV
from trainer.loop import (
    ProcessContext,
    build_hooks,
    init_process_group,
    recovery_layer,
    step_seed,
    world_nodes,
    write_result,
)

__all__ = ["Session", "StepPosition", "launch"]


@dataclass
class StepPosition:
    """The data source of a script: its position is the step (the script's data must depend
    only on the step, the seed and the rank, so resume is exact)."""

    vocab_size: int = 0

    def batch(self, step: int, rank: int, world_size: int) -> Any:
        raise NotImplementedError("a script reads its own data")

    def state_at(self, step: int) -> Any:
        return _Position(step)

    def check_state(self, state: dict[str, Any], step: int) -> None:
        if state.get("step", step) != step:
            raise ValueError(f"checkpoint data position {state} does not match step {step}")


@dataclass
class _Position:
    step: int

    def to_dict(self) -> dict[str, int]:
        return {"step": self.step}


class Session:
    """One attempt of the script's train function (a new one after each in-process restart)."""

    def __init__(self, ctx: ProcessContext, call_wrapper: Any = None) -> None:
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.call_wrapper = call_wrapper
        self.iteration = getattr(call_wrapper, "iteration", 0)
        self.rank = int(os.environ.get("RANK", "0"))
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self._ckpt: CheckpointManager | None = None
        self._hooks: Hooks | None = None
        self._loss: float | None = None
        self._t0 = 0.0
        self.result: dict[str, Any] | None = None  # set by finish()

    # -- what the script may read --------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.ctx.placement.device

    @property
    def steps(self) -> int:
        return self.cfg.steps

    @property
    def seed(self) -> int:
        return self.cfg.seed

    @property
    def run_root(self) -> Path:
        return self.cfg.run_root

    @property
    def data_dir(self) -> Path:
        return self.cfg.data_dir

    # -- the calls -----------------------------------------------------------------------------
    def init_process_group(self) -> tuple[int, int]:
        self.rank, self.world_size = init_process_group(self.ctx, self.iteration)
        if self.rank == 0 and self.iteration > 0:
            self.ctx.events.emit("restart", layer="inprocess", iteration=self.iteration)
        return self.rank, self.world_size

    def resume(self, model: nn.Module, optim: Optimizer) -> int:
        if not dist.is_initialized():
            raise RuntimeError("call session.init_process_group() before session.resume()")
        group = dist.new_group(
            backend="gloo", timeout=datetime.timedelta(seconds=self.cfg.ckpt_timeout_s)
        )
        self._ckpt = CheckpointManager(
            self.cfg,
            self.ctx.saver,
            self.ctx.events,
            rank=self.rank,
            world_size=self.world_size,
            group=group,
            sections=self.ctx.heartbeat,
        )
        resumed = self._ckpt.resume(model, optim, self.ctx.sampler)
        self._loss = resumed.loss
        first = resumed.step + 1
        self._hooks = build_hooks(
            self.ctx,
            rank=self.rank,
            call_wrapper=self.call_wrapper,
            first_step=first,
            layer=recovery_layer(self.ctx, self.iteration, self.world_size),
        )
        self._ckpt.on_commit = self._hooks.on_commit
        if self.call_wrapper is not None:
            self._ckpt.progress = self.call_wrapper.ping
        nodes = world_nodes(self.world_size, group)
        if self.rank == 0:
            self.ctx.events.emit(
                "train_start",
                start_step=first,
                steps=self.cfg.steps,
                world_size=self.world_size,
                nodes=nodes,
                iteration=self.iteration,
                restart_count=self.ctx.restart_count,
                job_id=os.environ.get("TORCHELASTIC_RUN_ID"),
                workload=self.cfg.workload,
            )
            with self._ckpt.fence.hold("record the launch"):
                run_state.record_launch(
                    self.cfg.run_root,
                    job_id=os.environ.get("TORCHELASTIC_RUN_ID"),
                    world_size=self.world_size,
                    nodes=nodes,
                )
        return first

    def step_start(self, step: int) -> None:
        self._require_resumed().on_step_start(step)
        torch.manual_seed(step_seed(self.cfg.seed, step, self.rank))
        self._t0 = time.perf_counter()

    def before_optimizer_step(self) -> None:
        """Optional, right before ``optim.step()``: on CUDA, waits for the device-to-host copy
        of a save in flight (the copy must see this step's parameters)."""
        self.ctx.saver.before_optimizer_step()

    def step_end(
        self,
        step: int,
        loss: torch.Tensor | float,
        model: nn.Module,
        optim: Optimizer,
        *,
        tokens: int = 0,
    ) -> None:
        """``tokens``: tokens in the step's global batch, for the tokens/s the progress shows
        (optional)."""
        hooks, ckpt = self._require_resumed(), self._ckpt
        assert ckpt is not None
        value = torch.as_tensor(loss).detach().float().reshape(1).clone().cpu()
        dist.all_reduce(value)  # gloo has no AVG: sum, then divide
        self._loss = float(value.item()) / self.world_size
        step_s = time.perf_counter() - self._t0
        blocking = ckpt.maybe_save(step, model, optim, self.ctx.sampler, self._loss)
        if blocking is not None:
            hooks.on_save_started(step)
        ckpt.poll()
        hooks.on_step_end(StepEnd(step, self._loss, step_s, tokens, blocking))

    def finish(self, model: nn.Module) -> dict[str, Any]:
        ckpt = self._ckpt
        if ckpt is None:
            raise RuntimeError("call session.resume() first")
        ckpt.finish()
        result = {
            "status": "completed",
            "final_step": self.cfg.steps,
            "final_loss": self._loss,
            "params_sha256": params_sha256(model, rank=self.rank),
            "world_size": self.world_size,
            "latest_checkpoint": manifest.read_latest(self.cfg.run_root),
            "config_hash": self.cfg.fingerprint(),
        }
        if self.rank == 0:
            write_result(self.cfg, result)
            self.ctx.events.emit("train_end", **{k: v for k, v in result.items() if k != "status"})
        dist.barrier(group=ckpt.group)
        dist.destroy_process_group()
        self.result = result
        return result

    def _require_resumed(self) -> Hooks:
        if self._hooks is None:
            raise RuntimeError("call session.resume(model, optim) before the training loop")
        return self._hooks


def launch(
    train: Callable[[Session], Any],
    *,
    run_root: str | Path | None = None,
    data_dir: str | Path | None = None,
    steps: int | None = None,
    **overrides: Any,
) -> int:
    """Run ``train`` under the layers; returns the process exit code."""
    from trainer.config import ConfigError
    from trainer.train import execute

    try:
        cfg = _config(run_root, data_dir, steps, overrides)
    except ConfigError as e:
        print(f"error: invalid configuration: {e}", file=sys.stderr)
        return 2

    def body(ctx: ProcessContext, call_wrapper: Any) -> dict[str, Any]:
        session = Session(ctx, call_wrapper)
        train(session)
        if session.result is None:
            raise RuntimeError("the train function returned without calling session.finish()")
        return session.result

    return execute(cfg, body, data=lambda cfg: StepPosition())


def _config(
    run_root: str | Path | None,
    data_dir: str | Path | None,
    steps: int | None,
    overrides: dict[str, Any],
) -> TrainConfig:
    path = os.environ.get(CONFIG_ENV)
    if path:  # under the pipeline (or trainer.launch): the attempt's whole config
        return load_config(Path(path))
    from trainer.config import ConfigError

    if run_root is None or data_dir is None:
        raise ConfigError(
            "run_root", f"pass run_root and data_dir to launch(), or set {CONFIG_ENV}"
        )
    if steps is not None:
        overrides["steps"] = steps
    cfg = TrainConfig(
        run_root=Path(run_root),
        data_dir=Path(data_dir),
        workload=f"script:{Path(sys.argv[0]).absolute()}",
    )
    return dataclasses.replace(cfg, **overrides) if overrides else cfg
