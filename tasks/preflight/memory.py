"""How much host memory a run of a workload needs when every rank runs on this machine (the
local backend), estimated before anything trains: an 8B workload on a 24 GB machine must fail in
preflight, naming the fix, not by the OOM killer minutes later (issue 27).

The model is built on torch's ``meta`` device (shapes, no storage: milliseconds even at 8B).
Per parameter, across all ranks (FSDP shards each once): fp32 weights, gradients and AdamW's two
moments (16 bytes), and the async checkpoint's staged copy of weights and moments (12 bytes).
Per worker: torch's runtime and the checkpoint writer (~0.5 GB measured for the tiny workloads).
Activations are left out: they depend on the batch and are small next to the state here."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainer.checkpointing.layout import NODE_MEMORY_GENERATIONS
from trainer.config import TrainConfig
from trainer.workload import Workload, load_workload

STATE_BYTES_PER_PARAM = 16  # fp32 weights + gradients + AdamW exp_avg and exp_avg_sq
STAGED_BYTES_PER_PARAM = 12  # the async save's copy of weights and both moments
PER_WORKER_GB = 0.5
# A memory save (trainer.checkpointing.node_copy) holds the same state as the staged copy, in
# each of the generations it alternates between.
NODE_COPY_BYTES_PER_PARAM = STAGED_BYTES_PER_PARAM


@dataclass(frozen=True)
class NodeMemoryNeed:
    """What the memory saves of one node keep in its memory: the node's ranks' shards of the
    weights and both moments (FSDP shards evenly), ``copies`` times (:func:`node_memory_copies`)."""

    params: int
    nodes: int  # the fewest nodes the job may run on: the largest shard per node
    copies: int

    @property
    def gb(self) -> float:
        return self.params * NODE_COPY_BYTES_PER_PARAM * self.copies / self.nodes / 1e9

    def explain(self) -> str:
        return (
            f"{_count(self.params)} parameters x {NODE_COPY_BYTES_PER_PARAM} bytes (weights, "
            f"AdamW state) x {self.copies} copies ({describe_copies(self.copies)}) / "
            f"{self.nodes} node(s)"
        )


def node_memory_copies(generations: int, *, peers: bool) -> int:
    """How many copies of its ranks' state a node's memory holds at most: the generations of
    its own memory saves and, where the job has more than one node, as many peer copies of
    another node's ranks (trainer.checkpointing.node_copy) plus the one arriving (received
    into a file of its own before it replaces the older)."""
    if generations <= 0:
        return 0
    return generations + (generations + 1 if peers else 0)


def describe_copies(copies: int) -> str:
    if copies <= NODE_MEMORY_GENERATIONS:
        return f"{copies} generations of its own"
    own = NODE_MEMORY_GENERATIONS
    return f"{own} generations of its own, {copies - own - 1} of a peer node's, 1 arriving"


def node_memory_need(
    params: int, *, memory_tiers: bool, nodes: int, peers: bool
) -> NodeMemoryNeed | None:
    """The memory saves' need per node (None: no memory tiers, ``memory_interval`` 0). The
    interval does not change it: two generations of every shard, however often written.
    ``nodes``: the fewest the job runs on (each holds the most then); ``peers``: whether it can
    have more than one (a peer copy goes to another node)."""
    if not memory_tiers:
        return None
    copies = node_memory_copies(NODE_MEMORY_GENERATIONS, peers=peers)
    return NodeMemoryNeed(params=params, nodes=max(1, nodes), copies=copies)


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"


@dataclass(frozen=True)
class MemoryNeed:
    params: int
    workers: int
    # Copies of the state in node memory (0: none; node_memory_copies): locally /dev/shm is
    # this machine's memory too, for every simulated node.
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
        copies = f", {self.memory_copies} node-memory copies" if self.memory_copies else ""
        return (
            f"{_count(self.params)} parameters x {self.per_param} bytes (weights, gradients, "
            f"AdamW state, the checkpoint's staged copy{copies}) + {PER_WORKER_GB} GB per "
            f"worker x {self.workers}"
        )


def count_parameters(workload: Workload) -> int:
    """The workload's parameter count, from its model built on the meta device."""
    model = workload.build_model(torch.device("meta"))
    return sum(p.numel() for p in model.parameters())


def node_memory_need_of(cfg: TrainConfig, *, nodes: int, peers: bool) -> NodeMemoryNeed | None:
    """:func:`node_memory_need` of a training config's workload (None: no tier). Raises what
    building its model on the meta device raises (a script's workload has no model to count)."""
    if not cfg.checkpoint.memory.enabled:
        return None
    n = count_parameters(load_workload(cfg.workload, cfg.workload_options))
    return node_memory_need(n, memory_tiers=True, nodes=nodes, peers=peers)
