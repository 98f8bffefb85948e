"""Recovery after a crash (rank 0, before choosing a checkpoint): a ``.partial`` whose manifest
verifies is rolled forward, any other is removed; a ``.superseded`` copy is restored if its
replacement never arrived; ``.deleting`` is removed; ``LATEST`` is repaired. Idempotent.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

from trainer.checkpointing.commit import install, repair_latest
from trainer.checkpointing.durable import durable_rename
from trainer.checkpointing.layout import (
    DELETING_SUFFIX,
    PARTIAL_SUFFIX,
    SUPERSEDED_SUFFIX,
    checkpoints_dir,
    committed_path,
    named,
    step_of,
)
from trainer.checkpointing.manifest import MANIFEST, drop_bookkeeping, verify_checkpoint

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Recovery:
    action: str  # rolled-forward | removed-partial | restored-superseded | removed-leftover
    dir: str
    step: int | None
    reason: str


def recover(run_root: Path, *, fingerprint: str, verify_digests: bool = True) -> list[Recovery]:
    """Resolve what a crashed commit left behind, so that every committed step survives and no
    partial is trusted without a verified manifest (``verify_digests``: every file's digest, as
    :func:`choose_resume`; else sizes and the ``.metadata`` digest). Idempotent."""
    root = checkpoints_dir(run_root)
    if not root.is_dir():
        return []
    done: list[Recovery] = []
    for path in named(root, DELETING_SUFFIX):
        shutil.rmtree(path, ignore_errors=True)
        done.append(Recovery("removed-leftover", path.name, step_of(path), "an interrupted prune"))
    for path in named(root, PARTIAL_SUFFIX):
        done.append(_settle_partial(run_root, path, fingerprint, verify_digests))
    for path in named(root, SUPERSEDED_SUFFIX):
        done.append(_settle_superseded(run_root, path))
    repair_latest(run_root)
    return done


def _settle_partial(run_root: Path, path: Path, fingerprint: str, digests: bool) -> Recovery:
    step = step_of(path)
    assert step is not None
    why = _incomplete(path, fingerprint, digests)
    if not why:
        # Killed after its manifest was written: everything it needs is on disk and verified.
        drop_bookkeeping(path)
        install(run_root, step, path)
        return Recovery("rolled-forward", path.name, step, "complete: its manifest verifies")
    shutil.rmtree(path, ignore_errors=True)
    return Recovery("removed-partial", path.name, step, why)


def _incomplete(path: Path, fingerprint: str, digests: bool) -> str:
    """Why a ``.partial`` cannot be rolled forward ("" if it can)."""
    if not (path / MANIFEST).is_file():
        return "no manifest.json: the save never reached its commit"
    verdict = verify_checkpoint(path, digests=digests)
    if not verdict.ok:
        return verdict.reason
    if verdict.manifest.get("config_hash") != fingerprint:
        return f"written with config hash {verdict.manifest.get('config_hash')}, not {fingerprint}"
    return ""


def _settle_superseded(run_root: Path, path: Path) -> Recovery:
    step = step_of(path)
    assert step is not None
    dst = committed_path(run_root, step)
    if dst.exists():
        shutil.rmtree(path, ignore_errors=True)
        return Recovery("removed-leftover", path.name, step, "its replacement is committed")
    durable_rename(path, dst)
    return Recovery("restored-superseded", path.name, step, "its replacement never arrived")
