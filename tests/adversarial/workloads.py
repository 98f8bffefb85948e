"""Workloads the adversarial drills train: the built-in tiny GPT, slowed down so that a drill can
act in the middle of training (the tiny GPT does a step in ~30 ms). Same model, data and maths:
its parameters end bitwise equal to gpt-tiny's."""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.distributed as dist
from torch import nn

from trainer.workloads import gpt

STEP_SLEEP_S = 0.5


def _slow_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    time.sleep(STEP_SLEEP_S)
    return gpt.loss(model, inputs, targets)


SLOW_GPT = dataclasses.replace(gpt.SPEC, name="slow-gpt", loss=_slow_loss)

# Slower still: long enough for a replaced flow runner to find the Job still training.
SLOWER_GPT = dataclasses.replace(
    gpt.SPEC, name="slower-gpt", loss=lambda m, i, t: (time.sleep(1.2), gpt.loss(m, i, t))[1]
)


def _paced_alone_loss(
    model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    # Only a world shrunk to one rank is slowed (2 s a step of two micro-batches): the 2-rank
    # steps keep their speed, and a returning node's agent (9 s of start-up here, seconds more
    # under load) joins long before the shrunk world's last step. It costs only the wait for it.
    if dist.is_initialized() and dist.get_world_size() == 1:
        time.sleep(1.0)
    return gpt.loss(model, inputs, targets)


# Slowed only while it trains alone: for shrink-and-grow drills of the built-in loop.
PACED_ALONE_GPT = dataclasses.replace(gpt.SPEC, name="paced-alone-gpt", loss=_paced_alone_loss)
