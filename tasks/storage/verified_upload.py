"""An object uploaded so that S3 itself checks its bytes against a known sha256: a single PUT
or a multipart upload with a SHA-256 checksum per part, the server's checksum compared after,
and a read-back where a server keeps no checksum. Only the error names what went wrong (never a
credential)."""

from __future__ import annotations

import base64
import contextlib
import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tasks.errors import ExportError

_CHUNK = 8 << 20
PART_SIZE = 8 << 20  # multipart threshold and part size (S3 wants >= 5 MiB but the last)


def b64_of_hex(sha_hex: str) -> str:
    """The manifest's hex sha256 as S3 spells a SHA-256 checksum (base64 of the raw digest)."""
    return base64.b64encode(bytes.fromhex(sha_hex)).decode()


def _b64_sha256(data: bytes) -> str:
    return base64.b64encode(hashlib.sha256(data).digest()).decode()


def composite_sha256_b64(part_checksums: list[str]) -> str:
    """S3's COMPOSITE SHA-256 of a multipart upload: the digest of the parts' digests, "-N"."""
    raw = b"".join(base64.b64decode(c) for c in part_checksums)
    return f"{_b64_sha256(raw)}-{len(part_checksums)}"


def head_object(client: Any, bucket: str, key: str) -> dict[str, Any] | None:
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


def part_checksums(path: Path, part_size: int) -> tuple[str, list[str]]:
    """(whole-file sha256 hex, per-part SHA-256 checksums) in one read."""
    whole, parts = hashlib.sha256(), []
    for chunk in _parts(path, part_size):
        whole.update(chunk)
        parts.append(_b64_sha256(chunk))
    return whole.hexdigest(), parts


def _refused(e: Exception) -> bool:
    from botocore.exceptions import ClientError

    code = e.response.get("Error", {}).get("Code") if isinstance(e, ClientError) else None
    return code in ("BadDigest", "InvalidDigest", "XAmzContentSHA256Mismatch")


def put_single(
    client: Any, bucket: str, key: str, path: Path, sha_hex: str, extra: dict[str, str]
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
    extra: dict[str, str],
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
            checksum = _b64_sha256(chunk)
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


def verify_uploaded(
    client: Any, bucket: str, key: str, size: int, sha: str, parts: list[str] | None
) -> str:
    """After an upload: the server's checksum must be the one the manifest's digest implies
    (it verified the bytes on the way in); a server that keeps no checksum is read back."""
    head = head_object(client, bucket, key)
    if head is None or head.get("ContentLength") != size:
        raise ExportError(f"s3://{bucket}/{key} is missing or has the wrong size after upload")
    remote = head.get("ChecksumSHA256")
    if not remote:
        if _read_back_sha(client, bucket, key) != sha:
            raise ExportError(f"s3://{bucket}/{key} read back does not match the manifest")
        return "read-back"
    # Whole-object for a single PUT, composite for a multipart upload (``parts``).
    if remote != (b64_of_hex(sha) if parts is None else composite_sha256_b64(parts)):
        raise ExportError(
            f"s3://{bucket}/{key}: the server's SHA-256 {remote} is not the manifest's digest"
        )
    return "sha256" if parts is None else "sha256-parts"
