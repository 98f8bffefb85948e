"""What a node loss costs, decided by a pure function over what the watcher knows at the loss
(arch §7): the in-job layer re-forms the job (``spare`` or ``elastic``), or only a new attempt
can continue (``stage-retry``). No I/O here: :mod:`tasks.train_stage` gathers the snapshot."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from trainer.elastic import NodeRange


class LossPath(enum.StrEnum):
    SPARE = "spare"  # a waiting spare takes the lost node's place: the world keeps its size
    ELASTIC = "elastic"  # the survivors re-form a smaller world, at least the range's minimum
    STAGE_RETRY = "stage-retry"  # too few nodes remain: the attempt ends, a new one starts
    # Too few remain, but the rendezvous lives on: the survivors wait in it for a node to return
    # (the job then re-forms in-job); the stage retry only if none does in time.
    NODE_WAIT = "node-wait"


@dataclass(frozen=True)
class LossSnapshot:
    lost: int  # the node just lost
    world_nodes: frozenset[int]  # the nodes training when it was lost (the last train_start)
    alive: frozenset[int]  # every node still running after it (spares waiting included)
    nodes: NodeRange
    # The node hosting the rendezvous store, if one does: losing it ends the generation, and
    # only a scheduler (here a stage retry) can start a new one. None: the store runs apart.
    store_host: int | None = None
    # How long survivors below the minimum may wait in the rendezvous for a node to return
    # (0: they may not; a fixed-size job, whose lost node nothing replaces in-job).
    wait_s: float = 0.0


@dataclass(frozen=True)
class LossDecision:
    path: LossPath
    reason: str
    # The lost node was a waiting spare: training goes on untouched, nothing to recover.
    idle_spare: bool = False


def decide(s: LossSnapshot) -> LossDecision:
    if s.store_host is not None and s.lost == s.store_host:
        return LossDecision(
            LossPath.STAGE_RETRY,
            f"node {s.lost} hosted the rendezvous store: the job cannot re-form without it",
        )
    # Not told yet which nodes train (no train_start read): every live node counts as one.
    world = s.world_nodes or s.alive | {s.lost}
    waiting = sorted(s.alive - world)
    if s.lost not in world:
        return LossDecision(
            LossPath.SPARE,
            f"node {s.lost} was a waiting spare; training is unaffected "
            f"({len(waiting)} spare(s) left)",
            idle_spare=True,
        )
    survivors = sorted(world & s.alive)
    if waiting:
        return LossDecision(
            LossPath.SPARE, f"spare node {waiting[0]} takes node {s.lost}'s place in-job"
        )
    if len(survivors) >= s.nodes.min:
        return LossDecision(
            LossPath.ELASTIC,
            f"{len(survivors)} node(s) remain, at least the minimum of {s.nodes.min}: the job "
            "re-forms on them",
        )
    if survivors and s.wait_s > 0:
        return LossDecision(
            LossPath.NODE_WAIT,
            f"{len(survivors)} node(s) remain, fewer than the minimum of {s.nodes.min}: they "
            f"wait up to {s.wait_s:g} s for a node to return, then a stage retry",
        )
    return LossDecision(
        LossPath.STAGE_RETRY,
        f"{len(survivors)} node(s) remain, fewer than the minimum of {s.nodes.min}",
    )
