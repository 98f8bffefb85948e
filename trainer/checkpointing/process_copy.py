"""The process's own copy of its last save (issue 29, item 1: the first tier, in-process).

Every save first snapshots the rank's state into CPU staging buffers
(:mod:`~trainer.checkpointing.staging`), which hold it until the next save refills them. An
in-process restart keeps the process, so when every rank still holds the same step and nothing
newer is committed, it reloads from that snapshot with no read at all (:class:`OwnCopyRestorer`),
and may replay fewer steps (a save in flight at the fault is newer than the newest commit).
It never left the process (no digest, no torn file), but it must be complete (a fault during
the staging copy drops it), of the current layout (staging reallocates, and the copy goes) and
finite (a NaN would be restored silently). A respawn or a lost node reads the durable tier.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed._state_dict_utils import _copy_state_dict
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.optim import Optimizer

from trainer.checkpointing import tiers
from trainer.checkpointing.manifest import as_loss
from trainer.checkpointing.restoring import RestoreContext, Resumed
from trainer.checkpointing.staging import local_tensors
from trainer.workload import DataSource

SOURCE = "memory"  # a resume event's tier


@dataclass
class ProcessCopy:
    """The last save's staged state (CPU tensors, DTensors with CPU local shards), its step, and
    what the manager records beside it (the loss, the data loader's position)."""

    step: int
    staged: dict[str, Any]
    info: dict[str, Any] = field(default_factory=dict)

    def nbytes(self) -> int:
        """This rank's bytes in it."""
        return sum(t.numel() * t.element_size() for t in local_tensors(self.staged))

    def problem(self) -> str | None:
        """Why it cannot be restored from ("" is never returned), or None."""
        if self.step <= 0:
            return "no save of a training step"
        if "data_loader" not in self.info:
            return "the save's data loader position was not recorded"
        for t in local_tensors(self.staged):
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                return "it holds values that are not finite"
        return None

    def restore_into(self, target: dict[str, Any]) -> None:
        """Copy it into ``target``, a state dict of the same structure (the live model's and
        optimizer's, from ``get_state_dict``): the inverse of the staging copy."""
        with torch.no_grad():
            _copy_state_dict(self.staged, target, type_check=False)


@dataclass(frozen=True)
class OwnCopyRestorer:
    ctx: RestoreContext
    copy: ProcessCopy | None  # this process's; chosen only where every rank offered one
    total_bytes: int  # every rank's, as offered

    def restore(
        self, model: nn.Module, optim: Optimizer, sampler: DataSource, choice: tiers.Choice
    ) -> Resumed | None:
        """All ranks: the agreed copy into the live model and optimizer; None where some rank
        could not (the next candidate overwrites whatever was copied)."""
        t0 = time.perf_counter()
        failed = ""
        try:
            if self.copy is None:
                raise RuntimeError("this process holds no copy")
            model_sd, optim_sd = get_state_dict(model, optim)
            self.copy.restore_into({"model": model_sd, "optim": optim_sd})
            set_state_dict(model, optim, model_state_dict=model_sd, optim_state_dict=optim_sd)
            sampler.check_state(self.copy.info["data_loader"], self.copy.step)
        except Exception as e:
            failed = f"{type(e).__name__}: {e}"
        why, _ = self.ctx.failure(failed)
        if why:
            self.ctx.skipped(choice.step, SOURCE, f"restoring the process's own copy failed: {why}")
            return None
        assert self.copy is not None
        self.ctx.loaded(self.copy.step, SOURCE, t0, self.total_bytes)
        return Resumed(self.copy.step, as_loss(self.copy.info.get("loss")), None)
