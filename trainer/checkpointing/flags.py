"""The cross-rank agreement on a save in flight, by name.

Every rank contributes its share every step; summed over ranks (by the training loop's own
all-reduce, beside the loss, or by one small collective of the saver's), the same decision is
taken on every rank: whether every writer is done, whether one died, whether the coordinator's
commit still runs and whether it failed.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass, fields
from typing import ClassVar

import torch


@dataclass(frozen=True)
class SaveFlags:
    """One rank's share, or the sum over ranks (then each field counts ranks)."""

    not_done: int = 0  # the rank's writer has not finished the save in flight
    writer_dead: int = 0  # ... and its writer process is gone
    commit_running: int = 0  # the coordinator's commit of the finalized save still runs
    commit_failed: int = 0  # ... it ended, with an error

    SIZE: ClassVar[int] = 4  # the tensor's length, in the order of the fields

    def to_tensor(self) -> torch.Tensor:
        """Float (it rides in the loss's all-reduce), in field order."""
        return torch.tensor(astuple(self), dtype=torch.float32)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> SaveFlags:
        values = [round(float(v)) for v in t.reshape(-1).tolist()]
        if len(values) != cls.SIZE:
            raise ValueError(f"save flags have {cls.SIZE} values, got {len(values)}")
        return cls(*values)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))
