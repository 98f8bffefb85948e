"""The commit protocol (arch §3): every rank's shards written and fsynced -> the DCP
``.metadata`` -> rank 0 writes ``manifest.json`` -> atomic rename ``.partial`` -> committed
(directory fsynced) -> ``LATEST`` replaced atomically -> older steps pruned once the newest
verifies. Every step is one rename, so a kill between any two leaves a state that
:func:`recover` resolves without losing a committed step.

Recovery after a crash (rank 0, before choosing a checkpoint): a ``.partial`` whose manifest
verifies is rolled forward, any other is removed; a ``.superseded`` copy is restored if its
replacement never arrived; ``.deleting`` is removed; ``LATEST`` is repaired. Idempotent.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.checkpointing.layout import (
    DELETING_SUFFIX,
    LATEST,
    PARTIAL_SUFFIX,
    SUPERSEDED_SUFFIX,
    checkpoints_dir,
    committed_path,
    committed_steps,
    delete_dir,
    durable_rename,
    named,
    partial_path,
    read_latest,
    step_of,
    superseded_path,
)
from trainer.checkpointing.manifest import (
    DIGEST,
    FORMAT,
    MANIFEST,
    collect_file_entries,
    drop_bookkeeping,
    verify_checkpoint,
)
from trainer.run_files import write_durably

log = logging.getLogger(__name__)


# Prune re-digests the newest survivor in full up to this size (sha256, of manifests before v2,
# runs at ~1.7 GB/s here: 64 MiB costs ~40 ms on the commit path, xxh3-128 a fraction of it);
# above it, sizes of every file plus the digest of the manifest-listed .metadata.
PRUNE_FULL_DIGEST_MAX_BYTES = 64 << 20


def commit(
    run_root: Path,
    step: int,
    *,
    world_size: int,
    info: dict[str, Any],
    keep_last: int | None = None,
    epoch: int | None = None,
) -> Path:
    """Rank 0 only, after every rank's shards and the DCP metadata are on disk: commits the
    partial of ``epoch`` (a partial of another epoch is not this writer's to commit). With
    ``keep_last``, prunes as well (:func:`prune`); without, the caller prunes."""
    src = partial_path(run_root, step, epoch)
    files = collect_file_entries(src, world_size)
    manifest = {
        "format": FORMAT,
        "step": step,
        "world_size": world_size,
        "created_at": time.time(),
        "digest": DIGEST,
        **info,
        "files": [e.record(DIGEST) for e in files],
    }
    write_durably(src / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))
    drop_bookkeeping(src)
    dst = install(run_root, step, src)
    if keep_last is not None:
        prune(run_root, keep_last)
    return dst


def install(run_root: Path, step: int, src: Path | None = None) -> Path:
    """Rename the complete ``.partial`` of ``step`` to committed, then point ``LATEST`` at it.
    An older commit of the step (one a resume skipped) is first renamed aside to
    ``.superseded``, still a reader's fallback, and removed once its replacement is in place:
    at no instant is there no candidate for the step."""
    src = src or partial_path(run_root, step)
    dst = committed_path(run_root, step)
    aside = superseded_path(run_root, step)
    if dst.exists():
        if aside.exists():  # left by a crashed earlier supersede; dst is the newer copy
            delete_dir(aside)
        durable_rename(dst, aside)
    durable_rename(src, dst)
    write_durably(checkpoints_dir(run_root) / LATEST, f"{step}\n")
    if aside.exists():
        delete_dir(aside)
    return dst


@dataclass
class Pruned:
    removed: list[int] = field(default_factory=list)
    refused: str = ""  # why nothing was removed (the newest survivor did not verify)


def prune(run_root: Path, keep_last: int) -> Pruned:
    """Keep the newest ``keep_last`` committed steps, but delete nothing unless the newest one
    re-reads correctly from disk: a silently damaged newest must not cost its fallbacks."""
    steps = committed_steps(run_root)
    doomed = steps[:-keep_last] if keep_last > 0 else steps
    if not doomed:
        return Pruned()
    newest = committed_path(run_root, steps[-1])
    verdict = verify_checkpoint(newest, digests=_total_bytes(newest) <= PRUNE_FULL_DIGEST_MAX_BYTES)
    if not verdict.ok:
        why = f"newest checkpoint does not verify ({verdict.reason}): keeping steps {steps}"
        log.warning("not pruning: %s", why)
        return Pruned(refused=why)
    for step in doomed:
        delete_dir(committed_path(run_root, step))
    return Pruned(removed=doomed)


def _total_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.iterdir() if p.is_file())


def repair_latest(run_root: Path) -> None:
    """LATEST names the newest committed step (a kill between the rename and the LATEST write
    leaves it one commit behind)."""
    for tmp in checkpoints_dir(run_root).glob(f".{LATEST}.*.tmp"):  # a killed write's
        tmp.unlink(missing_ok=True)
    steps = committed_steps(run_root)
    if steps and read_latest(run_root) != steps[-1]:
        write_durably(checkpoints_dir(run_root) / LATEST, f"{steps[-1]}\n")


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
    if verdict.manifest is None:
        return verdict.reason
    if verdict.manifest.config_hash != fingerprint:
        return f"written with config hash {verdict.manifest.config_hash}, not {fingerprint}"
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
