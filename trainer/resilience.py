"""NVRx glue: the in-process restart Wrapper and ft_launcher heartbeats.

Both layers are switchable by config and each works without the other:
- in-process (``inprocess.Wrapper``) restarts the train function in every rank of the same
  interpreters after an exception or a timed-out collective;
- in-job (``ft_launcher`` + ``RankMonitorClient``) kills and respawns the workers when a rank dies
  or stops sending heartbeats.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

from trainer.config import InProcessConfig

log = logging.getLogger(__name__)

FT_RANK_MONITOR_SOCKET_ENV = "FT_RANK_MONITOR_IPC_SOCKET"

# The marker helpers below are read by the pipeline (tasks/): this module imports NVRx only
# inside the functions that need it (importing it costs seconds).
#
# The terminal marker on the shared filesystem, where NVRx >= 0.7 writes its own before exiting
# 93: a peer's exit 93 can be masked on multi-node jobs (the others are signalled), so whoever
# classifies the end reads this file as well as every node's exit code.
NO_RESTART_MARKER = Path("control") / "no_restart"


def stop_without_restart(run_root: Path | None, *, rank: int, reason: str) -> bool:
    """No restart can fix ``reason`` (bad configuration, a fatal error): write the marker, then
    ask ft_launcher not to respawn the workers. Returns whether the launcher took the request
    (False outside ft_launcher, or on an NVRx without it: the marker still ends the stage)."""
    from trainer import nvrx_compat

    if run_root is not None:
        write_no_restart(run_root, rank=rank, reason=reason)
    return nvrx_compat.request_no_restart(rank, reason)


def write_no_restart(run_root: Path, *, rank: int, reason: str) -> None:
    path = run_root / NO_RESTART_MARKER
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".no_restart.{rank}.{os.getpid()}")
    tmp.write_text(json.dumps({"t": time.time(), "rank": rank, "reason": reason}) + "\n")
    os.replace(tmp, path)  # atomic: a reader never sees half a marker


def read_no_restart(run_root: Path) -> str | None:
    """The marker's reason, or None when there is none. A marker that cannot be parsed still
    means "do not restart" (NVRx's own may hold anything)."""
    path = run_root / NO_RESTART_MARKER
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        return str(json.loads(text).get("reason") or text.strip() or "no_restart marker")
    except (ValueError, AttributeError):
        return text.strip() or f"{path} present"


def clear_no_restart(run_root: Path) -> None:
    """A new attempt starts without an old attempt's verdict (after the config was fixed)."""
    (run_root / NO_RESTART_MARKER).unlink(missing_ok=True)


class Heartbeat:
    """``RankMonitorClient`` heartbeats when the worker runs under ft_launcher, no-op otherwise.

    One per process (it survives in-process restarts). A heartbeat goes out after every step, so
    ft_launcher's heartbeat timeout covers a step, the blocking part of a save, and a whole
    in-process restart with its checkpoint load (validated in :class:`trainer.config.TrainConfig`).
    """

    def __init__(self, enabled: bool = True) -> None:
        self.client: Any = None
        if enabled and os.environ.get(FT_RANK_MONITOR_SOCKET_ENV):
            from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient

            self.client = RankMonitorClient()
            self.client.init_workload_monitoring()
            # Beat at once: NVRx 0.4.1's rank monitor server turns permanently ABORTED (every
            # later heartbeat of this node's rank fails) if a respawned worker's connection is
            # lost before its first heartbeat. Keep that window as short as possible.
            self.client.send_heartbeat()

    @property
    def active(self) -> bool:
        return self.client is not None

    def beat(self) -> None:
        if self.client is not None:
            self.client.send_heartbeat()

    def close(self) -> None:
        if self.client is not None:
            self.client.shutdown_workload_monitoring()
            self.client = None


def wrap_inprocess(
    fn: Callable[..., Any],
    cfg: InProcessConfig,
    *,
    world_size: int,
    on_restart: Callable[[], None],
    logfile: Path,
    store_port: int,
) -> Callable[..., Any]:
    """Wrap ``fn`` in ``inprocess.Wrapper`` (must happen before any process group exists).

    - restarts only with the full world (``RetryController(min_world_size=world_size)``): if a rank
      is gone for good, shrinking would change the data order, so the Wrapper gives up and the
      in-job layer (ft_launcher) restarts every worker instead;
    - ``on_restart`` runs as the Wrapper's finalize (drop the save in flight);
    - no CUDA health check on CPU (the default ThreadedFinalize/CudaHealthCheck need CUDA).
    """
    from nvidia_resiliency_ext import inprocess

    from trainer import nvrx_compat

    class _Finalize(inprocess.finalize.Finalize):
        def __call__(self, state: Any) -> Any:
            on_restart()
            return state

    health: Any = None
    import torch

    if torch.cuda.is_available():
        health = inprocess.health_check.CudaHealthCheck(
            timeout=datetime.timedelta(seconds=cfg.soft_timeout_s)
        )
    s = datetime.timedelta(seconds=1)
    wrapper = inprocess.Wrapper(
        store_kwargs={
            "port": store_port,
            "timeout": datetime.timedelta(seconds=cfg.barrier_timeout_s),
        },
        initialize=inprocess.initialize.RetryController(
            max_iterations=cfg.max_restarts + 1,
            min_world_size=world_size,
            min_active_world_size=world_size,
        ),
        finalize=_Finalize(),
        health_check=health,
        soft_timeout=cfg.soft_timeout_s * s,
        hard_timeout=cfg.hard_timeout_s * s,
        heartbeat_timeout=cfg.heartbeat_timeout_s * s,
        barrier_timeout=cfg.barrier_timeout_s * s,
        completion_timeout=cfg.completion_timeout_s * s,
        monitor_process_logfile=str(logfile.absolute()),
    )
    nvrx_compat.disable_device_health_checks(wrapper)

    def entry(call_wrapper: Any = None) -> Any:
        return fn(call_wrapper)

    # The Wrapper injects its CallWrapper by parameter *annotation object*; this module uses
    # postponed (string) annotations, so set the real class explicitly.
    entry.__annotations__ = {"call_wrapper": Optional[inprocess.CallWrapper], "return": Any}  # noqa: UP045
    return wrapper(entry)
