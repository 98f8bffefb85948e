"""What every tier's restorer shares: the ranks' context, the result, the agreement on a
failure and the events that say what was read or skipped.

A resume chooses a tier (:mod:`~trainer.checkpointing.tiers`), then that tier's restorer loads
it into the live model and optimizer on every rank (``process_copy.OwnCopyRestorer``,
``restore_node``, ``restore_durable``). A memory tier that fails on any rank gives None on every
rank, and the manager chooses again over what is left; the durable restorer is the last word (it
loads, starts fresh, or raises :class:`FatalError`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.checkpointing import coordination
from trainer.config import TrainConfig
from trainer.errors import TerminalError
from trainer.event_types import Resume
from trainer.events import EventLog
from trainer.fence import Fence


class FatalError(TerminalError):
    """A failure no restart can fix (bad data, no valid checkpoint, config mismatch)."""


@dataclass
class Resumed:
    step: int  # 0 when starting fresh
    loss: float | None
    path: Path | None


@dataclass(frozen=True)
class RestoreContext:
    """The ranks a restore runs on and where it reports."""

    cfg: TrainConfig
    rank: int
    world_size: int
    group: Any  # the checkpoint process group
    events: EventLog
    fence: Fence

    def failure(self, mine: str, nbytes: int = 0) -> tuple[str, int]:
        """All ranks: this rank's failure ("" for none) and bytes read, gathered; the first
        failure named with its rank ("" when every rank succeeded) and the bytes of all."""
        sent = coordination.Outcome(failed=coordination.cut(mine) or "", nbytes=nbytes)
        outcomes = coordination.gather(sent, self.group, limit=coordination.OUTCOME_LIMIT)
        why = next((f"rank {r}: {o.failed}" for r, o in enumerate(outcomes) if o.failed), "")
        return why, sum(o.nbytes for o in outcomes)

    def loaded(self, step: int, source: str, began: float, nbytes: int, **extra: Any) -> None:
        """Rank 0: the ``resume`` event of a load."""
        if self.rank == 0:
            self.events.emit(
                Resume(
                    action="loaded",
                    step=step,
                    world_size=self.world_size,
                    load_s=round(time.perf_counter() - began, 4),
                    source=source,
                    bytes=nbytes,
                    **{"saved_world_size": self.world_size, **extra},
                )
            )

    def skipped(self, step: int, source: str, reason: str) -> None:
        """Rank 0: the ``resume`` event of a candidate not read, and why."""
        if self.rank == 0:
            self.events.emit(Resume(action="skipped", step=step, source=source, reason=reason))
