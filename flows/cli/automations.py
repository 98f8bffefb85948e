"""``nvrx-pipeline automations apply``: the shipped Prefect automations (flows.automations)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from flows.cli.common import EXIT_FAILED, EXIT_USAGE, command, fail


def cmd_automations(args: argparse.Namespace) -> int:
    import yaml

    from flows import automations as shipped

    try:
        if not args.dry_run:
            applied, skipped = shipped.apply(
                path=args.file,
                notify_block=args.notify_block,
                deployment=args.deployment,
                checkpoint_stall_minutes=args.checkpoint_stall_minutes,
            )
        else:
            # Dry run: no server to look names up in; a nil id stands in for each one given.
            nil = "00000000-0000-0000-0000-000000000000"
            ids: dict[str, object] = {"{notify_block}": nil} if args.notify_block else {}
            if args.deployment:
                ids |= {"{deployment}": nil, "{resume_parameters}": shipped.resume_parameters()}
            stall = shipped.stall_ids(args.checkpoint_stall_minutes)
            resolved = shipped.resolve(shipped.load(args.file), ids | stall)
            print(yaml.safe_dump({"automations": resolved.automations}, sort_keys=False), end="")
            applied, skipped = {}, resolved.skipped
    except shipped.AutomationConfigError as e:
        return fail(e, EXIT_USAGE)
    except Exception as e:  # the server: unreachable, or it refused an automation
        from prefect.settings import PREFECT_API_URL

        return fail(
            f"the Prefect server at {PREFECT_API_URL.value() or '(none configured)'}: "
            f"{type(e).__name__}: {e}; check PREFECT_API_URL and that the server is up",
            EXIT_FAILED,
        )
    for name, aid in applied.items():
        print(f"applied {name} ({aid})")
    for name, why in skipped.items():
        print(f"skipped {name}: {why}")
    return 0


def add(sub: Any) -> None:
    from flows.automations import DEFAULT_FILE

    auto = command(sub, "automations", cmd_automations, help="Prefect automations for nvrx events")
    auto_sub = auto.add_subparsers(dest="action", required=True)
    ap = command(
        auto_sub,
        "apply",
        cmd_automations,
        "automations",
        help="create or replace the shipped automations",
    )
    ap.add_argument("--file", type=Path, default=DEFAULT_FILE, help="automations YAML")
    ap.add_argument(
        "--notify-block", help="notification block TYPE-SLUG/NAME, e.g. slack-webhook/ops"
    )
    ap.add_argument(
        "--deployment",
        help="the pipeline deployment FLOW/NAME whose runs are resumed on capacity.restored",
    )
    ap.add_argument(
        "--checkpoint-stall-minutes",
        type=float,
        default=30.0,
        metavar="N",
        help="notify when a training run commits no checkpoint for N minutes (30)",
    )
    ap.add_argument("--dry-run", action="store_true", help="print what would be applied")
