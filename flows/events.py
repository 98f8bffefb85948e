"""Prefect events for what operators act on (the list and payloads: docs/pipeline.md), each
about the run (resource ``nvrx.run.<run_id>``) and related to the flow run that saw it and its
deployment, so automations can match on any of them (and link to the flow run in the UI).

``nvrx.run.awaiting-capacity`` carries the run's whole parameters, its run id included: the
capacity-restored automation re-runs the deployment with exactly those, so the same run
resumes from its newest valid checkpoint.

Free text in a payload (a cause, a path: from exception messages and the run root's events,
which anyone who may write the shared filesystem can shape) is bounded and flattened to one line
here, before it goes into an event, an automation's template and a notification:
:func:`bounded_text`.

Emitting never fails a run: outside a Prefect context (plain function calls, benchmarks)
``emit_event`` is a no-op, and any error is logged and dropped.
"""

from __future__ import annotations

import functools
import logging
import re
from typing import Any

from trainer.event_types import Checkpoint, Event, Fault, Recovered, WorldChange

_log = logging.getLogger(__name__)

# A cause or a path fits in far less; a notification shows a few hundred characters of it.
TEXT_LIMIT = 1000
# What a plain-text notification would take for structure rather than text: line breaks (a
# forged "Re-run with ..." line), other C0/C1 controls (terminal escapes in a mail client), and
# the invisible and bidirectional marks that make text read other than it is.
_CONTROLS = re.compile(r"[\x00-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e\u2066-\u2069\ufeff]+")


def bounded_text(value: str, limit: int = TEXT_LIMIT) -> str:
    """``value`` as one line of at most ``limit`` characters and a note of how many were cut.

    Not escaped: the notification blocks (Apprise) take their body as plain text and escape it
    for each service (Slack's ``<!channel>`` and links, HTML mail), and Prefect's templates do
    not evaluate what they insert; escaping here too would show ``&amp;lt;`` in Slack."""
    head = _CONTROLS.sub(" ", value[:limit])
    more = len(value) - limit
    return head if more <= 0 else f"{head}… ({more} more characters)"


def _resource(rid: str, role: str, name: str | None = None) -> dict[str, str]:
    named = {} if name is None else {"prefect.resource.name": name}
    return {"prefect.resource.id": rid, "prefect.resource.role": role, **named}


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
    related = [_resource(f"prefect.flow-run.{pipeline}", "flow-run", run_id)]
    if pipeline != str(fid):
        related.append(_resource(f"prefect.flow-run.{fid}", "stage"))
    if dep:
        related.append(_resource(f"prefect.deployment.{dep}", "deployment"))
    return related


def emit(name: str, run_id: str, **payload: Any) -> None:
    from prefect.events import emit_event

    try:
        emit_event(
            event=f"nvrx.{name}",
            resource=_resource(f"nvrx.run.{run_id}", "nvrx-run", run_id),
            related=_related(run_id),
            payload={
                k: bounded_text(v) if isinstance(v, str) else v
                for k, v in payload.items()
                if v is not None
            },
        )
    except Exception as e:  # events inform; they must never fail the run
        _log.warning("could not emit nvrx.%s: %s", name, e)


# An ``events.jsonl`` event (trainer or train-stage watcher) -> its Prefect event and payload:
# each payload key, =the event's attribute where it is named otherwise.
_FROM_TRAINER: dict[type[Event], tuple[str, str]] = {
    Fault: ("fault.detected", "kind=fault_kind fault rank node nodes step path"),
    WorldChange: ("world.changed", "from_world to_world nodes cause step"),
    Recovered: ("recovery.completed", "layer seconds=recovery_s fault fault_kind step"),
    Checkpoint: ("checkpoint.committed", "step blocking_s path"),
}


def emit_for_trainer_event(run_id: str, e: Event) -> None:
    if (mapped := _FROM_TRAINER.get(type(e))) is not None:
        name, fields = mapped
        pairs = (f.partition("=") for f in fields.split())
        emit(name, run_id, **{key: getattr(e, attr or key) for key, _, attr in pairs})
