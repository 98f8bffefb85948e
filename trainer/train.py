"""Worker program: ``python -m trainer --config FILE [--set KEY=VALUE ...]`` (or ``-m
trainer.train``; the command line is :mod:`trainer.worker_cli`).

Under a launcher, enter it as ``-m trainer`` (``trainer/__main__.py``): the checkpoint writer and
its Manager are spawned processes, and each would re-import this module, and torch with it, if it
were ``__main__``.

The config file is the attempt's whole :class:`~trainer.config.TrainConfig` as JSON (the launcher
writes it: ``trainer.config.save_config``); ``--set`` overrides single fields, for debugging.
Without ``--config``, ``--set run_root=DIR --set data_dir=DIR`` and the defaults make one.

Runs under ``ft_launcher`` (in-job restart), under plain ``torchrun``, or as a single process for
debugging (no launcher environment: world size 1). CPU + gloo without a GPU, CUDA + NCCL with one.

Local, 2 simulated nodes x 1 CPU worker each (run both lines, e.g. in two shells; the first agent
to start hosts the c10d rendezvous store)::

    ft_launcher --nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d \\
        --rdzv-endpoint=127.0.0.1:29500 --rdzv-id=run1 --rdzv-conf=join_timeout=20 \\
        --max-restarts=3 --monitor-interval=0.5 --workers-stop-timeout=5 \\
        --ft-initial-rank-heartbeat-timeout=90 --ft-rank-heartbeat-timeout=30 \\
        --ft-workload-check-interval=1 --ft-enable-nic-monitor=false \\
        -m trainer --set run_root=/tmp/run1 --set data_dir=/tmp/data --set steps=20

One node, 2 CPU workers: the same with ``--nnodes=1 --nproc-per-node=2``.

EKS, p5.48xlarge, 8 GPUs per node, N nodes (one pod per node; ``$JOB-0.$SVC`` is the index-0 pod
of the Indexed Job behind its headless Service; add ``--ft-gpu-memory-reclaim-timeout=0`` only on
CPU hosts with NVRx >= 0.7)::

    ft_launcher --nnodes=$N --nproc-per-node=8 --rdzv-backend=c10d \\
        --rdzv-endpoint=$JOB-0.$SVC:29500 --rdzv-id=$RUN_ID --rdzv-conf=join_timeout=120 \\
        --max-restarts=3 --monitor-interval=1 --workers-stop-timeout=30 \\
        --ft-initial-rank-heartbeat-timeout=900 --ft-rank-heartbeat-timeout=300 \\
        --ft-workload-check-interval=5 --ft-enable-nic-monitor=false \\
        -m trainer --config /fsx/runs/$RUN_ID/config/train-attempt1.json

(``trainer.launch.ft_launcher_argv`` builds the same line from a config.)

Exit codes (``trainer.errors.ExitCode``): 0 done (``<run_root>/result.json`` written); 2 bad
configuration; 3 fatal (bad data, no valid checkpoint). For 2 and 3 the worker first writes
``<run_root>/control/no_restart`` and asks ft_launcher not to restart (NVRx's
``WorkloadAction.ShutdownWorkload``: the launcher closes the rendezvous instead of respawning the
workers), so the job ends after one start and the pipeline reports do-not-requeue. 4: fenced
(``trainer.fence``: its attempt was replaced, and it changed nothing). Anything else is a crash
that the in-job layer may restart.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from trainer.config import ConfigError, TrainConfig
from trainer.data import DataError
from trainer.errors import ExitCode, TerminalError
from trainer.events import EventLog
from trainer.faults import FaultSpecError
from trainer.gloo_release import release_process_groups
from trainer.worker_cli import build_parser, claimed_run_root, config_from_args

if TYPE_CHECKING:
    from trainer.checkpointing.async_save import AsyncCheckpointer
    from trainer.parallel import Placement
    from trainer.resilience import Heartbeat
    from trainer.workload import DataSource

log = logging.getLogger("trainer")


def _free_port_run(count: int = 3, attempts: int = 50) -> int:
    """A port P with P..P+count-1 all free right now (a world of one, no launcher: its
    MASTER_PORT)."""
    for _ in range(attempts):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = int(s.getsockname()[1])
        if base + count > 65535:
            continue
        socks = []
        try:
            for p in range(base, base + count):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError("no run of free local ports found for MASTER_PORT")


def _ensure_dist_env() -> None:
    """Single-process debugging: no launcher, so be a world of one."""
    if "RANK" not in os.environ:
        os.environ.update(
            RANK="0",
            WORLD_SIZE="1",
            LOCAL_RANK="0",
            LOCAL_WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(_free_port_run()),
        )


def _cpu_threads() -> None:
    """Intra-op threads per worker: NVRX_CPU_THREADS when the launcher knows how many workers
    share the host (several simulated nodes), else cores / local workers. Results are bitwise
    reproducible for a given thread count, not across thread counts."""
    explicit = os.environ.get("NVRX_CPU_THREADS")
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    threads = int(explicit) if explicit else (os.cpu_count() or 1) // local_world
    torch.set_num_threads(max(1, threads))


def workload_data(cfg: TrainConfig) -> DataSource:
    """The workload's data source, its vocabulary checked against the model's."""
    from trainer.workload import DataSettings

    wl = cfg.wl
    sampler = wl.data_source(
        DataSettings(
            data_dir=cfg.data_dir,
            seq_len=wl.seq_len,
            global_batch=cfg.global_batch,
            seed=cfg.seed,
            verify=cfg.verify_data,
            verified_manifest=cfg.data_manifest_sha256,
        )
    )
    if sampler.vocab_size > wl.vocab_size:
        raise DataError(
            f"dataset {cfg.data_dir} has vocab_size {sampler.vocab_size}, larger than the "
            f"vocabulary of workload {wl.ref!r} ({wl.vocab_size}): tokens would index past the "
            "embedding"
        )
    return sampler


def run(
    cfg: TrainConfig,
    body: Callable[[Any, Any], dict[str, Any]] | None = None,
    data: Callable[[TrainConfig], DataSource] = workload_data,
) -> dict[str, Any]:
    """Run training in this worker process under the enabled layers; raises on failure.

    ``body(ctx, call_wrapper)`` is one attempt of the training run (re-entered by the in-process
    layer after a fault): the built-in loop (:func:`trainer.loop.train`) by default, a user
    script's train function in script mode (:mod:`trainer.script`)."""
    from trainer.checkpointing.async_save import AsyncCheckpointer
    from trainer.loop import train
    from trainer.parallel import resolve_device
    from trainer.resilience import Heartbeat

    body = body or train
    _ensure_dist_env()
    _cpu_threads()
    world = int(os.environ["WORLD_SIZE"])
    cfg.micro_batch_count(world)  # a world the global batch cannot be shared by fails here
    cfg.run_root.mkdir(parents=True, exist_ok=True)
    events = EventLog(cfg.run_root)
    placement = resolve_device(cfg.device, deterministic=cfg.deterministic)
    saver = AsyncCheckpointer(device=placement.device, timeout_s=cfg.checkpoint.durable.timeout_s)
    if placement.device.type == "cpu" and threading.active_count() == 1:
        # The writer, forked now: no other thread runs yet and CUDA is not in use, so it is
        # ready at once with nothing to import (nvrx_compat.start_persistent_writer). Else it
        # is spawned after the first step (CheckpointManager.maybe_save), as on CUDA.
        saver.start(rank=int(os.environ["RANK"]), fork=True)
    heartbeat = Heartbeat(
        cfg.injob.enabled,
        cfg.injob.heartbeat_interval_s,
        learner=_timeout_learner(cfg),
        on_timeouts=_announce_timeouts(events, rank=int(os.environ["RANK"])),
    )
    beat = _node_beat(cfg)
    try:
        # A spawned writer starts after this incarnation's first step (maybe_save): its
        # interpreter would otherwise compete with the model build and the load.
        return _run(cfg, body, data, events, placement, saver, heartbeat)
    finally:
        saver.close()
        heartbeat.close()
        if beat is not None:
            beat.close()


def _node_beat(cfg: TrainConfig) -> Any:
    """The node's sign of life for the watcher (trainer.node_beat): written by its first
    worker, from a thread that outlives in-process restarts. None where no backend said
    which node this is (run by hand)."""
    from trainer import fence
    from trainer.elastic import node_id
    from trainer.node_beat import NodeBeat

    node = node_id()
    if node < 0 or os.environ.get("LOCAL_RANK", "0") != "0":
        return None
    return NodeBeat(
        cfg.run_root,
        epoch=fence.epoch_from_env(),
        node=node,
        interval_s=cfg.injob.heartbeat_interval_s,
    )


def _node_memory(cfg: TrainConfig, rank: int, world: int) -> Any:
    """This rank's node-memory tier, where the launcher gave the node a directory and
    the config has memory tiers."""
    from trainer import fence
    from trainer.checkpointing import node_copy

    if not cfg.checkpoint.memory.enabled:
        return None
    node = node_copy.from_env(
        rank=rank, world_size=world, fingerprint=cfg.fingerprint(), epoch=fence.epoch_from_env()
    )
    if node is not None and os.environ.get("LOCAL_RANK", "0") == "0":
        gone = node.forget_other_worlds()  # once per node (idempotent if two ranks race)
        if gone:
            log.info("node memory: removed the copies of other world sizes: %s", gone)
    return node


def _run(
    cfg: TrainConfig,
    body: Callable[[Any, Any], dict[str, Any]],
    data: Callable[[TrainConfig], DataSource],
    events: EventLog,
    placement: Placement,
    saver: AsyncCheckpointer,
    heartbeat: Heartbeat,
) -> dict[str, Any]:
    from trainer import nvrx_compat, run_state
    from trainer.elastic import restart_layer
    from trainer.process import ProcessContext
    from trainer.resilience import wrap_inprocess

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    t_data = time.time()
    sampler = data(cfg)
    data_s = time.time() - t_data
    inprocess_ok, why_not = nvrx_compat.inprocess_available()
    use_inprocess = cfg.inprocess.enabled and inprocess_ok
    restart_count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    # From control/ (trainer.run_state), never a scan of the event log: O(1) at any length.
    job_id = os.environ.get("TORCHELASTIC_RUN_ID")
    prior = run_state.prior_world(cfg.run_root, job_id)
    respawned = prior is not None
    ctx = ProcessContext(
        cfg=cfg,
        placement=placement,
        sampler=sampler,
        saver=saver,
        events=events,
        heartbeat=heartbeat,
        restart_count=restart_count,
        respawned=respawned,
        prior=prior,
        stage_attempt=int(os.environ.get("NVRX_STAGE_ATTEMPT", "1")),
        node_memory=_node_memory(cfg, rank, world),
    )
    # Once per process: an in-process restart re-enters `body`, not this function.
    from trainer.credentials import secret_like
    from trainer.metrics import start_endpoint

    start_endpoint(cfg, rank, int(os.environ.get("LOCAL_RANK", "0")), events)
    if rank == 0:
        events.emit(
            "worker_start",
            world_size=world,
            device=str(placement.device),
            backend=placement.backend,
            nvrx_version=nvrx_compat.version(),
            torch_version=torch.__version__,
            inprocess=use_inprocess,
            inprocess_unavailable=None if inprocess_ok else why_not,
            injob=heartbeat.active,
            restart_count=restart_count,
            config_hash=cfg.fingerprint(),
            # The credential-like names this worker was given (the run's declared secrets, and
            # nothing of the orchestrator's: tasks.secrets), never their values.
            secret_env=secret_like(os.environ),
            # Recovery phases (trainer.timeline): when this interpreter started, and how long
            # the dataset check took (sizes and manifest digest, or every shard's digest).
            process_start_t=process_start_time(),
            data_s=round(data_s, 4),
        )
        if restart_count > 0 or respawned:
            layer = restart_layer(ctx.prior, world)
            events.emit("restart", layer=layer, restart_count=restart_count, world_size=world)
    if not use_inprocess:
        return body(ctx, None)
    import datetime

    from trainer.stores import tcp_store

    master_port = int(os.environ["MASTER_PORT"])
    # One store per incarnation, at MASTER_PORT (the port the launcher found free for this
    # rendezvous round), hosted by rank 0 on MASTER_ADDR's address alone (trainer.stores): our
    # process groups (a prefix per restart iteration) and the Wrapper's keys (the workers' and
    # their monitor processes') are all its clients. No port next to it: MASTER_PORT+1 and +2
    # were never reserved, and one taken by any socket of the host (an outgoing connection's
    # port, likely for an even one) left every rank waiting on a store nobody hosted until the
    # rank monitor's out-of-section timeout (issue 29, item 7).
    ctx.base_store = tcp_store(
        os.environ["MASTER_ADDR"],
        master_port,
        world_size=world,
        is_master=rank == 0,
        timeout=datetime.timedelta(seconds=cfg.inprocess.barrier_timeout_s),
        multi_tenant=True,
    )

    def on_restart() -> None:
        import torch.distributed as dist

        from trainer.resilience import node_lost_since

        if node_lost_since(cfg.run_root, ctx.started):
            # A node of this job is gone: the full-world Wrapper cannot restart without it, so
            # leave to the in-job layer now (it re-forms the world, trainer.elastic) rather than
            # drain the save in flight for a restart that will be refused.
            from nvidia_resiliency_ext.inprocess.exception import RestartAbort

            raise RestartAbort("a node of this job was lost: the in-job layer re-forms the world")
        heartbeat.end_sections()  # the restart runs out of section
        saver.abandon()
        if dist.is_initialized():
            dist.destroy_process_group()

    def attempt(call_wrapper: Any = None) -> dict[str, Any]:
        try:
            return body(ctx, call_wrapper)
        except TerminalError as e:
            # No restart can fix it: escape the Wrapper (RestartAbort is a BaseException).
            from nvidia_resiliency_ext.inprocess.exception import RestartAbort

            raise RestartAbort(str(e)) from e
        except Exception as e:
            # Restarted in-process. On gloo, a peer waits in its next collective until this
            # rank's connections close: close them now, not at the process-group timeout.
            if placement.backend == "gloo":
                saver.drop_group()
                released_s = release_process_groups(e.__traceback__)
                log.info("rank %d released its process groups in %.3f s", rank, released_s)
            raise

    wrapped = wrap_inprocess(
        attempt,
        cfg.inprocess,
        world_size=world,
        on_restart=on_restart,
        logfile=cfg.run_root / "logs" / "inprocess-monitor-{rank}.log",
        store_port=master_port,
    )
    (cfg.run_root / "logs").mkdir(exist_ok=True)
    return wrapped()  # type: ignore[no-any-return]


def _timeout_learner(cfg: TrainConfig) -> Any:
    """This incarnation's in-job timeouts (trainer.timeouts): the launch values until measured,
    then derived from its own sections."""
    from trainer.timeouts import TimeoutLearner, TimeoutPolicy

    return TimeoutLearner(TimeoutPolicy.of(cfg))


def _announce_timeouts(events: EventLog, *, rank: int) -> Any:
    """Rank 0 says what its rank monitor now times with (every rank learns its own: one event
    per change of rank 0's, not one per rank)."""

    def announce(timeouts: Any, applied: bool) -> None:
        if rank == 0:
            events.emit(
                "timeouts",
                step_timeout_s=timeouts.step.seconds,
                checkpoint_timeout_s=timeouts.checkpoint.seconds,
                load_timeout_s=timeouts.load.seconds,
                out_of_section_timeout_s=timeouts.out_of_section.seconds,
                heartbeat_timeout_s=timeouts.heartbeat.seconds,
                applied=applied,
                detail=timeouts.describe(),
            )

    return announce


def process_start_time() -> float | None:
    """This process's start (epoch seconds): a respawned worker's interpreter start-up and
    imports are part of its recovery time."""
    try:
        import psutil

        return round(float(psutil.Process().create_time()), 3)
    except Exception:  # psutil missing or /proc unreadable: the phase is just not split
        return None


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


def execute(
    cfg: TrainConfig,
    body: Callable[[Any, Any], dict[str, Any]] | None = None,
    data: Callable[[TrainConfig], DataSource] = workload_data,
) -> int:
    """:func:`run`, turned into the worker's exit code (arch §5): 0 done, 2 bad
    configuration, 3 fatal (4, fenced, exits in :mod:`trainer.fence`); a crash raises (the
    in-job layer may restart it). For 2 and 3 the whole job is stopped without restarts first
    (:func:`_terminal`): respawning the workers cannot fix either, and under ft_launcher the exit
    code alone would be retried until the launcher's restarts ran out."""
    try:
        result = run(cfg, body, data)
    except BaseException as e:
        # The in-process Wrapper re-raises what escaped it wrapped: look at the cause.
        terminal = _fatal_cause(e, (TerminalError,))
        if terminal is None:
            raise
        if isinstance(terminal, ConfigError):
            _terminal(cfg, f"ConfigError: invalid configuration: {terminal}")
        else:
            _terminal(cfg, f"{type(terminal).__name__}: {terminal}")
        return ExitCode(getattr(terminal, "exit_code", ExitCode.FATAL))
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(result))
    return ExitCode.OK


def _fatal_cause(
    exc: BaseException, kinds: tuple[type[BaseException], ...]
) -> BaseException | None:
    """The fatal error behind ``exc`` (the in-process Wrapper re-raises it wrapped)."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, kinds):
            return cur
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return None


def _terminal(cfg: TrainConfig, message: str) -> None:
    """Report an error no restart can fix (rank 0: the ``fatal`` event and result.json, which
    the pipeline reads as do-not-requeue), then stop the job without restarts."""
    print(f"error: {message}", file=sys.stderr)
    if int(os.environ.get("RANK", "0")) == 0:
        try:
            from trainer.process import write_result

            EventLog(cfg.run_root).emit("fatal", error=message, requeue=False)
            write_result(cfg, {"status": "failed", "error": message, "requeue": False})
        except OSError as e:  # a full disk may be the very cause: still stop, still exit 3
            log.warning("could not record the fatal error on %s: %s", cfg.run_root, e)
    _stop_without_restart(cfg.run_root, message)


def _stop_without_restart(run_root: Path | None, message: str) -> None:
    """Every rank that finds the error says so (the marker) and asks its own launcher: on a
    multi-node job the failing rank need not be rank 0."""
    from trainer.resilience import stop_without_restart

    try:
        stop_without_restart(run_root, rank=int(os.environ.get("RANK", "0")), reason=message)
    except OSError as e:  # the exit code still reports it; never hide the cause behind this
        log.warning("could not record the no-restart marker: %s", e)


if __name__ == "__main__":
    sys.exit(main())
