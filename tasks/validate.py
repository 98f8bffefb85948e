"""Checkpoint validation, first version: the committed checkpoint's manifest digests verify.
(A later issue adds metadata coverage, a fresh-process load and a loss check.)"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tasks.errors import ValidationFailed
from trainer import manifest


@dataclass
class ValidationReport:
    step: int
    path: str
    validated: bool
    fell_back_from: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return self.__dict__.copy()


def validate_latest(run_root: Path) -> ValidationReport:
    """The newest committed checkpoint that verifies; earlier failures are reported, and none
    valid fails the stage."""
    rejected: list[dict[str, Any]] = []
    for step in reversed(manifest.committed_steps(run_root)):
        path = manifest.committed_path(run_root, step)
        verdict = manifest.verify_checkpoint(path)
        if verdict.ok:
            return ValidationReport(step, str(path), True, rejected)
        rejected.append({"step": step, "reason": verdict.reason})
    if not rejected:
        raise ValidationFailed(
            f"no committed checkpoint under {manifest.checkpoints_dir(run_root)}"
        )
    raise ValidationFailed(
        "no valid checkpoint: " + "; ".join(f"step {r['step']}: {r['reason']}" for r in rejected)
    )
