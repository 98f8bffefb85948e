"""The pipeline's flow parameters: one top-level flow parameter per :class:`PipelineParams` field.

Prefect merges a run's parameters *shallowly* over its deployment's: with one parameter per
field, a run that sets only ``steps`` keeps the deployment's ``backend`` (one ``params`` object
fell back to the model defaults), and ``--param steps=50`` works as Prefect users expect. A group
(``eks``, ``dataset``, ``export``, ``drills``) is one parameter, which Prefect replaces whole:
:func:`flows.pipeline.resolve_params` merges the fields a run set over the deployment's group.

The flow's signature and its docstring's ``Args:`` are generated from the model
(:func:`flat_parameters`), so the UI form keeps every field's limits and description with no
second list of fields to drift from the first.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel

F = TypeVar("F", bound=Callable[..., Any])


def _signature(model: type[BaseModel]) -> inspect.Signature:
    params = []
    for name, field in model.model_fields.items():
        # The constraints (ge, le, min_length, ...) ride in the annotation, so Prefect's schema
        # (the UI form) and its parameter validation both enforce them.
        annotation: Any = (
            Annotated[(field.annotation, *field.metadata)] if field.metadata else field.annotation
        )
        params.append(
            inspect.Parameter(
                name,
                inspect.Parameter.KEYWORD_ONLY,
                default=field.get_default(call_default_factory=True),
                annotation=annotation,
            )
        )
    return inspect.Signature(params)


def _args_section(model: type[BaseModel]) -> str:
    """Google-style ``Args:``: where Prefect reads a parameter's description for the form."""
    lines = ["Args:"]
    for name, field in model.model_fields.items():
        about = " ".join((field.description or name).split())
        lines.append(f"    {name}: {about}")
    return "\n".join(lines)


def flat_parameters(model: type[BaseModel]) -> Callable[[F], F]:
    """Give ``fn(**fields)`` the model's fields as keyword parameters (signature and docs)."""

    def wrap(fn: F) -> F:
        fn.__signature__ = _signature(model)  # type: ignore[attr-defined]
        fn.__doc__ = f"{inspect.cleandoc(fn.__doc__ or '')}\n\n{_args_section(model)}\n"
        return fn

    return wrap


def deep_merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """``over`` on ``base``; where both hold a mapping, merged key by key."""
    out = dict(base)
    for key, value in over.items():
        below = out.get(key)
        if isinstance(value, Mapping) and isinstance(below, Mapping):
            out[key] = deep_merge(below, value)
        else:
            out[key] = value
    return out
