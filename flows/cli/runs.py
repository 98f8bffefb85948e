"""``nvrx-pipeline runs``: the runs of a state directory (tasks.run_status), newest first."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from flows.cli.common import command

EXIT = {
    0: "the list printed (empty: no run under that root)",
}


def cmd_runs(args: argparse.Namespace) -> int:
    from tasks.run_status import list_runs

    root = args.runs_root or Path(args.state_dir) / "fsx" / "runs"
    rows = list_runs(root)
    if args.json:
        print(json.dumps([r.__dict__ for r in rows]))
        return 0
    if not rows:
        print(f"no runs under {root} (pass --state-dir, or --runs-root /fsx/runs on EKS)")
        return 0
    print(f"{'run id':<34} {'state':<12} {'step':>10}  updated")
    for r in rows:
        step = f"{r.step}/{r.target_steps}" if r.target_steps else str(r.step)
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.updated))
        owner = f"  (owner {r.owner})" if r.owner else ""
        print(f"{r.run_id:<34} {r.state:<12} {step:>10}  {when}{owner}")
    print(f"details: nvrx-pipeline status RUN_ID --state-dir {args.state_dir}")
    return 0


def add(sub: Any) -> None:
    runs = command(
        sub, "runs", EXIT, cmd_runs, help="list the runs of a state directory, newest first"
    )
    runs.add_argument("--state-dir", default=".state", help="local state dir (default .state)")
    runs.add_argument("--runs-root", type=Path, help="the runs directory itself (EKS: /fsx/runs)")
    runs.add_argument("--json", action="store_true", help="a JSON list instead of text")
