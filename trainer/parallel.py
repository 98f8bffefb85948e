"""Device, backend and FSDP2 sharding. CPU + gloo without a GPU, CUDA + NCCL with one;
nothing else in the trainer changes between the two."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from trainer.config import Device


@dataclass(frozen=True)
class Placement:
    device: torch.device
    backend: str


def resolve_device(choice: Device) -> Placement:
    want_cuda = choice == Device.CUDA or (choice == Device.AUTO and torch.cuda.is_available())
    if want_cuda:
        if not torch.cuda.is_available():
            raise RuntimeError("device=cuda but torch sees no GPU (CUDA build and driver needed)")
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return Placement(torch.device("cuda", local_rank), "nccl")
    return Placement(torch.device("cpu"), "gloo")


def shard_model(model: nn.Module, placement: Placement, world_size: int) -> nn.Module:
    """FSDP2 ``fully_shard`` per transformer block, then the root (embeddings and head).

    FSDP2 trains on CPU with gloo (forward, backward, AdamW, DCP resume all measured bitwise
    exact), so there is no FSDP1 fallback.
    """
    mesh = init_device_mesh(placement.device.type, (world_size,))
    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1
