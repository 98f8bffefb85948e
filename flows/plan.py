"""A run's plan: every fact a stage needs, built once per run and handed to the stages whole
(the parameters, where the run lives, the backend's placement, the trainer config), instead of
each stage building the backend again to learn its placement and the trainer config again from
the parameters (no Prefect here)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from flows.context import RunContext, _placed, placement
from flows.models import PipelineParams
from tasks.backends.base import Placement
from trainer.config import TrainConfig


@dataclass(frozen=True)
class RunPlan:
    params: PipelineParams
    ctx: RunContext
    placement: Placement  # where the backend puts the shared filesystem and the workers
    # The trainer config as the workers see it (written whole for each attempt), with the
    # digest of the dataset manifest hydration verified: built once the dataset is there (the
    # config checks that its data directory exists).
    hydrated_train: TrainConfig | None = None

    @classmethod
    def build(cls, params: PipelineParams, *, run_id: str | None = None) -> RunPlan:
        where = placement(params)
        return cls(
            params=params,
            ctx=RunContext.create(params, run_id=run_id, where=where),
            placement=where,
        )

    def hydrated(self, manifest_sha256: str | None) -> RunPlan:
        """After the hydrate stage: the trainer config, whose workers check the dataset's
        manifest and sizes only."""
        ctx = dataclasses.replace(self.ctx, data_manifest_sha256=manifest_sha256)
        cfg = _placed(self.params, self.placement, ctx.run_root, ctx.data_dir, ctx.weights_dir)
        return dataclasses.replace(
            self,
            ctx=ctx,
            hydrated_train=dataclasses.replace(cfg, data_manifest_sha256=manifest_sha256),
        )

    @property
    def train(self) -> TrainConfig:
        if self.hydrated_train is None:
            raise RuntimeError("the trainer config is built after the hydrate stage")
        return self.hydrated_train
