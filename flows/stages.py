"""The stage flows: each its own Prefect flow run (logs, artifacts); the work is in ``tasks``."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, cast
from uuid import UUID

from prefect import flow, task
from prefect.artifacts import (
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.logging import get_run_logger

from flows.context import (
    RunContext,
    eks_requirements,
    eks_train_config,
    local_train_config,
    stage_train_config,
)
from flows.events import emit, emit_for_trainer_event, last_attempt_cause
from flows.models import PipelineParams
from tasks.backends.base import LaunchRequest
from tasks.backends.eks.clients import connect
from tasks.backends.eks.hydrate import hydrate_fsx
from tasks.backends.eks.train import eks_train_attempt
from tasks.backends.local import LocalBackend
from tasks.checks import CheckResult
from tasks.classify import EndKind
from tasks.errors import PreflightFailed
from tasks.export import ExportOptions, ExportReport, export_checkpoint
from tasks.hydrate import HydrateReport, hydrate_dataset, hydrate_weights, upload_dataset
from tasks.ownership import lease
from tasks.preflight.checks import S3_CHECKS, Requirements, Snapshot, failures, run_checks
from tasks.preflight.eks import gather_eks, run_eks_checks
from tasks.preflight.local import gather_local, gather_s3
from tasks.retry_policy import prefect_retry_condition
from tasks.storage.s3 import boto3_client, s3fs_filesystem
from tasks.train_stage import AttemptReport, run_attempt
from tasks.validate import validate_latest
from tasks.validation.checkpoint import Expectations
from trainer.data import write_synthetic_dataset
from trainer.events import STDOUT_PREFIX


# -- demo data ------------------------------------------------------------------------------------
@task(name="seed-demo-dataset")
def seed_demo_dataset(params: PipelineParams, ctx: RunContext) -> bool:
    """Local S3 only: create the buckets and a synthetic dataset when the prefix is empty."""
    log = get_run_logger()
    client = boto3_client(ctx.s3)
    for bucket in (params.dataset.bucket, params.export.bucket):
        try:
            client.head_bucket(Bucket=bucket)
        except Exception:
            client.create_bucket(Bucket=bucket)
            log.info("created bucket %s", bucket)
    key = f"{params.dataset.prefix}/dataset.json"
    try:
        client.head_object(Bucket=params.dataset.bucket, Key=key)
        return False
    except Exception:
        pass
    staging = ctx.state_dir / "seed" / params.dataset.prefix
    write_synthetic_dataset(staging, vocab_size=512, seed=0)
    n = upload_dataset(client, staging, params.dataset.bucket, params.dataset.prefix)
    log.info(
        "seeded s3://%s/%s with a synthetic dataset (%d objects)",
        params.dataset.bucket,
        params.dataset.prefix,
        n,
    )
    return True


# -- preflight ------------------------------------------------------------------------------------
@task(name="gather-preflight-snapshot")
def gather_snapshot(params: PipelineParams, ctx: RunContext) -> Any:
    s3 = {
        "s3": ctx.s3,
        "client": boto3_client(ctx.s3),
        "buckets": (params.dataset.bucket, params.export.bucket),
        "dataset_bucket": params.dataset.bucket,
        "dataset_prefix": params.dataset.prefix,
    }
    if params.backend == "eks":
        clients = connect(params.eks.region)
        snap = gather_eks(clients.kube, clients.fsx, eks_requirements(params))
        gather_s3(snap, **s3)
        return snap
    return gather_local(state_dir=ctx.state_dir, **s3)


@flow(name="preflight")
def preflight_flow(params: PipelineParams, ctx: RunContext) -> list[dict[str, str]]:
    snap = cast(Snapshot, gather_snapshot(params, ctx))
    req = Requirements(
        workers=params.world_size,
        buckets=(params.dataset.bucket, params.export.bucket),
        dataset_uri=f"s3://{params.dataset.bucket}/{params.dataset.prefix}",
        workload=params.workload,
        vocab_size=None if (wl := params.workload_spec()) is None else wl.vocab_size,
    )
    if params.backend == "eks":
        results = run_eks_checks(snap, eks_requirements(params))
        results += [check(snap, req) for check in S3_CHECKS]
    else:
        results = run_checks(snap, req)
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
    return rows


# -- hydrate --------------------------------------------------------------------------------------
@flow(name="hydrate")
def hydrate_flow(params: PipelineParams, ctx: RunContext) -> dict[str, Any]:
    log = get_run_logger()
    if params.backend == "eks":
        fsx_report = hydrate_fsx(
            connect(params.eks.region),
            run_id=ctx.run_id,
            eks=params.eks,
            bucket=params.dataset.bucket,
            prefix=params.dataset.prefix,
            data_dir=ctx.data_dir,
            progress=log.info,
        )
        log.info(
            "hydrated %s -> FSx %s: %d files, %d bytes, checked against the manifest",
            fsx_report.source,
            fsx_report.dest,
            fsx_report.files,
            fsx_report.bytes,
        )
        return fsx_report.to_dict()
    fs = s3fs_filesystem(ctx.s3)
    # Sync context: these return the value, not a coroutine (their typing covers both).
    artifact = cast(
        UUID, create_progress_artifact(0.0, key="hydrate-progress", description="files hydrated")
    )

    def progress(done: int, total: int, name: str) -> None:
        update_progress_artifact(artifact, 100.0 * done / max(total, 1))
        log.info("hydrate %d/%d %s", done, total, name)

    report: HydrateReport = hydrate_dataset(
        fs, params.dataset.bucket, params.dataset.prefix, ctx.data_dir, progress=progress
    )
    weights = params.s3_init_weights()
    if weights is not None and ctx.weights_dir is not None:
        w = hydrate_weights(fs, weights, ctx.weights_dir)
        log.info(
            "hydrated initial weights %s -> %s: %d files, %d downloaded",
            w.source,
            w.dest,
            w.files,
            w.downloaded,
        )
    log.info(
        "hydrated %s -> %s: %d files, %d downloaded, %d already present and verified",
        report.source,
        report.dest,
        report.files,
        report.downloaded,
        report.skipped,
    )
    return report.to_dict()


# -- train ----------------------------------------------------------------------------------------
class _Progress:
    """Streams rank-0 progress into the flow log (throttled) and a progress artifact."""

    def __init__(self, target: int, attempt: int, run_id: str) -> None:
        self.log = get_run_logger()
        self.target = target
        self.run_id = run_id
        self.artifact = cast(
            UUID,
            create_progress_artifact(
                0.0, key="train-progress", description=f"training steps (attempt {attempt})"
            ),
        )
        self.last_log = 0.0

    def __call__(self, e: dict[str, Any]) -> None:
        emit_for_trainer_event(self.run_id, e)
        kind = e["kind"]
        if kind == "step":
            now = time.monotonic()
            if now - self.last_log >= 2.0 or e["step"] == self.target:
                self.last_log = now
                update_progress_artifact(self.artifact, 100.0 * e["step"] / self.target)
                self.log.info(
                    "step %d/%d loss %.4f %.0f tok/s",
                    e["step"],
                    self.target,
                    e["loss"],
                    e.get("tokens_per_s", 0.0),
                )
        elif kind == "fault":
            self.log.warning("fault injected: %s at step %s", e.get("fault"), e.get("step"))
        elif kind == "restart":
            self.log.warning("restart by the %s layer", e.get("layer"))
        elif kind == "recovered":
            self.log.info(
                "recovered from %s by %s in %.1f s",
                e.get("fault"),
                e.get("layer"),
                e.get("recovery_s", 0.0),
            )
        elif kind == "resume" and e.get("action") in ("loaded", "skipped", "failed"):
            self.log.info("resume %s: step %s %s", e["action"], e.get("step"), e.get("reason", ""))
        elif kind == "checkpoint":
            self.log.info(
                "checkpoint step %d committed (blocked %.3f s)", e["step"], e["blocking_s"]
            )
        elif kind == "fatal":
            self.log.error("trainer fatal error: %s", e.get("error"))


def _eks_attempt(params: PipelineParams, ctx: RunContext, attempt: int) -> AttemptReport:
    log = get_run_logger()
    log.info(
        "train attempt %d on EKS: %d node(s) x %d GPU(s), %d steps, namespace %s",
        attempt,
        params.nodes,
        params.eks.gpus_per_node,
        params.steps,
        params.eks.namespace,
    )

    def on_log(line: str) -> None:
        if not line.startswith(STDOUT_PREFIX):  # those arrive as events from events.jsonl
            log.info("[rank 0] %s", line)

    def on_wait(check: CheckResult, waited: float) -> None:
        log.warning("waiting for healthy nodes (%.0f s): %s", waited, check.detail)

    return eks_train_attempt(
        connect(params.eks.region),
        cfg=eks_train_config(params, ctx.run_id),
        run_id=ctx.run_id,
        attempt=attempt,
        nodes=params.nodes,
        eks=params.eks,
        requirements=eks_requirements(params),
        deadline_s=params.train_timeout_s,
        on_event=_Progress(params.steps, attempt, ctx.run_id),
        on_log=on_log,
        on_wait=on_wait,
    )


@flow(name="train")
def train_flow(params: PipelineParams, ctx: RunContext, attempt: int) -> dict[str, Any]:
    log = get_run_logger()
    if attempt > 1:
        cause = last_attempt_cause(ctx.run_root)
        log.warning("stage retry: train attempt %d after: %s", attempt, cause)
        emit("stage.retried", ctx.run_id, stage="train", attempt=attempt, cause=cause)
    if params.backend == "eks":
        return _finish_attempt(_eks_attempt(params, ctx, attempt))
    cfg = local_train_config(params, ctx)
    held = lease.held(ctx.run_root)
    backend = LocalBackend(recorder=held)
    request = LaunchRequest(
        run_id=ctx.run_id,
        attempt=attempt,
        cfg=cfg,
        nodes=params.nodes,
        nproc_per_node=params.nproc_per_node,
        invocation=held.owner.invocation if held is not None else "unowned",
    )
    adopted = None
    if held is not None and held.adoptable is not None and held.takeover is not None:
        # The dead owner's attempt is still training, healthy: watch it, do not start another.
        plan, held.adoptable = held.adoptable, None
        request = dataclasses.replace(request, attempt=plan.attempt)
        previous = held.takeover.owner.invocation
        adopted = backend.adopt(request, list(plan.nodes), invocation=previous)
        log.info("train attempt %d: adopted from the previous owner: %s", plan.attempt, plan.reason)
    else:
        log.info(
            "train attempt %d: %d node(s) x %d worker(s), %d steps, backend %s",
            attempt,
            params.nodes,
            params.nproc_per_node,
            params.steps,
            backend.name,
        )
    report = run_attempt(
        backend,
        request,
        deadline_s=params.train_timeout_s,
        on_event=_Progress(params.steps, request.attempt, ctx.run_id),
        adopted=adopted,
    )
    return _finish_attempt(report)


def _finish_attempt(report: AttemptReport) -> dict[str, Any]:
    if report.outcome.kind != EndKind.COMPLETED:
        error = report.outcome.error()
        assert error is not None
        raise error
    get_run_logger().info("train attempt %d completed in %.1f s", report.attempt, report.wall_s)
    return dict(report.outcome.details["result"])


@task(name="train-stage", retry_condition_fn=prefect_retry_condition)
def train_stage(params: PipelineParams, ctx: RunContext) -> dict[str, Any]:
    """The train stage as a task: Prefect retries it (a new ``train`` flow run per attempt)
    only when :func:`tasks.retry_policy.stage_retry_allowed` says so."""
    from prefect.runtime import task_run

    return train_flow(params, ctx, attempt=int(task_run.run_count or 1))


# -- validate -------------------------------------------------------------------------------------
@flow(name="validate")
def validate_flow(params: PipelineParams, ctx: RunContext) -> dict[str, Any]:
    cfg = stage_train_config(params, ctx)
    # The workload, batch and seed come from each checkpoint's manifest; the config hash says
    # whether that is this run's.
    exp = Expectations(
        config_hash=cfg.fingerprint(),
        world_size=params.world_size,
        data_dir=ctx.data_dir,
        # This run's workload, never the one a manifest names: a forged manifest must not
        # choose which code validation imports.
        workload=cfg.workload_record(),
    )
    outcome = validate_latest(ctx.run_root, exp)  # raises ValidationFailed when none is valid
    log = get_run_logger()
    for r in outcome.rejected:
        log.warning(
            "checkpoint step %s FAILED validation: %s",
            r.step,
            "; ".join(c["detail"] for c in r.failed_checks()),
        )
    if outcome.fell_back:
        log.warning("falling back to checkpoint step %s", outcome.chosen.step)
    rows = [
        {"step": r.step, "check": c["name"], "status": c["status"], "detail": c["detail"]}
        for r in [*outcome.rejected, outcome.chosen]
        for c in r.checks
    ]
    create_table_artifact(
        rows, key="validation", description=f"checkpoint validation of {ctx.run_id}"
    )
    log.info(
        "checkpoint step %s validated (%s MB/s digests)",
        outcome.chosen.step,
        outcome.chosen.hash_mb_s,
    )
    return outcome.to_dict()


# -- export ---------------------------------------------------------------------------------------
@flow(name="export")
def export_flow(params: PipelineParams, ctx: RunContext, checkpoint_path: str) -> dict[str, Any]:
    from pathlib import Path

    client = boto3_client(ctx.s3)
    options = ExportOptions(
        sse=None if params.export.sse == "none" else params.export.sse,
        kms_key_id=params.export.kms_key_id,
        consolidated=params.export.consolidated,
        workload=stage_train_config(params, ctx).workload_record(),
    )
    report: ExportReport = export_checkpoint(
        client,
        Path(checkpoint_path),
        params.export.bucket,
        params.export.prefix,
        ctx.run_id,
        endpoint=ctx.s3.endpoint_url,
        options=options,
    )
    emit(
        "export.completed",
        ctx.run_id,
        uri=report.uri,
        objects=report.objects,
        bytes=report.bytes,
        verified=report.verified,
        verification=report.verification,
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
    return report.to_dict()
