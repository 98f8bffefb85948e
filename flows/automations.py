"""Apply the shipped automations (``deploy/automations.yaml``) to a Prefect server.

The file holds Prefect's own automation schema with placeholders filled at apply time:
``{notify_block}`` and ``{deployment}`` from names (ids differ per server), ``{resume_parameters}``
from the flow's own parameters (:func:`resume_parameters`) and ``{checkpoint_stall_s}``. A
placeholder may be a whole value or part of a string (``prefect.deployment.{deployment}``).
Resolution is a pure function (:func:`resolve`); only :func:`apply` talks to the server.
Applying is idempotent: an automation with the same name is replaced.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

DEFAULT_FILE = Path(__file__).resolve().parents[1] / "deploy" / "automations.yaml"
# placeholder -> the flag that provides it
PLACEHOLDERS = {
    "{notify_block}": "--notify-block",
    "{deployment}": "--deployment",
    "{resume_parameters}": "--deployment",
    "{checkpoint_stall_s}": "--checkpoint-stall-minutes",
}
AWAITING_CAPACITY = "nvrx.run.awaiting-capacity"


class AutomationConfigError(ValueError):
    pass


@dataclass
class Resolved:
    automations: list[dict[str, Any]] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # name -> why


def load(path: Path = DEFAULT_FILE) -> list[dict[str, Any]]:
    try:
        doc = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise AutomationConfigError(f"cannot read automations file {path}: {e}") from e
    items = (doc or {}).get("automations")
    if not isinstance(items, list) or not all(isinstance(a, dict) and a.get("name") for a in items):
        raise AutomationConfigError(
            f"{path}: expected `automations:` as a list of objects with a `name`"
        )
    return items


def _fill(value: Any, ids: dict[str, Any]) -> Any:
    if isinstance(value, dict):
        return {k: _fill(v, ids) for k, v in value.items()}
    if isinstance(value, list):
        return [_fill(v, ids) for v in value]
    if isinstance(value, str):
        if value in ids:  # a whole value: any type (a number, a mapping)
            return ids[value]
        for name, filled in ids.items():
            if isinstance(filled, str):
                value = value.replace(name, filled)
    return value


# What the capacity-resume never copies from the event: a resume injects no drill (the failed
# run's fired already; an event's must not add one). Anyone who may emit events can forge an
# awaiting-capacity event, so each field it does copy reaches a run the flow validates as any
# other run of the deployment: its allow-lists and own endpoints, buckets, state directory and
# secrets (tasks.deployment_policy), and a run_id the deployment itself created
# (tasks.ownership.binding). An event asks for nothing a run of the deployment could not.
NOT_RESUMED = frozenset({"drills"})


def resumed_fields() -> list[str]:
    """The flow parameters the capacity-resume copies from the event, in the form's order."""
    from flows.models import PipelineParams

    return [name for name in PipelineParams.model_fields if name not in NOT_RESUMED]


def resume_parameters() -> dict[str, Any]:
    """The run-deployment action's parameters that resume a run: each flow parameter of
    :func:`resumed_fields` taken from the ``nvrx.run.awaiting-capacity`` event's ``parameters``
    (the failed run's own, its run id included), kept as JSON (Prefect's ``json`` + ``jinja``
    templates), so a custom run resumes with its own values, not the deployment's defaults;
    each validated again by the flow (:data:`NOT_RESUMED` says how)."""

    event = f'(events | selectattr("event", "equalto", "{AWAITING_CAPACITY}") | list | last)'
    return {
        name: {
            "__prefect_kind": "json",
            "value": {
                "__prefect_kind": "jinja",
                "template": f"{{{{ {event}.payload.parameters[{name!r}] | tojson }}}}",
            },
        }
        for name in resumed_fields()
    }


def resolve(items: list[dict[str, Any]], ids: dict[str, Any]) -> Resolved:
    """Fill placeholders with ids (``{"{notify_block}": "<uuid>", ...}``); an automation that
    needs one not given is skipped, naming the flag that provides it. Each result is validated
    against Prefect's ``AutomationCore`` (a bad file fails here, naming the automation)."""
    from prefect.events.schemas.automations import AutomationCore

    out = Resolved()
    for item in items:
        text = json.dumps(item, default=str)
        flags = {flag for p, flag in PLACEHOLDERS.items() if p in text and p not in ids}
        if flags:
            out.skipped[item["name"]] = "needs " + ", ".join(sorted(flags))
            continue
        filled = _fill(item, ids)
        try:
            AutomationCore.model_validate(filled)
        except Exception as e:  # pydantic lists every action type of the union: keep it short
            raise AutomationConfigError(
                f"automation {item['name']!r} is invalid: {str(e)[:600]}"
            ) from e
        out.automations.append(filled)
    return out


def lookup_ids(client: Any, *, notify_block: str | None, deployment: str | None) -> dict[str, Any]:
    """Names to ids on this server: ``TYPE-SLUG/NAME`` of a block, ``FLOW/DEPLOYMENT``."""
    ids: dict[str, Any] = {}
    if notify_block:
        type_slug, _, name = notify_block.partition("/")
        try:
            block = client.read_block_document_by_name(name=name, block_type_slug=type_slug)
        except Exception as e:
            raise AutomationConfigError(
                f"--notify-block {notify_block}: no such block ({e}); create it in the UI "
                "(Blocks) or with `prefect block create`, and pass TYPE-SLUG/NAME"
            ) from e
        ids["{notify_block}"] = str(block.id)
    if deployment:
        try:
            dep = client.read_deployment_by_name(deployment)
        except Exception as e:
            raise AutomationConfigError(
                f"--deployment {deployment}: no such deployment ({e}); pass FLOW/DEPLOYMENT, "
                "e.g. nvrx-training-pipeline/eks-on-demand"
            ) from e
        ids["{deployment}"] = str(dep.id)
        ids["{resume_parameters}"] = resume_parameters()
    return ids


def stall_ids(minutes: float) -> dict[str, float]:
    """``--checkpoint-stall-minutes``: Prefect refuses a proactive window under 10 s."""
    if not minutes * 60 >= 10:
        raise AutomationConfigError(
            f"--checkpoint-stall-minutes {minutes}: give at least 10 s (0.17); a few times the "
            "time between checkpoints is a good start"
        )
    return {"{checkpoint_stall_s}": round(minutes * 60, 3)}


def apply(
    *,
    path: Path = DEFAULT_FILE,
    notify_block: str | None = None,
    deployment: str | None = None,
    checkpoint_stall_minutes: float = 30,
) -> tuple[dict[str, str], dict[str, str]]:
    """Create or replace the automations. Returns (name -> id applied, name -> why skipped)."""
    from prefect.client.orchestration import get_client
    from prefect.events.schemas.automations import AutomationCore

    items = load(path)
    with get_client(sync_client=True) as client:
        ids = lookup_ids(client, notify_block=notify_block, deployment=deployment)
        resolved = resolve(items, {**ids, **stall_ids(checkpoint_stall_minutes)})
        applied = {}
        for item in resolved.automations:
            for old in client.read_automations_by_name(item["name"]):
                client.delete_automation(old.id)
            applied[item["name"]] = str(
                client.create_automation(AutomationCore.model_validate(item))
            )
    return applied, resolved.skipped
