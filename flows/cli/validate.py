"""``nvrx-pipeline validate``: every check of a committed checkpoint directory."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from flows.cli.common import EXIT_FAILED, EXIT_USAGE, command, fail


def cmd_validate(args: argparse.Namespace) -> int:
    from tasks.validation.checkpoint import Expectations, validate_checkpoint
    from trainer.checkpointing import WorkloadRef

    if not args.path.is_dir():
        return fail(f"{args.path} is not a checkpoint directory", EXIT_USAGE)
    # The workload, batch and seed come from the checkpoint's own manifest unless overridden.
    workload = None if args.workload is None else WorkloadRef(args.workload, args.workload_options)
    exp = Expectations(workload=workload, data_dir=args.data_dir)
    report = validate_checkpoint(args.path, exp)
    if args.json:
        print(json.dumps(report.to_dict()), flush=True)
    else:
        print(f"{report.status.upper()}: {report.path} (step {report.step})")
        for c in report.checks:
            print(f"  {c.status.value:<8} {c.name}: {c.detail}")
    return 0 if report.passed else EXIT_FAILED


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
