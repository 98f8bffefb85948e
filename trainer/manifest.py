"""Checkpoint layout and commit protocol (DESIGN §3). The one place the manifest format lives.

::

    <run_root>/checkpoints/step_000000100.partial/   being written: never trusted
    <run_root>/checkpoints/step_000000100/           committed: shards, .metadata, manifest.json
    <run_root>/checkpoints/LATEST                    newest committed step, written last

Commit: every rank's shards written and fsynced (each rank's async writer also leaves a digest
sidecar) -> the DCP ``.metadata`` -> rank 0 writes ``manifest.json`` (every file with size and
sha256) -> atomic rename ``.partial`` -> committed (directory fsynced) -> ``LATEST`` replaced
atomically. A reader trusts a directory only if its manifest exists and every file matches it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.hashing import sha256_file

FORMAT = "nvrx-ckpt-v1"
MANIFEST = "manifest.json"
LATEST = "LATEST"
PARTIAL_SUFFIX = ".partial"
DIGEST_SIDECAR = ".digests-rank{rank}.json"
_STEP_RE = re.compile(r"^step_(\d{9})$")


class CheckpointError(RuntimeError):
    pass


class NoValidCheckpoint(CheckpointError):
    """Checkpoints exist but none verifies: refusing to silently start from step 0."""


def checkpoints_dir(run_root: Path) -> Path:
    return Path(run_root) / "checkpoints"


def step_dirname(step: int) -> str:
    return f"step_{step:09d}"


def committed_path(run_root: Path, step: int) -> Path:
    return checkpoints_dir(run_root) / step_dirname(step)


def partial_path(run_root: Path, step: int) -> Path:
    return checkpoints_dir(run_root) / (step_dirname(step) + PARTIAL_SUFFIX)


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory entry, e.g. after a rename)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def write_digest_sidecar(directory: Path, rank: int, files: list[Path]) -> None:
    """Digest this rank's freshly written files (run in the async writer, off the training path)."""
    entries = [{"name": p.name, "bytes": p.stat().st_size, "sha256": sha256_file(p)} for p in files]
    _write_atomic(Path(directory) / DIGEST_SIDECAR.format(rank=rank), json.dumps(entries))


def _collect_file_entries(directory: Path, world_size: int) -> list[dict[str, Any]]:
    entries: dict[str, dict[str, Any]] = {}
    for rank in range(world_size):
        sidecar = directory / DIGEST_SIDECAR.format(rank=rank)
        if sidecar.is_file():
            for e in json.loads(sidecar.read_text()):
                entries[e["name"]] = e
    for path in sorted(directory.iterdir()):
        name = path.name
        if name == MANIFEST or name.startswith(".digests-rank") or name.endswith(".tmp"):
            continue
        if name not in entries or entries[name]["bytes"] != path.stat().st_size:
            # No sidecar for it (e.g. the DCP .metadata, written by the coordinator): hash here.
            entries[name] = {
                "name": name,
                "bytes": path.stat().st_size,
                "sha256": sha256_file(path),
            }
    return [entries[k] for k in sorted(entries)]


def commit(
    run_root: Path,
    step: int,
    *,
    world_size: int,
    info: dict[str, Any],
    keep_last: int,
) -> Path:
    """Rank 0 only, after every rank's shards and the DCP metadata are on disk."""
    src = partial_path(run_root, step)
    dst = committed_path(run_root, step)
    files = _collect_file_entries(src, world_size)
    manifest = {
        "format": FORMAT,
        "step": step,
        "world_size": world_size,
        "created_at": time.time(),
        "digest": "sha256",
        **info,
        "files": files,
    }
    _write_atomic(src / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))
    for sidecar in src.glob(".digests-rank*.json"):
        sidecar.unlink()
    if dst.exists():  # an earlier life committed this step already; the new one supersedes it
        shutil.rmtree(dst)
    os.rename(src, dst)
    fsync_path(dst.parent)
    _write_atomic(checkpoints_dir(run_root) / LATEST, f"{step}\n")
    prune(run_root, keep_last)
    return dst


def committed_steps(run_root: Path) -> list[int]:
    root = checkpoints_dir(run_root)
    if not root.is_dir():
        return []
    steps = [
        int(m.group(1)) for p in root.iterdir() if (m := _STEP_RE.match(p.name)) and p.is_dir()
    ]
    return sorted(steps)


def read_latest(run_root: Path) -> int | None:
    path = checkpoints_dir(run_root) / LATEST
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def prune(run_root: Path, keep_last: int) -> None:
    for step in committed_steps(run_root)[:-keep_last]:
        shutil.rmtree(committed_path(run_root, step), ignore_errors=True)


def remove_partials(run_root: Path) -> list[str]:
    """Drop directories left by saves that never committed (rank 0, before any new save)."""
    root = checkpoints_dir(run_root)
    removed = []
    if root.is_dir():
        for p in root.iterdir():
            if p.name.endswith(PARTIAL_SUFFIX):
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p.name)
    return removed


def read_manifest(directory: Path) -> dict[str, Any]:
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"{path} is missing")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from e
    for key in ("format", "step", "world_size", "files"):
        if key not in manifest:
            raise CheckpointError(f"{path} lacks field {key!r}")
    if manifest["format"] != FORMAT:
        raise CheckpointError(f"{path} has format {manifest['format']!r}, expected {FORMAT!r}")
    return manifest


def workload_of(manifest: dict[str, Any]) -> dict[str, Any] | None:
    """``{"ref", "options"}`` of the workload that wrote a checkpoint (older manifests name
    only a GPT size under ``model``)."""
    wl = manifest.get("workload")
    if isinstance(wl, dict) and isinstance(wl.get("ref"), str):
        return {"ref": wl["ref"], "options": dict(wl.get("options") or {})}
    if isinstance(manifest.get("model"), str):
        return {"ref": f"gpt-{manifest['model']}", "options": {}}
    return None


@dataclass
class Verdict:
    ok: bool
    reason: str = ""
    manifest: dict[str, Any] = field(default_factory=dict)


def verify_checkpoint(directory: Path, *, digests: bool = True) -> Verdict:
    """Does ``directory`` hold a complete, uncorrupted committed checkpoint?"""
    directory = Path(directory)
    try:
        manifest = read_manifest(directory)
    except CheckpointError as e:
        return Verdict(False, str(e))
    for entry in manifest["files"]:
        path = directory / entry["name"]
        if not path.is_file():
            return Verdict(False, f"{path} is missing", manifest)
        size = path.stat().st_size
        if size != entry["bytes"]:
            return Verdict(
                False, f"{path} is {size} bytes, manifest says {entry['bytes']}", manifest
            )
        if digests and sha256_file(path) != entry["sha256"]:
            return Verdict(False, f"{path} does not match its sha256 in the manifest", manifest)
    if not any(e["name"] == ".metadata" for e in manifest["files"]):
        return Verdict(False, f"{directory} has no DCP .metadata in its manifest", manifest)
    return Verdict(True, "", manifest)


@dataclass
class ResumeChoice:
    step: int | None  # None: start fresh (no checkpoints at all)
    path: Path | None
    manifest: dict[str, Any]
    rejected: list[tuple[int, str]]  # (step, why) for every newer checkpoint that was skipped


def choose_resume(run_root: Path, *, fingerprint: str, verify_digests: bool = True) -> ResumeChoice:
    """The newest committed checkpoint that verifies and belongs to this configuration.

    Raises :class:`NoValidCheckpoint` when checkpoints exist but none can be trusted.
    """
    rejected: list[tuple[int, str]] = []
    steps = committed_steps(run_root)
    for step in reversed(steps):
        path = committed_path(run_root, step)
        verdict = verify_checkpoint(path, digests=verify_digests)
        if verdict.ok and verdict.manifest.get("config_hash") != fingerprint:
            verdict = Verdict(
                False,
                f"{path} was written with config hash {verdict.manifest.get('config_hash')}, this "
                f"run has {fingerprint} (model or optimisation settings changed)",
            )
        if verdict.ok:
            return ResumeChoice(step, path, verdict.manifest, rejected)
        rejected.append((step, verdict.reason))
    if steps:
        details = "; ".join(f"step {s}: {why}" for s, why in rejected)
        raise NoValidCheckpoint(
            f"{len(steps)} checkpoint(s) under {checkpoints_dir(run_root)} and none is valid "
            f"({details}). Refusing to start from step 0: restore a checkpoint, or start over "
            "explicitly with resume=fresh."
        )
    return ResumeChoice(None, None, {}, rejected)
