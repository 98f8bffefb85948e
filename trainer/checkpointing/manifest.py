"""The manifest: the one place its format lives (arch §3).

Every rank's async writer leaves a digest sidecar beside its shards; at commit, rank 0 lists
every file actually in the directory with its size and sha256 (``manifest.json``), and a reader
trusts a directory only if its manifest exists and every file matches it
(:func:`verify_checkpoint`). The DCP ``.metadata`` is a pickle: it is digested always and read
only through the restricted unpickler (trainer.untrusted).
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.checkpointing.durable import write_atomic
from trainer.checkpointing.errors import CheckpointError
from trainer.checkpointing.layout import DCP_METADATA, is_safe_name, step_of
from trainer.hashing import sha256_file

log = logging.getLogger(__name__)


FORMAT = "nvrx-ckpt-v1"

MANIFEST = "manifest.json"

DIGEST_SIDECAR = ".digests-rank{rank}.json"

_SHA256_RE = re.compile(r"[0-9a-f]{64}")


def write_digest_sidecar(directory: Path, rank: int, files: list[Path]) -> None:
    """Digest this rank's freshly written files (run in the async writer, off the training path)."""
    entries = [{"name": p.name, "bytes": p.stat().st_size, "sha256": sha256_file(p)} for p in files]
    write_atomic(Path(directory) / DIGEST_SIDECAR.format(rank=rank), json.dumps(entries))


def is_bookkeeping(name: str) -> bool:
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


def collect_file_entries(directory: Path, world_size: int) -> list[dict[str, Any]]:
    """Every file actually in ``directory`` (never a name only a sidecar mentions)."""
    known = _sidecar_digests(directory, world_size)
    entries = []
    for path in sorted(directory.iterdir()):
        name = path.name
        if is_bookkeeping(name) or not path.is_file():
            continue
        if not is_safe_name(name):
            log.warning("not listing %s in the manifest: not a DCP file name", path)
            continue
        size = path.stat().st_size
        # No sidecar for it (e.g. the DCP .metadata, written by the coordinator): hash here.
        digest = known.get((name, size)) or sha256_file(path)
        entries.append({"name": name, "bytes": size, "sha256": digest})
    return entries


def drop_bookkeeping(directory: Path) -> None:
    for path in directory.iterdir():
        if path.name != MANIFEST and is_bookkeeping(path.name):
            path.unlink(missing_ok=True)


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


def listed_bytes(manifest: dict[str, Any]) -> int:
    """The bytes of every file a (read, checked) manifest lists: what a load of it reads."""
    return sum(int(e["bytes"]) for e in manifest.get("files", []))


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
