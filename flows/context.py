"""Where a run lives and its plan, derived once from its parameters (no Prefect here)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from flows.models import PipelineParams, new_run_id
from tasks.backends import registry
from tasks.backends.base import LaunchRequest, Placement
from tasks.storage.s3 import S3Settings, parse_s3_uri
from trainer.checkpointing.config import CheckpointConfig, DurableConfig, MemoryConfig
from trainer.config import InJobConfig, InProcessConfig, TrainConfig


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
        backend's placement, when the caller has it (:class:`RunPlan`)."""
        state = Path(params.state_dir).absolute()
        where = where or registry.create(params.backend, params).placement
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


def train_config(
    params: PipelineParams,
    where: Placement,
    run_root: Path,
    data_dir: Path,
    weights_dir: Path | None = None,
) -> TrainConfig:
    """The trainer config of this run, as the backend's workers see it (``where``). The Wrapper's
    soft timeout must also exceed the longest wait a rank spends inside one C call (process-group
    start-up skew, a collective waiting for a slower peer): the Wrapper only sees progress when
    the main thread runs Python. The trainer's defaults (3/8/16 s, ft_launcher heartbeat 30 s)
    hold on a loaded 2-core machine; the 2/4/8 s set that the trainer's own drills use did not,
    with two simulated nodes."""
    workload, options = params.workload, dict(params.workload_options)
    if where.local_paths and params.is_script:
        # Named relative to where the pipeline was started; the workers run in another directory.
        workload = "script:" + str(Path(workload.removeprefix("script:")).absolute())
    if weights_dir is not None:  # the workers read them where hydrate put them
        options["init_weights"] = str(weights_dir)
    return TrainConfig(
        run_root=run_root,
        data_dir=data_dir,
        workload=workload,
        workload_options=options,
        script_args=tuple(params.script_args),
        steps=params.steps,
        global_batch=params.global_batch,
        micro_batches=params.micro_batches,
        checkpoint=CheckpointConfig(
            durable=DurableConfig(interval=params.ckpt_interval, keep_last=params.keep_last),
            memory=MemoryConfig(interval=params.memory_interval),
        ),
        faults=params.drills.specs,
        device=where.device,
        deterministic=params.deterministic,
        local_paths=where.local_paths,
        inprocess=replace(where.inprocess or InProcessConfig(), enabled=params.inprocess_restart),
        injob=replace(
            where.injob or InJobConfig(), enabled=params.injob_restart, **params.injob.pinned()
        ),
        straggler=params.straggler.config(),
        step_check=params.step_check.config(),
        metrics_port=None
        if params.metrics_port is None
        else params.metrics_port + where.rank0_metrics_offset,
        metrics_addr=where.metrics_addr,
        metrics_every_node=where.metrics_every_node,
    )


@dataclass(frozen=True)
class RunPlan:
    """Every fact a stage needs, built once per run and handed to the stages whole, instead of
    each stage building the backend again to learn its placement and the trainer config again
    from the parameters."""

    params: PipelineParams
    ctx: RunContext
    placement: Placement  # where the backend puts the shared filesystem and the workers
    # The trainer config as the workers see it (written whole for each attempt), with the
    # digest of the dataset manifest hydration verified: built once the dataset is there (the
    # config checks that its data directory exists).
    hydrated_train: TrainConfig | None = None

    @classmethod
    def build(cls, params: PipelineParams, *, run_id: str | None = None) -> RunPlan:
        where = registry.create(params.backend, params).placement
        return cls(params, RunContext.create(params, run_id=run_id, where=where), where)

    def hydrated(self, manifest_sha256: str | None) -> RunPlan:
        """After the hydrate stage: the trainer config, whose workers check the dataset's
        manifest and sizes only."""
        ctx = replace(self.ctx, data_manifest_sha256=manifest_sha256)
        cfg = train_config(self.params, self.placement, ctx.run_root, ctx.data_dir, ctx.weights_dir)
        cfg = replace(cfg, data_manifest_sha256=manifest_sha256)
        return replace(self, ctx=ctx, hydrated_train=cfg)

    def with_s3(self, s3: S3Settings) -> RunPlan:
        """Once the state directory's S3 server is known: its settings, which name its keys."""
        return replace(self, ctx=replace(self.ctx, s3=s3))

    @property
    def train(self) -> TrainConfig:
        if self.hydrated_train is None:
            raise RuntimeError("the trainer config is built after the hydrate stage")
        return self.hydrated_train


def eks_train_config(params: PipelineParams, run_id: str) -> TrainConfig:
    """The trainer config as the EKS pods see it (``render-k8s``): the run and the data on the
    FSx mount."""
    from tasks.backends.eks.placement import placement

    where = placement(params.eks)
    fsx = where.shared_root
    data = fsx / "datasets" / params.dataset.bucket / params.dataset.prefix
    return train_config(params, where, fsx / "runs" / run_id, data)


def render_global_batch(data: Mapping[str, Any]) -> int | None:
    """The global batch ``render-k8s`` uses when the parameters set none: the run form's default
    (8) is sized for the embedded default's world of 2 CPU workers, and an EKS world (nodes x
    eks.gpus_per_node, 16 by default) must divide it, so take the smallest multiple of the
    world that is at least the default. None when the user set one (theirs is validated as
    is) or the world cannot be read (validation then names the bad field)."""
    from tasks.backends.eks.params import EksParams
    from trainer.elastic import NodeRange, NodeRangeError

    if "global_batch" in data:
        return None
    gpus_default = EksParams.model_fields["gpus_per_node"].default
    try:
        # An elastic range (MIN:MAX) divides the batch by its largest world.
        nodes = NodeRange.parse(data.get("nodes", PipelineParams.model_fields["nodes"].default)).max
        gpus = int(dict(data.get("eks") or {}).get("gpus_per_node", gpus_default))
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
