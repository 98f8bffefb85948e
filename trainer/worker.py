"""One worker process under the enabled layers (arch §5): its environment, its long-lived parts
(the checkpoint writer, the heartbeat, the node's beat, node memory, the metrics endpoint), its
start event, and the train function, once or under :mod:`trainer.inprocess_layer`."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from trainer.config import TrainConfig
from trainer.data import DataError
from trainer.event_types import Restart, WorkerStart
from trainer.events import EventLog
from trainer.process import Body, Origin, ProcessContext
from trainer.rundir import RunResult
from trainer.timeouts import Timeouts
from trainer.workload import DataSettings, DataSource

log = logging.getLogger("trainer")

# Where the training run's data comes from (the workload's own source by default).
DataFactory = Callable[[TrainConfig], DataSource]


def _ensure_dist_env() -> None:
    """Single-process debugging: no launcher, so be a world of one (its store, in-process
    restart's too, at MASTER_PORT alone: trainer.inprocess_layer)."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        os.environ.update(
            RANK="0",
            WORLD_SIZE="1",
            LOCAL_RANK="0",
            LOCAL_WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )


def _cpu_threads() -> None:
    """Intra-op threads per worker: NVRX_CPU_THREADS (set where simulated nodes share a host),
    else cores / local workers. Results are bitwise reproducible for a given thread count only."""
    explicit = os.environ.get("NVRX_CPU_THREADS")
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    threads = int(explicit) if explicit else (os.cpu_count() or 1) // local_world
    torch.set_num_threads(max(1, threads))


def workload_data(cfg: TrainConfig) -> DataSource:
    """The workload's data source, its vocabulary checked against the model's."""
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


def run(cfg: TrainConfig, body: Body | None = None, data: DataFactory = workload_data) -> RunResult:
    """Run training in this worker process under the enabled layers; raises on failure.
    ``body(ctx, call_wrapper)`` is one attempt (re-entered by the in-process layer): the built-in
    loop (:func:`trainer.loop.train`) by default, a script's train function in script mode."""
    from trainer.checkpointing.async_save import AsyncCheckpointer
    from trainer.loop import train
    from trainer.parallel import resolve_device
    from trainer.resilience import Heartbeat
    from trainer.timeouts import TimeoutLearner, TimeoutPolicy

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
        learner=TimeoutLearner(TimeoutPolicy.of(cfg)),  # the launch values until measured
        on_timeouts=_announce_timeouts(events, rank=int(os.environ["RANK"])),
    )
    try:
        # A spawned writer starts after this incarnation's first step (maybe_save): its
        # interpreter would otherwise compete with the model build and the load.
        return _run(cfg, body, data, events, placement, saver, heartbeat)
    finally:
        saver.close()
        heartbeat.close()


def _node_memory(cfg: TrainConfig, rank: int, world: int) -> Any:
    """This rank's node-memory tier, where the launcher gave the node a directory."""
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
    body: Body,
    data: DataFactory,
    events: EventLog,
    placement: Any,
    saver: Any,
    heartbeat: Any,
) -> RunResult:
    from trainer import nvrx_compat
    from trainer.credentials import secret_like

    started = time.time()  # a node lost after this is this process's to hand over
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    sampler = data(cfg)
    data_s = time.time() - started
    inprocess_ok, why_not = nvrx_compat.inprocess_available()
    use_inprocess = cfg.inprocess.enabled and inprocess_ok
    origin = Origin.of(cfg.run_root)
    node_memory = _node_memory(cfg, rank, world)
    # Once per process: an in-process restart re-enters `body`, not this function.
    from trainer.metrics import start_endpoint

    start_endpoint(cfg, rank, int(os.environ.get("LOCAL_RANK", "0")), events)
    restart_count = origin.restart_count
    if rank == 0:
        events.emit(
            WorkerStart(
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
                # The credential-like names this worker was given (tasks.secrets), never values.
                secret_env=secret_like(os.environ),
                # Recovery phases (trainer.timeline): the interpreter's start, the dataset check.
                process_start_t=process_start_time(),
                data_s=round(data_s, 4),
            )
        )
        if origin.respawned:  # the one attribution of a restart: trainer.process.Origin
            layer = origin.layer(0, world)
            assert layer is not None  # a respawn always has its layer
            events.emit(Restart(layer=layer, restart_count=restart_count, world_size=world))
    ctx = ProcessContext(
        cfg=cfg,
        placement=placement,
        sampler=sampler,
        saver=saver,
        events=events,
        heartbeat=heartbeat,
        origin=origin,
        node_memory=node_memory,
        started=started,
    )
    if not use_inprocess:
        return body(ctx, None)
    from trainer.inprocess_layer import InProcessLayer

    return InProcessLayer(ctx, body, rank=rank, world_size=world).run()


def _announce_timeouts(events: EventLog, *, rank: int) -> Callable[[Timeouts, bool], None]:
    """Rank 0 says what its rank monitor now times with (one event per change, not per rank)."""

    def announce(timeouts: Timeouts, applied: bool) -> None:
        if rank == 0:
            events.emit(timeouts.event(applied))

    return announce


def process_start_time() -> float | None:
    """This process's start (epoch seconds): a respawn's start-up is part of its recovery."""
    try:
        import psutil

        return round(float(psutil.Process().create_time()), 3)
    except Exception:  # psutil missing or /proc unreadable: the phase is just not split
        return None
