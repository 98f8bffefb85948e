"""Script mode: an existing FSDP training script adopts the layers through a small API (public;
the walk-through is docs/training.md, "Script mode").

The script keeps its model, optimizer, data and loop; its train function gets a :class:`Session`
(``init_process_group``, ``resume``, then per step ``step_start`` and ``step_end``, and
``finish``) and the script ends with ``sys.exit(launch(train, run_root=..., data_dir=...,
steps=...))``. ``micro_batches`` (optional) keeps a job whose world may change (``nodes=MIN:MAX``)
bitwise exact: each micro-batch is seeded by (seed, step, micro-batch), so a smaller world
computes the same ones (``tests/scripts/gpt_script.py``). ``launch`` returns the exit code (0
done, 2 bad configuration, 3 fatal). Under the pipeline the config comes from ``NVRX_CONFIG``
(the keyword arguments are then ignored); standalone, they make one.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from trainer.config import TrainConfig, load_config
from trainer.launch import CONFIG_ENV
from trainer.process import ProcessContext
from trainer.rundir import RunResult
from trainer.session import MicroBatch, TrainSession, step_seed

if TYPE_CHECKING:
    from torch import nn

__all__ = ["MicroBatch", "Session", "StepPosition", "launch"]


@dataclass
class StepPosition:
    """The data source of a script: its position is the step (the script's data must depend
    only on the step, the seed and the rank, so resume is exact)."""

    vocab_size: int = 0

    def batch(self, step: int, rank: int, world_size: int) -> Any:
        raise NotImplementedError("a script reads its own data")

    def state_at(self, step: int) -> Any:
        return _Position(step)

    def check_state(self, state: Mapping[str, object], step: int) -> None:
        if state.get("step", step) != step:
            raise ValueError(f"checkpoint data position {state} does not match step {step}")


@dataclass
class _Position:
    step: int

    def to_dict(self) -> dict[str, int]:
        return {"step": self.step}


class Session(TrainSession):
    """One attempt of the script's train function (a new one after each in-process restart):
    the training core the built-in loop runs too, with what a script may read."""

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

    def step_start(self, step: int) -> None:
        """Drills, the step's clock, and torch's RNG seeded by (seed, step, this rank's first
        micro-batch): on a fixed-size world, the rank."""
        super().step_start(step)
        assert self.share is not None
        torch.manual_seed(step_seed(self.cfg.seed, step, self.share.mine[0]))

    def before_optimizer_step(
        self, model: nn.Module | None = None, loss: torch.Tensor | float | None = None
    ) -> bool:
        """Right before ``optim.step()``. With ``model``: the step check (trainer.step_check);
        False when it rejected the step: its gradients are cleared, nothing may be applied, and
        the script computes the same step again (``micro_batches`` reseeds each pass; the
        rank's stream is reseeded here too). ``loss``: this rank's (None: the micro-batches'
        sum, or only gradients are checked). A replay that fails again raises. Without
        ``model`` (older scripts): no check, but a non-finite loss at ``step_end`` is never
        saved and restarts from the newest good state. On CUDA it also waits for the
        device-to-host copy of a save in flight (the copy must see this step's parameters)."""
        if model is not None and not self.check_step(self._step, model, loss):
            assert self.share is not None
            torch.manual_seed(step_seed(self.cfg.seed, self._step, self.share.mine[0]))
            return False
        self.ctx.saver.before_optimizer_step()
        return True


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

    def body(ctx: ProcessContext, call_wrapper: Any) -> RunResult:
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
