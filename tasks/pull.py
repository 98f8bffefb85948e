"""Pull an export (``s3://bucket/prefix/<run_id>/step_<N>/``, :mod:`tasks.export`) into a local
directory, every file verified against the export's manifest.

- S3 objects are untrusted: the manifest is parsed by :mod:`trainer.checkpointing` (safe names,
  well-formed sizes and digests), each object hashed as it arrives and never read past its
  size, and the DCP ``.metadata`` goes through the restricted unpickler.
- Atomic: everything lands in a hidden ``.DIR.pull-*`` directory beside ``DIR``, renamed to
  ``DIR`` only once it verifies: a failed or killed pull never leaves a ``DIR`` to trust.
- Idempotent: a ``DIR`` holding the same export (same manifest bytes) that verifies is left as
  it is; any other non-empty ``DIR`` is refused.
The manifest is not signed: a pull proves the files are the ones it names, not who wrote it.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import shutil
import threading
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tasks.errors import PullError, PullUsageError, StorageError
from tasks.export import CONSOLIDATED
from tasks.storage.s3 import describe_client_error
from trainer import checkpointing
from trainer.checkpointing import FileEntry, Manifest
from trainer.hashing import SHA256, read_capped, sha256_file

_CHUNK = 8 << 20
# Reading more than a manifest may hold from an object that claims to be one is refused rather
# than held in memory.
MANIFEST_MAX_BYTES = checkpointing.MANIFEST_MAX_BYTES
_STEP_SEGMENT_RE = re.compile(r"step_(\d+)")

# (bytes done, bytes in all, the file just finished or None mid-file)
Progress = Callable[[int, int, "str | None"], None]


@dataclass
class PullReport:
    uri: str
    dir: str
    files: int  # every file in DIR, manifest.json included
    bytes: int
    verified: bool  # every file's size and sha256 compared with the manifest
    step: int
    downloaded: int  # 0 when DIR already held this export
    params_sha256: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d = self.__dict__.copy()
        if d["params_sha256"] is None:
            del d["params_sha256"]
        return d


# -- decisions (pure) -------------------------------------------------------------------------
def files_to_pull(manifest: Manifest, *, where: str) -> list[FileEntry]:
    """Every file an export holds besides its manifest, each entry's digest its sha256: the DCP
    files (already checked by :func:`trainer.checkpointing.read_manifest`) and what a
    consolidated export added under ``consolidated`` (``model.safetensors``; a directory such as
    ``hf/`` with its files, named ``hf/<file>``). Each name is checked like the manifest's own;
    a name given twice, or naming the manifest, is refused (it would overwrite another file)."""
    if manifest.digest != SHA256:  # a checkpoint's own manifest copied up by hand, not an export's
        raise PullError(
            f"{where}: field 'digest' is {manifest.digest!r}: an export's manifest lists every "
            "file's sha256 (export the checkpoint with this project's export)"
        )
    entries = list(manifest.files)
    consolidated = manifest.raw.get("consolidated", {})  # an export's own field, checked here
    if not isinstance(consolidated, dict):
        raise PullError(f"{where}: 'consolidated' is not an object")
    for key, value in consolidated.items():
        if isinstance(value, dict) and "sha256" in value:
            entries.append(checkpointing.check_entry(where, {**value, "name": key}))
        elif isinstance(value, dict) and isinstance(value.get("files"), list):
            if not checkpointing.is_safe_name(key):
                raise PullError(
                    f"{where} lists the directory name {key!r}: not a single safe path component"
                )
            for f in value["files"]:
                entry = checkpointing.check_entry(where, f)
                entries.append(replace(entry, name=f"{key}/{entry.name}"))
        else:
            raise PullError(f"{where}: consolidated[{key!r}] is neither a file nor a directory")
    seen: set[str] = set()
    for e in entries:
        if e.name == checkpointing.MANIFEST or e.name in seen:
            raise PullError(f"{where} lists {e.name!r} twice (or as the manifest): refusing it")
        seen.add(e.name)
    dirs = {n.split("/")[0] for n in seen if "/" in n}
    if clash := dirs & seen:
        raise PullError(f"{where} lists {sorted(clash)[0]!r} as a file and a directory")
    return entries


def mismatch(f: FileEntry, size: int, sha256: str) -> str | None:
    """Why ``size`` bytes hashing to ``sha256`` are not the manifest's ``f`` (to follow the
    file's name or URI); None if they are."""
    if size != f.bytes:
        return f"is {size} bytes, the manifest says {f.bytes}"
    if sha256 != f.digest:
        return "does not match its sha256 in the manifest"
    return None


def step_in_prefix(prefix: str) -> int | None:
    """The N of a prefix ending in ``step_<N>`` (how export names it), else None."""
    m = _STEP_SEGMENT_RE.fullmatch(prefix.rsplit("/", 1)[-1])
    return int(m.group(1)) if m else None


def params_sha256_of(manifest: Manifest) -> str | None:
    """The digest of the model parameters, when the manifest records one (a consolidated export
    does, beside its ``model.safetensors``)."""
    if isinstance(value := manifest.raw.get("params_sha256"), str):
        return value
    consolidated = manifest.raw.get("consolidated")
    entry = consolidated.get(CONSOLIDATED) if isinstance(consolidated, dict) else None
    value = entry.get("params_sha256") if isinstance(entry, dict) else None
    return value if isinstance(value, str) else None


# -- the destination --------------------------------------------------------------------------
def check_destination(dest: Path) -> bool:
    """True if ``dest`` holds an export already (to compare), False if it is absent or empty;
    :class:`PullUsageError` naming the fix for anything else."""
    if dest.is_symlink() or (dest.exists() and not dest.is_dir()):
        raise PullUsageError(
            f"DIR {dest} exists and is not a directory: give a new or empty directory"
        )
    if not dest.exists() or not any(dest.iterdir()):
        return False
    if not (dest / checkpointing.MANIFEST).is_file():
        raise PullUsageError(
            f"DIR {dest} is not empty and holds no export: give a new or empty directory, or "
            "remove it first"
        )
    return True


def verify_local(directory: Path, files: list[FileEntry]) -> str | None:
    """Why ``directory`` is not a verified copy of ``files`` (every size and sha256, then the
    DCP checks of :func:`trainer.checkpointing.verify_checkpoint`); None if it is."""
    for f in files:
        path = directory / f.name
        if path.is_symlink() or not path.is_file():
            return f"{f.name} is missing"
        why = mismatch(f, path.stat().st_size, sha256_file(path))
        if why:
            return f"{f.name} {why}"
    verdict = checkpointing.verify_checkpoint(directory, digests=False)
    return None if verdict.ok else verdict.reason


# -- S3 I/O -----------------------------------------------------------------------------------
class _Stopped(Exception):
    """Another download failed (or the pull was interrupted): stop this one."""


def _read_manifest_object(client: Any, bucket: str, key: str) -> bytes:
    from botocore.exceptions import ClientError

    try:
        body = client.get_object(Bucket=bucket, Key=key)["Body"]
    except ClientError as e:
        if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
            steps = _steps_under(client, bucket, key.rsplit("/", 1)[0])
            hint = f" (under it: {', '.join(steps)})" if steps else ""
            raise PullError(
                f"s3://{bucket}/{key} does not exist: S3_URI must be an export prefix, "
                f"s3://bucket/prefix/<run_id>/step_<N>/{hint}"
            ) from e
        raise
    data = bytearray()
    while chunk := body.read(_CHUNK):
        data += chunk
        if len(data) > MANIFEST_MAX_BYTES:
            raise PullError(f"s3://{bucket}/{key} is larger than {MANIFEST_MAX_BYTES} bytes")
    return bytes(data)


def _steps_under(client: Any, bucket: str, prefix: str) -> list[str]:
    """The ``step_<N>/`` exports right under ``prefix`` (a run's prefix given by mistake), for
    the error message; none when listing is not allowed (``s3:ListBucket``) or fails."""
    try:
        r = client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/", Delimiter="/", MaxKeys=100)
    except Exception:
        return []
    names = [p["Prefix"].rstrip("/").rsplit("/", 1)[-1] for p in r.get("CommonPrefixes", [])]
    found = sorted((step, n) for n in names if (step := step_in_prefix(n)) is not None)
    return [f"s3://{bucket}/{prefix}/{n}/" for _, n in found]


def pull_export(
    client: Any,
    bucket: str,
    prefix: str,
    dest: Path,
    *,
    endpoint: str | None,
    max_workers: int = 4,
    on_progress: Progress = lambda done, total, name: None,
) -> PullReport:
    """Download the export at ``s3://bucket/prefix/`` into ``dest``, verified (module doc).
    Raises :class:`PullUsageError` for a ``dest`` that cannot take it, :class:`PullError`
    when the export does not verify, :class:`StorageError` when S3 fails."""
    if not prefix:
        raise PullUsageError(
            f"S3_URI s3://{bucket}/ names a bucket only: give the export prefix, "
            "s3://bucket/prefix/<run_id>/step_<N>/"
        )
    uri = f"s3://{bucket}/{prefix}/"
    dest = Path(dest).absolute()
    existing = check_destination(dest)
    try:
        raw = _read_manifest_object(client, bucket, f"{prefix}/{checkpointing.MANIFEST}")
    except PullError:
        raise
    except Exception as e:
        raise StorageError(describe_client_error(e, bucket=bucket, endpoint=endpoint)) from e
    if existing:
        return _already_there(uri, prefix, dest, raw)
    dest.parent.mkdir(parents=True, exist_ok=True)
    # Not mkdtemp: its 0700 would become DIR's mode; mkdir honours the umask like any new dir.
    staging = dest.parent / f".{dest.name}.pull-{secrets.token_hex(6)}"
    staging.mkdir()
    try:
        with open(staging / checkpointing.MANIFEST, "xb") as out:
            out.write(raw)
            out.flush()
            os.fsync(out.fileno())
        man, files = _parse(uri, staging, prefix)
        get = _Get(client, bucket, prefix, staging, endpoint)
        get.all(files, first_bytes=len(raw), max_workers=max_workers, on_progress=on_progress)
        # Sizes and digests were checked on arrival; these are the DCP checks (restricted
        # unpickling of .metadata) that need the files in place.
        verdict = checkpointing.verify_checkpoint(staging, digests=False)
        if not verdict.ok:
            raise PullError(verdict.reason.replace(str(staging), uri.rstrip("/")))
        checkpointing.fsync_path(staging)
        try:
            os.rename(staging, dest)  # replaces an empty dest; refuses one filled meanwhile
        except OSError as e:
            raise PullUsageError(
                f"DIR {dest} could not be replaced ({e.strerror}): was it written to during "
                "the pull? Give a new or empty directory"
            ) from e
        checkpointing.fsync_path(dest.parent)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return _report(uri, dest, man, files, len(raw), downloaded=len(files) + 1)


@dataclass(frozen=True)
class _Get:
    """Downloads of one export's files into ``staging``."""

    client: Any
    bucket: str
    prefix: str
    staging: Path
    endpoint: str | None

    def one(self, f: FileEntry, *, on_bytes: Callable[[int], None]) -> None:
        """One file, hashed as it arrives; never more than the manifest's size (an object past
        it is refused without reading on: it could be endless)."""
        key, dest = f"{self.prefix}/{f.name}", self.staging / f.name
        body = self.client.get_object(Bucket=self.bucket, Key=key)["Body"]
        dest.parent.mkdir(exist_ok=True)
        with open(dest, "xb") as out:
            n, sha = read_capped(body, f.bytes, out=out, on_bytes=on_bytes)
            out.flush()
            os.fsync(out.fileno())
        over = n > f.bytes
        why = f"is larger than the manifest's {f.bytes} bytes" if over else mismatch(f, n, sha)
        if why:
            raise PullError(f"s3://{self.bucket}/{key} {why}")

    def all(
        self, files: list[FileEntry], *, first_bytes: int, max_workers: int, on_progress: Progress
    ) -> None:
        """Every file, ``max_workers`` at a time, each verified as it arrives; the first
        failure stops the others and is raised (``first_bytes``: the manifest's, already
        there)."""
        total = first_bytes + sum(f.bytes for f in files)
        done = [first_bytes]
        lock, stop = threading.Lock(), threading.Event()

        def on_bytes(n: int) -> None:
            if stop.is_set():
                raise _Stopped
            with lock:
                done[0] += n
                on_progress(done[0], total, None)

        def fetch(f: FileEntry) -> str:
            if stop.is_set():
                raise _Stopped
            self.one(f, on_bytes=on_bytes)
            with lock:
                on_progress(done[0], total, f.name)
            return f.name

        try:
            with ThreadPoolExecutor(max_workers=max_workers) as pool:
                futures = [pool.submit(fetch, f) for f in files]
                try:
                    wait(futures, return_when=FIRST_EXCEPTION)
                finally:
                    stop.set()  # the first failure (or an interrupt) stops the others
            # The first real failure, not a download it stopped.
            failures = [x for fut in futures if (x := fut.exception()) is not None]
            if first := next((x for x in failures if not isinstance(x, _Stopped)), None):
                raise first
        except (PullError, OSError):  # OSError: the local disk (full, not writable)
            raise
        except Exception as e:
            why = describe_client_error(e, bucket=self.bucket, endpoint=self.endpoint)
            raise StorageError(why) from e


def _parse(uri: str, directory: Path, prefix: str) -> tuple[Manifest, list[FileEntry]]:
    where = uri + checkpointing.MANIFEST
    try:
        man = checkpointing.read_manifest(directory)
        files = files_to_pull(man, where=where)
    except checkpointing.CheckpointError as e:
        raise PullError(str(e).replace(str(directory / checkpointing.MANIFEST), where)) from e
    named = step_in_prefix(prefix)
    if named is not None and named != man.step:
        raise PullError(f"{where} is the manifest of step {man.step}, not {named}")
    return man, files


def _already_there(uri: str, prefix: str, dest: Path, raw: bytes) -> PullReport:
    mine = dest / checkpointing.MANIFEST
    if sha256_file(mine) != hashlib.sha256(raw).hexdigest():
        raise PullUsageError(
            f"DIR {dest} holds a different export (its manifest.json differs from {uri}): "
            "give a new or empty directory, or remove it first"
        )
    man, files = _parse(uri, dest, prefix)
    why = verify_local(dest, files)
    if why:
        raise PullUsageError(
            f"DIR {dest} holds this export but does not verify ({why}): remove it and pull again"
        )
    return _report(uri, dest, man, files, len(raw), downloaded=0)


def _report(
    uri: str,
    dest: Path,
    man: Manifest,
    files: list[FileEntry],
    manifest_bytes: int,
    *,
    downloaded: int,
) -> PullReport:
    return PullReport(
        uri=uri,
        dir=str(dest),
        files=len(files) + 1,
        bytes=manifest_bytes + sum(f.bytes for f in files),
        verified=True,
        step=man.step,
        downloaded=downloaded,
        params_sha256=params_sha256_of(man),
    )
