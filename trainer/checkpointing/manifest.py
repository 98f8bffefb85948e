"""The manifest: the one place its format lives (arch §3).

Every rank's writer leaves a digest sidecar beside its shards, digests taken as the bytes were
written (:mod:`~trainer.checkpointing.shard_digest`); at commit, rank 0 lists every file actually
in the directory with its size and digest (``manifest.json``), and a reader trusts a directory
only if every file matches it (:func:`verify_checkpoint`). The DCP ``.metadata`` is a pickle: it
is digested always and read only through the restricted unpickler (trainer.untrusted).

A reader takes two formats and refuses anything else, naming the file and the field:
``nvrx-ckpt-v2`` (:data:`FORMAT`, what commits write): ``{"digest": "xxh3_128", "files":
[{"name", "bytes", "xxh3_128"}]}``, the top-level ``"digest"`` naming the key of each entry's
hex digest (:data:`DIGEST`, or ``sha256``); ``nvrx-ckpt-v1`` (:data:`FORMAT_V1`): every entry's
``"sha256"``, as checkpoints committed before v2 and an export's manifest have it
(:func:`as_sha256`: sha256 is what a reader outside this project checks). The digests are
checksums against corruption (bit rot, torn writes, a damaged copy), not a signature: trust
comes from where the manifest lives (the fenced run root; docs/checkpoints.md, "Threat model").
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.checkpointing.errors import CheckpointError
from trainer.checkpointing.layout import DCP_METADATA, is_safe_name, step_of
from trainer.hashing import HEX_DIGITS, SHA256, XXH3_128, file_digest
from trainer.run_files import UnsafeFile, read_small, write_durably

log = logging.getLogger(__name__)


FORMAT = "nvrx-ckpt-v2"
FORMAT_V1 = "nvrx-ckpt-v1"
DIGEST = XXH3_128  # what commits write

MANIFEST = "manifest.json"

DIGEST_SIDECAR = ".digests-rank{rank}.json"

# A manifest lists a few files per rank and carries the training config: kilobytes. A file
# that claims to be one and is larger is refused rather than held in memory; a sidecar lists
# one rank's files.
MANIFEST_MAX_BYTES = 64 << 20
_SIDECAR_MAX_BYTES = 1 << 20

_HEX_RE = {name: re.compile(f"[0-9a-f]{{{n}}}") for name, n in HEX_DIGITS.items()}


def _short(value: Any) -> str:
    """An untrusted value for an error message, never longer than a line."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def write_digest_sidecar(
    directory: Path,
    rank: int,
    files: list[Path],
    *,
    streamed: dict[str, tuple[int, str]] | None = None,
) -> None:
    """This rank's freshly written files with their size and digest (in the writer process).
    ``streamed``: path -> (bytes, digest) the taps took as the bytes went to the file; a file
    they did not see whole is read back once, and a log line says so."""
    entries = []
    for p in files:
        size = p.stat().st_size
        got = (streamed or {}).get(str(p))
        if got is not None and got[0] == size:
            digest = got[1]
        else:
            why = "no digest streamed" if got is None else f"{got[0]} bytes streamed of {size}"
            _log_read_back(p, why)
            digest = file_digest(p, DIGEST)
        entries.append({"name": p.name, "bytes": size, DIGEST: digest})
    write_durably(Path(directory) / DIGEST_SIDECAR.format(rank=rank), json.dumps(entries))


_read_back_logged = False


def _log_read_back(path: Path, why: str) -> None:
    """Said once per writer process: every save of a writer without the seam would repeat it."""
    global _read_back_logged
    if not _read_back_logged:
        _read_back_logged = True
        log.warning(
            "%s: %s as it was written; hashing it once after writing (so for any later file of "
            "this process that needs it, unlogged)",
            path,
            why,
        )


def is_bookkeeping(name: str) -> bool:
    return name == MANIFEST or name.startswith(".digests-rank") or name.endswith(".tmp")


def _sidecar_digests(directory: Path, world_size: int) -> dict[tuple[str, int], str]:
    """(name, bytes) -> digest from the writers' sidecars; a sidecar is only a shortcut, so an
    unreadable or malformed one is ignored (the file is hashed here instead)."""
    known: dict[tuple[str, int], str] = {}
    for rank in range(world_size):
        try:
            raw = read_small(directory / DIGEST_SIDECAR.format(rank=rank), limit=_SIDECAR_MAX_BYTES)
            entries = json.loads(raw) if raw is not None else []
        except (OSError, ValueError):
            continue
        for e in entries if isinstance(entries, list) else []:
            if not isinstance(e, dict) or not is_safe_name(e.get("name")):
                continue
            digest, size = e.get(DIGEST), e.get("bytes")
            if isinstance(digest, str) and _HEX_RE[DIGEST].fullmatch(digest) and type(size) is int:
                known[(e["name"], size)] = digest
    return known


def collect_file_entries(directory: Path, world_size: int) -> list[FileEntry]:
    """Every file actually in ``directory`` (not a name only a sidecar mentions), to list."""
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
        # No sidecar for it (the DCP .metadata, kilobytes written by the coordinator): hash here.
        entries.append(FileEntry(name, size, known.get((name, size)) or file_digest(path, DIGEST)))
    return entries


def drop_bookkeeping(directory: Path) -> None:
    for path in directory.iterdir():
        if path.name != MANIFEST and is_bookkeeping(path.name):
            path.unlink(missing_ok=True)


@dataclass(frozen=True)
class FileEntry:
    """A file a manifest lists (:func:`check_entry` checked it): one safe name in the checkpoint
    directory, its size and its hex digest in the manifest's algorithm."""

    name: str
    bytes: int
    digest: str

    def record(self, algorithm: str) -> dict[str, str | int]:
        """The entry as a manifest holds it: the digest under its algorithm's name."""
        return {"name": self.name, "bytes": self.bytes, algorithm: self.digest}


@dataclass(frozen=True)
class WorkloadRef:
    """A workload by reference, as :func:`trainer.workload.load_workload` takes it: the one that
    wrote a checkpoint, or the one a caller says did."""

    ref: str
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def is_script(self) -> bool:
        return self.ref.startswith("script:")


@dataclass(frozen=True)
class Manifest:
    """A checkpoint's manifest as :func:`parse_manifest` checked it, the fields readers use
    typed. ``raw``: the JSON object as read, every field, unchecked beyond them (what an export's
    manifest carries on, :func:`as_sha256`: never re-serialized from the typed fields)."""

    step: int
    world_size: int
    digest: str  # the algorithm: each entry's digest is under this key (module doc)
    files: tuple[FileEntry, ...]
    config_hash: str | None = None
    loss: float | None = None  # the loss recorded at its step, where it is a number
    workload: WorkloadRef | None = None  # the workload that wrote it, as it says
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def config(self) -> dict[str, Any]:
        """The training config it was written with (``{}`` where there is none)."""
        config = self.raw.get("config")
        return config if isinstance(config, dict) else {}

    @property
    def data_loader(self) -> dict[str, Any]:
        """The sampler's position at its step (``{}`` where there is none)."""
        state = self.raw.get("data_loader")
        return state if isinstance(state, dict) else {}


def read_manifest(directory: Path) -> Manifest:
    """The manifest of ``directory``, checked: a regular file of at most
    :data:`MANIFEST_MAX_BYTES`, parsed by :func:`parse_manifest`."""
    path = Path(directory) / MANIFEST
    try:
        raw = read_small(path, limit=MANIFEST_MAX_BYTES)
    except UnsafeFile as e:
        raise CheckpointError(str(e)) from e
    except OSError as e:
        raise CheckpointError(f"{path} cannot be read: {e}") from e
    if raw is None:
        raise CheckpointError(f"{path} is missing")
    try:
        obj = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from e
    return parse_manifest(path, obj)


def parse_manifest(path: Path | str, obj: Any) -> Manifest:
    """``obj`` (the JSON of the manifest at ``path``, untrusted) as a :class:`Manifest`: of a
    known format, its step and world size integers, every entry well-formed."""
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path} is not a JSON object")
    for key in ("format", "step", "world_size", "files"):
        if key not in obj:
            raise CheckpointError(f"{path} lacks field {key!r}")
    digest = _digest_named(path, obj["format"], obj.get("digest"))
    for key, low in (("step", 0), ("world_size", 1)):
        if type(obj[key]) is not int or obj[key] < low:
            raise CheckpointError(
                f"{path}: field {key!r} is {_short(obj[key])}, not an integer of at least {low}"
            )
    if not isinstance(obj["files"], list):
        raise CheckpointError(f"{path}: field 'files' is not a list")
    files = tuple(check_entry(path, e, digest=digest, index=i) for i, e in enumerate(obj["files"]))
    config_hash = obj.get("config_hash")
    if config_hash is not None and not isinstance(config_hash, str):
        raise CheckpointError(f"{path}: field 'config_hash' is {_short(config_hash)}, not a string")
    return Manifest(
        obj["step"],
        obj["world_size"],
        digest,
        files,
        config_hash=config_hash,
        loss=as_loss(obj.get("loss")),
        workload=_workload_of(obj.get("workload"), obj.get("model")),
        raw=obj,
    )


def as_loss(loss: object) -> float | None:
    """A loss recorded in a manifest or a copy, where it is a number (untrusted input)."""
    return float(loss) if isinstance(loss, (int, float)) and not isinstance(loss, bool) else None


def _digest_named(path: Path | str, fmt: object, digest: object) -> str:
    """The digest a manifest's entries hold, from its format and its ``"digest"`` field."""
    if fmt == FORMAT_V1:
        if digest not in (None, SHA256):
            raise CheckpointError(
                f"{path}: field 'digest' is {_short(digest)}, but format {FORMAT_V1} digests "
                "files with sha256"
            )
        return SHA256
    if fmt != FORMAT:
        raise CheckpointError(
            f"{path}: field 'format' is {_short(fmt)}, expected {FORMAT!r} (or {FORMAT_V1!r})"
        )
    if not isinstance(digest, str) or digest not in HEX_DIGITS:
        raise CheckpointError(
            f"{path}: field 'digest' is {_short(digest)}, not a digest this reader knows "
            f"({', '.join(HEX_DIGITS)})"
        )
    return digest


def check_entry(
    path: Path | str, entry: Any, *, digest: str = SHA256, index: int | None = None
) -> FileEntry:
    """A file entry is trusted only if its name is one safe path component (it is joined onto
    the checkpoint directory) and its size and ``digest`` are well-formed. ``path`` (a manifest
    file or an S3 URI) and ``index`` (in ``files``) say where, in the message."""
    at = f"{path}" if index is None else f"{path}: files[{index}]"
    if not isinstance(entry, dict):
        raise CheckpointError(f"{at} is a file entry that is not an object: {_short(entry)}")
    name = entry.get("name")
    if not is_safe_name(name):
        raise CheckpointError(
            f"{at} lists the file name {_short(name)}: not a single safe path component"
        )
    size = entry.get("bytes")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise CheckpointError(f"{at} gives {name!r} the size (field 'bytes') {_short(size)}")
    value = entry.get(digest)
    if not isinstance(value, str) or not _HEX_RE[digest].fullmatch(value):
        raise CheckpointError(
            f"{at} gives {name!r} a malformed {digest} (field {digest!r}): {_short(value)}, "
            f"not {HEX_DIGITS[digest]} lowercase hex digits"
        )
    return FileEntry(name, size, value)


def as_sha256(manifest: Manifest, sha256: dict[str, str]) -> dict[str, Any]:
    """A checked manifest as format v1 (its JSON), every file's digest the sha256 given for it
    by name (an export's manifest: what a reader outside this project checks)."""
    files = [FileEntry(e.name, e.bytes, sha256[e.name]).record(SHA256) for e in manifest.files]
    return {**manifest.raw, "format": FORMAT_V1, "digest": SHA256, "files": files}


def _workload_of(wl: object, model: object) -> WorkloadRef | None:
    """The workload that wrote a checkpoint, as its manifest's ``workload`` says (older
    manifests name only a GPT size under ``model``)."""
    if isinstance(wl, dict) and isinstance(wl.get("ref"), str):
        options = wl.get("options")
        return WorkloadRef(wl["ref"], dict(options) if isinstance(options, dict) else {})
    return WorkloadRef(f"gpt-{model}") if isinstance(model, str) else None


@dataclass(frozen=True)
class ManifestCheck:
    """A checkpoint directory's verdict: its manifest where it verifies, else why not."""

    reason: str = ""
    manifest: Manifest | None = None

    @property
    def ok(self) -> bool:
        return self.manifest is not None


def mismatch(path: Path, entry: FileEntry, digest: str) -> str | None:
    """Why the file at ``path`` is not the checked ``entry`` (read once, never past the size the
    entry gives), or None."""
    try:
        got = file_digest(path, digest, limit=entry.bytes)
    except ValueError:
        return f"{path} holds more than the {entry.bytes} bytes its manifest gives"
    except OSError as e:
        return f"{path} cannot be read: {e}"
    if got != entry.digest:
        return f"{path} does not match its {digest} in the manifest"
    return None


def digest_share(directory: Path, manifest: Manifest, *, index: int, count: int) -> str | None:
    """Why this share of the checkpoint's files (every ``count``-th from ``index``, largest
    first so the shares weigh about the same) does not match its digests, or None. One share
    per rank: a resume reads the checkpoint once, in parallel."""
    entries = sorted(manifest.files, key=lambda e: (-e.bytes, e.name))
    for entry in entries[index::count]:
        why = mismatch(Path(directory) / entry.name, entry, manifest.digest)
        if why:
            return why
    return None


def verify_checkpoint(directory: Path, *, digests: bool = True) -> ManifestCheck:
    """Does ``directory`` hold a complete, uncorrupted checkpoint? Sizes of every listed file
    always; the digest of every file with ``digests``, else only of the DCP ``.metadata`` (a
    pickle: nothing is unpickled that a digest has not vouched for, arch §6)."""
    directory = Path(directory)
    try:
        manifest = read_manifest(directory)
    except CheckpointError as e:
        return ManifestCheck(str(e))
    named = step_of(directory)
    if named is not None and manifest.step != named:
        return ManifestCheck(f"{directory} holds a manifest of step {manifest.step}")
    if not any(e.name == DCP_METADATA for e in manifest.files):
        return ManifestCheck(f"{directory} has no DCP .metadata in its manifest")
    for entry in manifest.files:
        path = directory / entry.name
        if not path.is_file():
            return ManifestCheck(f"{path} is missing")
        size = path.stat().st_size
        if size != entry.bytes:
            return ManifestCheck(f"{path} is {size} bytes, manifest says {entry.bytes}")
        if digests or entry.name == DCP_METADATA:
            why = mismatch(path, entry, manifest.digest)
            if why:
                return ManifestCheck(why)
    # The manifest is not signed: whoever can write the shared filesystem can forge a .metadata
    # and its digest together. Read through the restricted unpickler, a forged one is refused
    # (and never runs) and the reader falls back like for any invalid checkpoint.
    from trainer.untrusted import UnsafeCheckpointError, load_dcp_metadata

    try:
        load_dcp_metadata(directory)
    except UnsafeCheckpointError as e:
        return ManifestCheck(str(e))
    return ManifestCheck("", manifest)
