"""How much host memory a run of a workload needs when every rank runs on this machine (the
local backend), estimated before anything trains: an 8B workload on a 24 GB machine must fail
in preflight, naming the fix, not by the OOM killer minutes later (issue 27).

The model is built on torch's ``meta`` device (shapes, no storage: milliseconds even at 8B) and
its parameters counted. Per parameter, across all ranks (FSDP shards each once): fp32 weights,
gradients and AdamW's two moments (16 bytes), and the asynchronous checkpoint's staged copy of
the weights and moments (12 bytes). Per worker process: torch's own runtime and the checkpoint
writer beside it (~0.5 GB measured here for the tiny workloads). Activations are left out: they
depend on the batch and are small next to the state for the models this backend can hold."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainer.workload import Workload

STATE_BYTES_PER_PARAM = 16  # fp32 weights + gradients + AdamW exp_avg and exp_avg_sq
STAGED_BYTES_PER_PARAM = 12  # the async save's copy of weights and both moments
PER_WORKER_GB = 0.5


@dataclass(frozen=True)
class MemoryNeed:
    params: int
    workers: int

    @property
    def gb(self) -> float:
        per_param = STATE_BYTES_PER_PARAM + STAGED_BYTES_PER_PARAM
        return self.params * per_param / 1e9 + PER_WORKER_GB * self.workers

    def explain(self) -> str:
        n = self.params
        count = f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"
        per_param = STATE_BYTES_PER_PARAM + STAGED_BYTES_PER_PARAM
        return (
            f"{count} parameters x {per_param} bytes (weights, gradients, AdamW state, the "
            f"checkpoint's staged copy) + {PER_WORKER_GB} GB per worker x {self.workers}"
        )


def count_parameters(workload: Workload) -> int:
    """The workload's parameter count, from its model built on the meta device."""
    model = workload.build_model(torch.device("meta"))
    return sum(p.numel() for p in model.parameters())


def local_memory_need(workload: Workload, workers: int) -> MemoryNeed:
    return MemoryNeed(params=count_parameters(workload), workers=workers)
