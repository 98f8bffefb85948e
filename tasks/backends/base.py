"""The backend protocol (arch §4): what the flows call, never knowing which backend runs.

A backend checks that it can run (``preflight``), puts the dataset where its workers read it
(``hydrate``), starts an attempt (``launch``) or finds one still running that a dead or replaced
flow runner started (``reattach``), and removes everything of a run (``cleanup``). A launched
attempt is a :class:`Job`; :func:`tasks.train_stage.run_attempt` watches every backend's jobs the
same way (events, drills, deadline, result) and asks the job for its outcome at the end.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from tasks.backends.eks.params import EksParams
from tasks.checks import CheckResult
from tasks.classify import Observation, Outcome
from tasks.storage.s3 import S3Settings
from tasks.weights_pin import UNPINNED, WeightsPin
from trainer.config import Device, InJobConfig, InProcessConfig, TrainConfig
from trainer.elastic import NodeRange
from trainer.event_types import Event


class RunParams(Protocol):
    """What a backend reads of a run's parameters (:class:`flows.models.PipelineParams`)."""

    @property
    def launched_nodes(self) -> int: ...
    @property
    def nproc_per_node(self) -> int: ...
    @property
    def eks(self) -> EksParams: ...
    @property
    def state_dir(self) -> str: ...
    @property
    def metrics_port(self) -> int | None: ...


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Where and how the workers of a backend run: what the trainer config is built with."""

    shared_root: Path  # the shared filesystem as this process sees it (and the workers)
    device: Device = Device.AUTO
    local_paths: bool = True  # the workers see this process's paths (a script made absolute)
    inprocess: InProcessConfig | None = None  # None: the trainer's defaults
    injob: InJobConfig | None = None
    s3_region: str | None = None  # an explicit region (eks.region); None: the standard chain
    # Metrics endpoints (PipelineParams.metrics_port): the address the flow's and rank 0's listen
    # on, and rank 0's port relative to the flow's (+1 where both share a host).
    metrics_addr: str = "127.0.0.1"
    rank0_metrics_offset: int = 1
    # Each node a scrape target of its own (a pod): every node's first worker serves too.
    metrics_every_node: bool = False


@dataclass(frozen=True, kw_only=True)
class LaunchRequest:
    run_id: str
    attempt: int  # 1-based train-stage attempt
    cfg: TrainConfig
    nodes: int  # the most nodes the job trains on
    nproc_per_node: int
    # An elastic job (trainer.elastic) trains on as few as min_nodes (None: exactly ``nodes``);
    # ``spares`` more nodes wait in the rendezvous to replace lost ones.
    min_nodes: int | None = None
    spares: int = 0
    # The invocation launching it (its lease, arch §6): every process started carries it, and
    # the rendezvous id includes it (a later invocation's attempt 1 is not an in-job respawn).
    invocation: str = "unowned"
    deadline_s: float | None = None  # the attempt's deadline (the backend may enforce it too)
    # The epoch the watcher published for this attempt (trainer.fence), handed to every worker
    # as NVRX_EPOCH: a writer of any other epoch changes nothing in the run root.
    epoch: int | None = None
    # The run's declared secrets (environment name -> secret name; tasks.secrets): names
    # only, resolved where the workers start, never written down.
    secrets: Mapping[str, str] = field(default_factory=dict)

    @property
    def node_range(self) -> NodeRange:
        return NodeRange(self.nodes if self.min_nodes is None else self.min_nodes, self.nodes)

    @property
    def launched(self) -> int:
        """Nodes started: the most the job trains on, and the spares."""
        return self.nodes + self.spares


@dataclass(frozen=True, kw_only=True)
class HydrateRequest:
    run_id: str
    bucket: str
    prefix: str
    data_dir: Path
    s3: S3Settings
    weights: tuple[str, Path] | None = None  # (s3://... initial weights, where they go)
    weights_pin: WeightsPin = UNPINNED  # their digest (if pinned) and size cap


@dataclass(frozen=True)
class Hydrated:
    source: str
    dest: str
    detail: str  # one line for the log: what was copied, skipped and checked
    files: int
    seconds: float
    # The digest of the manifest every file was checked against (the workers check sizes only).
    manifest_sha256: str | None
    report: dict[str, Any]  # the backend's own report, whole (its own fields besides these)

    @classmethod
    def of(cls, r: Any, detail: str) -> Hydrated:
        """From a backend's report: a dataclass with these fields (and its own)."""
        return cls(r.source, r.dest, detail, r.files, r.seconds, r.manifest_sha256, asdict(r))


class Job(Protocol):
    """One launched attempt."""

    @property
    def name(self) -> str: ...  # how events and messages name it
    @property
    def attempt(self) -> int: ...  # the train-stage attempt it runs (a reattached one's own)

    poll_s: float  # how often the watcher polls it
    # After a node-loss drill, how long the survivors run on before the watcher stops them (they
    # would only wait in rendezvous for the lost node): what the backend needs to see the loss
    # as a real one looks (EKS: the deleted pod's conditions), nothing more.
    loss_grace_s: float
    # The node whose loss takes the rendezvous store with it (None: the store runs apart, so
    # any node may be lost): tasks.loss_policy sends such a loss to a stage retry.
    store_host: int | None

    def running(self) -> bool:
        """Poll once: is anything of the attempt still running normally?"""

    def observe(self, event: Event) -> None:
        """Every event of the attempt, as the watcher reads it (a backend may act on one: the
        local backend starts its hot spares once the world formed)."""

    def alive_nodes(self) -> frozenset[int]:
        """The nodes still running (or about to start), spares included."""

    def losses(self) -> frozenset[int]:
        """Nodes the backend saw lost since the watcher last asked (each reported once; a
        drill's loss is the watcher's own). The watcher decides each (tasks.loss_policy)."""

    def lose_node(self, node: int) -> None:
        """End every process of node ``node`` now, as a real node loss would: a node-loss
        drill, or a node the watcher found silent (frozen, partitioned)."""

    def stop(self) -> None:
        """End everything of the attempt still running, now (idempotent; safe while
        unwinding)."""

    def observation(self) -> Observation:
        """What the backend saw of the attempt's end (every node's end, a loss, a reason of
        its own), for the one judge, :func:`tasks.classify.judge`."""

    def finish(self, outcome: Outcome) -> dict[str, Any]:
        """After a normal end: release what the attempt holds (a backend may keep a failed
        attempt's objects for forensics). Returns what the end event should record."""


# What a job can do besides: capabilities the watcher asks for with isinstance, and the form
# checks through BackendType.drills before any job exists.
@runtime_checkable
class ElasticJob(Protocol):
    def absorb(self, node: int) -> None:
        """The in-job layer carries on without node ``node`` (an elastic shrink or a spare's
        takeover): its loss must not end the attempt. Called before a drill takes it away."""


@runtime_checkable
class ReturnDrills(Protocol):
    def restore_node(self, node: int) -> None:
        """Fault drill: bring lost node ``node`` back, as a replacement node joining would."""


@runtime_checkable
class EvictDrills(Protocol):
    def evict_node(self, node: int, grace_s: float) -> None:
        """Fault drill: tell node ``node`` to go with notice (SIGTERM to its launcher, SIGKILL
        ``grace_s`` later), as a drain or a spot reclaim does; returns at once."""


@runtime_checkable
class Cordons(Protocol):
    def cordon_node(self, node: int) -> str | None:
        """Mark the machine under node ``node`` unschedulable (a node confirmed slow), so that
        its replacement lands elsewhere; returns its name (None: none known). The local
        backend has nothing to cordon: a spare or the elastic world replaces the node."""


class Backend(Protocol):
    name: str
    placement: Placement

    def preflight(self, req: Any, s3: dict[str, Any]) -> list[CheckResult]:
        """``req``: :class:`tasks.preflight.checks.Requirements`; ``s3``: the S3 inputs of
        :func:`tasks.preflight.local.gather_s3`."""

    def hydrate(
        self, request: HydrateRequest, progress: Callable[[int, int, str], None]
    ) -> Hydrated: ...

    def reattach(self, request: LaunchRequest) -> Job | None:
        """An attempt of this run still running and healthy, started by an invocation that is
        gone: watched from here on instead of launching another. None: launch."""

    def launch(self, request: LaunchRequest) -> Job: ...

    def cleanup(self, run_id: str, run_root: Path) -> list[str]:
        """Remove everything of run ``run_id`` that a dead (or this) invocation left running;
        what was removed. Never touches a live other owner's run."""
