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
# A memory save (trainer.checkpointing.node_copy) holds the same state as the staged copy, in
# each of the generations it alternates between.
NODE_COPY_BYTES_PER_PARAM = STAGED_BYTES_PER_PARAM


@dataclass(frozen=True)
class NodeMemoryNeed:
    """What the memory saves of one node keep in its memory: the node's ranks' shards of the
    weights and both moments (FSDP shards evenly), in each generation."""

    params: int
    nodes: int  # the fewest nodes the job may run on: the largest shard per node
    generations: int

    @property
    def gb(self) -> float:
        return self.params * NODE_COPY_BYTES_PER_PARAM * self.generations / self.nodes / 1e9

    def explain(self) -> str:
        return (
            f"{_count(self.params)} parameters x {NODE_COPY_BYTES_PER_PARAM} bytes (weights, "
            f"AdamW state) x {self.generations} generations / {self.nodes} node(s)"
        )


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"


@dataclass(frozen=True)
class MemoryNeed:
    params: int
    workers: int
    # Generations of memory saves kept in node memory (0: none): locally /dev/shm is this
    # machine's memory too, for every simulated node.
    memory_copies: int = 0

    @property
    def per_param(self) -> int:
        return (
            STATE_BYTES_PER_PARAM
            + STAGED_BYTES_PER_PARAM
            + NODE_COPY_BYTES_PER_PARAM * self.memory_copies
        )

    @property
    def gb(self) -> float:
        return self.params * self.per_param / 1e9 + PER_WORKER_GB * self.workers

    def explain(self) -> str:
        copies = f", {self.memory_copies} memory saves" if self.memory_copies else ""
        return (
            f"{_count(self.params)} parameters x {self.per_param} bytes (weights, gradients, "
            f"AdamW state, the checkpoint's staged copy{copies}) + {PER_WORKER_GB} GB per "
            f"worker x {self.workers}"
        )


def count_parameters(workload: Workload) -> int:
    """The workload's parameter count, from its model built on the meta device."""
    model = workload.build_model(torch.device("meta"))
    return sum(p.numel() for p in model.parameters())


def local_memory_need(workload: Workload, workers: int, *, memory_copies: int = 0) -> MemoryNeed:
    return MemoryNeed(
        params=count_parameters(workload), workers=workers, memory_copies=memory_copies
    )
