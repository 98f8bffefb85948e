"""Every run parameter, as a user finds it: its dotted name (what ``--set`` takes), its default
and its description, read from :class:`flows.models.PipelineParams` itself, so the list cannot
drift from the form; and the nearest real name for a mistyped one (issue 27)."""

from __future__ import annotations

import difflib
import json
import typing
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined


@dataclass(frozen=True)
class ParamDoc:
    name: str  # dotted, as --set and a params file's nesting spell it
    type: str
    default: Any  # JSON-able; None: none
    description: str


def _type_name(annotation: Any) -> str:
    text = str(annotation) if not isinstance(annotation, type) else annotation.__name__
    return text.replace("typing.", "").replace("NoneType", "None")


def _jsonable(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    try:
        json.dumps(value)
    except TypeError:
        return str(value)
    return value


def params_docs(model: type[BaseModel] | None = None, prefix: str = "") -> list[ParamDoc]:
    """Every leaf field of ``model`` (default: PipelineParams), nested models flattened."""
    if model is None:
        from flows.models import PipelineParams

        model = PipelineParams
    hints = typing.get_type_hints(model)
    out: list[ParamDoc] = []
    for name, field in model.model_fields.items():
        dotted, annotation = f"{prefix}{name}", hints.get(name, field.annotation)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):  # a group
            out.extend(params_docs(annotation, f"{dotted}."))
            continue
        default = field.get_default(call_default_factory=True)
        out.append(
            ParamDoc(
                name=dotted,
                type=_type_name(annotation),
                default=None if default is PydanticUndefined else _jsonable(default),
                description=" ".join((field.description or "").split()),
            )
        )
    return out


def did_you_mean(name: str, docs: list[ParamDoc] | None = None) -> str | None:
    """The real parameter nearest to a mistyped dotted ``name`` (``stpes``, ``dataset.prefx``,
    a leaf given without its group such as ``bucket``), or None when none is close."""
    names = [d.name for d in (docs if docs is not None else params_docs())]
    groups = sorted({n.split(".", 1)[0] for n in names if "." in n})
    close = difflib.get_close_matches(name, names + groups, n=1, cutoff=0.75)
    if close:
        return close[0]
    leaf = name.rsplit(".", 1)[-1]
    leaves = [n for n in names if n.rsplit(".", 1)[-1] == leaf]
    if leaves and "." not in name:
        return " or ".join(leaves)
    return None


def format_table(docs: list[ParamDoc]) -> str:
    """Plain text, one parameter a paragraph: name, type and default, then the description."""
    lines = []
    for d in docs:
        default = json.dumps(d.default) if d.default is not None else "none"
        lines.append(f"{d.name}  ({d.type}, default {default})")
        if d.description:
            lines.append(f"    {d.description}")
    return "\n".join(lines)
