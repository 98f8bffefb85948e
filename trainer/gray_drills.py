"""The gray drills the trainer plays itself (``FaultSpec.is_gray``), inside the step check
(:mod:`trainer.step_check`), between backward and the check's collective:

- ``corrupt-grad@step=N,rank=R``: NaN written into rank R's local gradient shard at step N, once
  per run (claimed like every drill: its replay, or a restart's, runs clean);
- ``corrupt-grad@step=N,node=K,every``: the same on every rank of node K at every step from N on,
  replays included (a node that keeps corrupting);
- ``slow@step=N,node=K,factor=F``: from step N on, each rank of node K sleeps (F-1)× its own busy
  time of the step before the collective, so its busy time is F× as long. On CPU this is exactly
  what the straggler signal sees; a slowdown inside FSDP's own collectives would show as the
  whole job slow, not as one node.

Each emits its ``fault`` event once per run (the first rank to claim it). No fault is opened for
recovery: nothing restarts for a gray fault by itself.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path

import torch

from trainer.event_types import Fault
from trainer.events import EventLog
from trainer.faults import FaultSpec
from trainer.rundir import RunDir


class GrayDrills:
    """This rank's gray drills (those whose ``targets`` include it)."""

    def __init__(
        self,
        specs: tuple[FaultSpec, ...],
        run_root: Path,
        events: EventLog,
        *,
        rank: int,
        node: int,
        guard: Callable[[str], contextlib.AbstractContextManager[None]] | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.specs = [s for s in specs if s.is_gray and s.targets(rank=rank, node=node)]
        self.run_dir = RunDir(run_root)
        self.events = events
        self.rank, self.node = rank, node
        self.guard = guard or (lambda action: contextlib.nullcontext())
        self.sleep = sleep
        self._said: set[FaultSpec] = set()  # fault events this process already claimed

    def __bool__(self) -> bool:
        return bool(self.specs)

    def _plays(self, spec: FaultSpec, step: int) -> bool:
        """Due at ``step``: from its step on (``every``, ``slow``), or once per run (claimed)."""
        if spec.every or spec.slows:
            if step < spec.step:
                return False
            self._say_once(spec, step)
            return True
        if step != spec.step or not self._claim(spec):
            return False
        self._say(spec, step)
        return True

    def _claim(self, spec: FaultSpec) -> bool:
        with self.guard(f"claim the drill {spec}"):
            return self.run_dir.claim(spec.slug)

    def _say_once(self, spec: FaultSpec, step: int) -> None:
        if spec not in self._said and self._claim(spec):
            self._say(spec, step)
        self._said.add(spec)

    def _say(self, spec: FaultSpec, step: int) -> None:
        self.events.emit(
            Fault(
                fault=str(spec),
                fault_kind=spec.kind.value,
                step=step,
                rank=self.rank,
                node=self.node if self.node >= 0 else None,
            )
        )

    def corrupt(self, step: int, grads: list[torch.Tensor]) -> None:
        """NaN into the first element of this rank's first non-empty local gradient shard."""
        for spec in self.specs:
            if spec.corrupts_grad and self._plays(spec, step):
                for g in grads:
                    if g.numel():
                        with torch.no_grad():
                            g.view(-1)[0] = float("nan")
                        break

    def slow(self, step: int, busy_s: float) -> None:
        """Sleep (F-1)× this rank's busy time so far."""
        for spec in self.specs:
            if spec.slows and spec.factor is not None and self._plays(spec, step):
                self.sleep((spec.factor - 1.0) * busy_s)
