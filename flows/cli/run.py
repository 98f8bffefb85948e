"""``nvrx-pipeline run``: the whole pipeline, with live progress; prints the report (or, with
``--json``, the PipelineResult) and saves nothing the flow does not."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from flows.cli.common import (
    EXIT_FAILED,
    EXIT_USAGE,
    add_params_options,
    command,
    fail,
    params_from_args,
)

if TYPE_CHECKING:
    from prefect.client.schemas.objects import State

    from flows.models import PipelineResult


@contextmanager
def _live_progress(run_root: Path, target: int, tty: bool) -> Iterator[None]:
    """Tails the run's step events: a progress bar on a terminal, a line every 10 steps
    otherwise. Faults, restarts and recoveries are the flow's log lines alone (printing them
    here too showed each twice)."""
    stop = threading.Event()
    thread = threading.Thread(target=_tail, args=(run_root, target, tty, stop), daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=5)


def _tail(run_root: Path, target: int, tty: bool, stop: threading.Event) -> None:
    from trainer.event_read import EventReader
    from trainer.event_types import Step
    from trainer.rundir import Layout

    tail = EventReader(run_root / Layout.EVENTS, from_start=False)
    if tty:
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total} steps"),
            TimeElapsedColumn(),
        ) as bar:
            task = bar.add_task("training", total=target)
            while not stop.wait(0.5):
                for e in tail.read_new():
                    if isinstance(e, Step):
                        desc = f"training loss {e.loss or 0.0:.3f} {e.tokens_per_s or 0:,.0f} tok/s"
                        bar.update(task, completed=e.step, description=desc)
        return
    while not stop.wait(1.0):
        for e in tail.read_new():
            if isinstance(e, Step) and (e.step % 10 == 0 or e.step == target):
                print(
                    f"step {e.step}/{target} loss {e.loss or 0.0:.4f} "
                    f"{e.tokens_per_s or 0:.0f} tok/s",
                    file=sys.stderr,
                    flush=True,
                )


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def cmd_run(args: argparse.Namespace) -> int:
    from flows.context import RunContext
    from flows.models import PipelineResult

    params = params_from_args(args, inject=args.inject)
    if params is None:
        return EXIT_USAGE
    ctx = RunContext.create(params)
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from tasks.local_services import ServiceError, prefect_client_env

    try:
        prefect = prefect_client_env(Path(params.state_dir), os.environ)
    except ServiceError as e:
        return fail(e, EXIT_FAILED)
    os.environ.update(prefect)
    if "PREFECT_API_URL" in prefect:
        kept = prefect["PREFECT_API_URL"].removesuffix("/api")
        print(f"Prefect server: {kept} (nvrx-pipeline up)", file=sys.stderr)
    from flows.pipeline import training_pipeline
    from trainer.rundir import Layout

    started = time.time()
    # SIGTERM (a scheduler, `kill`, Prefect cancelling the process) unwinds like Ctrl-C, so the
    # run ends what it started and gives its lease back (arch §6); SIGKILL is what the next
    # invocation's takeover is for.
    signal.signal(signal.SIGTERM, _interrupt)
    with _live_progress(ctx.run_root, params.steps, sys.stderr.isatty()):
        # (``**fields`` in the flow's signature hides Prefect's return_state overload from mypy)
        state = cast(
            "State[PipelineResult]",
            training_pipeline(**params.flow_parameters(), return_state=True),
        )
    if state.is_completed():
        result = state.result()
    else:
        saved = ctx.run_root / Layout.PIPELINE_RESULT
        # Only this invocation's: a refused second invocation must not report the owner's.
        if saved.exists() and saved.stat().st_mtime >= started:
            result = PipelineResult.model_validate_json(saved.read_text())
        else:
            result = PipelineResult(
                status="failed", run_id=ctx.run_id, target_steps=params.steps, error=state.message
            )
        print(f"error: pipeline failed: {result.error or state.message}", file=sys.stderr)
    if args.json:
        print(result.model_dump_json(), flush=True)
    else:
        from flows.report import REPORT_FILE, render_report

        print(render_report(result))
        saved = ctx.run_root / REPORT_FILE
        if saved.exists() and saved.stat().st_mtime >= started:
            print(f"report saved: {saved} (the timeline: {ctx.run_root / 'timeline.png'})")
    return 0 if state.is_completed() else EXIT_FAILED


def add(sub: Any) -> None:
    run = command(sub, "run", cmd_run, help="run the whole pipeline")
    add_params_options(run)
    run.add_argument(
        "--inject",
        action="append",
        default=[],
        metavar="SPEC",
        help="fault drill, e.g. node-loss@step=9,node=1",
    )
    run.add_argument("--run-id", help="name the run; an existing id resumes it")
    # The same spellings as status, export, pull and prepare-dataset (each sets its parameter).
    run.add_argument(
        "--state-dir", help="the state_dir parameter: local state (FSx, S3 data, runs; .state)"
    )
    run.add_argument(
        "--s3-endpoint", help="the s3_endpoint parameter (a local one is started on demand)"
    )
    run.add_argument("--json", action="store_true", help="print the PipelineResult as JSON last")
    run.epilog = (
        "parameters: `nvrx-pipeline params` lists every one with its default and description;\n"
        "examples/params/ holds a params file per backend (--config).\n\n" + (run.epilog or "")
    )
