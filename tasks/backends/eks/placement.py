"""Where an EKS run's ranks run: the FSx mount, CUDA, and the in-job layers' timeouts on GPU
nodes. Apart from the backend so that a run's plan needs no Kubernetes client to build."""

from __future__ import annotations

from pathlib import Path

from tasks.backends.base import Placement
from tasks.backends.eks.params import EksParams
from trainer.config import Device, InJobConfig, InProcessConfig

# GPU nodes: NCCL collectives of a large model, checkpoint I/O to FSx and a rendezvous of many
# pods take minutes, not seconds. Still nested: pg < soft < hard < ft_launcher heartbeat.
EKS_INPROCESS = InProcessConfig(
    pg_timeout_s=120.0,
    soft_timeout_s=240.0,
    hard_timeout_s=280.0,
    heartbeat_timeout_s=200.0,
    barrier_timeout_s=600.0,
    completion_timeout_s=600.0,
    # NVRx's own defaults: on many nodes the Wrapper's store traffic grows with the polling rate.
    monitor_interval_s=1.0,
    last_call_wait_s=1.0,
    termination_grace_s=5.0,
)
EKS_INJOB = InJobConfig(
    # Every timeout auto (trainer.timeouts): until measured, the start-up allowance covers pod
    # start-up, CUDA and NCCL initialisation, an 8B model's build and load from FSx, the first
    # (compiling) steps and the first save; then each is 5 x what this incarnation measured,
    # the step timeout at least the in-process layer's window (pg_timeout_s + a beat), the
    # others at least section_floor_s (an 8B save or load to FSx takes minutes).
    startup_allowance_s=1800.0,
    section_floor_s=300.0,
    monitor_interval_s=1.0,
    workers_stop_timeout_s=30.0,
    rdzv_join_timeout_s=120.0,
    check_interval_s=5.0,
)


def placement(eks: EksParams) -> Placement:
    return Placement(
        shared_root=Path(eks.fsx_mount),
        device=Device.CUDA,
        local_paths=False,
        inprocess=EKS_INPROCESS,
        injob=EKS_INJOB,
        s3_region=eks.region,
        # Rank 0 and the flow run in pods of their own: the same port, container port `metrics`.
        metrics_addr="0.0.0.0",
        rank0_metrics_offset=0,
        # every training pod is a PodMonitor target: each serves (its rank, its versions)
        metrics_every_node=True,
    )
