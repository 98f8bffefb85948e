"""The live state of a rank, as ``get_state_dict`` gives it, kept between memory saves.

A memory save runs on the training thread as often as every step, and ``get_state_dict`` was
most of its cost (1.7 of 2.7 ms on the tiny model): it walks the model and optimizer and builds
both state dicts anew, although between two steps nothing of their *structure* changes; their
tensors are the live ones, updated in place, so a state dict taken once reads the newest values.
What can change is the structure: the optimizer's state appears at its first step and is
replaced by a restore, a scheduler changes a group's learning rate, a parameter's storage can
be swapped (``p.data = ...``, FSDP's unsharded parameters). :func:`identity` is a cheap walk over
exactly those: while it is equal the kept state dicts are reused (only ever read from).
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer


def _tensor_key(t: torch.Tensor) -> tuple[Any, ...]:
    local = t._local_tensor if isinstance(t, DTensor) else t
    return (id(t), id(local), local.data_ptr(), local.dtype, tuple(local.shape), local.stride())


def _value_key(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return _tensor_key(v)
    if isinstance(v, (list, tuple)):
        return tuple(_value_key(x) for x in v)
    if isinstance(v, dict):
        return tuple((k, _value_key(x)) for k, x in v.items())
    if isinstance(v, (int, float, bool, str)) or v is None:
        return (type(v), v)
    return (type(v), id(v))  # anything else: the same object or a new state dict


def identity(model: nn.Module, optim: Optimizer) -> tuple[Any, ...]:
    """What ``get_state_dict(model, optim)``'s structure and non-tensor values depend on."""
    parts: list[Any] = [id(model), id(optim)]
    for name, p in model.named_parameters():
        parts.append((name, _tensor_key(p)))
    for name, b in model.named_buffers():
        parts.append((name, _tensor_key(b)))
    for group in optim.param_groups:
        parts.append(tuple((k, _value_key(v)) for k, v in group.items() if k != "params"))
        for p in group["params"]:
            state = optim.state.get(p)
            parts.append((id(p), None if state is None else _value_key(state)))
    return tuple(parts)


# Versions are unique in the process, not per LiveState: a node memory outlives the manager of
# an in-process restart, and a new manager's first version must not name the old one's layout
# (whose views are of the tensors the restore replaced).
_VERSIONS = itertools.count(1)


class LiveState:
    """``get_state_dict(model, optim)`` as ``{"model": ..., "optim": ...}``, taken again only
    when :func:`identity` changed; ``version`` changes with every retake, unique in the process
    (a memory save's plan of where each tensor goes is kept for one version)."""

    def __init__(self) -> None:
        self._key: tuple[Any, ...] | None = None
        self._state: dict[str, Any] | None = None
        self.version = 0

    def get(self, model: nn.Module, optim: Optimizer) -> dict[str, Any]:
        key = identity(model, optim)
        if self._state is None or key != self._key:
            model_sd, optim_sd = get_state_dict(model, optim)
            self._state = {"model": model_sd, "optim": optim_sd}
            # get_state_dict can create the optimizer's state (a step with zero gradients
            # when it has none yet): the key is taken after it.
            self._key = identity(model, optim)
            self.version = next(_VERSIONS)
        return self._state

    def forget(self) -> None:
        """After a restore: the next ``get`` takes the state dicts again."""
        self._key, self._state = None, None
