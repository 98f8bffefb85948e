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

    def to_dict(self) -> dict[str, str]:
        return {"name": self.name, "status": self.status.value, "detail": self.detail}


def failures(results: list[CheckResult]) -> list[CheckResult]:
    return [r for r in results if r.status == Status.FAILED]
