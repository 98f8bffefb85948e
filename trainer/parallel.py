"""Device and backend: CPU + gloo without a GPU, CUDA + NCCL with one; nothing else in the
trainer changes between the two (FSDP2 sharding is the workload's: ``Workload.shard``)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

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


def world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1
