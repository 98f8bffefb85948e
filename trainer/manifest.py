"""Checkpoint layout and commit protocol (arch §3). The one place the manifest format lives.

::

    <run_root>/checkpoints/step_000000100.partial/     being written: never trusted as is
    <run_root>/checkpoints/step_000000100/             committed: shards, .metadata, manifest.json
    <run_root>/checkpoints/step_000000100.superseded/  an older commit of the same step, moved
                                                       aside while its replacement is renamed in
    <run_root>/checkpoints/step_000000100.deleting/    being pruned (renamed first, then removed)
    <run_root>/checkpoints/LATEST                      newest committed step, written last

Commit: every rank's shards written and fsynced (each rank's async writer also leaves a digest
sidecar) -> the DCP ``.metadata`` -> rank 0 writes ``manifest.json`` (every file with size and
sha256) -> atomic rename ``.partial`` -> committed (directory fsynced) -> ``LATEST`` replaced
atomically -> older steps pruned once the newest verifies. A reader trusts a directory only if
its manifest exists and every file matches it.

Crash safety: every step of a commit is one rename, and a kill between any two of them leaves a
state that :func:`recover` resolves (rank 0, before resuming) without losing a committed step:
a ``.partial`` whose manifest verifies is rolled forward, any other is removed; a
``.superseded`` copy is restored if its replacement never arrived; ``.deleting`` is removed.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.errors import TrainerError
from trainer.hashing import sha256_file

log = logging.getLogger(__name__)

FORMAT = "nvrx-ckpt-v1"
MANIFEST = "manifest.json"
LATEST = "LATEST"
DCP_METADATA = ".metadata"
PARTIAL_SUFFIX = ".partial"
SUPERSEDED_SUFFIX = ".superseded"
DELETING_SUFFIX = ".deleting"
DIGEST_SIDECAR = ".digests-rank{rank}.json"
# fullmatch everywhere: ``$`` would accept a trailing newline.
_STEP_RE = re.compile(r"step_(\d{9})")
# A partial written under an epoch (trainer.fence) carries it: ``step_000000100.e7.partial``.
_STEP_DIR_RE = re.compile(r"step_(\d{9})((?:\.e[1-9]\d{0,17})?\.partial|\.superseded|\.deleting)?")
# A file a manifest may name: one path component, no separator, no NUL, no leading dot (so no
# ``.`` / ``..`` and no hidden files) except the DCP metadata itself.
_SAFE_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,254}")
_SHA256_RE = re.compile(r"[0-9a-f]{64}")
# Prune re-digests the newest survivor in full up to this size (measured: ~2 ms for the tiny
# model's 2.2 MB; sha256 runs at ~1.7 GB/s here, so 64 MiB costs ~40 ms on the commit path);
# above it, sizes of every file plus the digest of the manifest-listed .metadata.
PRUNE_FULL_DIGEST_MAX_BYTES = 64 << 20


class CheckpointError(TrainerError, RuntimeError):
    pass


class NoValidCheckpoint(CheckpointError):
    """Checkpoints exist but none verifies: refusing to silently start from step 0."""


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
    m = _STEP_DIR_RE.fullmatch(Path(directory).name)
    return int(m.group(1)) if m else None


def is_safe_name(name: object) -> bool:
    """May ``name`` be joined onto a checkpoint directory? One plain path component only."""
    return isinstance(name, str) and (name == DCP_METADATA or bool(_SAFE_NAME_RE.fullmatch(name)))


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


def _rename(src: Path, dst: Path) -> None:
    os.rename(src, dst)
    fsync_path(dst.parent)


def write_digest_sidecar(directory: Path, rank: int, files: list[Path]) -> None:
    """Digest this rank's freshly written files (run in the async writer, off the training path)."""
    entries = [{"name": p.name, "bytes": p.stat().st_size, "sha256": sha256_file(p)} for p in files]
    _write_atomic(Path(directory) / DIGEST_SIDECAR.format(rank=rank), json.dumps(entries))


def _is_bookkeeping(name: str) -> bool:
    return name == MANIFEST or name.startswith(".digests-rank") or name.endswith(".tmp")


def _sidecar_digests(directory: Path, world_size: int) -> dict[tuple[str, int], str]:
    """(name, bytes) -> sha256 from the writers' sidecars; a sidecar is only a shortcut, so an
    unreadable one is ignored (the file is hashed here instead)."""
    known: dict[tuple[str, int], str] = {}
    for rank in range(world_size):
        sidecar = directory / DIGEST_SIDECAR.format(rank=rank)
        try:
            entries = json.loads(sidecar.read_text()) if sidecar.is_file() else []
        except (OSError, ValueError):
            continue
        for e in entries if isinstance(entries, list) else []:
            if isinstance(e, dict) and is_safe_name(e.get("name")):
                known[(e["name"], e.get("bytes", -1))] = str(e.get("sha256"))
    return known


def _collect_file_entries(directory: Path, world_size: int) -> list[dict[str, Any]]:
    """Every file actually in ``directory`` (never a name only a sidecar mentions)."""
    known = _sidecar_digests(directory, world_size)
    entries = []
    for path in sorted(directory.iterdir()):
        name = path.name
        if _is_bookkeeping(name) or not path.is_file():
            continue
        if not is_safe_name(name):
            log.warning("not listing %s in the manifest: not a DCP file name", path)
            continue
        size = path.stat().st_size
        # No sidecar for it (e.g. the DCP .metadata, written by the coordinator): hash here.
        digest = known.get((name, size)) or sha256_file(path)
        entries.append({"name": name, "bytes": size, "sha256": digest})
    return entries


def _drop_bookkeeping(directory: Path) -> None:
    for path in directory.iterdir():
        if path.name != MANIFEST and _is_bookkeeping(path.name):
            path.unlink(missing_ok=True)


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
    _drop_bookkeeping(src)
    dst = install(run_root, step, src)
    if keep_last is not None:
        prune(run_root, keep_last)
    return dst


def install(run_root: Path, step: int, src: Path | None = None) -> Path:
    """Rename the complete ``.partial`` of ``step`` to committed, then point ``LATEST`` at it.

    A directory cannot be renamed over a non-empty one, so an older commit of the same step (an
    earlier life's, e.g. one that resume skipped) is first renamed aside to ``.superseded``,
    which readers still take as that step's fallback; it is removed only once its replacement
    is in place. At no instant is there no candidate for the step."""
    src = src or partial_path(run_root, step)
    dst = committed_path(run_root, step)
    aside = superseded_path(run_root, step)
    if dst.exists():
        if aside.exists():  # left by a crashed earlier supersede; dst is the newer copy
            _delete_dir(aside)
        _rename(dst, aside)
    _rename(src, dst)
    _write_atomic(checkpoints_dir(run_root) / LATEST, f"{step}\n")
    if aside.exists():
        _delete_dir(aside)
    return dst


def _delete_dir(path: Path) -> None:
    """Remove a checkpoint directory so that a kill half-way never leaves a half-deleted one
    under a trusted name: rename it to ``.deleting`` first (one atomic step), then remove."""
    doomed = path.with_name(path.name.split(".")[0] + DELETING_SUFFIX)
    if doomed.exists():
        shutil.rmtree(doomed)
    _rename(path, doomed)
    shutil.rmtree(doomed)


def committed_steps(run_root: Path) -> list[int]:
    root = checkpoints_dir(run_root)
    if not root.is_dir():
        return []
    steps = [
        int(m.group(1)) for p in root.iterdir() if (m := _STEP_RE.fullmatch(p.name)) and p.is_dir()
    ]
    return sorted(steps)


def read_latest(run_root: Path) -> int | None:
    path = checkpoints_dir(run_root) / LATEST
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


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
        _delete_dir(committed_path(run_root, step))
    return Pruned(removed=doomed)


def _total_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.iterdir() if p.is_file())


def read_manifest(directory: Path) -> dict[str, Any]:
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"{path} is missing")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{path} is not a JSON object")
    for key in ("format", "step", "world_size", "files"):
        if key not in manifest:
            raise CheckpointError(f"{path} lacks field {key!r}")
    if manifest["format"] != FORMAT:
        raise CheckpointError(f"{path} has format {manifest['format']!r}, expected {FORMAT!r}")
    if not isinstance(manifest["files"], list):
        raise CheckpointError(f"{path}: 'files' is not a list")
    for entry in manifest["files"]:
        check_entry(path, entry)
    return manifest


def check_entry(path: Path | str, entry: Any) -> None:
    """A file entry is trusted only if its name is one safe path component (it is joined onto
    the checkpoint directory) and its size and digest are well-formed. ``path``: where the
    entry was read (a manifest file or an S3 URI), for the message."""
    if not isinstance(entry, dict):
        raise CheckpointError(f"{path} has a file entry that is not an object: {entry!r}")
    name = entry.get("name")
    if not is_safe_name(name):
        raise CheckpointError(
            f"{path} lists the file name {name!r}: not a single safe path component"
        )
    size = entry.get("bytes")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise CheckpointError(f"{path} gives {name!r} the size {size!r}")
    if not isinstance(entry.get("sha256"), str) or not _SHA256_RE.fullmatch(entry["sha256"]):
        raise CheckpointError(f"{path} gives {name!r} a malformed sha256 {entry.get('sha256')!r}")


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


def digest_share(
    directory: Path, manifest: dict[str, Any], *, index: int, count: int
) -> str | None:
    """Check the sha256 of this share of the checkpoint's files (every ``count``-th file from
    ``index``, largest first so the shares weigh about the same); the reason it fails, or
    None. With one share per rank, a resume reads the checkpoint once, in parallel, instead of
    rank 0 hashing all of it before anyone loads."""
    entries = sorted(manifest["files"], key=lambda e: (-int(e["bytes"]), str(e["name"])))
    for entry in entries[index::count]:
        path = Path(directory) / entry["name"]
        try:
            if sha256_file(path) != entry["sha256"]:
                return f"{path} does not match its sha256 in the manifest"
        except OSError as e:
            return f"{path} cannot be read: {e}"
    return None


def verify_checkpoint(directory: Path, *, digests: bool = True) -> Verdict:
    """Does ``directory`` hold a complete, uncorrupted checkpoint?

    Sizes of every listed file always; sha256 of every file with ``digests``, else only of the
    DCP ``.metadata``: it is a pickle, and nothing is unpickled that a digest has not vouched
    for (arch §6)."""
    directory = Path(directory)
    try:
        manifest = read_manifest(directory)
    except CheckpointError as e:
        return Verdict(False, str(e))
    named = step_of(directory)
    if named is not None and manifest["step"] != named:
        return Verdict(False, f"{directory} holds a manifest of step {manifest['step']}", manifest)
    if not any(e["name"] == DCP_METADATA for e in manifest["files"]):
        return Verdict(False, f"{directory} has no DCP .metadata in its manifest", manifest)
    for entry in manifest["files"]:
        path = directory / entry["name"]
        if not path.is_file():
            return Verdict(False, f"{path} is missing", manifest)
        size = path.stat().st_size
        if size != entry["bytes"]:
            return Verdict(
                False, f"{path} is {size} bytes, manifest says {entry['bytes']}", manifest
            )
        if (digests or entry["name"] == DCP_METADATA) and sha256_file(path) != entry["sha256"]:
            return Verdict(False, f"{path} does not match its sha256 in the manifest", manifest)
    # The manifest is not signed: whoever can write the shared filesystem can forge a .metadata
    # and its digest together. Read through the restricted unpickler, a forged one is refused
    # (and never runs) and the reader falls back like for any invalid checkpoint.
    from trainer.untrusted import UnsafeCheckpointError, load_dcp_metadata

    try:
        load_dcp_metadata(directory)
    except UnsafeCheckpointError as e:
        return Verdict(False, str(e), manifest)
    return Verdict(True, "", manifest)


# -- recovery after a crash (rank 0, before choosing a checkpoint) ---------------------------
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
    for path in _named(root, DELETING_SUFFIX):
        shutil.rmtree(path, ignore_errors=True)
        done.append(Recovery("removed-leftover", path.name, step_of(path), "an interrupted prune"))
    for path in _named(root, PARTIAL_SUFFIX):
        done.append(_settle_partial(run_root, path, fingerprint, verify_digests))
    for path in _named(root, SUPERSEDED_SUFFIX):
        done.append(_settle_superseded(run_root, path))
    _repair_latest(run_root)
    return done


def _named(root: Path, suffix: str) -> list[Path]:
    return sorted(
        p
        for p in root.iterdir()
        if (m := _STEP_DIR_RE.fullmatch(p.name))
        and (m.group(2) or "").endswith(suffix)
        and p.is_dir()
    )


def _settle_partial(run_root: Path, path: Path, fingerprint: str, digests: bool) -> Recovery:
    step = step_of(path)
    assert step is not None
    why = _incomplete(path, fingerprint, digests)
    if not why:
        # Killed after its manifest was written: everything it needs is on disk and verified.
        _drop_bookkeeping(path)
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
    _rename(path, dst)
    return Recovery("restored-superseded", path.name, step, "its replacement never arrived")


def _repair_latest(run_root: Path) -> None:
    """LATEST names the newest committed step (a kill between the rename and the LATEST write
    leaves it one commit behind)."""
    (checkpoints_dir(run_root) / f".{LATEST}.tmp").unlink(missing_ok=True)  # a killed write's
    steps = committed_steps(run_root)
    if steps and read_latest(run_root) != steps[-1]:
        _write_atomic(checkpoints_dir(run_root) / LATEST, f"{steps[-1]}\n")


# -- choosing a checkpoint --------------------------------------------------------------------
@dataclass
class ResumeChoice:
    step: int | None  # None: start fresh (no checkpoints at all)
    path: Path | None
    manifest: dict[str, Any]
    rejected: list[tuple[int, str]]  # (step, why) for every newer checkpoint that was skipped


def candidates(run_root: Path) -> list[tuple[int, Path]]:
    """What a reader may resume from, oldest first: committed steps, and a ``.superseded`` copy
    of a step whose replacement is not in place yet (a commit in progress or killed)."""
    found = {step: committed_path(run_root, step) for step in committed_steps(run_root)}
    root = checkpoints_dir(run_root)
    if root.is_dir():
        for path in _named(root, SUPERSEDED_SUFFIX):
            step = step_of(path)
            if step is not None:
                found.setdefault(step, path)
    return sorted(found.items())


def resume_candidates(
    run_root: Path, *, fingerprint: str
) -> tuple[list[tuple[int, Path, dict[str, Any]]], list[tuple[int, str]], int]:
    """Newest first, the checkpoints that pass every check but the files' digests (sizes, the
    ``.metadata`` digest and its restricted unpickling, this run's config hash); the rejected
    ones with why; and how many there were. The digests are the caller's (``digest_share``)."""
    rejected: list[tuple[int, str]] = []
    ok: list[tuple[int, Path, dict[str, Any]]] = []
    found = candidates(run_root)
    for step, path in reversed(found):
        verdict = verify_checkpoint(path, digests=False)
        if verdict.ok and verdict.manifest.get("config_hash") != fingerprint:
            verdict = Verdict(
                False,
                f"{path} was written with config hash {verdict.manifest.get('config_hash')}, this "
                f"run has {fingerprint} (model or optimisation settings changed)",
            )
        if verdict.ok:
            ok.append((step, path, verdict.manifest))
        else:
            rejected.append((step, verdict.reason))
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
    return ResumeChoice(None, None, {}, rejected)
