"""Workloads the adversarial drills train: the built-in tiny GPT, slowed down so that a drill can
act in the middle of training (the tiny GPT does a step in ~30 ms). Same model, data and maths:
its parameters end bitwise equal to gpt-tiny's."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainer.launch import CONFIG_ENV
from trainer.rundir import Layout
from trainer.workloads import gpt

STEP_SLEEP_S = 0.5


def _slow_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    time.sleep(STEP_SLEEP_S)
    return gpt.loss(model, inputs, targets)


SLOW_GPT = dataclasses.replace(gpt.SPEC, name="slow-gpt", loss=_slow_loss)


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


@functools.cache
def _run_root() -> Path | None:
    """This worker's run root, from the attempt's config file: the one its command line names
    (``--config=``: the Kubernetes stand-in's pods run a local copy of the mounted file), else
    the one every worker is told of; None (paced throughout) when neither reads."""
    from trainer.config import load_config

    named = [a.split("=", 1)[1] for a in sys.argv if a.startswith("--config=")]
    for config in [*named, os.environ.get(CONFIG_ENV)]:
        try:
            return load_config(Path(config)).run_root if config else None
        except Exception:
            continue
    return None


class _Seen:
    """Whether the run's events.jsonl holds an event matching ``match`` yet: read on from where
    the last look stopped (whole lines only), and True for good once seen."""

    def __init__(self, match: Callable[[dict[str, Any]], bool]) -> None:
        self.match, self.offset, self.seen = match, 0, False

    def __call__(self) -> bool:
        root = _run_root()
        if self.seen or root is None:
            return self.seen
        try:
            with open(root / Layout.EVENTS, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except OSError:
            return False
        whole = chunk[: chunk.rfind(b"\n") + 1]
        self.offset += len(whole)
        for line in whole.splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict) and self.match(event):
                self.seen = True
        return self.seen


def _paced_until(
    seen: _Seen, sleep_s: float
) -> Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]:
    def loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if not seen():
            time.sleep(sleep_s)
        return gpt.loss(model, inputs, targets)

    return loss


# SLOW_GPT's pace only until the drill has done what it needed the training slow for: a new
# orchestrator took the run over (its ``takeover`` event). The steps after it (a relaunched
# attempt's, or the adopted nodes' last ones) then train at full speed: 0.5 s a step of waiting
# bought nothing there (the same maths: bitwise equal to gpt-tiny).
PACED_UNTIL_TAKEOVER_GPT = dataclasses.replace(
    gpt.SPEC,
    name="paced-until-takeover-gpt",
    loss=_paced_until(_Seen(lambda e: e.get("kind") == "takeover"), STEP_SLEEP_S),
)

# Slower still (1.2 s a step) only until a replaced flow runner has reattached to the Job (its
# adopted ``stage_attempt``): the Job is still training when it looks, then ends at full speed.
PACED_UNTIL_ADOPTED_GPT = dataclasses.replace(
    gpt.SPEC,
    name="paced-until-adopted-gpt",
    loss=_paced_until(
        _Seen(lambda e: e.get("kind") == "stage_attempt" and bool(e.get("adopted"))), 1.2
    ),
)
