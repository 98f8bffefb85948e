"""Export a committed checkpoint to ``s3://bucket/prefix/<run_id>/step_<N>/``.

- Refuses a checkpoint whose files do not match its manifest (names the file).
- Uploads in parallel (boto3's managed transfer: multipart above 8 MiB, several files at once).
- Verifies every object after upload against the server's CRC32 (full-object, or the composite
  CRC32 of a multipart upload, recomputed locally over the same part size) where it returns one,
  otherwise the size plus a sha256 of the bytes read back.
- Uploads ``manifest.json`` last and only once everything else verified, so a reader trusts a
  prefix only when its manifest is there and matches.
- Idempotent: objects already present with the same size and sha256 (metadata, and checksum where
  available) are not uploaded again; a re-run after an interruption uploads only what is missing
  or mismatched.
- Optional server-side encryption (SSE-S3 or SSE-KMS with a key id).
Credentials are never logged or returned: errors are described by :func:`describe_client_error`.
"""

from __future__ import annotations

import base64
import hashlib
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.errors import ExportError, StorageError
from tasks.storage.s3 import describe_client_error, validate_bucket, validate_prefix
from trainer import manifest as ckpt_manifest
from trainer.hashing import sha256_file

_CHUNK = 8 << 20
CONSOLIDATED = "model.safetensors"
PRETRAINED = "hf"  # the workload's own layout, e.g. <prefix>/hf/config.json + safetensors


def _sha_of(man: dict[str, Any], name: str) -> str:
    return str(next(e["sha256"] for e in man["files"] if e["name"] == name))


@dataclass(frozen=True, kw_only=True)
class ExportOptions:
    sse: str | None = None  # None, "AES256" (SSE-S3) or "aws:kms" (SSE-KMS)
    kms_key_id: str | None = None
    max_workers: int = 4
    # Also export the full model weights as one model.safetensors (its digest goes into the
    # uploaded manifest under "consolidated").
    consolidated: bool = False

    def __post_init__(self) -> None:
        if self.sse not in (None, "AES256", "aws:kms"):
            raise ExportError(f"sse must be AES256 or aws:kms, got {self.sse!r}")
        if self.kms_key_id and self.sse != "aws:kms":
            raise ExportError("kms_key_id needs sse='aws:kms'")


@dataclass
class ExportReport:
    uri: str
    objects: int
    uploaded: int
    skipped: int
    bytes: int  # the whole exported set
    bytes_uploaded: int
    verified: bool
    verification: str  # "crc32", "crc32-composite" or "read-back", per the server

    def to_dict(self) -> dict[str, Any]:
        return self.__dict__.copy()


def crc32_b64(path: Path) -> str:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return base64.b64encode(crc.to_bytes(4, "big")).decode()


def composite_crc32_b64(path: Path, part_size: int) -> str:
    """S3's COMPOSITE CRC32 of a multipart upload: the CRC32 of the parts' CRC32s, "-<parts>"."""
    digests, parts = b"", 0
    with open(path, "rb") as f:
        while chunk := f.read(part_size):
            digests += zlib.crc32(chunk).to_bytes(4, "big")
            parts += 1
    return base64.b64encode(zlib.crc32(digests).to_bytes(4, "big")).decode() + f"-{parts}"


_PART = 8 << 20  # multipart threshold and part size: also what the composite CRC is over


def _transfer_config() -> Any:
    from boto3.s3.transfer import TransferConfig

    return TransferConfig(multipart_threshold=_PART, multipart_chunksize=_PART, max_concurrency=4)


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


def _matches(
    client: Any, bucket: str, key: str, head: dict[str, Any] | None, path: Path, sha: str
) -> tuple[bool, str]:
    """Is the object the same bytes as ``path``? Uses the server's full-object CRC32 when it
    returns one (no download), else reads the object back."""
    if head is None or head.get("ContentLength") != path.stat().st_size:
        return False, "size"
    if head.get("Metadata", {}).get("sha256") != sha:
        return False, "metadata"
    remote_crc = head.get("ChecksumCRC32")
    if remote_crc and "-" not in remote_crc:
        return remote_crc == crc32_b64(path), "crc32"
    if remote_crc and remote_crc == composite_crc32_b64(path, _PART):
        return True, "crc32-composite"
    # No checksum, or parts of another size (uploaded by someone else): read the bytes back.
    return _read_back_sha(client, bucket, key) == sha, "read-back"


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
    verdict = ckpt_manifest.verify_checkpoint(ckpt_dir)
    if not verdict.ok:
        raise ExportError(f"refusing to export {ckpt_dir}: {verdict.reason}")
    man = verdict.manifest
    base = "/".join(p for p in (prefix, run_id, f"step_{man['step']}") if p)
    extra: dict[str, Any] = {}
    if opts.sse:
        extra["ServerSideEncryption"] = opts.sse
    if opts.kms_key_id:
        extra["SSEKMSKeyId"] = opts.kms_key_id
    config = _transfer_config()
    modes: set[str] = set()
    sources = {e["name"]: ckpt_dir / e["name"] for e in man["files"]}
    manifest_path = ckpt_dir / ckpt_manifest.MANIFEST
    staging = None
    staged: set[str] = set()  # files made here (not in the checkpoint's manifest)
    if opts.consolidated:
        import json
        import tempfile

        from tasks.validation.checkpoint import consolidate

        staging = Path(tempfile.mkdtemp(prefix="nvrx-export-"))
        info = consolidate(ckpt_dir, staging / CONSOLIDATED, pretrained_out=staging / PRETRAINED)
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
        manifest_path = staging / ckpt_manifest.MANIFEST
        manifest_path.write_text(
            json.dumps({**man, "consolidated": consolidated}, indent=1, sort_keys=True)
        )

    def put(name: str, sha: str) -> tuple[bool, int]:
        path = manifest_path if name == ckpt_manifest.MANIFEST else sources[name]
        key = f"{base}/{name}"
        same, _ = _matches(client, bucket, key, _head(client, bucket, key), path, sha)
        if same:
            on_object(name, "present")
            return False, 0
        client.upload_file(
            str(path),
            bucket,
            key,
            Config=config,
            ExtraArgs={**extra, "Metadata": {"sha256": sha}, "ChecksumAlgorithm": "CRC32"},
        )
        ok, mode = _matches(client, bucket, key, _head(client, bucket, key), path, sha)
        modes.add(mode)
        if not ok:
            raise ExportError(f"s3://{bucket}/{key} does not match {path} after upload ({mode})")
        on_object(name, "uploaded")
        return True, path.stat().st_size

    try:
        client.head_bucket(Bucket=bucket)
        files = [
            (name, sha256_file(src) if name in staged else _sha_of(man, name))
            for name, src in sources.items()
        ]
        with ThreadPoolExecutor(max_workers=opts.max_workers) as pool:
            results = list(pool.map(lambda f: put(*f), files))
        # Last, and only after every other object verified: the manifest.
        results.append(put(ckpt_manifest.MANIFEST, sha256_file(manifest_path)))
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
    uploaded = sum(1 for done, _ in results if done)
    return ExportReport(
        uri=f"s3://{bucket}/{base}/",
        objects=len(results),
        uploaded=uploaded,
        skipped=len(results) - uploaded,
        bytes=total,
        bytes_uploaded=sum(n for _, n in results),
        verified=True,
        verification="+".join(sorted(modes)) or "unchanged",
    )
