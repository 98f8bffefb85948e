"""Export a committed checkpoint to ``s3://bucket/prefix/<run_id>/step_<N>/``.

- A checkpoint whose files do not match its manifest is refused (naming the file); each file is
  read once, its manifest digest checked and its sha256 taken in the same pass.
- The exported manifest is format v1: every file's size and sha256 (what ``pull`` and readers
  outside this project check, docs/exports.md). The sha256 travels with every object as its S3
  SHA-256 checksum, so the *server* refuses bytes that changed since (BadDigest: nothing
  stored). A multipart object (above ``part_size``) is checked part by part by the server and
  hashed whole as it is sent, compared with the manifest before completing (else aborted), and
  the server's composite checksum must then equal ours. A server without checksums is read
  back (``read-back``); ``verified`` always means "compared with the manifest's digest".
- Order: an existing manifest is deleted *first*, the objects uploaded, the manifest *last*: a
  reader that trusts a prefix by its manifest never sees an old one over changed objects.
- Idempotent: objects present with the manifest's digest (metadata and server checksum) are not
  uploaded again; when all are, nothing is uploaded or deleted.
- Optional server-side encryption (SSE-S3, or SSE-KMS with a key id). Credentials are never
  logged or returned (:func:`describe_client_error`).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.errors import ExportError, StorageError
from tasks.storage.s3 import describe_client_error, validate_bucket, validate_prefix
from tasks.storage.verified_upload import (
    PART_SIZE,
    b64_of_hex,
    composite_sha256_b64,
    head_object,
    part_checksums,
    put_single,
    upload_multipart,
    verify_uploaded,
)
from trainer import checkpointing
from trainer.checkpointing import FileEntry, Manifest, WorkloadRef
from trainer.hashing import SHA256, new_hasher, read_capped, sha256_file

CONSOLIDATED = "model.safetensors"
PRETRAINED = "hf"  # the workload's own layout, e.g. <prefix>/hf/config.json + safetensors


@dataclass(frozen=True, kw_only=True)
class ExportOptions:
    sse: str | None = None  # None, "AES256" (SSE-S3) or "aws:kms" (SSE-KMS)
    kms_key_id: str | None = None
    max_workers: int = 4
    # Also export the full model weights as one model.safetensors (its digest goes into the
    # uploaded manifest under "consolidated").
    consolidated: bool = False
    part_size: int = PART_SIZE
    # The workload that wrote it, for the consolidated weights (None: the manifest's, if a
    # built-in: a file on the shared filesystem does not choose code to import).
    workload: WorkloadRef | None = None

    def __post_init__(self) -> None:
        if self.sse not in (None, "AES256", "aws:kms"):
            raise ExportError(f"sse must be AES256 or aws:kms, got {self.sse!r}")
        if self.kms_key_id and self.sse != "aws:kms":
            raise ExportError("kms_key_id needs sse='aws:kms'")
        if self.part_size < 5 << 20:
            raise ExportError(f"part_size must be at least 5 MiB (S3), got {self.part_size}")


@dataclass
class ExportReport:
    uri: str
    objects: int
    uploaded: int
    skipped: int
    bytes: int  # the whole exported set
    bytes_uploaded: int
    verified: bool  # every object's bytes compared with the manifest's digest
    # how: "sha256" (server, whole object), "sha256-parts" (server per part + whole-object
    # digest of the bytes sent), "read-back"; "unchanged" when all were present
    verification: str

    def to_dict(self) -> dict[str, Any]:
        return self.__dict__.copy()


def checked_sha256(path: Path, entry: FileEntry, digest: str) -> str:
    """One read of a checkpoint file: refused (naming it) unless it is the checked manifest
    ``entry``'s size and ``digest``, never read past that size; its sha256."""
    size = entry.bytes
    other = None if digest == SHA256 else new_hasher(digest)
    try:
        with open(path, "rb") as f:
            seen, sha = read_capped(f, size, also=other)
    except OSError as e:
        raise ExportError(f"refusing to export {path}: it cannot be read: {e}") from e
    if seen != size:
        raise ExportError(
            f"refusing to export {path}: it is not the {size} bytes its manifest gives"
        )
    if (sha if other is None else other.hexdigest()) != entry.digest:
        raise ExportError(
            f"refusing to export {path}: it does not match its {digest} in the manifest"
        )
    return sha


def checked_digests(ckpt_dir: Path, man: Manifest, max_workers: int) -> dict[str, str]:
    """name -> sha256 of every file a checked manifest lists, each checked against it
    (:func:`checked_sha256`), in parallel: hashlib and xxhash release the GIL."""
    with ThreadPoolExecutor(max_workers=max_workers) as pool:
        shas = pool.map(lambda e: checked_sha256(ckpt_dir / e.name, e, man.digest), man.files)
        return dict(zip((e.name for e in man.files), shas, strict=True))


def export_checkpoint(
    client: Any,
    ckpt_dir: Path,
    bucket: str,
    prefix: str,
    run_id: str,
    *,
    endpoint: str | None,
    options: ExportOptions | None = None,
    on_object: Callable[[str, str], None] = lambda name, action: None,
) -> ExportReport:
    opts = options or ExportOptions()
    validate_bucket(bucket)
    validate_prefix(prefix)
    # Sizes, the .metadata's digest and its restricted unpickling; every file's digest next,
    # in the read that also takes its sha256.
    man = (verdict := checkpointing.verify_checkpoint(ckpt_dir, digests=False)).manifest
    if man is None:
        raise ExportError(f"refusing to export {ckpt_dir}: {verdict.reason}")
    shas = checked_digests(ckpt_dir, man, opts.max_workers)
    base = "/".join(p for p in (prefix, run_id, f"step_{man.step}") if p)
    with _outward_files(ckpt_dir, man, shas, opts) as files:
        up = _Uploader(client, bucket, base, opts, files, on_object)
        try:
            client.head_bucket(Bucket=bucket)
            sizes, n_objects = up.run(shas)
        except (ExportError, StorageError):
            raise
        except Exception as e:
            raise StorageError(describe_client_error(e, bucket=bucket, endpoint=endpoint)) from e
        total = sum(p.stat().st_size for p in files.sources.values())
    return ExportReport(
        uri=f"s3://{bucket}/{base}/",
        objects=n_objects,
        uploaded=len(sizes),
        skipped=n_objects - len(sizes),
        bytes=total,
        bytes_uploaded=sum(sizes),
        verified=True,
        verification="+".join(sorted(up.modes)) or "unchanged",
    )


@dataclass
class _Files:
    """What goes out: each object's local file (the manifest's among them), and which of them
    were made for the export (their sha256 is taken here, not checked against the manifest)."""

    sources: dict[str, Path]
    staged: set[str]


@contextlib.contextmanager
def _outward_files(
    ckpt_dir: Path, man: Manifest, shas: dict[str, str], opts: ExportOptions
) -> Iterator[_Files]:
    sources = {e.name: ckpt_dir / e.name for e in man.files}
    staged: set[str] = set()
    # The manifest goes as format v1, with sha256 (module doc): a v1 checkpoint's own file as it
    # is, unless consolidated files join it; any other written here.
    outward = checkpointing.as_sha256(man, shas)
    if not opts.consolidated and outward == man.raw:
        yield _Files({**sources, checkpointing.MANIFEST: ckpt_dir / checkpointing.MANIFEST}, staged)
        return
    staging = Path(tempfile.mkdtemp(prefix="nvrx-export-"))
    try:
        if opts.consolidated:
            from tasks.validation.checkpoint import consolidate

            info = consolidate(
                ckpt_dir,
                staging / CONSOLIDATED,
                pretrained_out=staging / PRETRAINED,
                workload=opts.workload,
            )
            sources[CONSOLIDATED] = staging / CONSOLIDATED
            staged.add(CONSOLIDATED)
            assert info.safetensors is not None  # consolidate() raises otherwise
            consolidated: dict[str, Any] = {
                CONSOLIDATED: {
                    "bytes": info.safetensors.bytes,
                    "sha256": info.safetensors.sha256,
                    "params_sha256": info.params_sha256,
                }
            }
            if info.pretrained is not None:
                # The workload's own layout (Hugging Face for Llama), loadable without this
                # project.
                for f in info.pretrained.files:
                    name = f"{PRETRAINED}/{f.name}"
                    sources[name] = staging / PRETRAINED / f.name
                    staged.add(name)
                consolidated[PRETRAINED] = {
                    "files": [f.model_dump() for f in info.pretrained.files]
                }
            outward = {**outward, "consolidated": consolidated}
        manifest_path = staging / checkpointing.MANIFEST
        manifest_path.write_text(json.dumps(outward, indent=1, sort_keys=True))
        yield _Files({**sources, checkpointing.MANIFEST: manifest_path}, staged)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


class _Uploader:
    """The upload of one export: what is there already, the plan, the objects, the manifest."""

    def __init__(
        self,
        client: Any,
        bucket: str,
        base: str,
        opts: ExportOptions,
        files: _Files,
        on_object: Callable[[str, str], None],
    ) -> None:
        self.client, self.bucket, self.base, self.opts = client, bucket, base, opts
        self.sources, self.on_object = files.sources, on_object
        self.staged = files.staged
        self.modes: set[str] = set()  # how the uploaded objects were verified
        self.extra: dict[str, str] = {}
        if opts.sse:
            self.extra["ServerSideEncryption"] = opts.sse
        if opts.kms_key_id:
            self.extra["SSEKMSKeyId"] = opts.kms_key_id

    def run(self, shas: dict[str, str]) -> tuple[list[int], int]:
        """(the uploaded objects' sizes, the number of objects)."""
        manifest = checkpointing.MANIFEST
        # The manifest's own digest is taken now (it is staged), so a change before its upload
        # is refused too.
        digests = {
            name: sha256_file(src) if name in self.staged or name == manifest else shas[name]
            for name, src in self.sources.items()
        }
        with ThreadPoolExecutor(max_workers=self.opts.max_workers) as pool:
            names = list(digests)
            present = pool.map(lambda n: self._present(n, digests[n]), names)
            found = dict(zip(names, present, strict=True))
        manifest_key = f"{self.base}/{manifest}"
        ours = found.pop(manifest)  # the remote manifest is this export's
        todo = [n for n, ok in found.items() if not ok]
        for name, ok in found.items():
            if ok:
                self.on_object(name, "present")
        # Any change withdraws a remote manifest first: readers stop trusting the prefix before
        # any object under it changes.
        changed = bool(todo) or not ours
        if changed and (ours or head_object(self.client, self.bucket, manifest_key) is not None):
            self.client.delete_object(Bucket=self.bucket, Key=manifest_key)
            self.on_object(manifest, "withdrawn")
        with ThreadPoolExecutor(max_workers=self.opts.max_workers) as pool:
            sizes = list(pool.map(lambda n: self._put(n, digests[n]), todo))
        if changed:
            # Last, and only after every other object verified against the manifest.
            sizes.append(self._put(manifest, digests[manifest]))
        else:
            self.on_object(manifest, "present")
        return sizes, len(digests)

    def _local_checksum(self, name: str, sha: str) -> tuple[str, list[str] | None]:
        """What the server's checksum must read for the manifest's bytes of ``name``."""
        path = self.sources[name]
        if path.stat().st_size <= self.opts.part_size:
            return b64_of_hex(sha), None
        whole, parts = part_checksums(path, self.opts.part_size)
        if whole != sha:
            raise ExportError(
                f"refusing to export {path}: it no longer matches the manifest's sha256 {sha}"
            )
        return composite_sha256_b64(parts), parts

    def _present(self, name: str, sha: str) -> bool:
        """Is the remote object the manifest's bytes? Size, our sha256 metadata and the server's
        own SHA-256 checksum must all agree; an object without a server checksum (an older
        export's, someone else's) is uploaded again rather than trusted."""
        head = head_object(self.client, self.bucket, f"{self.base}/{name}")
        # Nothing to compare: the file is not read for its part digests.
        if head is None or head.get("ContentLength") != self.sources[name].stat().st_size:
            return False
        remote = head.get("ChecksumSHA256")
        if head.get("Metadata", {}).get("sha256") != sha or not remote:
            return False
        return bool(remote == self._local_checksum(name, sha)[0])

    def _put(self, name: str, sha: str) -> int:
        path, key = self.sources[name], f"{self.base}/{name}"
        size = path.stat().st_size
        parts: list[str] | None = None
        if size <= self.opts.part_size:
            put_single(self.client, self.bucket, key, path, sha, self.extra)
        else:
            parts = upload_multipart(
                self.client,
                self.bucket,
                key,
                path,
                sha,
                part_size=self.opts.part_size,
                extra=self.extra,
            )
        self.modes.add(verify_uploaded(self.client, self.bucket, key, size, sha, parts))
        self.on_object(name, "uploaded")
        return size
