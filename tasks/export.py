"""Export a committed checkpoint to ``s3://bucket/prefix/<run_id>/step_<N>/``.

- Refuses a checkpoint whose files do not match its manifest (names the file). Each file is read
  once for it: its manifest digest (xxh3-128, or sha256 in checkpoints before manifest v2) is
  checked and its sha256 taken in the same pass.
- The exported manifest is the checkpoint's, in format v1: every file's size and sha256, what a
  reader outside this project checks (``pull``, docs/exports.md). The sha256 travels with every
  object as its S3 SHA-256 checksum, so the *server* compares the bytes it receives with the
  digest of the bytes that matched the manifest, and refuses them when a file changed since
  (BadDigest: nothing is stored). A multipart object (above
  ``part_size``) is verified part by part by the server; the same bytes are hashed whole as they
  are sent and compared with the manifest's digest before the upload is completed (else it is
  aborted: nothing visible), and the server's composite checksum must then equal ours.
- A server that returns no checksum is verified by reading every object back (``read-back``).
  ``verified`` in the report always means "compared with the manifest's digest".
- Order: an existing manifest at the prefix is deleted *first*, then the objects are uploaded,
  then the manifest *last*, so a reader that trusts a prefix only when its manifest is there
  never sees an old manifest over objects that changed under it.
- Idempotent: objects already present with the manifest's digest (metadata and server checksum)
  are not uploaded again; when everything is present nothing is uploaded or deleted.
- Optional server-side encryption (SSE-S3 or SSE-KMS with a key id).
Credentials are never logged or returned: errors are described by :func:`describe_client_error`.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.errors import ExportError, StorageError
from tasks.storage.s3 import describe_client_error, validate_bucket, validate_prefix
from trainer import checkpointing
from trainer.hashing import SHA256, new_hasher, read_capped, sha256_file

_CHUNK = 8 << 20
PART_SIZE = 8 << 20  # multipart threshold and part size (S3 wants >= 5 MiB but the last)
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
    # {"ref", "options"} of the workload that wrote it, for the consolidated weights (None: the
    # manifest's, if a built-in: a file on the shared filesystem does not choose code to import).
    workload: dict[str, Any] | None = None

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


# -- digests (pure) ---------------------------------------------------------------------------
def b64_of_hex(sha_hex: str) -> str:
    """The manifest's hex sha256 as S3 spells a SHA-256 checksum (base64 of the raw digest)."""
    return base64.b64encode(bytes.fromhex(sha_hex)).decode()


def composite_sha256_b64(part_checksums: list[str]) -> str:
    """S3's COMPOSITE SHA-256 of a multipart upload: the digest of the parts' digests, "-N"."""
    raw = b"".join(base64.b64decode(c) for c in part_checksums)
    return base64.b64encode(hashlib.sha256(raw).digest()).decode() + f"-{len(part_checksums)}"


def expected_checksum(size: int, sha_hex: str, part_checksums: list[str] | None) -> str:
    """The ChecksumSHA256 the server reports for an object we upload: whole-object for a single
    PUT, composite for a multipart upload (``part_checksums``)."""
    return b64_of_hex(sha_hex) if part_checksums is None else composite_sha256_b64(part_checksums)


def is_present(head: dict[str, Any] | None, size: int, sha_hex: str, checksum: str) -> bool:
    """Is the remote object the manifest's bytes? Size, our sha256 metadata and the server's
    own SHA-256 checksum must all agree; an object without a server checksum (written by an
    older export, or by someone else) is uploaded again rather than trusted."""
    if head is None or head.get("ContentLength") != size:
        return False
    if head.get("Metadata", {}).get("sha256") != sha_hex:
        return False
    return bool(head.get("ChecksumSHA256")) and head.get("ChecksumSHA256") == checksum


@dataclass(frozen=True)
class ExportPlan:
    upload: tuple[str, ...]  # objects to upload, in order, the manifest (if any) last
    withdraw_manifest: bool  # delete the remote manifest before anything is uploaded


def plan_export(
    present: dict[str, bool], manifest_present: bool, remote_manifest: bool
) -> ExportPlan:
    """What to do, decided from what is there. ``present``: per object (not the manifest),
    already the manifest's bytes; ``manifest_present``: the remote manifest is ours;
    ``remote_manifest``: some manifest is there. Any change withdraws the old manifest first."""
    todo = tuple(n for n, ok in present.items() if not ok)
    if not todo and manifest_present:
        return ExportPlan((), False)
    return ExportPlan((*todo, checkpointing.MANIFEST), remote_manifest)


# -- S3 I/O -----------------------------------------------------------------------------------
def _head(client: Any, bucket: str, key: str) -> dict[str, Any] | None:
    from botocore.exceptions import ClientError

    try:
        return dict(client.head_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED"))
    except ClientError as e:
        if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
            return None
        raise


def _read_back_sha(client: Any, bucket: str, key: str) -> str:
    h = hashlib.sha256()
    body = client.get_object(Bucket=bucket, Key=key)["Body"]
    for chunk in iter(lambda: body.read(_CHUNK), b""):
        h.update(chunk)
    return h.hexdigest()


def _parts(path: Path, part_size: int) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while chunk := f.read(part_size):
            yield chunk


def checked_sha256(path: Path, entry: dict[str, Any], digest: str) -> str:
    """One read of a checkpoint file: refused (naming it) unless it is the checked manifest
    ``entry``'s size and ``digest``, never read past that size; its sha256."""
    size = int(entry["bytes"])
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
    if (sha if other is None else other.hexdigest()) != entry[digest]:
        raise ExportError(
            f"refusing to export {path}: it does not match its {digest} in the manifest"
        )
    return sha


def checked_digests(ckpt_dir: Path, man: dict[str, Any], max_workers: int) -> dict[str, str]:
    """name -> sha256 of every file a checked manifest lists, each checked against it
    (:func:`checked_sha256`), in parallel: hashlib and xxhash release the GIL."""
    digest = checkpointing.digest_of(man)
    entries = man["files"]
    with ThreadPoolExecutor(max_workers=max_workers) as pool:
        shas = pool.map(lambda e: checked_sha256(ckpt_dir / e["name"], e, digest), entries)
        return dict(zip((e["name"] for e in entries), shas, strict=True))


def part_checksums(path: Path, part_size: int) -> tuple[str, list[str]]:
    """(whole-file sha256 hex, per-part SHA-256 checksums) in one read."""
    whole, parts = hashlib.sha256(), []
    for chunk in _parts(path, part_size):
        whole.update(chunk)
        parts.append(base64.b64encode(hashlib.sha256(chunk).digest()).decode())
    return whole.hexdigest(), parts


def _refused(e: Exception) -> bool:
    from botocore.exceptions import ClientError

    code = e.response.get("Error", {}).get("Code") if isinstance(e, ClientError) else None
    return code in ("BadDigest", "InvalidDigest", "XAmzContentSHA256Mismatch")


def _put_single(
    client: Any, bucket: str, key: str, path: Path, sha_hex: str, extra: dict[str, Any]
) -> None:
    """One PUT whose SHA-256 checksum is the manifest's digest: the server checks the bytes."""
    try:
        with open(path, "rb") as body:
            client.put_object(
                Bucket=bucket,
                Key=key,
                Body=body,
                ChecksumSHA256=b64_of_hex(sha_hex),
                Metadata={"sha256": sha_hex},
                **extra,
            )
    except Exception as e:
        if _refused(e):
            raise ExportError(
                f"s3://{bucket}/{key}: the server refused {path}: its bytes do not match the "
                f"manifest's sha256 {sha_hex} (the file changed after the manifest was written)"
            ) from e
        raise


def upload_multipart(
    client: Any,
    bucket: str,
    key: str,
    path: Path,
    sha_hex: str,
    *,
    part_size: int,
    extra: dict[str, Any],
) -> list[str]:
    """A multipart upload with a SHA-256 checksum per part (the server checks each part), and
    the whole of what was sent compared with the manifest's digest before completing: on a
    mismatch the upload is aborted and nothing becomes visible. Returns the parts' checksums."""
    upload_id = client.create_multipart_upload(
        Bucket=bucket, Key=key, ChecksumAlgorithm="SHA256", Metadata={"sha256": sha_hex}, **extra
    )["UploadId"]
    try:
        whole, parts = hashlib.sha256(), []
        for number, chunk in enumerate(_parts(path, part_size), start=1):
            whole.update(chunk)
            checksum = base64.b64encode(hashlib.sha256(chunk).digest()).decode()
            r = client.upload_part(
                Bucket=bucket,
                Key=key,
                UploadId=upload_id,
                PartNumber=number,
                Body=chunk,
                ChecksumSHA256=checksum,
            )
            parts.append({"PartNumber": number, "ETag": r["ETag"], "ChecksumSHA256": checksum})
        if whole.hexdigest() != sha_hex:
            raise ExportError(
                f"s3://{bucket}/{key}: refusing to complete the upload of {path}: the bytes sent "
                f"hash to {whole.hexdigest()}, the manifest says {sha_hex} (the file changed "
                "after the manifest was written)"
            )
        client.complete_multipart_upload(
            Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}
        )
    except BaseException as e:
        with contextlib.suppress(Exception):  # the original error is the one to report
            client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id)
        if isinstance(e, Exception) and _refused(e):
            raise ExportError(f"s3://{bucket}/{key}: the server refused a part of {path}") from e
        raise
    return [p["ChecksumSHA256"] for p in parts]


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
    verdict = checkpointing.verify_checkpoint(ckpt_dir, digests=False)
    if not verdict.ok:
        raise ExportError(f"refusing to export {ckpt_dir}: {verdict.reason}")
    man = verdict.manifest
    shas = checked_digests(ckpt_dir, man, opts.max_workers)
    base = "/".join(p for p in (prefix, run_id, f"step_{man['step']}") if p)
    extra: dict[str, Any] = {}
    if opts.sse:
        extra["ServerSideEncryption"] = opts.sse
    if opts.kms_key_id:
        extra["SSEKMSKeyId"] = opts.kms_key_id
    modes: set[str] = set()
    sources = {e["name"]: ckpt_dir / e["name"] for e in man["files"]}
    manifest_path = ckpt_dir / checkpointing.MANIFEST
    staging = None
    staged: set[str] = set()  # files made here (not in the checkpoint's manifest)
    # The manifest goes as format v1, with sha256 (module doc): a v1 checkpoint's own file as it
    # is, unless consolidated files join it; any other written here.
    outward = checkpointing.as_sha256(man, shas)
    if opts.consolidated or outward != man:
        staging = Path(tempfile.mkdtemp(prefix="nvrx-export-"))
        manifest_path = staging / checkpointing.MANIFEST
    if opts.consolidated:
        from tasks.validation.checkpoint import consolidate

        assert staging is not None
        info = consolidate(
            ckpt_dir,
            staging / CONSOLIDATED,
            pretrained_out=staging / PRETRAINED,
            workload=opts.workload,
        )
        sources[CONSOLIDATED] = staging / CONSOLIDATED
        staged.add(CONSOLIDATED)
        consolidated: dict[str, Any] = {
            CONSOLIDATED: {k: info[k] for k in ("bytes", "sha256", "params_sha256")}
        }
        if info.get("pretrained"):
            # The workload's own layout (Hugging Face for Llama), loadable without this project.
            for f in info["pretrained"]["files"]:
                name = f"{PRETRAINED}/{f['name']}"
                sources[name] = staging / PRETRAINED / f["name"]
                staged.add(name)
            consolidated[PRETRAINED] = {"files": info["pretrained"]["files"]}
        outward = {**outward, "consolidated": consolidated}
    if staging is not None:
        manifest_path.write_text(json.dumps(outward, indent=1, sort_keys=True))

    part_size = opts.part_size

    def path_of(name: str) -> Path:
        return manifest_path if name == checkpointing.MANIFEST else sources[name]

    def local_checksum(name: str, sha: str) -> tuple[str, list[str] | None]:
        """What the server's checksum must read for the manifest's bytes of ``name``."""
        path = path_of(name)
        if path.stat().st_size <= part_size:
            return b64_of_hex(sha), None
        whole, parts = part_checksums(path, part_size)
        if whole != sha:
            raise ExportError(
                f"refusing to export {path}: it no longer matches the manifest's sha256 {sha}"
            )
        return composite_sha256_b64(parts), parts

    def present(name: str, sha: str) -> bool:
        path = path_of(name)
        head = _head(client, bucket, f"{base}/{name}")
        if head is None:  # nothing to compare: do not read the file for its part digests
            return False
        return is_present(head, path.stat().st_size, sha, local_checksum(name, sha)[0])

    def put(name: str, sha: str) -> int:
        path, key = path_of(name), f"{base}/{name}"
        size = path.stat().st_size
        parts: list[str] | None = None
        if size <= part_size:
            _put_single(client, bucket, key, path, sha, extra)
        else:
            parts = upload_multipart(
                client, bucket, key, path, sha, part_size=part_size, extra=extra
            )
        modes.add(_verify_uploaded(client, bucket, key, size, sha, parts))
        on_object(name, "uploaded")
        return size

    try:
        client.head_bucket(Bucket=bucket)
        digests = {
            name: sha256_file(src) if name in staged else shas[name]
            for name, src in sources.items()
        }
        # The manifest's own digest: taken now, so a change before its upload is refused too.
        digests[checkpointing.MANIFEST] = sha256_file(manifest_path)
        with ThreadPoolExecutor(max_workers=opts.max_workers) as pool:
            names = list(digests)
            found = dict(zip(names, pool.map(lambda n: present(n, digests[n]), names), strict=True))
        manifest_key = f"{base}/{checkpointing.MANIFEST}"
        ours = found.pop(checkpointing.MANIFEST)
        plan = plan_export(found, ours, ours or _head(client, bucket, manifest_key) is not None)
        for name, ok in found.items():
            if ok:
                on_object(name, "present")
        if plan.withdraw_manifest:
            # First: readers stop trusting the prefix before any object under it changes.
            client.delete_object(Bucket=bucket, Key=manifest_key)
            on_object(checkpointing.MANIFEST, "withdrawn")
        objects = [n for n in plan.upload if n != checkpointing.MANIFEST]
        with ThreadPoolExecutor(max_workers=opts.max_workers) as pool:
            sizes = list(pool.map(lambda n: put(n, digests[n]), objects))
        if checkpointing.MANIFEST in plan.upload:
            # Last, and only after every other object verified against the manifest.
            sizes.append(put(checkpointing.MANIFEST, digests[checkpointing.MANIFEST]))
        else:
            on_object(checkpointing.MANIFEST, "present")
        total = sum(p.stat().st_size for p in sources.values()) + manifest_path.stat().st_size
    except ExportError:
        raise
    except StorageError:
        raise
    except Exception as e:
        raise StorageError(describe_client_error(e, bucket=bucket, endpoint=endpoint)) from e
    finally:
        if staging is not None:
            import shutil

            shutil.rmtree(staging, ignore_errors=True)
    n_objects = len(digests)
    return ExportReport(
        uri=f"s3://{bucket}/{base}/",
        objects=n_objects,
        uploaded=len(sizes),
        skipped=n_objects - len(sizes),
        bytes=total,
        bytes_uploaded=sum(sizes),
        verified=True,
        verification="+".join(sorted(modes)) or "unchanged",
    )


def _verify_uploaded(
    client: Any, bucket: str, key: str, size: int, sha: str, parts: list[str] | None
) -> str:
    """After an upload: the server's checksum must be the one the manifest's digest implies
    (it verified the bytes on the way in); a server that keeps no checksum is read back."""
    head = _head(client, bucket, key)
    if head is None or head.get("ContentLength") != size:
        raise ExportError(f"s3://{bucket}/{key} is missing or has the wrong size after upload")
    remote = head.get("ChecksumSHA256")
    if not remote:
        if _read_back_sha(client, bucket, key) != sha:
            raise ExportError(f"s3://{bucket}/{key} read back does not match the manifest")
        return "read-back"
    if remote != expected_checksum(size, sha, parts):
        raise ExportError(
            f"s3://{bucket}/{key}: the server's SHA-256 {remote} is not the manifest's digest"
        )
    return "sha256" if parts is None else "sha256-parts"
