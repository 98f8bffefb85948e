"""Check results shared by preflight and checkpoint validation: PASSED / FAILED / SKIPPED, and a
SKIPPED check always says why (its data source failed): a blind check must not look healthy."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Status(enum.StrEnum):
    PASSED = "PASSED"
    FAILED = "FAILED"
    SKIPPED = "SKIPPED"


@dataclass(frozen=True)
class CheckResult:
    name: str
    status: Status
    detail: str
    fix: str = ""
    # A required check that could not look (SKIPPED) fails the gate: a blind gate must not pass.
    required: bool = True

    def to_dict(self) -> dict[str, str]:
        return {"name": self.name, "status": self.status.value, "detail": self.detail}


def blocks(result: CheckResult) -> bool:
    """Does this result stop the gate? FAILED always; SKIPPED when the check is required."""
    return result.status == Status.FAILED or (result.status == Status.SKIPPED and result.required)


def failures(results: list[CheckResult]) -> list[CheckResult]:
    """What stops the gate, each with its detail (for a blind check: the source's error) and
    its fix."""
    return [r for r in results if blocks(r)]
