"""GPUs for the local backend's simulated nodes. Every simulated node's workers number their
ranks 0.. (``LOCAL_RANK``) and a CUDA worker takes ``cuda:LOCAL_RANK``, so without a split two
nodes on a machine with GPUs would share ``cuda:0`` (issue 27). Each node gets its own devices
through ``CUDA_VISIBLE_DEVICES`` (its ``LOCAL_RANK`` then indexes its own list); a machine with
too few refuses the launch, naming the fix. A pure function of the counts: tested without a GPU.
"""

from __future__ import annotations

import os

from trainer.config import Device
from trainer.errors import TrainerError


class DeviceSplitError(TrainerError, ValueError):
    pass


def visible_gpus(env_value: str | None, device_count: int) -> list[str]:
    """The GPUs this process may hand out: its own ``CUDA_VISIBLE_DEVICES`` list when set (ids
    or UUIDs, as the driver takes them), else 0..device_count-1."""
    if env_value is None:
        return [str(i) for i in range(device_count)]
    return [d.strip() for d in env_value.split(",") if d.strip()]  # set but empty: none


def split_devices(
    device: Device, gpus: list[str], *, nodes: int, nproc_per_node: int
) -> dict[int, str] | None:
    """``CUDA_VISIBLE_DEVICES`` for each of ``nodes`` simulated nodes (spares included), or
    None when the workers train on CPU (``device=cpu``, or ``auto`` with no GPU)."""
    if device == Device.CPU or (device == Device.AUTO and not gpus):
        return None
    need = nodes * nproc_per_node
    if len(gpus) < need:
        raise DeviceSplitError(
            f"device={device.value}: {nodes} simulated node(s) x {nproc_per_node} rank(s) need "
            f"{need} GPU(s), one each, and this machine has {len(gpus)}"
            + (" (CUDA_VISIBLE_DEVICES)" if gpus else "")
            + ". Fix: nodes x nproc_per_node (spares included) at most the GPUs, or train on "
            "CPU (start the run with CUDA_VISIBLE_DEVICES= empty), or use the eks backend"
        )
    return {n: ",".join(gpus[n * nproc_per_node : (n + 1) * nproc_per_node]) for n in range(nodes)}


def node_gpus(device: Device, *, nodes: int, nproc_per_node: int) -> dict[int, str] | None:
    """:func:`split_devices` over this process's GPUs (``CUDA_VISIBLE_DEVICES``, else CUDA's
    count)."""
    gpus = visible_gpus(os.environ.get("CUDA_VISIBLE_DEVICES"), cuda_device_count())
    return split_devices(device, gpus, nodes=nodes, nproc_per_node=nproc_per_node)


def cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count()  # 0 on a CPU build or without a driver
