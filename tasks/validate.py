"""The validate stage's decision: the newest committed checkpoint that passes every check; when
the newest fails, fall back to the previous valid one (reported), and fail when none is valid."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tasks.errors import ValidationFailed
from tasks.validation.checkpoint import CheckpointReport, Expectations, validate_checkpoint
from trainer import checkpointing


@dataclass
class ValidationOutcome:
    chosen: CheckpointReport
    rejected: list[CheckpointReport] = field(default_factory=list)

    @property
    def fell_back(self) -> bool:
        return bool(self.rejected)

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.chosen.step,
            "path": self.chosen.path,
            "validated": self.chosen.passed,
            "report": self.chosen.to_dict(),
            "fell_back_from": [
                {"step": r.step, "failed": [c.row() for c in r.failed_checks()]}
                for r in self.rejected
            ],
        }


def validate_latest(run_root: Path, exp: Expectations, *, load: bool = True) -> ValidationOutcome:
    """``load=False`` skips the fresh-process load check (quick checks only)."""
    rejected: list[CheckpointReport] = []
    for step in reversed(checkpointing.committed_steps(run_root)):
        report = validate_checkpoint(checkpointing.committed_path(run_root, step), exp, load=load)
        if report.step is None:
            # The manifest could not be read (it is what failed): the directory names the step,
            # so the report and the fallback still say which checkpoint was rejected.
            report = dataclasses.replace(report, step=step)
        if report.passed:
            return ValidationOutcome(report, rejected)
        rejected.append(report)
    if not rejected:
        raise ValidationFailed(
            f"no committed checkpoint under {checkpointing.checkpoints_dir(run_root)}"
        )
    details = "; ".join(
        f"step {r.step}: " + ", ".join(c.detail for c in r.failed_checks()) for r in rejected
    )
    raise ValidationFailed(f"no valid checkpoint: {details}")
