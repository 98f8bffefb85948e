"""``params_sha256``: one digest of the full model parameters, independent of sharding.

Gathers the full (unsharded) state dict to rank 0 and hashes every parameter in name order
(name, dtype, shape, raw bytes), so a model trained on 2 ranks and the same model loaded on 1
rank digest identically.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict


def tensor_dict_sha256(tensors: Mapping[str, Any]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def params_sha256(model: nn.Module, *, rank: int) -> str | None:
    """Collective over the model's process group; the digest on rank 0, None elsewhere."""
    full = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    return tensor_dict_sha256(full) if rank == 0 else None
