"""``training_pipeline(**fields) -> PipelineResult``: preflight -> hydrate -> train -> validate ->
export. Its parameters are :class:`PipelineParams`'s fields, one flow parameter each
(:mod:`flows.parameters`): ``training_pipeline(**params.flow_parameters())`` from Python.

Orchestration only: the stages are flows in :mod:`flows.stages`, the work is in ``tasks``. The
train stage is retried as a whole only on ``NodeLost`` (:mod:`tasks.retry_policy`);
every other failure fails the flow with its cause."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar
from uuid import UUID

from prefect import flow
from prefect.artifacts import create_image_artifact, create_markdown_artifact
from prefect.logging import get_run_logger

from flows import parameters
from flows.context import RunContext, RunPlan
from flows.demo_data import seed_demo_dataset
from flows.events import emit
from flows.models import (
    CheckpointInfo,
    ExportInfo,
    PipelineParams,
    PipelineResult,
    TakeoverInfo,
    deployment_scope,
)
from flows.report import REPORT_FILE, png_data_uri, render_report
from flows.results import ExportResult, TrainResult, ValidationResult
from flows.stages import (
    export_flow,
    hydrate_flow,
    preflight_flow,
    train_stage,
    validate_flow,
)
from tasks import metrics as run_metrics
from tasks import retry_policy
from tasks.backends import registry
from tasks.ownership import binding, lease, takeover
from tasks.storage.local_s3 import local_s3
from trainer.event_types import Cleanup, Event, Step, Takeover
from trainer.events import EventLog
from trainer.history import RunHistory
from trainer.run_files import write_text_atomic
from trainer.rundir import Layout, read_events
from trainer.timeline import plot_timeline

T = TypeVar("T")


def run_id_of_flow_run(flow_run_id: UUID | str) -> str:
    """The run id of a flow run whose parameters name none: stable for the flow run, so a
    rescheduled flow run (its runner's pod evicted) continues the same run instead of starting
    over at step 0."""
    return f"run-{UUID(str(flow_run_id)).hex[:12]}"


def _flow_run_name() -> str:
    """The flow run is named by its run id (what `nvrx-pipeline status` and the events use)."""
    from prefect.runtime import flow_run

    return str(flow_run.parameters.get("run_id") or run_id_of_flow_run(flow_run.id))


def resolve_params(values: Mapping[str, Any], deployment_id: Any) -> PipelineParams:
    """A flow run's parameters (validated by Prefect, or JSON) over its deployment's, deep, and
    validated whole: the parameters the flow runs with (its cross-field checks run here)."""
    from pydantic import BaseModel

    deployment: Mapping[str, Any] = {}
    scope = None
    if deployment_id:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            dep = client.read_deployment(deployment_id)
            flow_name = client.read_flow(dep.flow_id).name
        deployment = dict(dep.parameters or {})
        # What the deployment reaches itself is what its runs may (tasks.deployment_policy).
        scope = deployment_scope(dep.id, f"{flow_name}/{dep.name}", deployment)
    # A group as the run gave it: only the fields it set (validated models remember them).
    given = {
        k: v.model_dump(mode="json", exclude_unset=True) if isinstance(v, BaseModel) else v
        for k, v in values.items()
    }
    return PipelineParams.model_validate(
        parameters.deep_merge(deployment, given), context={"deployment": scope}
    )


def creator() -> binding.Creator:
    """The deployment this flow run comes from (none outside one), as runs record it."""
    from prefect.runtime import deployment, flow_run

    ident = deployment.get_id()
    if not ident:
        return binding.Creator()
    return binding.Creator(str(ident), f"{flow_run.get_flow_name()}/{deployment.get_name()}")


def _clean_up_after(flow: Any, flow_run: Any, state: Any) -> None:
    """Prefect's hook on a cancelled or crashed flow run (run by the runner after it stopped
    the flow's process, or by the engine): remove everything of the run that its dead
    invocation left (local: the simulated nodes and the S3 server; EKS: every Job, Service and
    NetworkPolicy labelled with the run id). The flow's own ``finally`` does this when it can
    unwind; this is for when it could not (killed after the grace period, OOM, a crash)."""
    import logging

    log = logging.getLogger("nvrx.cleanup")
    try:
        params = resolve_params(flow_run.parameters or {}, flow_run.deployment_id)
        ctx = RunContext.create(params, run_id=params.run_id or run_id_of_flow_run(flow_run.id))
        # Only a run this flow run's deployment created: a run of another deployment, named
        # by a flow run cancelled at once, is not this hook's to clean up.
        dep = flow_run.deployment_id
        try:
            binding.check(ctx.run_root, ctx.run_id, binding.Creator(dep and str(dep), None))
        except binding.RunOfAnotherDeployment as e:
            log.warning("run %s: left alone: %s", ctx.run_id, e)
            return
        owner = lease.live_owner(ctx.run_root)
        if owner is not None:
            log.warning("run %s: left alone, a live invocation %s owns it", ctx.run_id, owner)
            return
        removed = registry.create(params.backend, params).cleanup(ctx.run_id, ctx.run_root)
        EventLog(ctx.run_root).emit(Cleanup(state=state.type.value, removed=removed))
        log.warning("run %s (%s): removed %s", ctx.run_id, state.type.value, removed or "nothing")
    except Exception as e:  # a hook must not fail the state transition it reports
        log.error("cleanup of flow run %s failed: %s: %s", flow_run.id, type(e).__name__, e)


@flow(
    name="nvrx-training-pipeline",
    flow_run_name=_flow_run_name,
    persist_result=True,
    result_serializer="json",
    on_cancellation=[_clean_up_after],
    on_crashed=[_clean_up_after],
)
@parameters.flat_parameters(PipelineParams)
def training_pipeline(**fields: Any) -> PipelineResult:
    """One training run, from preflight to a verified checkpoint in S3."""
    from prefect.runtime import deployment, flow_run

    log = get_run_logger()
    # Cross-field checks run here, on the run's parameters merged over the deployment's, and
    # so do the deployment's allow-lists and its own endpoints, buckets, secrets and drills.
    params = resolve_params(fields, deployment.get_id())
    # Every fact of the run built once (the placement, the paths, the trainer config).
    plan = RunPlan.build(params, run_id=params.run_id or run_id_of_flow_run(flow_run.id))
    ctx = plan.ctx
    log.info("run %s: run root %s", ctx.run_id, ctx.run_root)
    # A deployment's run continues only a run its deployment created: refused here, having
    # read only (tasks.ownership.binding).
    me = creator()
    existed = ctx.run_root.exists()
    binding.check(ctx.run_root, ctx.run_id, me)
    # Before anything else: one writer per run directory (arch §6). A second invocation of a
    # live run stops here with RunBusy naming the owner, having written nothing.
    with lease.hold(ctx.run_root, ctx.run_id, flow_run=str(flow_run.id or "")) as held:
        binding.bind(ctx.run_root, ctx.run_id, me, existed=existed)  # a new run is ours
        since = time.time()  # this invocation's events, the takeover's included
        if held.takeover is not None:
            _take_over(held, ctx)
        return _run(plan, held, since)


def _take_over(held: lease.RunLease, ctx: RunContext) -> None:
    """The previous owner died: adopt what it left running when healthy, end it otherwise."""
    log = get_run_logger()
    previous = held.takeover
    assert previous is not None
    plan = takeover.decide(takeover.gather(previous, ctx.run_root))
    ended = takeover.carry_out(plan, previous, ctx.run_root)
    EventLog(ctx.run_root).emit(
        Takeover(
            previous=previous.owner.describe(),
            action=plan.action.value,
            reason=plan.reason,
            attempt=plan.attempt,
            ended_pids=ended,
            steps_lost=plan.steps_lost,
        )
    )
    log.warning(
        "took over run %s from %s (gone): %s, %s%s",
        ctx.run_id,
        previous.owner.describe(),
        plan.action.value,
        plan.reason,
        f"; {plan.steps_lost} step(s) since the last commit are lost" if plan.steps_lost else "",
    )
    if plan.action == takeover.Action.ADOPT:
        held.adoptable = plan


def _run(plan: RunPlan, held: lease.RunLease, since: float) -> PipelineResult:
    run = _Run(plan, since)
    try:
        _stages(run, held)
    except lease.LeaseLost as e:
        # Another invocation owns the run now: nothing of it is this one's to report, write or
        # notify (the run is not failing; its owner changed). Said in the log, and raised.
        get_run_logger().error("stopped acting for run %s: %s", run.plan.ctx.run_id, e)
        raise
    except BaseException as e:
        _report_end_early(run, held, e)
        raise
    ctx = run.plan.ctx
    history, events = run.read_log()
    result = run.result("completed", history)
    _publish(ctx, result, events, held)
    emit(
        "run.completed",
        ctx.run_id,
        step=result.final_step,
        export_uri=result.export.uri,
        ettr=result.ettr,
        faults=len(result.faults),
    )
    return result


@dataclasses.dataclass
class _Run:
    """The run so far: its plan (hydrated once the data is), what each stage returned, how long
    and how often each ran, and the stage it is in (a failed run reports what it got to)."""

    plan: RunPlan
    since: float  # this invocation's events start here
    t0: float = dataclasses.field(default_factory=time.monotonic)
    current: str | None = None
    durations: dict[str, float] = dataclasses.field(default_factory=dict)
    attempts: dict[str, int] = dataclasses.field(default_factory=dict)
    train: TrainResult | None = None
    validation: ValidationResult | None = None
    export: ExportResult | None = None

    def stage(self, name: str, fn: Callable[[], T]) -> T:
        self.current = name
        started = time.monotonic()
        try:
            return fn()
        finally:
            self.durations[name] = self.durations.get(name, 0.0) + time.monotonic() - started
            # Prefect retries the train stage as a whole: its attempts are in the event log.
            self.attempts[name] = (
                RunHistory.read(self.plan.ctx.run_root, since=self.since).stage_attempts()
                if name == "train"
                else 1
            )

    def read_log(self) -> tuple[RunHistory, list[Event]]:
        """This invocation's events (a resumed run id has earlier invocations' too), read once
        at its end: their fold for the result, and the events for the timeline plot (which
        draws every step, so they are held whole here anyway)."""
        events = [e for e in read_events(self.plan.ctx.run_root) if e.t >= self.since]
        return RunHistory.of(events), events

    def result(self, status: str, history: RunHistory, error: str | None = None) -> PipelineResult:
        """What the run got to; ``history``: the fold of this invocation's events."""
        train, validation, export, took = self.train, self.validation, self.export, history.takeover
        return PipelineResult(
            status=status,  # type: ignore[arg-type]
            run_id=self.plan.ctx.run_id,
            target_steps=self.plan.params.steps,
            final_step=train.final_step if train else history.progress(),
            final_loss=train.final_loss if train else None,
            params_sha256=train.params_sha256 if train else None,
            checkpoint=CheckpointInfo()
            if validation is None
            else CheckpointInfo(
                step=validation.step,
                uri=validation.path,
                validated=validation.validated,
                fell_back_from=[r.step for r in validation.fell_back_from if r.step is not None],
            ),
            export=ExportInfo()
            if export is None
            else ExportInfo.model_validate(export, from_attributes=True),
            faults=history.fault_records(),
            world_changes=history.world_change_records(),
            stragglers=history.straggler_records(),
            timeouts=dict(history.timeouts.detail) if history.timeouts is not None else {},
            memory_interval=history.memory_interval.detail if history.memory_interval else None,
            stage_attempts=self.attempts,
            stage_durations_s={k: round(v, 3) for k, v in self.durations.items()},
            ettr=history.ettr(),
            train_time=history.time_breakdown(),
            wall_s=round(time.monotonic() - self.t0, 3),
            error=error,
            takeover=None
            if took is None
            else TakeoverInfo(
                previous_owner=took.previous,
                action=took.action,
                reason=took.reason,
                steps_lost=took.steps_lost,
            ),
        )


def _stages(run: _Run, held: lease.RunLease) -> None:
    """Preflight, hydrate, train, validate, export: each stage's result kept in ``run``."""
    plan = run.plan
    params, ctx = plan.params, plan.ctx
    log = get_run_logger()
    # The embedded default starts its own S3 server; a cluster uses the one it is given.
    with local_s3(
        ctx.s3 if params.backend_type.embedded_s3 else None,
        ctx.state_dir,
        user=held.owner.invocation,
    ) as server:
        if server is not None:
            plan = run.plan = plan.with_s3(server.settings(ctx.s3))
            ctx = plan.ctx
            held.record({"kind": "s3", "endpoint": server.endpoint, "pid": server.pid})
            log.info(
                "%s local S3 server at %s (data in %s)",
                "started the" if server.started_here else "using this state directory's",
                ctx.s3.endpoint_url,
                server.data_dir,
            )
        if params.seed_demo_dataset and ctx.s3.is_local:
            seed_demo_dataset(params, ctx)
        run.stage("preflight", lambda: preflight_flow(plan))
        hydrated = run.stage("hydrate", lambda: hydrate_flow(plan))
        plan = run.plan = plan.hydrated(hydrated.manifest_sha256)
        retries = params.max_train_attempts - 1
        with _metrics(plan):
            run.train = run.stage("train", lambda: train_stage.with_options(retries=retries)(plan))
        validation = run.validation = run.stage("validate", lambda: validate_flow(plan))
        run.export = run.stage("export", lambda: export_flow(plan, validation.path))


def _report_end_early(run: _Run, held: lease.RunLease, e: BaseException) -> None:
    """A run that failed or was cancelled: its event, and its result and report as far as it
    got (the caller re-raises)."""
    ctx = run.plan.ctx
    cancelled = _is_cancellation(e)
    history, events = run.read_log()
    step = history.progress()
    cause = f"{type(e).__name__}: {e}"
    emit(
        "run.cancelled" if cancelled else "run.failed",
        ctx.run_id,
        stage=run.current,
        cause=cause,
        step=step,
    )
    if not cancelled and retry_policy.awaits_capacity(e):
        # Everything the capacity-restored automation needs to resume this very run.
        emit(
            "run.awaiting-capacity",
            ctx.run_id,
            cause=cause,
            step=step,
            parameters={**run.plan.params.flow_parameters(), "run_id": ctx.run_id},
        )
    result = run.result("cancelled" if cancelled else "failed", history, error=cause)
    _publish(ctx, result, events, held)


def _metrics(plan: RunPlan) -> contextlib.AbstractContextManager[Any]:
    """The run's Prometheus endpoint for the train stage, all its attempts (tasks.metrics)."""
    params, ctx, where = plan.params, plan.ctx, plan.placement
    if params.metrics_port is not None:
        rank0 = params.metrics_port + where.rank0_metrics_offset
        get_run_logger().info(
            "metrics: http://%s:%d/metrics (rank 0: port %d)",
            where.metrics_addr,
            params.metrics_port,
            rank0,
        )
    return run_metrics.serving(
        ctx.run_root, ctx.run_id, port=params.metrics_port, addr=where.metrics_addr
    )


def _is_cancellation(e: BaseException) -> bool:
    """A stop asked for (Prefect cancelling the flow run's process, SIGTERM, Ctrl-C), not a
    failure: it is reported as ``nvrx.run.cancelled``, which failure automations do not match."""
    import asyncio

    from prefect.exceptions import TerminationSignal

    return isinstance(e, KeyboardInterrupt | TerminationSignal | asyncio.CancelledError)


def _publish(
    ctx: RunContext, result: PipelineResult, events: list[Event], held: lease.RunLease
) -> None:
    held.check("write pipeline_result.json")
    ctx.run_root.mkdir(parents=True, exist_ok=True)
    write_text_atomic(
        ctx.run_root / Layout.PIPELINE_RESULT, result.model_dump_json(indent=1) + "\n"
    )
    report = render_report(result)
    try:
        # The report stays with the run (the artifact lives only as long as the Prefect server
        # that holds it: `run`'s temporary one ends with the run).
        write_text_atomic(ctx.run_root / REPORT_FILE, report)
    except OSError as e:
        get_run_logger().warning("could not save the run report: %s", e)
    try:
        create_markdown_artifact(
            report,
            key="run-report",
            description=f"run {result.run_id}: {result.status}",
        )
    except Exception as e:  # a report must never mask the run's own outcome
        get_run_logger().warning("could not publish the run report: %s", e)
    try:
        if any(isinstance(e, Step) for e in events):
            png = plot_timeline(
                events,
                ctx.run_root / "timeline.png",
                title=f"run {result.run_id}: step vs wall time ({result.status})",
            )
            create_image_artifact(
                png_data_uri(png),
                key="recovery-timeline",
                description=f"run {result.run_id}: steps, faults, restarts and checkpoints ({png})",
            )
    except Exception as e:
        get_run_logger().warning("could not publish the recovery timeline: %s", e)
