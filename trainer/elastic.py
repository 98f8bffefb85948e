"""Elastic node counts: a job that keeps training on fewer nodes than it started with (arch §7).

``nodes`` is ``N`` or ``MIN:MAX`` (:class:`NodeRange`). A step must not depend on how many ranks
share it, so the global batch is split into ``MAX x ranks per node`` micro-batches on every world
and each rank accumulates its contiguous share (:func:`micro_batches`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from trainer.errors import TrainerError

_RANGE = re.compile(r"^\s*(\d+)\s*(?::\s*(\d+)\s*)?$")


class NodeRangeError(TrainerError, ValueError):
    pass


@dataclass(frozen=True)
class NodeRange:
    """How many nodes a job trains on: at least ``min``, at most ``max``."""

    min: int
    max: int

    def __post_init__(self) -> None:
        if self.min < 1:
            raise NodeRangeError(f"nodes: the minimum must be at least 1, got {self.min}")
        if self.max < self.min:
            raise NodeRangeError(
                f"nodes: {self.min}:{self.max} has its maximum below its minimum; write MIN:MAX, "
                f"e.g. {self.max}:{self.min}"
            )

    @classmethod
    def parse(cls, value: int | str | NodeRange) -> NodeRange:
        """``2`` or ``"2"`` (fixed), ``"1:2"`` (elastic); the error says the accepted forms."""
        if isinstance(value, NodeRange):
            return value
        if isinstance(value, bool):
            raise NodeRangeError(f"nodes: expected N or MIN:MAX, got {value!r}")
        if isinstance(value, int):
            return cls(value, value)
        m = _RANGE.match(value) if isinstance(value, str) else None
        if m is None:
            raise NodeRangeError(
                f"nodes: expected a node count N or an elastic range MIN:MAX (e.g. 2 or 1:2), "
                f"got {value!r}"
            )
        low = int(m.group(1))
        return cls(low, int(m.group(2)) if m.group(2) is not None else low)

    @property
    def elastic(self) -> bool:
        return self.min < self.max

    def __str__(self) -> str:
        """ft_launcher's ``--nnodes`` spelling."""
        return str(self.max) if not self.elastic else f"{self.min}:{self.max}"


def micro_batches(rank: int, world: int, count: int) -> range:
    """The micro-batches (of ``count`` per global batch) that rank ``rank`` of ``world`` trains:
    ``[r*count//world, (r+1)*count//world)``, micro-batch ``r`` alone on a full world. What stays
    bitwise equal across a change of world size: arch §7, "Exactness"."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not a rank of a world of {world}")
    if count < world:
        raise ValueError(
            f"a world of {world} ranks cannot share {count} micro-batches: at most {count} ranks "
            "(nodes MAX x ranks per node)"
        )
    return range(rank * count // world, (rank + 1) * count // world)


# A worker's node: the local backend's simulated node, or the Indexed Job's pod index on EKS.
# Only reported (which nodes trained), never trusted for ranks.
NODE_ENV = ("NVRX_NODE", "JOB_COMPLETION_INDEX")


def node_id(environ: dict[str, str] | None = None) -> int:
    """This worker's node, or -1 when no backend said."""
    import os

    env = os.environ if environ is None else environ
    for name in NODE_ENV:
        value = env.get(name, "")
        if value.isdigit():
            return int(value)
    return -1


@dataclass(frozen=True)
class PriorWorld:
    """What the previous incarnation of this launcher job trained on (``control/launch.json``,
    trainer.rundir)."""

    world_size: int
    nodes: tuple[int, ...]
    open_node_loss: bool  # a node-loss fault recorded since then and not yet recovered
