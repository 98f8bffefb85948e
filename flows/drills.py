"""Fault drills: the form's opt-in section, and whether a run can carry its drills out."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from trainer.faults import FaultSpec, FaultSpecError, parse_faults

if TYPE_CHECKING:
    from flows.models import PipelineParams


class DrillParams(BaseModel):
    """Fault drills: an opt-in section of the form, apart from the production parameters."""

    model_config = ConfigDict(extra="forbid", frozen=True)  # its specs stay its faults
    faults: list[str] = Field(
        default_factory=list,
        description="faults to inject, e.g. exception@step=7,rank=1 or node-loss@step=9,node=1; "
        "kinds: exception, stall, hang, sigkill, corrupt-checkpoint, corrupt-memory, "
        "corrupt-peer (the trainer's); "
        "node-loss, node-return, node-freeze (the watcher's, as the backend allows)",
    )

    # The drills parsed, once, here at the edge; everything inward gets these FaultSpecs.
    _specs: tuple[FaultSpec, ...] = PrivateAttr(default=())

    @model_validator(mode="after")
    def _parse(self) -> DrillParams:
        try:
            self._specs = parse_faults(self.faults)
        except FaultSpecError as e:
            raise ValueError(f"drills.faults: {e}") from None
        return self

    @property
    def specs(self) -> tuple[FaultSpec, ...]:
        return self._specs


def check_drills(params: PipelineParams) -> None:
    """Each drill fits the run (its backend, nodes, world and steps), and node drills come in an
    order a real cluster could produce: refused at the form, not at a worker mid-run."""
    kind = params.backend_type
    world = params.world_size
    for spec in params.drills.specs:
        where = f"drills.faults: {spec}"
        if spec.is_node_fault and spec.kind not in kind.drills:
            can = ", ".join(sorted(kind.drills)) or "none"
            raise ValueError(
                f"{where}: the {kind.name} backend cannot carry out {spec.kind} drills (it "
                f"can: {can}); remove it, or drill it on another backend"
            )
        if spec.needs_other_nodes and params.node_range.min < 2:
            raise ValueError(
                f"{where}: a frozen node is noticed against the other nodes' beats, so the "
                f"job must train on at least 2 nodes (nodes' minimum is "
                f"{params.node_range.min}); raise nodes, or drill a node-loss instead"
            )
        if spec.is_node_fault and spec.target_node >= params.launched_nodes:
            raise ValueError(
                f"{where} names node {spec.node}, there are {params.launched_nodes} (nodes' "
                "maximum plus spares, numbered from 0)"
            )
        if spec.rank is not None and spec.rank >= world:
            raise ValueError(f"{where} names rank {spec.rank}, world size is {world}")
        if spec.step > params.steps:
            raise ValueError(f"{where} is after the last step ({params.steps})")
    _check_node_order(params)


def _check_node_order(params: PipelineParams) -> None:
    """A node returns only after it was lost, and is lost only while it runs."""
    down: dict[int, int] = {}  # node -> step it was lost at
    specs = sorted(
        (s for s in params.drills.specs if s.is_node_fault),
        key=lambda s: (s.step, s.returns_node),
    )
    for spec in specs:
        node = spec.target_node
        where = f"drills.faults: {spec}"
        if spec.takes_node_away:  # a loss, or a freeze (noticed as a loss)
            if node in down:
                raise ValueError(
                    f"{where}: node {node} is already lost (at step {down[node]}); add a "
                    f"node-return@step=N,node={node} between the two"
                )
            down[node] = spec.step
        elif node not in down:
            raise ValueError(
                f"{where}: node {node} was not lost before step {spec.step}; a node returns "
                f"only after a node-loss@step=M,node={node} with M < {spec.step}"
            )
        elif down[node] >= spec.step:
            raise ValueError(f"{where}: must come after node {node}'s loss at step {down[node]}")
        else:
            del down[node]
