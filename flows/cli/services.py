"""The Prefect side: ``nvrx-pipeline serve``, the deployments (schedules included) served until
Ctrl-C; ``up`` / ``down``, a local Prefect server and the S3 server kept up across runs
(tasks.local_services, tasks.storage.local_s3), and stopped; ``automations apply``, the shipped
automations (flows.automations)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from flows.cli.common import (
    EXIT_FAILED,
    EXIT_USAGE,
    add_params_options,
    command,
    fail,
    params_from_args,
)


def cmd_serve(args: argparse.Namespace) -> int:
    from flows.deployments import serve_all

    defaults = params_from_args(args, inject=[], deployment=True)
    if defaults is None:
        return EXIT_USAGE
    try:
        serve_all(defaults)
    except KeyboardInterrupt:
        return 0
    except Exception as e:  # the server: unreachable, or it refused the deployments
        return fail(f"serving the deployments failed: {type(e).__name__}: {e}", EXIT_FAILED)
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    from tasks.errors import PipelineError
    from tasks.local_services import auth_file, start_prefect
    from tasks.storage.local_keys import PROFILE, keys_of
    from tasks.storage.local_s3 import keep_local_s3
    from tasks.storage.s3 import S3Settings

    state = Path(args.state_dir)
    kept: list[str | None] = []
    try:
        # The S3 server starts while the Prefect server does (seconds saved on every `up`).
        api = start_prefect(
            state,
            port=args.port,
            meanwhile=lambda: kept.append(
                keep_local_s3(S3Settings(endpoint_url=args.s3_endpoint), state)
            ),
        )
    except PipelineError as e:
        return fail(e, EXIT_FAILED)
    [endpoint] = kept
    ui = api.removesuffix("/api")
    password = auth_file(state)
    print(f"Prefect UI: {ui} (runs of --state-dir {state} use it; its data in {state}/prefect)")
    print(f"  its login asks for the password in {password} (only you can read it)")
    print(
        f"  other Prefect clients: export PREFECT_API_URL={api} "
        f"PREFECT_API_AUTH_STRING=$(cat {password})"
    )
    print(f"S3: {endpoint} (the demo's data and exports, kept until `nvrx-pipeline down`)")
    if endpoint is not None:
        creds = keys_of(state / "s3").credentials
        print(
            f"  its keys: AWS_SHARED_CREDENTIALS_FILE={creds} AWS_PROFILE={PROFILE} "
            f"(nvrx-pipeline's own commands find them with --state-dir {state})"
        )
    print(f"stop both: nvrx-pipeline down --state-dir {state}")
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    from tasks.local_services import stop_prefect
    from tasks.storage.local_s3 import unkeep_local_s3

    state = Path(args.state_dir)
    prefect = stop_prefect(state)
    s3 = unkeep_local_s3(state)
    print(f"Prefect server: {'stopped' if prefect else 'was not running'}")
    print(f"S3 server: {'stopped' if s3 else 'not running, or still used by a run'}")
    return 0


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
    serve = command(sub, "serve", cmd_serve, help="serve the deployments (schedules included)")
    add_params_options(
        serve,
        "YAML or JSON file: the deployments' defaults",
        "override a default parameter of both deployments (the UI form starts from these)",
    )
    up = command(
        sub,
        "up",
        cmd_up,
        help="keep a local Prefect server (the UI) and the S3 server up across runs",
        description="Start, for a state directory, a Prefect server (UI and artifacts, its "
        "database under STATE_DIR/prefect) and the embedded S3 server, and keep them up after "
        "each run ends, until `down`. `run` with the same --state-dir uses them.",
    )
    up.add_argument("--state-dir", default=".state", help="local state dir (default .state)")
    up.add_argument("--port", type=int, default=4200, help="the Prefect server's port (4200)")
    up.add_argument("--s3-endpoint", default="http://127.0.0.1:8333", help="the S3 server's")
    down = command(sub, "down", cmd_down, help="stop what `up` started")
    down.add_argument("--state-dir", default=".state", help="local state dir (default .state)")
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
