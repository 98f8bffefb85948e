"""Workloads the adversarial drills train: the built-in tiny GPT, slowed down so that a drill can
act in the middle of training (the tiny GPT does a step in ~30 ms). Same model, data and maths:
its parameters end bitwise equal to gpt-tiny's."""

from __future__ import annotations

import dataclasses
import time

import torch
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
