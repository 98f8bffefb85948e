"""``nvrx-pipeline status`` and ``runs``: one run's summary, and the runs of a state directory
newest first (tasks.run_status), printed."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from flows.cli.common import EXIT_USAGE, command, emit, fail


def cmd_status(args: argparse.Namespace) -> int:
    from flows import report
    from flows.models import RUN_ID
    from tasks.run_status import RunNotFound, locate_run, read_status

    if not RUN_ID.fullmatch(args.run_id):
        why = "lowercase letters, digits and dashes (a run's id, as `run` printed it)"
        return fail(f"run_id {args.run_id!r}: {why}", EXIT_USAGE)
    try:
        run_root = locate_run(args.run_id, state_dir=Path(args.state_dir), run_root=args.run_root)
    except RunNotFound as e:
        return fail(e, EXIT_USAGE)
    st = read_status(run_root)
    if args.json:
        print(json.dumps({"run_id": args.run_id, **st.model_dump(mode="json")}))
        return 0
    loss = "" if st.loss is None else f", loss {st.loss:.4f}"
    if st.tokens_per_s is not None:
        loss += f", {st.tokens_per_s:.0f} tok/s"
    print(f"run {args.run_id}: {st.state}")
    if (o := st.owner) is not None:
        gone = o.alive is False  # None: another host's, not known from here
        gone_s = " (gone: the next run of this id takes it over)" if gone else ""
        print(f"  owner: {o.owner}, heartbeat {o.heartbeat_age_s:.0f} s ago{gone_s}")
    print(f"  step {st.step}{loss}")
    if st.stages:
        print("  stages: " + ", ".join(f"{k} {v:.1f} s" for k, v in st.stages.items()))
    for a in st.train_attempts:
        print(f"  train attempt {a.attempt} ({a.backend}): {a.outcome}")
    for f in st.faults:
        rec = "not recovered"
        if f.recovered_by != "none":
            rec = f"recovered by {f.recovered_by} in {f.recovery_s:.1f} s"
        if f.resume_step is not None:
            rec += f", {report.resumed_from(f.resume_step, f)}, {f.replayed_steps} step(s) replayed"
        print(f"  fault {f.fault}: {rec}")
    print(
        f"  checkpoints: {st.checkpoints} committed, latest step {st.latest_checkpoint_step}"
        + (f", max blocking {st.ckpt_blocking_s_max:.3f} s" if st.checkpoints else "")
    )
    if st.ettr is not None:
        print(f"  ETTR: {st.ettr:.3f} ({report.ETTR_DEFINITION})")
    if (time_s := st.time) is not None:
        print(f"  train attempts {time_s.wall_s:.1f} s:")
        for label, sec, share in report.time_rows(time_s):
            print(f"    {label:<20} {sec:7.1f} s  {share:4.0%}")
        if report.too_short_for_ettr(time_s):
            print(f"  {report.SHORT_RUN_NOTE}")
    if st.export_uri:
        print(f"  export: {st.export_uri}")
    if st.error:
        print(f"  error: {st.error}")
    return 0


def cmd_runs(args: argparse.Namespace) -> int:
    from tasks.run_status import list_runs

    root = args.runs_root or Path(args.state_dir) / "fsx" / "runs"
    rows = list_runs(root)
    if args.json or not rows:
        none = f"no runs under {root} (pass --state-dir, or --runs-root /fsx/runs on EKS)"
        return emit(args.json, [r.__dict__ for r in rows], none)
    print(f"{'run id':<34} {'state':<12} {'step':>10}  updated")
    for r in rows:
        step = f"{r.step}/{r.target_steps}" if r.target_steps else str(r.step)
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.updated))
        owner = f"  (owner {r.owner})" if r.owner else ""
        print(f"{r.run_id:<34} {r.state:<12} {step:>10}  {when}{owner}")
    print(f"details: nvrx-pipeline status RUN_ID --state-dir {args.state_dir}")
    return 0


def add(sub: Any) -> None:
    stp = command(sub, "status", cmd_status, help="summarise a run from its events file")
    stp.add_argument("run_id")
    stp.add_argument("--state-dir", default=".state", help="local state dir (default .state)")
    stp.add_argument("--run-root", type=Path, help="the run directory itself (EKS: /fsx/runs/ID)")
    stp.add_argument("--json", action="store_true")
    runs = command(sub, "runs", cmd_runs, help="list the runs of a state directory, newest first")
    runs.add_argument("--state-dir", default=".state", help="local state dir (default .state)")
    runs.add_argument("--runs-root", type=Path, help="the runs directory itself (EKS: /fsx/runs)")
    runs.add_argument("--json", action="store_true", help="a JSON list instead of text")
