"""The backend protocol the train stage drives. The flows never see which backend runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from trainer.config import TrainConfig


@dataclass(frozen=True, kw_only=True)
class LaunchRequest:
    run_id: str
    attempt: int  # 1-based train-stage attempt
    cfg: TrainConfig
    nodes: int
    nproc_per_node: int
    # The invocation launching it (its lease, DESIGN §8): every process started carries it.
    invocation: str = "unowned"


@dataclass
class JobStatus:
    """What the watcher sees of a launched job at one instant."""

    exit_codes: dict[int, int | None]  # node -> exit code (None: still running)
    lost_nodes: set[int] = field(default_factory=set)  # nodes that vanished (killed, not exited)
    stopped_nodes: set[int] = field(default_factory=set)  # stopped by the watcher (``stop``)

    @property
    def running(self) -> list[int]:
        return [
            n
            for n, code in self.exit_codes.items()
            if code is None and n not in self.stopped_nodes and n not in self.lost_nodes
        ]


class Job(Protocol):
    def status(self) -> JobStatus: ...

    def lose_node(self, node: int) -> None:
        """Fault drill: take node ``node`` away as a real node loss would."""
        ...

    def stop(self) -> None:
        """Stop everything still running (idempotent)."""
        ...


class Backend(Protocol):
    name: str

    def launch(self, request: LaunchRequest) -> Job: ...
