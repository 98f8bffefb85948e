"""``nvrx-pipeline validate`` / ``export`` / ``pull``: a committed checkpoint directory's every
check; the checkpoint to S3, verified against its manifest; an export from S3 back into a
directory, verified (tasks.validation.checkpoint, tasks.export, tasks.pull)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from flows.cli.common import (
    EXIT_FAILED,
    EXIT_USAGE,
    add_s3_endpoint,
    command,
    emit,
    fail,
    s3_settings,
)


def cmd_validate(args: argparse.Namespace) -> int:
    from tasks.validation.checkpoint import Expectations, validate_checkpoint
    from trainer.checkpointing import WorkloadRef

    if not args.path.is_dir():
        return fail(f"{args.path} is not a checkpoint directory", EXIT_USAGE)
    # The workload, batch and seed come from the checkpoint's own manifest unless overridden.
    workload = None if args.workload is None else WorkloadRef(args.workload, args.workload_options)
    report = validate_checkpoint(args.path, Expectations(workload=workload, data_dir=args.data_dir))
    lines = [f"{report.status.upper()}: {report.path} (step {report.step})"]
    lines += (f"  {c.status.value:<8} {c.name}: {c.detail}" for c in report.checks)
    emit(args.json, report.to_dict(), "\n".join(lines))
    return 0 if report.passed else EXIT_FAILED


def cmd_export(args: argparse.Namespace) -> int:
    from tasks.errors import PipelineError
    from tasks.export import ExportOptions, export_checkpoint
    from tasks.storage.s3 import boto3_client, parse_s3_uri
    from trainer.checkpointing import WorkloadRef

    workload = None if args.workload is None else WorkloadRef(args.workload, args.workload_options)
    try:
        bucket, prefix = parse_s3_uri(args.s3_uri)
        settings = s3_settings(args)
        report = export_checkpoint(
            boto3_client(settings),
            args.path,
            bucket,
            prefix,
            args.run_id or args.path.parent.parent.name,
            endpoint=settings.endpoint_url,
            options=ExportOptions(
                sse=args.sse,
                kms_key_id=args.kms_key_id,
                consolidated=args.consolidated,
                workload=workload,
            ),
        )
    except (PipelineError, OSError) as e:
        return fail(e, EXIT_FAILED)
    return emit(
        args.json,
        report.to_dict(),
        f"exported {report.uri}: {report.objects} objects ({report.uploaded} uploaded, "
        f"{report.skipped} already there), verified by {report.verification}",
    )


def cmd_pull(args: argparse.Namespace) -> int:
    from tasks.errors import PipelineError, PullUsageError, StorageError
    from tasks.pull import pull_export
    from tasks.storage.s3 import boto3_client, parse_s3_uri

    try:
        bucket, prefix = parse_s3_uri(args.s3_uri)
    except StorageError as e:
        return fail(f"S3_URI: {e}", EXIT_USAGE)
    tty, last = sys.stderr.isatty(), [-1]

    def progress(done: int, total: int, name: str | None) -> None:
        # A terminal gets a line per file; a log, a line every 10 % (mid-file too).
        tenth = 10 * done // max(total, 1)
        if (tty and name is not None) or (not tty and tenth != last[0]):
            last[0] = tenth
            what = f" ({name})" if name else ""
            print(f"pull: {100 * done // max(total, 1):3d}%{what}", file=sys.stderr, flush=True)

    settings = s3_settings(args)
    try:
        report = pull_export(
            boto3_client(settings),
            bucket,
            prefix,
            args.dir,
            endpoint=settings.endpoint_url,
            on_progress=progress,
        )
    except PullUsageError as e:
        return fail(e, EXIT_USAGE)
    except (PipelineError, OSError) as e:
        return fail(e, EXIT_FAILED)
    how = "downloaded" if report.downloaded else "already there"
    return emit(
        args.json,
        report.to_dict(),
        f"pulled {report.uri} to {report.dir}: step {report.step}, {report.files} files, "
        f"{report.bytes} bytes, verified ({how})",
    )


def add(sub: Any) -> None:
    val = command(sub, "validate", cmd_validate, help="validate a committed checkpoint directory")
    val.add_argument("path", type=Path)
    val.add_argument(
        "--workload", help="workload that wrote it (default: the one its manifest names)"
    )
    val.add_argument(
        "--workload-options", type=json.loads, default={}, help="with --workload: JSON object"
    )
    val.add_argument("--data-dir", type=Path, help="dataset: enables the held-out loss check")
    val.add_argument("--json", action="store_true")
    exp = command(sub, "export", cmd_export, help="export a committed checkpoint to S3")
    exp.add_argument("path", type=Path)
    exp.add_argument("s3_uri")
    exp.add_argument("--run-id")
    add_s3_endpoint(exp)
    exp.add_argument("--sse", choices=["AES256", "aws:kms"], help="server-side encryption")
    exp.add_argument("--kms-key-id", help="KMS key id or ARN (with --sse aws:kms)")
    exp.add_argument(
        "--consolidated",
        action="store_true",
        help="also export the full weights as one model.safetensors",
    )
    exp.add_argument(
        "--workload",
        help="with --consolidated: workload that wrote it (default: the built-in its manifest "
        "names; a package.module:attr workload must be named here)",
    )
    exp.add_argument(
        "--workload-options", type=json.loads, default={}, help="with --workload: JSON object"
    )
    exp.add_argument("--json", action="store_true")
    pull = command(
        sub,
        "pull",
        cmd_pull,
        help="download an export from S3 into a directory, verified against its manifest",
        description="Download the export at S3_URI (s3://bucket/prefix/<run_id>/step_<N>/) into "
        "DIR, every file checked against the export's manifest.json (size and sha256). It lands "
        "in a hidden directory beside DIR and is renamed to DIR only once it verifies. DIR must "
        "be absent or empty, or already hold the same verified export (then nothing is "
        "downloaded).",
    )
    pull.add_argument("s3_uri", metavar="S3_URI", help="the export prefix")
    pull.add_argument("dir", metavar="DIR", type=Path, help="directory to create (or empty one)")
    add_s3_endpoint(pull)
    pull.add_argument("--json", action="store_true", help="print a summary as JSON last")
