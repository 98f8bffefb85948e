"""``nvrx-pipeline export``: a committed checkpoint to S3, verified against its manifest."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from flows.cli.common import EXIT_FAILED, add_s3_endpoint, command, fail

EXIT = {
    0: "exported and verified against the manifest",
    1: "the export failed",
    2: "bad usage",
}


def cmd_export(args: argparse.Namespace) -> int:
    from tasks.errors import PipelineError
    from tasks.export import ExportOptions, export_checkpoint
    from tasks.storage.s3 import S3Settings, boto3_client, parse_s3_uri
    from trainer.checkpointing import WorkloadRef

    try:
        bucket, prefix = parse_s3_uri(args.s3_uri)
        settings = S3Settings(endpoint_url=args.endpoint or os.environ.get("AWS_ENDPOINT_URL"))
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
                workload=None
                if args.workload is None
                else WorkloadRef(args.workload, args.workload_options),
            ),
        )
    except (PipelineError, OSError) as e:
        return fail(e, EXIT_FAILED)
    if args.json:
        print(json.dumps(report.to_dict()), flush=True)
    else:
        print(
            f"exported {report.uri}: {report.objects} objects ({report.uploaded} uploaded, "
            f"{report.skipped} already there), verified by {report.verification}"
        )
    return 0


def add(sub: Any) -> None:
    exp = command(sub, "export", EXIT, cmd_export, help="export a committed checkpoint to S3")
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
