"""Export a committed checkpoint to ``s3://bucket/prefix/<run_id>/step_<N>/``, first version.

Every object is uploaded (boto3's managed multipart transfer) with its sha256 as metadata and
verified by reading it back; ``manifest.json`` goes last, so a reader trusts a prefix only when
its manifest is there. Re-running skips objects already present with the same digest.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.errors import ExportError, StorageError
from tasks.storage.s3 import describe_client_error, validate_bucket, validate_prefix
from trainer import manifest as ckpt_manifest
from trainer.hashing import sha256_file


@dataclass
class ExportReport:
    uri: str
    objects: int
    uploaded: int
    skipped: int
    bytes: int  # the whole exported set
    bytes_uploaded: int
    verified: bool

    def to_dict(self) -> dict[str, Any]:
        return self.__dict__.copy()


def _remote_sha(client: Any, bucket: str, key: str) -> str | None:
    try:
        head = client.head_object(Bucket=bucket, Key=key)
    except client.exceptions.ClientError:
        return None
    return head.get("Metadata", {}).get("sha256")


def _read_back_sha(client: Any, bucket: str, key: str) -> str:
    h = hashlib.sha256()
    body = client.get_object(Bucket=bucket, Key=key)["Body"]
    for chunk in iter(lambda: body.read(8 << 20), b""):
        h.update(chunk)
    return h.hexdigest()


def export_checkpoint(
    client: Any, ckpt_dir: Path, bucket: str, prefix: str, run_id: str, *, endpoint: str | None
) -> ExportReport:
    validate_bucket(bucket)
    validate_prefix(prefix)
    man = ckpt_manifest.read_manifest(ckpt_dir)
    base = "/".join(p for p in (prefix, run_id, f"step_{man['step']}") if p)
    entries = [*man["files"], None]  # None: the manifest itself, last
    uploaded = skipped = nbytes = total = 0
    try:
        client.head_bucket(Bucket=bucket)
        for entry in entries:
            name = ckpt_manifest.MANIFEST if entry is None else entry["name"]
            path = ckpt_dir / name
            sha = sha256_file(path) if entry is None else entry["sha256"]
            key = f"{base}/{name}"
            total += path.stat().st_size
            if (
                _remote_sha(client, bucket, key) == sha
                and _read_back_sha(client, bucket, key) == sha
            ):
                skipped += 1
                continue
            client.upload_file(str(path), bucket, key, ExtraArgs={"Metadata": {"sha256": sha}})
            if _read_back_sha(client, bucket, key) != sha:
                raise ExportError(f"s3://{bucket}/{key} does not match {path} after upload")
            uploaded += 1
            nbytes += path.stat().st_size
    except ExportError:
        raise
    except Exception as e:
        raise StorageError(describe_client_error(e, bucket=bucket, endpoint=endpoint)) from e
    return ExportReport(
        uri=f"s3://{bucket}/{base}/",
        objects=len(entries),
        uploaded=uploaded,
        skipped=skipped,
        bytes=total,
        bytes_uploaded=nbytes,
        verified=True,
    )


def exported_manifest(client: Any, bucket: str, base: str) -> dict[str, Any]:
    body = client.get_object(Bucket=bucket, Key=f"{base}/{ckpt_manifest.MANIFEST}")["Body"].read()
    return json.loads(body)
