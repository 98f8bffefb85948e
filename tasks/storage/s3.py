"""S3 access: settings, clients (boto3 and s3fs from the same settings), URI validation, and
errors that say what is wrong (unreachable endpoint, missing bucket, bad credentials).

Real AWS works by configuration alone: leave ``endpoint_url`` unset and the default credential
chain (environment, profile, IRSA on EKS) applies; so do the region and the retries unless a
region is given (:mod:`tasks.aws` builds the clients). The state directory's own S3 server
requires its generated keys, which the settings name by path (``keys_file``: set by
:meth:`tasks.storage.local_s3.SharedServer.settings`, read when a client is made). Any other local
endpoint with no credentials in the environment gets static placeholder keys (an anonymous local
server still needs signed requests from boto3).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from tasks.errors import StorageError

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
# Used with fullmatch: "$" would accept a trailing newline ("bucket\n").
_BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]")


@dataclass(frozen=True, kw_only=True)
class S3Settings:
    endpoint_url: str | None = None  # None: real AWS
    region: str | None = None  # None: the standard chain (tasks.aws)
    # The generated keys of the state directory's own server (tasks.storage.local_keys), which
    # win over the environment's: a user's AWS keys are not this server's, nor its to see.
    keys_file: Path | None = None

    @property
    def is_local(self) -> bool:
        return self.endpoint_url is not None and urlparse(self.endpoint_url).hostname in LOCAL_HOSTS

    def credentials(self) -> dict[str, str]:
        if self.keys_file is not None:
            from tasks.storage.local_keys import read_credentials

            return read_credentials(self.keys_file)
        if self.is_local and not os.environ.get("AWS_ACCESS_KEY_ID"):
            return {"aws_access_key_id": "nvrx-local", "aws_secret_access_key": "nvrx-local"}
        return {}


def boto3_client(settings: S3Settings, *, credentials: dict[str, str] | None = None) -> Any:
    """``credentials`` (aws_access_key_id/aws_secret_access_key) override the default chain;
    for tests and explicit keys only."""
    from tasks import aws

    return aws.client(
        "s3",
        region=settings.region,
        endpoint_url=settings.endpoint_url,
        credentials=credentials if credentials is not None else settings.credentials(),
        connect_timeout=5,
        read_timeout=60,
        max_pool_connections=16,
    )


def s3fs_filesystem(settings: S3Settings) -> Any:
    from tasks import aws

    return aws.s3fs_filesystem(
        region=settings.region,
        endpoint_url=settings.endpoint_url,
        credentials=settings.credentials(),
        skip_instance_cache=True,
    )


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """``s3://bucket/prefix`` -> (bucket, prefix without slashes at either end)."""
    parsed = urlparse(uri)
    if parsed.scheme != "s3":
        raise StorageError(f"{uri!r} is not an S3 URI: expected s3://bucket/prefix")
    if parsed.username or parsed.password or "@" in parsed.netloc:
        raise StorageError("S3 URIs must not carry credentials; use the AWS credential chain")
    bucket, prefix = parsed.netloc, parsed.path.strip("/")
    validate_bucket(bucket)
    validate_prefix(prefix)
    return bucket, prefix


def validate_bucket(bucket: str) -> None:
    if not isinstance(bucket, str) or not _BUCKET_RE.fullmatch(bucket):
        raise StorageError(
            f"bucket {bucket!r} is not a valid S3 bucket name (3-63 lowercase letters, digits, "
            "dots, hyphens)"
        )


_PREFIX_SEGMENT_RE = re.compile(r"[A-Za-z0-9_\-][A-Za-z0-9._\-]*")


def validate_prefix(prefix: str) -> None:
    """A key prefix is also a path on the shared filesystem (``datasets/<bucket>/<prefix>``):
    plain segments only (letters, digits, ``._-``, not starting with a dot), no empty, ``.`` or
    ``..`` segment, no control character or trailing newline."""
    parts = prefix.split("/") if prefix else []
    if any(p in ("", ".", "..") for p in parts):
        raise StorageError(f"prefix {prefix!r} must not contain empty, '.' or '..' segments")
    bad = next((p for p in parts if not _PREFIX_SEGMENT_RE.fullmatch(p)), None)
    if bad is not None:
        raise StorageError(
            f"prefix {prefix!r}: segment {bad!r} may hold only letters, digits, '.', '_' and "
            "'-', and not start with a dot"
        )


def describe_client_error(exc: BaseException, *, bucket: str | None, endpoint: str | None) -> str:
    """One line naming the cause and the fix, for the errors users actually meet."""
    from botocore.exceptions import (
        ClientError,
        EndpointConnectionError,
        NoCredentialsError,
    )

    where = endpoint or "AWS S3"
    if isinstance(exc, EndpointConnectionError):
        return f"S3 endpoint {where} is unreachable: check the endpoint URL and that it is up"
    if isinstance(exc, NoCredentialsError):
        return (
            "no AWS credentials found: set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, a profile "
            "or IRSA"
        )
    if isinstance(exc, ClientError):
        code = exc.response.get("Error", {}).get("Code", "")
        if code in ("NoSuchBucket", "404", "NotFound"):
            return f"bucket {bucket!r} does not exist at {where}: create it or fix the name"
        if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "403"):
            return (
                f"S3 at {where} refused the credentials ({code}): check the keys and the "
                "bucket policy"
            )
        return f"S3 error {code} at {where} for bucket {bucket!r}: {exc}"
    return f"S3 at {where}: {type(exc).__name__}: {exc}"


def check_bucket(client: Any, bucket: str, *, endpoint: str | None) -> None:
    try:
        client.head_bucket(Bucket=bucket)
    except Exception as e:
        raise StorageError(describe_client_error(e, bucket=bucket, endpoint=endpoint)) from e
