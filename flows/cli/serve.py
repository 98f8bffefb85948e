"""``nvrx-pipeline serve``: the deployments (schedules included), served until Ctrl-C."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from flows.cli.common import EXIT_FAILED, EXIT_USAGE, add_params_options, command, params_from_args

EXIT = {
    0: "stopped (Ctrl-C)",
    1: "the Prefect server failed",
    2: "bad default parameters",
}


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
        print(f"error: serving the deployments failed: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_FAILED
    return 0


def add(sub: Any) -> None:
    serve = command(
        sub, "serve", EXIT, cmd_serve, help="serve the deployments (schedules included)"
    )
    add_params_options(
        serve,
        "YAML or JSON file: the deployments' defaults",
        "override a default parameter of both deployments (the UI form starts from these)",
    )
