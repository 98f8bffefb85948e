"""Worker program: ``python -m trainer --config FILE [--set KEY=VALUE ...]`` (command line:
:mod:`trainer.worker_cli`). Under a launcher enter it as ``-m trainer`` (``trainer/__main__.py``),
not ``-m trainer.train``: the spawned writer and Manager would re-import torch with ``__main__``.
Runs under ``ft_launcher``, plain ``torchrun``, or alone for debugging (world size 1).

Local, 2 simulated nodes x 1 CPU worker each (run both lines, e.g. in two shells; the first agent
to start hosts the c10d rendezvous store)::

    NVRX_NODE=0 python -m trainer.agent --beat /tmp/run1:1 -- \\
        --nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d \\
        --rdzv-endpoint=127.0.0.1:29500 --rdzv-id=run1 --rdzv-conf=join_timeout=20 \\
        --max-restarts=3 --monitor-interval=0.5 --workers-stop-timeout=5 --term-timeout=27 \\
        --ft-initial-rank-heartbeat-timeout=90 --ft-rank-heartbeat-timeout=30 \\
        --ft-workload-check-interval=1 --ft-enable-nic-monitor=false \\
        -m trainer --set run_root=/tmp/run1 --set data_dir=/tmp/data --set steps=20

One node, 2 CPU workers: the same with ``--nnodes=1 --nproc-per-node=2``. (``trainer.agent`` runs
NVRx's ``ft_launcher`` in its own process and beats for the node, ``NVRX_NODE`` on
``control/beats``: the watcher's sign of life; plain ``ft_launcher`` with the same arguments
trains the same, unwatched.)

EKS, p5.48xlarge, 8 GPUs per node, N nodes (one pod per node; ``$JOB-0.$SVC`` is the index-0 pod
of the Indexed Job behind its headless Service; add ``--ft-gpu-memory-reclaim-timeout=0`` only on
CPU hosts with NVRx >= 0.7)::

    python -m trainer.agent --beat /fsx/runs/$RUN_ID:1 -- \\
        --nnodes=$N --nproc-per-node=8 --rdzv-backend=c10d \\
        --rdzv-endpoint=$JOB-0.$SVC:29500 --rdzv-id=$RUN_ID --rdzv-conf=join_timeout=120 \\
        --max-restarts=3 --monitor-interval=1 --workers-stop-timeout=30 --term-timeout=27 \\
        --ft-initial-rank-heartbeat-timeout=900 --ft-rank-heartbeat-timeout=300 \\
        --ft-workload-check-interval=5 --ft-enable-nic-monitor=false \\
        -m trainer --config /fsx/runs/$RUN_ID/config/train-attempt1.json

(``trainer.launch.ft_launcher_argv`` builds the same line from a config.) Exit codes:
``trainer.errors.ExitCode``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

from trainer.config import ConfigError, TrainConfig
from trainer.errors import ExitCode, TerminalError
from trainer.events import EventLog
from trainer.faults import FaultSpecError
from trainer.launch import incarnation
from trainer.process import Body
from trainer.rundir import RunDir
from trainer.worker import DataFactory, run, workload_data
from trainer.worker_cli import build_parser, claimed_run_root, config_from_args

log = logging.getLogger("trainer")


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=os.environ.get("NVRX_LOG_LEVEL", "WARNING"),
        format="%(asctime)s %(levelname)s [rank %(process)d] %(name)s: %(message)s",
    )
    args = build_parser().parse_args(argv)
    try:
        cfg = config_from_args(args)
    except (ConfigError, FaultSpecError) as e:
        print(f"error: invalid configuration: {e}", file=sys.stderr)
        # No config, so no event log. The marker goes where the flags say the run lives, but
        # only under a launcher: run by hand, a bad config must leave nothing behind.
        under_launcher = "TORCHELASTIC_RUN_ID" in os.environ
        _stop_without_restart(
            claimed_run_root(args) if under_launcher else None, f"invalid configuration: {e}"
        )
        return ExitCode.CONFIG
    return execute(cfg)


def execute(cfg: TrainConfig, body: Body | None = None, data: DataFactory = workload_data) -> int:
    """:func:`run`, turned into the worker's exit code (arch §5); a crash raises (the in-job
    layer may restart it). For a terminal error the whole job is stopped without restarts
    first (:func:`_terminal`): under ft_launcher the exit code alone would be retried until the
    launcher's restarts ran out."""
    try:
        result = run(cfg, body, data)
    except BaseException as e:
        # The in-process Wrapper re-raises what escaped it wrapped: look at the cause.
        terminal = _terminal_cause(e)
        if terminal is None:
            raise
        if isinstance(terminal, ConfigError):
            _terminal(cfg, f"ConfigError: invalid configuration: {terminal}")
        else:
            _terminal(cfg, f"{type(terminal).__name__}: {terminal}")
        return terminal.exit_code
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(result.model_dump(exclude={"error", "requeue", "epoch"})))
    return ExitCode.OK


def _terminal_cause(exc: BaseException) -> TerminalError | None:
    """The terminal error behind ``exc`` (the in-process Wrapper re-raises it wrapped)."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, TerminalError):
            return cur
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return None


def _terminal(cfg: TrainConfig, message: str) -> None:
    """Report an error no restart can fix (the marker, the ``fatal`` event and result.json,
    which the pipeline reads as do-not-requeue: written once, by whichever rank finds it
    first), then ask this rank's launcher to stop the job without restarts."""
    from trainer import nvrx_compat

    print(f"error: {message}", file=sys.stderr)
    rank = int(os.environ.get("RANK", "0"))
    try:
        RunDir.from_env(cfg.run_root).record_terminal(
            rank=rank, reason=message, events=EventLog(cfg.run_root), incarnation=incarnation()
        )
    except OSError as e:  # a full disk may be the very cause: still stop, still exit 3
        log.warning("could not record the terminal error on %s: %s", cfg.run_root, e)
    nvrx_compat.request_no_restart(rank, message)


def _stop_without_restart(run_root: Path | None, message: str) -> None:
    """Every rank that finds the error writes the ``no_restart`` marker (a peer's exit 93 can be
    masked on multi-node jobs, so whoever classifies the end reads it too) and asks its own
    launcher not to respawn the workers: on a multi-node job the failing rank need not be rank 0.
    Without ft_launcher (or an NVRx that lacks the request) the marker still ends the stage."""
    from trainer import nvrx_compat

    rank = int(os.environ.get("RANK", "0"))
    try:
        if run_root is not None:
            events = EventLog(run_root)
            RunDir.from_env(run_root).write_no_restart(rank=rank, reason=message, events=events)
        nvrx_compat.request_no_restart(rank, message)
    except OSError as e:  # the exit code still reports it; never hide the cause behind this
        log.warning("could not record the no-restart marker: %s", e)


if __name__ == "__main__":
    sys.exit(main())
