"""Dataset preparation, as ``nvrx-pipeline prepare-dataset`` asks for it: token files (.bin raw
tokens, .npy arrays) or, with a local ``tokenizer.json``, JSONL text -> ``shard_*.bin`` and
``dataset.json`` in a directory (``trainer.prepare``), then optionally uploaded to an S3 prefix
(``tasks.hydrate.upload_dataset``). The bucket is checked before the conversion, which can take a
while. The command only parses and prints (``flows.cli.prepare_dataset``)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tasks.errors import StorageError
from tasks.storage.local_s3 import settings_for
from tasks.storage.s3 import parse_s3_uri
from trainer import prepare
from trainer.data import DataError


@dataclass(frozen=True, kw_only=True)
class PrepareRequest:
    inputs: list[Path]  # concatenated in order
    out: Path
    tokenizer: Path | None = None  # a local tokenizer.json: the inputs are JSONL text
    text_field: str = "text"
    eos_id: int | None = None
    no_eos: bool = False
    input_dtype: str | None = None  # raw .bin inputs: uint16 or uint32
    vocab_size: int | None = None
    dtype: str | None = None  # output dtype (default: the smallest that fits)
    shard_tokens: int | None = None
    s3_uri: str | None = None  # also upload to s3://bucket/prefix
    s3_endpoint: str | None = None
    # A local endpoint that is this state directory's S3 server is reached with its keys.
    state_dir: Path = Path(".state")


class PrepareInputError(Exception):
    """Bad input: ``field`` (None: the data itself, the message says where) and the fix."""

    def __init__(self, field: str | None, message: str) -> None:
        super().__init__(message if field is None else f"{field}: {message}")
        self.field, self.message = field, message


class UploadError(Exception):
    """The bucket cannot be reached or the upload failed (one line with the cause)."""


def _uploader(req: PrepareRequest) -> Callable[[], dict[str, object]] | None:
    """The upload asked for (its summary: uri, objects), its bucket checked now: before the
    conversion, which can take a while. None without ``s3_uri``."""
    if not req.s3_uri:
        if req.s3_endpoint:
            raise PrepareInputError("s3_endpoint", "only means something with --s3-uri")
        return None
    from tasks.hydrate import upload_dataset
    from tasks.storage.s3 import boto3_client, check_bucket, describe_client_error

    try:
        bucket, prefix = parse_s3_uri(req.s3_uri)
    except StorageError as e:
        raise PrepareInputError("s3_uri", str(e)) from None
    endpoint = req.s3_endpoint or os.environ.get("AWS_ENDPOINT_URL") or None
    try:
        client = boto3_client(settings_for(endpoint, req.state_dir))
        check_bucket(client, bucket, endpoint=endpoint)
    except StorageError as e:
        raise UploadError(str(e)) from None

    def upload() -> dict[str, object]:
        try:
            objects = upload_dataset(client, req.out, bucket, prefix)
        except Exception as e:  # boto3/botocore errors: one line with the cause
            raise UploadError(describe_client_error(e, bucket=bucket, endpoint=endpoint)) from None
        return {"uri": f"s3://{bucket}/{prefix}", "objects": objects}

    return upload


def prepare_dataset(
    req: PrepareRequest, progress: Callable[[int, int, str], None] | None = None
) -> dict[str, object]:
    """Write the dataset (and upload it); a summary: dir, dtype, vocab_size, files, tokens,
    source, and with an upload its uri and objects."""
    upload = _uploader(req)
    shard_tokens = prepare.DEFAULT_SHARD_TOKENS if req.shard_tokens is None else req.shard_tokens
    try:
        if req.tokenizer is not None:
            if req.input_dtype is not None:
                raise PrepareInputError(
                    "input_dtype", "is for token files; JSONL is tokenized (--tokenizer)"
                )
            manifest = prepare.from_jsonl(
                req.inputs,
                req.out,
                tokenizer_json=req.tokenizer,
                text_field=req.text_field,
                append_eos=not req.no_eos,
                eos_id=req.eos_id,
                vocab_size=req.vocab_size,
                dtype=req.dtype,
                shard_tokens=shard_tokens,
                progress=progress,
            )
        else:
            if req.vocab_size is None:
                raise PrepareInputError(
                    "vocab_size",
                    "token files need --vocab-size (the tokenizer's vocabulary size); "
                    "JSONL text needs --tokenizer",
                )
            for flag, given in (
                ("--text-field", req.text_field != "text"),
                ("--eos-id", req.eos_id is not None),
                ("--no-eos", req.no_eos),
            ):
                if given:
                    raise PrepareInputError(flag.lstrip("-").replace("-", "_"), "needs --tokenizer")
            manifest = prepare.from_token_files(
                req.inputs,
                req.out,
                vocab_size=req.vocab_size,
                input_dtype=req.input_dtype,
                dtype=req.dtype,
                shard_tokens=shard_tokens,
                progress=progress,
            )
    except prepare.PrepareError as e:
        raise PrepareInputError(e.field, e.message) from None
    except DataError as e:
        raise PrepareInputError(None, str(e)) from None
    summary: dict[str, object] = {
        "dir": str(req.out),
        "dtype": manifest.dtype,
        "vocab_size": manifest.vocab_size,
        "files": len(manifest.files),
        "tokens": manifest.total_tokens,
        "source": "token-files" if req.tokenizer is None else "jsonl",
    }
    return summary if upload is None else {**summary, **upload()}
