"""The process's own copy, restored (issue 29, item 4; a restorer of its own since issue 40,
item 1): the last durable save's snapshot, still in this process after an in-process restart
(:mod:`~trainer.checkpointing.process_copy`). Nothing is read: the fastest tier."""

from __future__ import annotations

import time
from dataclasses import dataclass

from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.optim import Optimizer

from trainer.checkpointing import tiers
from trainer.checkpointing.process_copy import SOURCE, ProcessCopy
from trainer.checkpointing.restoring import RestoreContext, Resumed, loss_of
from trainer.workload import DataSource


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
        return Resumed(self.copy.step, loss_of(self.copy.info), None)
