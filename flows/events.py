"""Prefect events for what operators act on, each about the run (resource
``nvrx.run.<run_id>``) and related to the flow run that saw it and its deployment, so
automations can match on any of them (and link to the flow run in the UI).

| event | when | payload |
| --- | --- | --- |
| ``nvrx.fault.detected`` | a fault was seen (drill, lost node) | kind, rank, node, step, path |
| ``nvrx.recovery.completed`` | the first step after a recovery | layer, seconds, fault, step |
| ``nvrx.world.changed`` | an elastic job re-formed on another size | from/to_world, nodes, cause |
| ``nvrx.stage.retried`` | a train-stage attempt after the first | stage, attempt, cause |
| ``nvrx.train.started`` / ``.ended`` | a train attempt began / ended | attempt, outcome |
| ``nvrx.checkpoint.committed`` | a checkpoint committed | step, blocking_s, path |
| ``nvrx.export.completed`` | the checkpoint verified in S3 | uri, objects, bytes |
| ``nvrx.run.completed`` / ``nvrx.run.failed`` | the pipeline ended | status, cause, step |
| ``nvrx.run.cancelled`` | the pipeline was stopped (SIGTERM, cancel, Ctrl-C) | stage, cause, step |
| ``nvrx.run.awaiting-capacity`` | failed for want of nodes | cause, step, parameters |

``nvrx.run.awaiting-capacity`` carries the run's whole parameters, its run id included: the
capacity-restored automation re-runs the deployment with exactly those, so the same run
resumes from its newest valid checkpoint.

Emitting never fails a run: outside a Prefect context (plain function calls, benchmarks)
``emit_event`` is a no-op, and any error is logged and dropped.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from trainer.event_types import Checkpoint, Event, Fault, Recovered, WorldChange
from trainer.history import RunHistory

RESOURCE_PREFIX = "nvrx.run."
_log = logging.getLogger(__name__)


def run_resource(run_id: str) -> dict[str, str]:
    return {
        "prefect.resource.id": f"{RESOURCE_PREFIX}{run_id}",
        "prefect.resource.name": run_id,
        "prefect.resource.role": "nvrx-run",
    }


@functools.lru_cache(maxsize=256)
def _pipeline_flow_run(flow_run_id: str) -> tuple[str, str | None]:
    """(flow run, deployment) of the pipeline run that ``flow_run_id`` belongs to: a stage's
    flow run is a subflow of the pipeline's, which is what notifications link to."""
    from prefect.runtime import deployment, flow_run

    parent = flow_run.get_parent_flow_run_id()
    if parent:
        return str(parent), flow_run.get_parent_deployment_id()
    return flow_run_id, deployment.get_id()


def _related(run_id: str) -> list[dict[str, str]]:
    from prefect.runtime import flow_run

    fid = flow_run.get_id()
    if not fid:
        return []
    # The pipeline's flow run first: an automation's template's `flow_run` is the first one.
    pipeline, dep = _pipeline_flow_run(str(fid))
    related = [
        {
            "prefect.resource.id": f"prefect.flow-run.{pipeline}",
            "prefect.resource.role": "flow-run",
            "prefect.resource.name": run_id,
        }
    ]
    if pipeline != str(fid):
        related.append(
            {"prefect.resource.id": f"prefect.flow-run.{fid}", "prefect.resource.role": "stage"}
        )
    if dep:
        related.append(
            {
                "prefect.resource.id": f"prefect.deployment.{dep}",
                "prefect.resource.role": "deployment",
            }
        )
    return related


def emit(name: str, run_id: str, **payload: Any) -> None:
    from prefect.events import emit_event

    try:
        emit_event(
            event=f"nvrx.{name}",
            resource=run_resource(run_id),
            related=_related(run_id),
            payload={k: v for k, v in payload.items() if v is not None},
        )
    except Exception as e:  # events inform; they must never fail the run
        _log.warning("could not emit nvrx.%s: %s", name, e)


def emit_for_trainer_event(run_id: str, e: Event) -> None:
    """Map one ``events.jsonl`` event (trainer or train-stage watcher) to its Prefect event."""
    match e:
        case Fault():
            emit(
                "fault.detected",
                run_id,
                kind=e.fault_kind,
                fault=e.fault,
                rank=e.rank,
                node=e.node,
                nodes=e.nodes,
                step=e.step,
                path=e.path,
            )
        case WorldChange():
            emit(
                "world.changed",
                run_id,
                from_world=e.from_world,
                to_world=e.to_world,
                nodes=e.nodes,
                cause=e.cause,
                step=e.step,
            )
        case Recovered():
            emit(
                "recovery.completed",
                run_id,
                layer=e.layer,
                seconds=e.recovery_s,
                fault=e.fault,
                fault_kind=e.fault_kind,
                step=e.step,
            )
        case Checkpoint():
            emit(
                "checkpoint.committed",
                run_id,
                step=e.step,
                blocking_s=e.blocking_s,
                path=e.path,
            )


def last_attempt_cause(run_root: Any) -> str | None:
    """Why the previous train attempt ended (its ``stage_attempt_end`` message)."""
    return RunHistory.read(run_root).last_attempt_cause()
