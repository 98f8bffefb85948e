"""Fault drills: the form's opt-in section, and whether a run can carry its drills out."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from tasks.backends.registry import BackendType
from trainer.faults import FaultSpec, FaultSpecError, parse_faults


class DrillParams(BaseModel):
    """Fault drills: an opt-in section of the form, apart from the production parameters."""

    model_config = ConfigDict(extra="forbid", frozen=True)  # its specs stay its faults
    faults: list[str] = Field(
        default_factory=list,
        description="faults to inject, e.g. exception@step=7,rank=1 or node-loss@step=9,node=1; "
        "kinds: exception, stall, hang, sigkill, corrupt-checkpoint, corrupt-memory, "
        "corrupt-peer, slow (node=K,factor=F), corrupt-grad (rank=R or node=K[,every]) "
        "(the trainer's); "
        "node-loss, node-return, node-freeze, node-evict (the watcher's, as the backend allows)",
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


def check_drills(
    specs: tuple[FaultSpec, ...],
    kind: BackendType,
    *,
    world: int,
    min_nodes: int,
    launched_nodes: int,
    steps: int,
    step_check: bool = True,
) -> None:
    """Each drill fits the run (its backend, nodes, world, steps and step check), and node drills
    come in an order a real cluster could produce: refused at the form, not at a worker mid-run."""
    for spec in specs:
        where = f"drills.faults: {spec}"
        if spec.is_gray and not step_check:
            raise ValueError(
                f"{where} is played inside the step check, and step_check.enabled is false: "
                "turn the check on, or drop the drill"
            )
        if spec.is_node_fault and spec.kind not in kind.drills:
            can = ", ".join(sorted(kind.drills)) or "none"
            raise ValueError(
                f"{where}: the {kind.name} backend cannot carry out {spec.kind} drills (it "
                f"can: {can}); remove it, or drill it on another backend"
            )
        if spec.needs_other_nodes and min_nodes < 2:
            raise ValueError(
                f"{where}: a {spec.kind} node is noticed against the other nodes, so the "
                f"job must train on at least 2 nodes (nodes' minimum is "
                f"{min_nodes}); raise nodes, or drill a node-loss instead"
            )
        if (spec.is_node_fault or spec.node is not None) and spec.target_node >= launched_nodes:
            raise ValueError(
                f"{where} names node {spec.node}, there are {launched_nodes} (nodes' "
                "maximum plus spares, numbered from 0)"
            )
        if spec.rank is not None and spec.rank >= world:
            raise ValueError(f"{where} names rank {spec.rank}, world size is {world}")
        if spec.step > steps:
            raise ValueError(f"{where} is after the last step ({steps})")
    _check_node_order(specs)


def _check_node_order(specs: tuple[FaultSpec, ...]) -> None:
    """A node returns only after it was lost, and is lost only while it runs."""
    down: dict[int, int] = {}  # node -> step it was lost at
    ordered = sorted(
        (s for s in specs if s.is_node_fault),
        key=lambda s: (s.step, s.returns_node),
    )
    for spec in ordered:
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
