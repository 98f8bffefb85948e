"""Choosing the checkpoint to resume from: the newest one that verifies and belongs to this
configuration; when checkpoints exist and none can be trusted, :class:`NoValidCheckpoint`
rather than a silent start from step 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from trainer.checkpointing.errors import NoValidCheckpoint
from trainer.checkpointing.layout import (
    SUPERSEDED_SUFFIX,
    checkpoints_dir,
    committed_path,
    committed_steps,
    named,
    step_of,
)
from trainer.checkpointing.manifest import Manifest, digest_share, verify_checkpoint


@dataclass
class ResumeChoice:
    step: int | None  # None: start fresh (no checkpoints at all)
    path: Path | None
    manifest: Manifest | None  # None: start fresh
    rejected: list[tuple[int, str]]  # (step, why) for every newer checkpoint that was skipped


def candidates(run_root: Path) -> list[tuple[int, Path]]:
    """What a reader may resume from, oldest first: committed steps, and a ``.superseded`` copy
    of a step whose replacement is not in place yet (a commit in progress or killed)."""
    found = {step: committed_path(run_root, step) for step in committed_steps(run_root)}
    root = checkpoints_dir(run_root)
    if root.is_dir():
        for path in named(root, SUPERSEDED_SUFFIX):
            step = step_of(path)
            if step is not None:
                found.setdefault(step, path)
    return sorted(found.items())


def resume_candidates(
    run_root: Path, *, fingerprint: str
) -> tuple[list[tuple[int, Path, Manifest]], list[tuple[int, str]], int]:
    """Newest first, the checkpoints that pass every check but the files' digests (sizes, the
    ``.metadata`` digest and its restricted unpickling, this run's config hash); the rejected
    ones with why; and how many there were. The digests are the caller's (``digest_share``)."""
    rejected: list[tuple[int, str]] = []
    ok: list[tuple[int, Path, Manifest]] = []
    found = candidates(run_root)
    for step, path in reversed(found):
        verdict = verify_checkpoint(path, digests=False)
        if verdict.manifest is None:
            rejected.append((step, verdict.reason))
        elif (got := verdict.manifest.config_hash) != fingerprint:
            why = f"{path} was written with config hash {got}, this run has {fingerprint}"
            rejected.append((step, f"{why} (model or optimisation settings changed)"))
        else:
            ok.append((step, path, verdict.manifest))
    return ok, rejected, len(found)


def no_valid_checkpoint(run_root: Path, found: int, rejected: list[tuple[int, str]]) -> str:
    details = "; ".join(f"step {s}: {why}" for s, why in sorted(rejected, reverse=True))
    return (
        f"{found} checkpoint(s) under {checkpoints_dir(run_root)} and none is valid "
        f"({details}). Refusing to start from step 0: restore a checkpoint, or start over "
        "explicitly with resume=fresh."
    )


def choose_resume(run_root: Path, *, fingerprint: str, verify_digests: bool = True) -> ResumeChoice:
    """The newest committed checkpoint that verifies and belongs to this configuration, in one
    process (the trainer's resume shares the digests out among its ranks instead).

    Without ``verify_digests`` only sizes and the ``.metadata`` digest are checked.
    Raises :class:`NoValidCheckpoint` when checkpoints exist but none can be trusted.
    """
    ok, rejected, found = resume_candidates(run_root, fingerprint=fingerprint)
    rejected = list(rejected)
    for step, path, info in ok:
        bad = digest_share(path, info, index=0, count=1) if verify_digests else None
        if bad is None:
            newer = sorted(((s, why) for s, why in rejected if s > step), reverse=True)
            return ResumeChoice(step, path, info, newer)
        rejected.append((step, bad))
    if found:
        raise NoValidCheckpoint(no_valid_checkpoint(run_root, found, rejected))
    return ResumeChoice(None, None, None, rejected)
