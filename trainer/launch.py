"""The ``ft_launcher`` command line for a training config: one source for tests, the local
backend and the EKS Job template.

Spellings are the ones that work on NVRx 0.4.1 and still on 0.7.0 (not ``--ft-param-*``).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass

from trainer.config import TrainConfig


@dataclass(frozen=True, kw_only=True)
class LaunchSpec:
    nnodes: int = 1
    nproc_per_node: int = 2
    rdzv_endpoint: str = "127.0.0.1:29500"
    rdzv_id: str = "nvrx"
    # Set on CPU hosts with NVRx >= 0.7 (GPU memory reclaim waits for NVML otherwise).
    cpu_only: bool = True


def ft_launcher_argv(cfg: TrainConfig, spec: LaunchSpec, trainer_args: list[str]) -> list[str]:
    inj = cfg.injob
    launcher = shutil.which("ft_launcher") or "ft_launcher"
    argv = [
        launcher,
        f"--nnodes={spec.nnodes}",
        f"--nproc-per-node={spec.nproc_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={spec.rdzv_endpoint}",
        f"--rdzv-id={spec.rdzv_id}",
        # Bounded wait for a lost node: without it survivors wait in rendezvous forever.
        f"--rdzv-conf=join_timeout={int(inj.rdzv_join_timeout_s)}",
        f"--max-restarts={inj.max_restarts}",
        f"--monitor-interval={inj.monitor_interval_s}",
        f"--workers-stop-timeout={int(inj.workers_stop_timeout_s)}",
        f"--ft-initial-rank-heartbeat-timeout={inj.initial_heartbeat_timeout_s}",
        f"--ft-rank-heartbeat-timeout={inj.heartbeat_timeout_s}",
        "--ft-workload-check-interval=1",
        "--ft-enable-nic-monitor=false",
    ]
    if spec.cpu_only and _nvrx_major_minor() >= (0, 7):
        argv.append("--ft-gpu-memory-reclaim-timeout=0")
    return [*argv, "-m", "trainer.train", *trainer_args]


def _nvrx_major_minor() -> tuple[int, int]:
    from trainer.nvrx_compat import version

    try:
        major, minor = version().split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return (0, 0)

