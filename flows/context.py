"""Where a run lives, derived once from its parameters (no Prefect here)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flows.models import PipelineParams, new_run_id
from tasks.backends import registry
from tasks.backends.base import LaunchRequest, Placement
from tasks.storage.s3 import S3Settings, parse_s3_uri
from trainer.checkpointing.config import CheckpointConfig, DurableConfig, MemoryConfig
from trainer.config import (
    Device,
    InJobConfig,
    InProcessConfig,
    TrainConfig,
)


@dataclass(frozen=True)
class RunContext:
    run_id: str
    state_dir: Path
    run_root: Path  # on the shared filesystem ("FSx"): checkpoints, events, logs
    data_dir: Path  # the hydrated dataset on the shared filesystem
    s3: S3Settings
    # Initial weights given as s3://... (workload_options.init_weights): where they are hydrated.
    weights_dir: Path | None = None
    # Set once hydration verified every shard against this manifest (its digest): the workers
    # then check the manifest and the sizes only, not every shard's digest at every start.
    data_manifest_sha256: str | None = None

    @classmethod
    def create(
        cls, params: PipelineParams, *, run_id: str | None = None, where: Placement | None = None
    ) -> RunContext:
        """Locally "FSx" is a directory under the state dir; on EKS it is the FSx claim, which
        the flow runner mounts at the same path as the training pods (``eks.fsx_mount``).
        ``run_id``: when the parameters name none (derived from the flow run); ``where``: the
        backend's placement, when the caller has it (flows.plan)."""
        state = Path(params.state_dir).absolute()
        where = where or placement(params)
        fsx = where.shared_root
        run_id = params.run_id or run_id or new_run_id()
        weights = params.s3_init_weights()
        return cls(
            run_id=run_id,
            state_dir=state,
            run_root=fsx / "runs" / run_id,
            data_dir=fsx / "datasets" / params.dataset.bucket / params.dataset.prefix,
            s3=S3Settings(endpoint_url=params.s3_endpoint, region=where.s3_region),
            weights_dir=None
            if weights is None
            else fsx / "weights" / "/".join(parse_s3_uri(weights)),
        )


def placement(params: PipelineParams) -> Placement:
    """Where this run's backend puts its shared filesystem and workers (no connection made)."""
    return registry.create(params.backend, params).placement


def train_config(
    params: PipelineParams,
    *,
    run_root: Path,
    data_dir: Path,
    weights_dir: Path | None = None,
    device: Device = Device.AUTO,
    local_paths: bool = True,
    inprocess: InProcessConfig | None = None,
    injob: InJobConfig | None = None,
    metrics_addr: str = "127.0.0.1",
    rank0_metrics_offset: int = 1,
    metrics_every_node: bool = False,
) -> TrainConfig:
    """The trainer config of this run. The Wrapper's soft timeout must also exceed the longest
    wait a rank spends inside one C call (process-group start-up skew, a collective waiting for a
    slower peer): the Wrapper only sees progress when the main thread runs Python. The trainer's
    defaults (3/8/16 s, ft_launcher heartbeat 30 s) hold on a loaded 2-core machine; the 2/4/8 s
    set that the trainer's own drills use did not, with two simulated nodes."""
    return TrainConfig(
        run_root=run_root,
        data_dir=data_dir,
        workload=_script_absolute(params.workload) if local_paths else params.workload,
        workload_options=_hydrated(params.workload_options, weights_dir),
        script_args=tuple(params.script_args),
        steps=params.steps,
        global_batch=params.global_batch,
        micro_batches=params.micro_batches,
        checkpoint=CheckpointConfig(
            durable=DurableConfig(interval=params.ckpt_interval, keep_last=params.keep_last),
            memory=MemoryConfig(interval=params.memory_interval),
        ),
        faults=params.drills.specs,
        device=device,
        deterministic=params.deterministic,
        local_paths=local_paths,
        inprocess=dataclasses.replace(
            inprocess or InProcessConfig(), enabled=params.inprocess_restart
        ),
        injob=dataclasses.replace(
            injob or InJobConfig(), enabled=params.injob_restart, **params.injob.pinned()
        ),
        metrics_port=None
        if params.metrics_port is None
        else params.metrics_port + rank0_metrics_offset,
        metrics_addr=metrics_addr,
        metrics_every_node=metrics_every_node,
    )


def _hydrated(options: dict[str, object], weights_dir: Path | None) -> dict[str, object]:
    """The workers read initial weights from the shared filesystem, where hydrate put them."""
    out = dict(options)
    if weights_dir is not None:
        out["init_weights"] = str(weights_dir)
    return out


def _script_absolute(workload: str) -> str:
    """A script named relative to where the pipeline was started, as the workers (which run in
    another directory) must see it."""
    if not workload.startswith("script:"):
        return workload
    return "script:" + str(Path(workload.removeprefix("script:")).absolute())


def eks_train_config(params: PipelineParams, run_id: str) -> TrainConfig:
    """The trainer config as the EKS pods see it (``render-k8s``): the run and the data on the
    FSx mount."""
    from tasks.backends.eks.placement import placement as eks_placement

    where = eks_placement(params.eks)
    fsx = where.shared_root
    data = fsx / "datasets" / params.dataset.bucket / params.dataset.prefix
    return _placed(params, where, fsx / "runs" / run_id, data, None)


def _placed(
    params: PipelineParams,
    where: Placement,
    run_root: Path,
    data_dir: Path,
    weights_dir: Path | None,
) -> TrainConfig:
    return train_config(
        params,
        run_root=run_root,
        data_dir=data_dir,
        weights_dir=weights_dir,
        device=where.device,
        local_paths=where.local_paths,
        inprocess=where.inprocess,
        injob=where.injob,
        metrics_addr=where.metrics_addr,
        rank0_metrics_offset=where.rank0_metrics_offset,
        metrics_every_node=where.metrics_every_node,
    )


def render_global_batch(data: dict[str, Any]) -> int | None:
    """The global batch ``render-k8s`` uses when the parameters set none: the run form's default
    (8) is sized for the embedded default's world of 2 CPU workers, and an EKS world (nodes x
    eks.gpus_per_node, 16 by default) must divide it, so take the smallest multiple of the
    world that is at least the default. None when the user set one (theirs is validated as
    is) or the world cannot be read (validation then names the bad field)."""
    from tasks.backends.eks.params import EksParams

    if "global_batch" in data:
        return None
    raw_eks = data.get("eks")
    eks: dict[str, Any] = raw_eks if isinstance(raw_eks, dict) else {}
    from trainer.elastic import NodeRange, NodeRangeError

    try:
        # An elastic range (MIN:MAX) divides the batch by its largest world.
        nodes = NodeRange.parse(data.get("nodes", PipelineParams.model_fields["nodes"].default)).max
        gpus = int(eks.get("gpus_per_node", EksParams.model_fields["gpus_per_node"].default))
    except (TypeError, ValueError, NodeRangeError):
        return None
    world = nodes * gpus
    if world < 1:
        return None
    default = int(PipelineParams.model_fields["global_batch"].default)
    return world * max(1, -(-default // world))


def launch_request(
    params: PipelineParams,
    cfg: TrainConfig,
    *,
    run_id: str,
    attempt: int,
    invocation: str,
    epoch: int | None = None,
) -> LaunchRequest:
    """One train attempt as the backend is asked to launch it: what the train flow launches and
    what ``render-k8s`` renders, from the same parameters (one code path)."""
    return LaunchRequest(
        run_id=run_id,
        attempt=attempt,
        cfg=cfg,
        nodes=params.max_nodes,
        nproc_per_node=params.ranks_per_node,
        min_nodes=params.node_range.min,
        spares=params.spares,
        invocation=invocation,
        deadline_s=params.train_timeout_s,
        epoch=epoch,
        secrets=dict(params.secrets),
    )
