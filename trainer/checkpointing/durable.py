"""File operations that a kill cannot leave half-done: an atomic write (temporary file, fsync,
rename, directory fsync), a rename made durable, and a directory deleted by renaming it to
``.deleting`` first, so that no half-deleted directory is ever left under a trusted name."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from trainer.checkpointing.layout import DELETING_SUFFIX


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory entry, e.g. after a rename)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def durable_rename(src: Path, dst: Path) -> None:
    os.rename(src, dst)
    fsync_path(dst.parent)


def delete_dir(path: Path) -> None:
    """Remove a checkpoint directory so that a kill half-way never leaves a half-deleted one
    under a trusted name: rename it to ``.deleting`` first (one atomic step), then remove."""
    doomed = path.with_name(path.name.split(".")[0] + DELETING_SUFFIX)
    if doomed.exists():
        shutil.rmtree(doomed)
    durable_rename(path, doomed)
    shutil.rmtree(doomed)
