"""Deployments of the pipeline: on demand (the Prefect UI's Run button) and a nightly schedule.

``nvrx-pipeline serve`` serves both from this process (no work pool needed); ``deploy/prefect.yaml``
declares the same two for a process work pool (``prefect deploy --all``). A run keeps every
default of its deployment that it does not set (:mod:`flows.parameters`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flows.models import PipelineParams

ON_DEMAND = "on-demand"
NIGHTLY = "nightly"
NIGHTLY_CRON = "0 2 * * *"
# One flow run of a deployment at a time; a run started meanwhile (a second click, the nightly
# schedule overlapping a long run) waits in the queue instead of competing for the nodes, the
# cores and the local S3 server. The run's lease (arch §6) still guards one run id.
CONCURRENCY_LIMIT = 1
COLLISION_STRATEGY = "ENQUEUE"


def default_parameters(defaults: PipelineParams | None = None) -> dict[str, Any]:
    """The form's starting values: every field but ``run_id`` (each run names its own)."""
    from flows.models import PipelineParams

    values = (defaults or PipelineParams()).flow_parameters()
    values.pop("run_id", None)
    return values


def deployments(defaults: PipelineParams | None = None) -> list[Any]:
    """Both deployments, with ``defaults`` (validated) as the parameters the UI form starts from."""
    from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy

    from flows.pipeline import training_pipeline

    on_demand = "Run the training pipeline on demand (embedded default backend)."
    nightly = "Nightly training run with the default drill-free parameters."
    kinds = [
        (ON_DEMAND, None, ["nvrx"], on_demand),
        (NIGHTLY, NIGHTLY_CRON, ["nvrx", "scheduled"], nightly),
    ]
    strategy = ConcurrencyLimitStrategy(COLLISION_STRATEGY)
    return [
        training_pipeline.to_deployment(
            name=name,
            cron=cron,
            parameters=default_parameters(defaults),
            description=description,
            tags=tags,
            concurrency_limit=ConcurrencyLimitConfig(
                limit=CONCURRENCY_LIMIT, collision_strategy=strategy
            ),
        )
        for name, cron, tags, description in kinds
    ]


def serve_all(defaults: PipelineParams | None = None, limit: int = 1) -> None:
    from prefect import serve

    # One pipeline at a time per server: a run owns this machine's cores and local S3.
    serve(*deployments(defaults), limit=limit)
