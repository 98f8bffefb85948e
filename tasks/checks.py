"""Checks shared by preflight and checkpoint validation: each declared once (:class:`Check`: its
name, the :class:`Source` s it reads, whether the gate needs it, a pure function), run by the
one runner (:func:`run_check`) that turns a failed or missing source into SKIPPED with the
source's error. Results are PASSED / FAILED / SKIPPED, and a SKIPPED check always says why: a
blind check must not look healthy, and a blind *required* one stops the gate (:func:`blocks`)."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


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

    def row(self) -> dict[str, str | bool]:
        """The report's JSON of it (``required`` too: a SKIPPED required check rejects)."""
        return {
            "name": self.name,
            "status": self.status.value,
            "detail": self.detail,
            "required": self.required,
        }


def blocks(result: CheckResult) -> bool:
    """Does this result stop the gate? FAILED always; SKIPPED when the check is required."""
    return result.status == Status.FAILED or (result.status == Status.SKIPPED and result.required)


def failures(results: list[CheckResult]) -> list[CheckResult]:
    """What stops the gate, each with its detail (for a blind check: the source's error) and
    its fix."""
    return [r for r in results if blocks(r)]


@dataclass
class Snapshot:
    """Facts gathered once. ``errors[source]`` says why a source could not be read;
    ``not_read[source]`` why it was deliberately not read (not needed this time): a check that
    is blind only for such sources is SKIPPED with that reason and stops nothing."""

    facts: dict[str, Any] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    not_read: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Source:
    """One thing the gatherer reads. ``fix``: how to make it readable; ``facts``: the keys it
    puts in the snapshot (default: its name; any absent: it was never gathered, as blind as a
    failed read)."""

    name: str
    fix: str
    facts: tuple[str, ...] = ()


@dataclass(frozen=True)
class Verdict:
    """What a check function decides; :func:`run_check` adds the check's name."""

    status: Status
    detail: str
    fix: str = ""


def passed(detail: str) -> Verdict:
    return Verdict(Status.PASSED, detail)


def failed(detail: str, fix: str) -> Verdict:
    return Verdict(Status.FAILED, detail, fix)


@dataclass(frozen=True, kw_only=True)
class Check:
    """A check, declared once (preflight, checkpoint validation). Callable as
    ``check(snapshot, requirements)``."""

    name: str
    requires: tuple[Source, ...]
    fn: Callable[[Snapshot, Any], Verdict]
    # False only for advisory checks whose absence another layer reports loudly (say why at
    # the declaration).
    required: bool = True

    def __call__(self, snap: Snapshot, req: Any) -> CheckResult:
        return run_check(self, snap, req)


def source_error(snap: Snapshot, source: Source) -> str | None:
    """Why ``source`` cannot be trusted in ``snap``, or None when it was read."""
    if source.name in snap.not_read and source.name not in snap.facts:
        return snap.not_read[source.name]
    if source.name in snap.errors:
        return f"source {source.name!r} failed: {snap.errors[source.name]}"
    missing = [k for k in source.facts or (source.name,) if k not in snap.facts]
    if missing:
        return f"source {source.name!r} was not gathered (no {', '.join(missing)})"
    return None


def run_check(check: Check, snap: Snapshot, req: Any) -> CheckResult:
    """The only place a blind source becomes SKIPPED (with its error, and its fix when the
    gate needs the check); otherwise the check's own verdict. A check blind only for sources
    deliberately not read is not needed this time: SKIPPED, with why, and not required."""
    blind = [s for s in check.requires if source_error(snap, s) is not None]
    if blind:
        # A real failure to read is what the result says first.
        blind.sort(key=lambda s: s.name in snap.not_read)
        needed = check.required and blind[0].name not in snap.not_read
        why = source_error(snap, blind[0]) or ""
        return CheckResult(
            check.name, Status.SKIPPED, why, blind[0].fix if needed else "", required=needed
        )
    v = check.fn(snap, req)
    return CheckResult(check.name, v.status, v.detail, v.fix, required=check.required)


def run_all(checks: tuple[Check, ...], snap: Snapshot, req: Any) -> list[CheckResult]:
    return [run_check(c, snap, req) for c in checks]
