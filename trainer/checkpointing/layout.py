"""Where a run's checkpoints are, and what their names say (arch §3)::

    <run_root>/checkpoints/step_000000100.partial/     being written: never trusted as is
    <run_root>/checkpoints/step_000000100.e7.partial/  the same, written under epoch 7 (fence)
    <run_root>/checkpoints/step_000000100/             committed: shards, .metadata, manifest.json
    <run_root>/checkpoints/step_000000100.superseded/  an older commit of the same step, moved
                                                       aside while its replacement is renamed in
    <run_root>/checkpoints/step_000000100.deleting/    being pruned (renamed first, then removed)
    <run_root>/checkpoints/LATEST                      newest committed step, written last

Names are parsed with ``fullmatch`` only, and a file a manifest names must be one safe path
component (:func:`is_safe_name`): everything on the shared filesystem is untrusted input.

The file operations here are ones a kill cannot leave half-done: an atomic write (temporary
file, fsync, rename, directory fsync), a rename made durable, and a directory deleted by renaming
it to ``.deleting`` first, so that no half-deleted directory is ever left under a trusted name.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import TypeGuard

from trainer.run_files import fsync_path

LATEST = "LATEST"

# Node memory (trainer.checkpointing.node_copy) is not on the shared filesystem: the launcher
# gives each node its directory in this variable (absent: the node has no node-memory tier).
NODE_MEMORY_ENV = "NVRX_NODE_MEMORY"
NODE_MEMORY_GENERATIONS = 2  # memory saves kept per rank: the newest, and the one before it

DCP_METADATA = ".metadata"
PARTIAL_SUFFIX = ".partial"
SUPERSEDED_SUFFIX = ".superseded"
DELETING_SUFFIX = ".deleting"

# fullmatch everywhere: ``$`` would accept a trailing newline.
# A partial written under an epoch (trainer.fence) carries it: ``step_000000100.e7.partial``.
STEP_DIR_RE = re.compile(r"step_(\d{9})((?:\.e[1-9]\d{0,17})?\.partial|\.superseded|\.deleting)?")

# A file a manifest may name: one path component, no separator, no NUL, no leading dot (so no
# ``.`` / ``..`` and no hidden files) except the DCP metadata itself.
_SAFE_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,254}")


def checkpoints_dir(run_root: Path) -> Path:
    return Path(run_root) / "checkpoints"


def step_dirname(step: int) -> str:
    return f"step_{step:09d}"


def committed_path(run_root: Path, step: int) -> Path:
    return checkpoints_dir(run_root) / step_dirname(step)


def partial_path(run_root: Path, step: int, epoch: int | None = None) -> Path:
    """Where ``step`` is written before its commit: by epoch (trainer.fence), so that a stale
    writer's late files never land in the current attempt's partial of the same step."""
    tag = f".e{epoch}" if epoch is not None else ""
    return checkpoints_dir(run_root) / (step_dirname(step) + tag + PARTIAL_SUFFIX)


def superseded_path(run_root: Path, step: int) -> Path:
    return checkpoints_dir(run_root) / (step_dirname(step) + SUPERSEDED_SUFFIX)


def step_of(directory: Path) -> int | None:
    """The step a checkpoint directory's name says (committed, partial, superseded, deleting)."""
    m = STEP_DIR_RE.fullmatch(Path(directory).name)
    return int(m.group(1)) if m else None


def is_safe_name(name: object) -> TypeGuard[str]:
    """May ``name`` be joined onto a checkpoint directory? One plain path component only."""
    return isinstance(name, str) and (name == DCP_METADATA or bool(_SAFE_NAME_RE.fullmatch(name)))


def named(root: Path, suffix: str) -> list[Path]:
    return sorted(
        p
        for p in root.iterdir()
        if (m := STEP_DIR_RE.fullmatch(p.name))
        and (m.group(2) or "").endswith(suffix)
        and p.is_dir()
    )


def committed_steps(run_root: Path) -> list[int]:
    root = checkpoints_dir(run_root)
    if not root.is_dir():
        return []
    return sorted(
        int(m[1])
        for p in root.iterdir()
        if (m := STEP_DIR_RE.fullmatch(p.name)) and not m[2] and p.is_dir()
    )


def read_latest(run_root: Path) -> int | None:
    path = checkpoints_dir(run_root) / LATEST
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def durable_rename(src: Path, dst: Path) -> None:
    os.rename(src, dst)
    fsync_path(dst.parent)


def delete_dir(path: Path) -> None:
    """Remove a checkpoint directory: renamed to ``.deleting`` first (one atomic step)."""
    doomed = path.with_name(path.name.split(".")[0] + DELETING_SUFFIX)
    if doomed.exists():
        shutil.rmtree(doomed)
    durable_rename(path, doomed)
    shutil.rmtree(doomed)
