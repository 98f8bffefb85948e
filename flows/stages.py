"""The stage flows: each its own Prefect flow run (logs, artifacts); the work is in ``tasks``.

Each returns a typed model (:mod:`flows.results`), persisted as JSON with its flow run and
published to its Artifacts tab."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, replace
from typing import ParamSpec, TypeVar, cast
from uuid import UUID

from prefect import Flow, flow, task
from prefect.artifacts import (
    create_link_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.logging import get_run_logger
from prefect.states import Failed, State

from flows.context import RunPlan, launch_request
from flows.events import emit
from flows.models import PipelineParams
from flows.results import (
    CheckRow,
    ExportResult,
    HydrateResult,
    PreflightResult,
    PreflightRow,
    RejectedCheckpoint,
    TrainResult,
    ValidationResult,
    console_link,
    publish,
)
from flows.train_progress import TrainProgress
from tasks import aws
from tasks.backends import registry
from tasks.backends.base import Backend, HydrateRequest
from tasks.checks import failures
from tasks.classify import EndKind
from tasks.errors import NodeLost, PreflightFailed
from tasks.export import ExportOptions, ExportReport, export_checkpoint
from tasks.ownership import lease
from tasks.preflight.checks import Requirements
from tasks.preflight.memory import MemoryNeed, count_parameters, node_memory_need
from tasks.retry_policy import prefect_retry_condition
from tasks.storage.s3 import boto3_client
from tasks.train_stage import AttemptReport, run_attempt
from tasks.validation import load_process
from tasks.validation.checkpoint import Expectations, prestart_load_check, validate_latest
from trainer.event_types import Event, TrainEnd
from trainer.history import RunHistory

P = ParamSpec("P")
R = TypeVar("R")


def stage_flow(name: str) -> Callable[[Callable[P, R]], Flow[P, R]]:
    """A stage's flow. Its runs read as what they are (``RUN_ID: train attempt 2``) in the UI's
    run list and in logs, not Prefect's random two words; its result is persisted as JSON
    (readable from the result storage without this code), so the API and the UI hold it."""

    def run_name() -> str:
        from prefect.runtime import flow_run

        params = flow_run.parameters
        plan, attempt = params.get("plan"), params.get("attempt")
        run_id = plan.ctx.run_id if isinstance(plan, RunPlan) else None
        label = f"{name} attempt {attempt}" if attempt else name
        return f"{run_id}: {label}" if run_id else label

    return flow(name=name, flow_run_name=run_name, persist_result=True, result_serializer="json")


def backend_for(plan: RunPlan) -> Backend:
    """This run's backend, its messages going to the stage's log, the run's lease (when held
    here) where it records what it starts."""
    log = get_run_logger()
    return registry.create(
        plan.params.backend,
        plan.params,
        lease=lease.held(plan.ctx.run_root),
        log=lambda msg: log.info(msg),
    )


@stage_flow("preflight")
def preflight_flow(plan: RunPlan) -> PreflightResult:
    params, ctx = plan.params, plan.ctx
    s3 = {
        "s3": ctx.s3,
        "client": boto3_client(ctx.s3),
        "buckets": (params.dataset.bucket, params.export.bucket),
        "dataset_bucket": params.dataset.bucket,
        "dataset_prefix": params.dataset.prefix,
    }
    wl = params.workload_spec()
    # What the workload needs of memory: every rank on this machine (the local backend), and
    # the memory saves of one node (node memory: this machine's /dev/shm for every simulated
    # node locally, the pod's on EKS).
    need, node_need = None, None
    if wl is not None:
        try:
            n = count_parameters(wl)
        except Exception as e:  # a user's model that cannot be built on the meta device
            get_run_logger().warning(
                "memory check: %s's parameters could not be counted on the meta device (%s: "
                "%s); checking the flat floor only",
                params.workload,
                type(e).__name__,
                e,
            )
        else:
            local = params.backend == "local"
            node_need = node_memory_need(
                n,
                memory_tiers=params.memory_interval != 0,
                # Locally every simulated node's memory is this machine's.
                nodes=1 if local else params.node_range.min,
                peers=params.node_range.max > 1,
            )
            if local:
                copies = node_need.copies if node_need is not None else 0
                need = MemoryNeed(params=n, workers=params.world_size, memory_copies=copies)
    req = Requirements(
        workers=params.world_size,
        buckets=(params.dataset.bucket, params.export.bucket),
        dataset_uri=f"s3://{params.dataset.bucket}/{params.dataset.prefix}",
        workload=params.workload,
        vocab_size=None if wl is None else wl.vocab_size,
    )
    if need is not None:
        req = replace(req, min_memory_gb=need.gb, memory_basis=need.explain())
    if node_need is not None:
        req = replace(req, node_memory_gb=node_need.gb, node_memory_basis=node_need.explain())
    results = backend_for(plan).preflight(req, s3)
    rows = [
        {"check": r.name, "status": r.status.value, "detail": r.detail, "fix": r.fix}
        for r in results
    ]
    create_table_artifact(rows, key="preflight", description=f"preflight of {ctx.run_id}")
    failed = failures(results)
    if failed:
        listing = "; ".join(f"{r.name}: {r.detail} (fix: {r.fix})" for r in failed)
        raise PreflightFailed(f"{len(failed)} preflight check(s) failed: {listing}")
    get_run_logger().info(
        "preflight passed: %s", ", ".join(f"{r.name} {r.status}" for r in results)
    )
    result = PreflightResult(checks=[PreflightRow.model_validate(r) for r in rows])
    publish("preflight", result, ctx.run_id)
    return result


@stage_flow("hydrate")
def hydrate_flow(plan: RunPlan) -> HydrateResult:
    params, ctx = plan.params, plan.ctx
    log = get_run_logger()
    # Sync context: these return the value, not a coroutine (their typing covers both).
    artifact = cast(
        UUID, create_progress_artifact(0.0, key="hydrate-progress", description="files hydrated")
    )

    def progress(done: int, total: int, name: str) -> None:
        update_progress_artifact(artifact, 100.0 * done / max(total, 1))
        log.info("hydrate %d/%d %s", done, total, name)

    weights = params.s3_init_weights()
    request = HydrateRequest(
        run_id=ctx.run_id,
        bucket=params.dataset.bucket,
        prefix=params.dataset.prefix,
        data_dir=ctx.data_dir,
        s3=ctx.s3,
        weights=None if weights is None or ctx.weights_dir is None else (weights, ctx.weights_dir),
        weights_pin=params.initial_weights.pin(),
    )
    if request.weights is not None and request.weights_pin.sha256 is None:
        # Allowed (NVRX_ALLOWED_UNPINNED_WEIGHTS unset or naming the bucket), and said: whoever
        # can write the prefix chooses the model this run starts from.
        log.warning(
            "initial weights %s are not pinned: set initial_weights.sha256 (the digest is in the "
            "hydrate line below) so that a swapped file is refused",
            weights,
        )
    done = backend_for(plan).hydrate(request, progress)
    update_progress_artifact(artifact, 100.0)
    log.info("hydrated %s -> %s: %s", done.source, done.dest, done.detail)
    fields = asdict(done)
    fields["backend"] = fields.pop("report")  # what the backend adds, whole
    result = HydrateResult(**fields)
    publish("hydrate", result, ctx.run_id)
    return result


@stage_flow("train")
def train_flow(plan: RunPlan, attempt: int) -> TrainResult | State[TrainResult]:
    params, ctx = plan.params, plan.ctx
    log = get_run_logger()
    if attempt > 1:
        cause = RunHistory.read(ctx.run_root).last_attempt_cause()
        log.warning("stage retry: train attempt %d after: %s", attempt, cause)
        emit("stage.retried", ctx.run_id, stage="train", attempt=attempt, cause=cause)
    held = lease.held(ctx.run_root)
    request = launch_request(
        params,
        plan.train,
        run_id=ctx.run_id,
        attempt=attempt,
        invocation=held.owner.invocation if held is not None else "unowned",
    )
    log.info(
        "train attempt %d: %s node(s)%s x %d rank(s), %d steps, backend %s",
        attempt,
        params.nodes,
        f" + {params.spares} spare(s)" if params.spares else "",
        params.ranks_per_node,
        params.steps,
        params.backend,
    )
    emit("train.started", ctx.run_id, attempt=attempt, nodes=params.nodes)
    progress = TrainProgress(params.steps, attempt, ctx.run_id)

    def on_event(e: Event) -> None:
        progress(e)
        if isinstance(e, TrainEnd):
            # Validation's load-check interpreter imports while the workers and agents exit
            # (tasks.validation.load_process): ~3.5 s off the pipeline's critical path.
            prestart_load_check()

    outcome = "error"
    try:
        report = run_attempt(
            backend_for(plan),
            request,
            on_event=on_event,
            check_owner=held.check if held is not None else lambda action: None,
        )
        outcome = report.outcome.kind.value
    finally:  # what the stalled-checkpoint automation stops waiting on
        emit("train.ended", ctx.run_id, attempt=attempt, outcome=outcome)
    if report.outcome.kind != EndKind.COMPLETED:
        return _failed_attempt(report, params)
    log.info("train attempt %d completed in %.1f s", report.attempt, report.wall_s)
    # The judge's RunResult (trainer.rundir), already validated: completed, every step.
    result = TrainResult.model_validate(report.outcome.details["result"].model_dump())
    publish("train", result, ctx.run_id)
    return result


def _failed_attempt(report: AttemptReport, params: PipelineParams) -> State[TrainResult]:
    """A classified end (a node lost, in-job restarts used up, do not requeue, the deadline)
    fails the attempt's flow run with the error as its state, not as an exception: the
    outcome is logged once, as what it is, with no traceback of the flow's machinery, and the
    train-stage task still gets the error (its retry condition decides on it)."""
    error = report.outcome.error()
    assert error is not None
    note = ""
    planned = [str(f) for f in params.drills.specs if f.kills_node]
    if isinstance(error, NodeLost) and planned:
        note = f" (the planned drill {', '.join(planned)})"
    get_run_logger().warning(
        "train attempt %d ended: %s: %s%s", report.attempt, type(error).__name__, error, note
    )
    return Failed(message=f"{type(error).__name__}: {error}", data=error)


@task(name="train-stage", retry_condition_fn=prefect_retry_condition)
def train_stage(plan: RunPlan) -> TrainResult:
    """The train stage as a task: Prefect retries it (a new ``train`` flow run per attempt)
    only when :func:`tasks.retry_policy.stage_retry_allowed` says so."""
    from prefect.runtime import task_run

    # An attempt's Failed state (see _failed_attempt) raises its error here.
    return cast(TrainResult, train_flow(plan, attempt=int(task_run.run_count or 1)))


@stage_flow("validate")
def validate_flow(plan: RunPlan) -> ValidationResult:
    params, ctx, cfg = plan.params, plan.ctx, plan.train
    # The workload, batch and seed come from each checkpoint's manifest; the config hash says
    # whether that is this run's.
    exp = Expectations(
        config_hash=cfg.fingerprint(),
        world_size=params.world_size,
        min_world_size=params.node_range.min * params.ranks_per_node,
        data_dir=ctx.data_dir,
        # This run's workload, never the one a manifest names: a forged manifest must not
        # choose which code validation imports.
        workload=cfg.workload_ref(),
    )
    try:
        outcome = validate_latest(ctx.run_root, exp)  # raises ValidationFailed when none valid
    finally:
        load_process.discard()  # a spare validation did not need (it loaded nothing)
    log = get_run_logger()
    for r in outcome.rejected:
        log.warning(
            "checkpoint step %s FAILED validation: %s",
            r.step,
            "; ".join(c.detail for c in r.failed_checks()),
        )
    if outcome.fell_back:
        log.warning("falling back to checkpoint step %s", outcome.chosen.step)
    rows = [
        {"step": r.step, "check": c.name, "status": c.status.value, "detail": c.detail}
        for r in [*outcome.rejected, outcome.chosen]
        for c in r.checks
    ]
    create_table_artifact(
        rows, key="validation", description=f"checkpoint validation of {ctx.run_id}"
    )
    chosen = outcome.chosen
    log.info("checkpoint step %s validated (%s MB/s digests)", chosen.step, chosen.hash_mb_s)
    result = ValidationResult(
        step=chosen.step,
        path=chosen.path,
        validated=chosen.passed,
        checks=[CheckRow.model_validate(c.row()) for c in chosen.checks],
        hash_mb_s=chosen.hash_mb_s,
        fell_back_from=[
            RejectedCheckpoint(
                step=r.step, failed=[CheckRow.model_validate(c.row()) for c in r.failed_checks()]
            )
            for r in outcome.rejected
        ],
    )
    publish("validate", result, ctx.run_id)
    return result


@stage_flow("export")
def export_flow(plan: RunPlan, checkpoint_path: str) -> ExportResult:
    from pathlib import Path

    params, ctx = plan.params, plan.ctx
    held = lease.held(ctx.run_root)
    if held is not None:
        held.check("export the checkpoint")
    options = ExportOptions(
        sse=None if params.export.sse == "none" else params.export.sse,
        kms_key_id=params.export.kms_key_id,
        consolidated=params.export.consolidated,
        workload=plan.train.workload_ref(),
    )
    report: ExportReport = export_checkpoint(
        boto3_client(ctx.s3),
        Path(checkpoint_path),
        params.export.bucket,
        params.export.prefix,
        ctx.run_id,
        endpoint=ctx.s3.endpoint_url,
        options=options,
    )
    get_run_logger().info(
        "exported %s: %d objects (%d uploaded, %d already there), verified against the "
        "manifest (%s)",
        report.uri,
        report.objects,
        report.uploaded,
        report.skipped,
        report.verification,
    )
    link: str | None = None
    try:  # a link must never fail the export it points to
        link = console_link(
            report.uri,
            ctx.s3.endpoint_url,
            None if ctx.s3.endpoint_url else aws.resolve_region(ctx.s3.region).name,
        )
        create_link_artifact(
            link,
            link_text=report.uri,
            key="export",
            description=f"the verified export of {ctx.run_id} ({report.objects} objects)",
        )
    except Exception as e:
        get_run_logger().warning("could not publish the export link: %s", e)
    result = ExportResult(**report.to_dict(), link=link)
    payload = {"uri", "objects", "bytes", "verified", "verification"}
    emit("export.completed", ctx.run_id, **result.model_dump(include=payload))
    publish("export", result, ctx.run_id)
    return result
