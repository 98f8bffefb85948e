"""The in-process layer (arch §2): one NVRx ``inprocess.Wrapper`` around the train function;
every rank re-enters it in the same interpreter after a fault.

- it restarts only with the full world (``RetryController(min_world_size=world_size)``): if a
  rank is gone for good, shrinking would change the data order, so the Wrapper gives up and the
  in-job layer (ft_launcher) restarts every worker instead;
- no CUDA health check on CPU (NVRx's default ``ThreadedFinalize``/``CudaHealthCheck`` need CUDA);
- a :class:`~trainer.errors.TerminalError` escapes it (``RestartAbort``): no restart can fix it.

Imported only where the layer is on: importing NVRx costs seconds.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
from typing import Any, Optional

import torch
import torch.distributed as dist
from nvidia_resiliency_ext import inprocess
from nvidia_resiliency_ext.inprocess.exception import RestartAbort

from trainer import nvrx_compat
from trainer.errors import TerminalError
from trainer.gloo_release import release_process_groups
from trainer.process import Body, ProcessContext
from trainer.rundir import Layout, RunDir, RunResult

log = logging.getLogger(__name__)


class Finalize(inprocess.finalize.Finalize):  # type: ignore[misc]
    """What every rank undoes before it re-enters the train function, in order."""

    def __init__(self, ctx: ProcessContext) -> None:
        self.ctx = ctx

    def __call__(self, state: Any) -> Any:
        # A node of this job is gone: the full-world Wrapper cannot restart without it, so leave
        # now to the in-job layer (it re-forms the world), before draining a save for nothing.
        if RunDir(self.ctx.cfg.run_root).node_lost_since(self.ctx.started):
            raise RestartAbort("a node of this job was lost: the in-job layer re-forms the world")
        # The restart runs out of the rank monitor's sections; the save in flight is dropped
        # (the next iteration resumes from the last complete one).
        self.ctx.heartbeat.end_sections()
        self.ctx.saver.abandon()
        # The next iteration makes a new group under a fresh store prefix (trainer.process).
        if dist.is_initialized():
            dist.destroy_process_group()
        return state


class InProcessLayer:
    """``body`` under the Wrapper, for one worker process: :meth:`run` returns its result."""

    def __init__(self, ctx: ProcessContext, body: Body, *, rank: int, world_size: int) -> None:
        self.ctx, self.body, self.rank, self.world_size = ctx, body, rank, world_size

    def attempt(self, call_wrapper: Any = None) -> RunResult:
        """One iteration: the body, with what no restart fixes turned into an escape."""
        try:
            return self.body(self.ctx, call_wrapper)
        except TerminalError as e:
            raise RestartAbort(str(e)) from e  # a BaseException: it leaves the Wrapper
        except Exception as e:
            # Restarted in-process. On gloo, a peer waits in its next collective until this
            # rank's connections close: close them now, not at the process-group timeout.
            if self.ctx.placement.backend == "gloo":
                self.ctx.saver.drop_group()
                released_s = release_process_groups(e.__traceback__)
                log.info("rank %d released its process groups in %.3f s", self.rank, released_s)
            raise

    def run(self) -> RunResult:
        """Wrap and enter (the Wrapper must exist before any process group does)."""
        from trainer.stores import BoundNvrxStore, tcp_store

        cfg, port = self.ctx.cfg.inprocess, int(os.environ["MASTER_PORT"])
        s = datetime.timedelta(seconds=1)
        # One store per incarnation at MASTER_PORT, hosted by rank 0, for our process groups and
        # the Wrapper's keys alike: not MASTER_PORT+1, never reserved (architecture.md, "Doors").
        store = tcp_store(
            os.environ["MASTER_ADDR"],
            port,
            world_size=self.world_size,
            is_master=self.rank == 0,
            timeout=cfg.barrier_timeout_s * s,
            multi_tenant=True,
        )
        self.ctx = dataclasses.replace(self.ctx, base_store=store)

        logfile = self.ctx.cfg.run_root / Layout.monitor_log("{rank}")
        wrapper = inprocess.Wrapper(
            # A client of that store, in the worker and in its monitor process alike.
            store_factory=BoundNvrxStore,
            store_kwargs={
                "port": port,
                "join": True,
                "timeout": cfg.barrier_timeout_s * s,
            },
            initialize=inprocess.initialize.RetryController(
                max_iterations=cfg.max_restarts + 1,
                min_world_size=self.world_size,
                min_active_world_size=self.world_size,
            ),
            finalize=Finalize(self.ctx),
            # NVRx's default CUDA health check needs CUDA.
            health_check=inprocess.health_check.CudaHealthCheck(timeout=cfg.soft_timeout_s * s)
            if torch.cuda.is_available()
            else None,
            soft_timeout=cfg.soft_timeout_s * s,
            hard_timeout=cfg.hard_timeout_s * s,
            heartbeat_timeout=cfg.heartbeat_timeout_s * s,
            barrier_timeout=cfg.barrier_timeout_s * s,
            completion_timeout=cfg.completion_timeout_s * s,
            monitor_thread_interval=cfg.monitor_interval_s * s,
            monitor_process_interval=cfg.monitor_interval_s * s,
            progress_watchdog_interval=cfg.monitor_interval_s * s,
            heartbeat_interval=cfg.monitor_interval_s * s,
            last_call_wait=cfg.last_call_wait_s * s,
            termination_grace_time=cfg.termination_grace_s * s,
            monitor_process_logfile=str(logfile.absolute()),
        )
        nvrx_compat.disable_device_health_checks(wrapper)

        def entry(call_wrapper: Any = None) -> Any:
            return self.attempt(call_wrapper)

        # The Wrapper injects its CallWrapper by parameter *annotation object*; this module uses
        # postponed (string) annotations, so set the real class explicitly.
        entry.__annotations__ = {"call_wrapper": Optional[inprocess.CallWrapper], "return": Any}  # noqa: UP045
        wrapped = wrapper(entry)
        logfile.parent.mkdir(exist_ok=True)
        return wrapped()  # type: ignore[no-any-return]
