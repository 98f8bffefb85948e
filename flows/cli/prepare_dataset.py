"""``nvrx-pipeline prepare-dataset``: token files or JSONL text -> a dataset directory, and
optionally its S3 prefix (tasks.dataset_prep does the work)."""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

from flows.cli.common import EXIT_FAILED, EXIT_USAGE, command, emit, fail


def cmd_prepare_dataset(args: argparse.Namespace) -> int:
    from tasks.dataset_prep import PrepareInputError, PrepareRequest, UploadError, prepare_dataset

    last = [-1]

    def progress(done: int, total: int, what: str) -> None:  # a line every 10 %
        tenth = 10 * done // max(total, 1)
        if tenth != last[0]:
            last[0] = tenth
            print(f"prepare: {10 * tenth:3d}% ({what})", file=sys.stderr, flush=True)

    # Each flag is the request's field of the same name.
    request = PrepareRequest(**{f.name: getattr(args, f.name) for f in fields(PrepareRequest)})
    try:
        summary = prepare_dataset(request, progress)
    except PrepareInputError as e:
        return fail(e, EXIT_USAGE)
    except UploadError as e:
        return fail(f"upload: {e}", EXIT_FAILED)
    text = (
        f"wrote {summary['dir']}: {summary['files']} shards, {summary['tokens']} "
        f"{summary['dtype']} tokens (vocab_size {summary['vocab_size']})"
    )
    if "uri" in summary:
        text += f"\nuploaded {summary['uri']} ({summary['objects']} objects)"
    return emit(args.json, summary, text)


def add(sub: Any) -> None:
    prep = command(
        sub,
        "prepare-dataset",
        cmd_prepare_dataset,
        help="turn token files (.bin/.npy) or JSONL text into a dataset (optionally upload it)",
        description="Token files (.bin raw tokens, .npy integer arrays) or, with --tokenizer, "
        "JSONL text -> shard_*.bin + dataset.json in --out.",
    )
    prep.add_argument("inputs", nargs="+", type=Path, help="input files, concatenated in order")
    prep.add_argument("--out", type=Path, required=True, help="dataset directory to write")
    prep.add_argument("--tokenizer", type=Path, help="local tokenizer.json: inputs are JSONL")
    prep.add_argument("--text-field", default="text", help="JSONL field with the text (text)")
    prep.add_argument("--eos-id", type=int, help="EOS id after each document (default: found)")
    prep.add_argument("--no-eos", action="store_true", help="no EOS between JSONL documents")
    prep.add_argument("--input-dtype", help="dtype of raw .bin inputs: uint16 or uint32")
    prep.add_argument("--vocab-size", type=int, help="vocabulary size (required for token files)")
    prep.add_argument("--dtype", help="output dtype, uint16 or uint32 (default: smallest fitting)")
    prep.add_argument("--shard-tokens", type=int, help="tokens per output shard (64 Mi)")
    prep.add_argument("--s3-uri", help="also upload the dataset to s3://bucket/prefix")
    prep.add_argument("--s3-endpoint", help="S3 endpoint URL (default: AWS, or $AWS_ENDPOINT_URL)")
    prep.add_argument(
        "--state-dir",
        type=Path,
        default=Path(".state"),
        help="a local endpoint that is this state directory's S3 server uses its keys (.state)",
    )
    prep.add_argument("--json", action="store_true", help="print a summary as JSON last")
