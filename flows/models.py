"""Pipeline parameters and result (arch §5). The parameter models are the Prefect UI form:
every field has limits and a description, and bad values are rejected naming the field."""

from __future__ import annotations

import os
import re
import secrets
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from flows.drills import DrillParams, check_drills
from flows.injob_params import InJobParams
from flows.locations import DatasetLocation, ExportLocation
from flows.step_check_params import StepCheckParams
from flows.straggler_params import StragglerParams
from flows.weights_params import InitialWeightsParams, check_initial_weights
from tasks.backends.eks.params import EksParams
from tasks.backends.registry import BackendType, backend_type
from tasks.deployment_policy import Deployment, Reach, check_pinned, check_reach, check_run
from tasks.secrets import check_declared
from trainer.records import FaultRecord, StragglerRecord, TimeBreakdown, WorldChangeRecord

if TYPE_CHECKING:
    from trainer.elastic import NodeRange
    from trainer.workload import Workload

MAX_NODES = 64

# Matched with fullmatch: `re.match(r"^...$")` would accept a trailing newline ("abc\n").
RUN_ID = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")
_S3_ENDPOINT = re.compile(r"https?://[^/@\s]+(:\d+)?/?")


def normal_endpoint(v: str | None) -> str | None:
    """An endpoint as the form keeps it: no trailing slash; empty: AWS S3's own (None)."""
    return None if v in (None, "") else v.rstrip("/")


def new_run_id() -> str:
    return time.strftime("run-%Y%m%d-%H%M%S-", time.gmtime()) + secrets.token_hex(2)


LOCAL_S3_ENDPOINT = "http://127.0.0.1:8333"


class PipelineParams(BaseModel):
    """One training run, from preflight to a verified checkpoint in S3."""

    model_config = ConfigDict(extra="forbid")

    run_id: str | None = Field(
        None,
        description="Names the run; an existing id resumes it from its newest valid checkpoint. "
        "Lowercase letters, digits, dashes. Empty: named by the flow run (run- and its id), "
        "so the same flow run executed again continues it.",
    )
    backend: Literal["local", "eks"] = Field(
        "local",
        description="local: simulated nodes on this machine (the embedded default); eks: an "
        "Indexed Job on Amazon EKS",
    )
    workload: str = Field(
        "gpt-tiny",
        min_length=1,
        description="what to train: gpt-tiny, gpt-100m, gpt-8b, llama-tiny, llama-1b, "
        "llama3-8b, or package.module:attr naming a trainer.workload.WorkloadSpec importable "
        "on the workers",
    )
    script_args: list[str] = Field(
        default_factory=list,
        description="script mode (workload script:PATH): the script's own arguments; "
        "{run_root}, {data_dir}, {steps}, {global_batch}, {seed} are filled in",
    )
    workload_options: dict[str, Any] = Field(
        default_factory=dict,
        description='the workload\'s own options (e.g. {"mixed_precision": "bf16"} for '
        "Llama), validated by the workload",
    )
    initial_weights: InitialWeightsParams = Field(
        default_factory=InitialWeightsParams,
        description="s3:// workload_options.init_weights: the digest they must have, a size cap",
    )
    secrets: dict[str, str] = Field(
        default_factory=dict,
        description='secrets the workers get as environment variables, by name: {"HF_TOKEN": '
        '"hf-token"} reads the Prefect Secret block hf-token locally, the Kubernetes Secret '
        "hf-token (key value) on EKS; values never reach a config, manifest, event or export",
    )
    steps: int = Field(20, ge=1, le=10_000_000, description="total optimizer steps")
    global_batch: int = Field(8, ge=1, le=1_000_000, description="sequences per step, all ranks")
    grad_accumulation: int = Field(
        1,
        ge=1,
        le=4096,
        description="micro-batches each rank accumulates per step (a rank holds the "
        "activations of one: a larger global batch in the same memory, a longer step)",
    )
    ckpt_interval: int = Field(5, ge=1, le=1_000_000, description="checkpoint every N steps")
    memory_interval: Annotated[int, Field(ge=0, le=1_000_000)] | Literal["auto"] = Field(
        "auto",
        description="a memory save every N steps: each rank's state copied to its node's "
        "memory, what a respawn resumes from; auto: each incarnation measures a save's cost "
        "and takes the smallest interval within 2 % of a step (0: no memory tiers, every "
        "resume reads the durable checkpoint)",
    )
    keep_last: int = Field(
        3,
        ge=2,
        le=100,
        description="committed checkpoints to keep: at least 2, so a corruption right after a "
        "commit still leaves one valid checkpoint",
    )
    nodes: int | str = Field(
        2,
        description="nodes to train on: N, or MIN:MAX for an elastic job that keeps training "
        "on as few as MIN when nodes are lost and grows back to MAX when they return (simulated "
        "nodes on the local backend)",
    )
    spares: int = Field(
        0,
        ge=0,
        le=16,
        description="hot spare nodes launched beyond the nodes' maximum: they wait in the "
        "rendezvous and take a lost node's place in-job",
    )
    nproc_per_node: int = Field(1, ge=1, le=8, description="worker processes per node")
    inprocess_restart: bool = Field(True, description="NVRx in-process restart layer")
    injob_restart: bool = Field(True, description="ft_launcher in-job restart layer")
    injob: InJobParams = Field(
        default_factory=InJobParams,
        description="the in-job layer's timeouts: each auto (measured) unless pinned",
    )
    straggler: StragglerParams = Field(
        default_factory=StragglerParams,
        description="slow nodes: scored against the job's median, and reported or replaced",
    )
    step_check: StepCheckParams = Field(
        default_factory=StepCheckParams,
        description="the check before each update: a step whose loss or gradient norm is "
        "non-finite or a spike is not applied and is computed again in place",
    )
    deterministic: bool = Field(
        False,
        description="CUDA: deterministic kernels, so that a recovered run is bitwise equal to "
        "a fault-free one (without them two fault-free GPU runs already differ); slower. The "
        "CPU path is deterministic either way",
    )
    max_train_attempts: int = Field(
        3, ge=1, le=10, description="train-stage attempts (retried only after node loss)"
    )
    train_timeout_s: float = Field(
        1800, ge=30, le=30 * 86400, description="deadline of one train-stage attempt"
    )
    eks: EksParams = Field(default_factory=EksParams)
    dataset: DatasetLocation = Field(default_factory=DatasetLocation)
    export: ExportLocation = Field(default_factory=ExportLocation)
    s3_endpoint: str | None = Field(
        LOCAL_S3_ENDPOINT,
        description="S3 endpoint URL; a local one is started on demand. Empty: AWS S3 "
        "(the default with backend=eks)",
    )
    seed_demo_dataset: bool = Field(
        True,
        description="local S3 only: write the demo's synthetic dataset into the default "
        "dataset location when it is empty (any other empty prefix fails the run)",
    )
    state_dir: str = Field(
        ".state", min_length=1, description="local state: the 'FSx' directory, S3 data, runs"
    )
    metrics_port: int | None = Field(
        9464,
        ge=1024,
        le=65534,
        description="Prometheus endpoint of the flow while training runs (rank 0's: the next "
        "port locally, this port in its pod on EKS). Empty: no metrics",
    )
    drills: DrillParams = Field(
        default_factory=DrillParams,
        description="opt-in fault drills, for testing recovery: leave empty in production",
    )

    @model_validator(mode="before")
    @classmethod
    def _moved(cls, data: Any) -> Any:
        if isinstance(data, dict) and "faults" in data:
            raise ValueError(
                "faults: fault drills moved to drills.faults (--set drills.faults=[...] or "
                "--inject SPEC on the command line)"
            )
        return data

    @field_validator("run_id")
    @classmethod
    def _run_id(cls, v: str | None) -> str | None:
        if v in (None, ""):
            return None
        if not RUN_ID.fullmatch(v):
            raise ValueError("use 1-63 lowercase letters, digits and dashes, starting alphanumeric")
        return v

    @field_validator("nodes", mode="before")
    @classmethod
    def _nodes(cls, v: Any) -> int | str:
        from trainer.elastic import NodeRange, NodeRangeError

        try:
            r = NodeRange.parse(v)
        except NodeRangeError as e:
            raise ValueError(str(e).removeprefix("nodes: ")) from None
        if r.max > MAX_NODES:
            raise ValueError(f"at most {MAX_NODES} nodes, got {r.max}")
        return r.max if not r.elastic else str(r)

    @property
    def node_range(self) -> NodeRange:
        """``nodes`` parsed: the fewest and the most nodes the job trains on."""
        from trainer.elastic import NodeRange

        return NodeRange.parse(self.nodes)

    @property
    def max_nodes(self) -> int:
        return self.node_range.max

    @property
    def launched_nodes(self) -> int:
        """Nodes started for an attempt: the maximum plus the hot spares."""
        return self.node_range.max + self.spares

    @field_validator("s3_endpoint")
    @classmethod
    def _endpoint(cls, v: str | None) -> str | None:
        if v in (None, ""):
            return None
        if not _S3_ENDPOINT.fullmatch(v):
            raise ValueError("expected http(s)://host[:port] with no path or credentials")
        return normal_endpoint(v)

    def flow_parameters(self) -> dict[str, Any]:
        """These parameters as the flow's keyword arguments (JSON values, every field)."""
        return self.model_dump(mode="json")

    def s3_init_weights(self) -> str | None:
        """``workload_options.init_weights`` when it names an S3 prefix (hydrated like the data)."""
        value = self.workload_options.get("init_weights")
        return value if isinstance(value, str) and value.startswith("s3://") else None

    def reach(self) -> Reach:
        """What this run reaches beyond its own run (checked against its deployment's)."""
        from tasks.storage.s3 import parse_s3_uri

        weights = self.s3_init_weights()
        return Reach(
            s3_endpoint=self.s3_endpoint,
            dataset_bucket=self.dataset.bucket,
            export_bucket=self.export.bucket,
            state_dir=os.path.normpath(self.state_dir),
            init_weights_bucket=None if weights is None else parse_s3_uri(weights)[0],
            secrets=tuple(sorted(set(self.secrets.values()))),
            drills=tuple((str(s), s.kind.value) for s in self.drills.specs),
        )

    @property
    def is_script(self) -> bool:
        return self.workload.startswith("script:")

    def workload_spec(self) -> Workload | None:
        """The workload, resolved, with its options validated (cached); None for a script."""
        from trainer.workload import load_workload

        if self.is_script:
            return None
        return load_workload(self.workload, self.workload_options)

    def _check_workload(self) -> None:
        """Resolve the workload and validate its options now, before anything launches."""
        from trainer.config import ConfigError

        if self.is_script:
            if self.workload_options:
                raise ValueError("workload_options: a script takes script_args, not options")
            if not self.workload.removeprefix("script:").strip():
                raise ValueError("workload: name the script, e.g. script:path/to/train.py")
            if self.export.consolidated:
                raise ValueError(
                    "export.consolidated: a script's model is its own; the pipeline exports "
                    "its DCP checkpoint (load it with torch.distributed.checkpoint)"
                )
            return
        if self.script_args:
            raise ValueError("script_args: only a script:PATH workload takes them")
        weights = self.s3_init_weights()
        if weights is not None:
            from tasks.errors import StorageError
            from tasks.storage.s3 import parse_s3_uri

            try:
                # The prefix becomes a directory on the shared filesystem (weights/<bucket>/
                # <prefix>): `s3:///abs/dir` or a `..` would put the hydrated files anywhere.
                parse_s3_uri(weights)
            except StorageError as e:
                raise ValueError(f"workload_options.init_weights: {e}") from None
        if weights and not self.backend_type.hydrates_s3_weights:
            raise ValueError(
                f"workload_options.init_weights: the {self.backend} backend does not copy s3:// "
                "weights; give a directory on its shared filesystem (on EKS, import it with the "
                "FSx file system's data repository association)"
            )

        try:
            self.workload_spec()
        except ConfigError as e:
            raise ValueError(str(e)) from None

    @property
    def backend_type(self) -> BackendType:
        return backend_type(self.backend)

    @property
    def ranks_per_node(self) -> int:
        """Workers per node: one per GPU on EKS, ``nproc_per_node`` CPU workers locally."""
        return self.backend_type.ranks_per_node(self)

    @property
    def world_size(self) -> int:
        """The world at full size (``nodes``' maximum); an elastic job may train on fewer."""
        return self.max_nodes * self.ranks_per_node

    @property
    def micro_batches(self) -> int | None:
        """The global batch's micro-batches per step: an elastic job's are those of its largest
        world (trainer.elastic), each rank accumulating its share; ``grad_accumulation`` of
        them per rank at full size. None: one per rank (a fixed-size job, no accumulation)."""
        if not self.node_range.elastic and self.grad_accumulation == 1:
            return None
        return self.world_size * self.grad_accumulation

    @model_validator(mode="after")
    def _consistent(self, info: ValidationInfo) -> PipelineParams:
        # What the deployment lets a run ask for, before anything else is resolved (a
        # workload is imported below: one the deployment does not allow never is).
        check_run(self.backend, self.workload)
        check_declared(self.secrets)
        kind = self.backend_type
        if not kind.embedded_s3 and self.s3_endpoint == LOCAL_S3_ENDPOINT:
            # The embedded default's local server makes no sense on a cluster (a form that
            # re-sends the default would otherwise start one in the flow runner's pod): AWS S3.
            self.s3_endpoint = None
        kind.check(self)
        self._check_workload()
        # Endpoints, buckets, the state directory, secrets and drills: the deployment's own or
        # on its lists (flows.pipeline.resolve_params says which deployment, when there is one).
        deployment = (info.context or {}).get("deployment") if info is not None else None
        check_reach(self.reach(), deployment)
        init_weights = self.workload_options.get("init_weights")
        check_initial_weights(self.initial_weights, self.s3_init_weights(), init_weights)
        check_pinned(self.reach().init_weights_bucket, self.initial_weights.sha256 is not None)
        world = self.world_size
        if self.global_batch % world:
            nodes = "nodes' maximum" if self.node_range.elastic else "nodes"
            raise ValueError(
                f"global_batch ({self.global_batch}) must be divisible by the world size "
                f"({world} = {nodes} x ranks per node)"
            )
        if self.global_batch % (world * self.grad_accumulation):
            raise ValueError(
                f"global_batch ({self.global_batch}) must be divisible by the world size x "
                f"grad_accumulation ({world} x {self.grad_accumulation}): every micro-batch "
                "holds the same number of sequences"
            )
        check_drills(
            self.drills.specs,
            kind,
            world=world,
            min_nodes=self.node_range.min,
            launched_nodes=self.launched_nodes,
            steps=self.steps,
            step_check=self.step_check.enabled,
        )
        return self


def own_reach(raw: Mapping[str, Any]) -> Reach:
    """What a deployment's own parameters (as stored: partial, JSON) reach, normalized as the
    form normalizes a run's; a malformed value reaches nothing."""
    from tasks.errors import StorageError
    from tasks.storage.s3 import parse_s3_uri
    from trainer.faults import FaultSpecError, parse_faults

    fields = PipelineParams.model_fields

    def group(name: str, key: str, model: type[BaseModel]) -> str:
        value = dict(raw.get(name) or {}).get(key, model.model_fields[key].default)
        return str(value)

    endpoint = normal_endpoint(raw.get("s3_endpoint", fields["s3_endpoint"].default))
    try:
        embedded = backend_type(str(raw.get("backend", "local"))).embedded_s3
    except ValueError:
        embedded = True
    if endpoint == LOCAL_S3_ENDPOINT and not embedded:
        endpoint = None  # as the form rewrites it (an EKS deployment's local default)
    weights = dict(raw.get("workload_options") or {}).get("init_weights")
    try:
        weights_bucket = parse_s3_uri(str(weights))[0] if str(weights).startswith("s3://") else None
    except StorageError:
        weights_bucket = None
    try:
        faults = dict(raw.get("drills") or {}).get("faults") or []
        drills = tuple((str(s), s.kind.value) for s in parse_faults(faults))
    except (FaultSpecError, TypeError, AttributeError):
        drills = ()
    secrets = dict(raw.get("secrets") or {})
    return Reach(
        s3_endpoint=endpoint,
        dataset_bucket=group("dataset", "bucket", DatasetLocation),
        export_bucket=group("export", "bucket", ExportLocation),
        state_dir=os.path.normpath(str(raw.get("state_dir", fields["state_dir"].default))),
        init_weights_bucket=weights_bucket,
        secrets=tuple(sorted({str(v) for v in secrets.values()})),
        drills=drills,
    )


def deployment_scope(id_: Any, name: str, raw: Mapping[str, Any]) -> Deployment:
    return Deployment(id=str(id_), name=name, own=own_reach(raw))


class CheckpointInfo(BaseModel):
    step: int | None = None
    uri: str | None = None
    validated: bool = False
    # Newer committed checkpoints that failed validation (the chosen one is a fallback).
    fell_back_from: list[int] = Field(default_factory=list)


class ExportInfo(BaseModel):
    uri: str | None = None
    objects: int = 0
    bytes: int = 0
    verified: bool = False


class TakeoverInfo(BaseModel):
    """This invocation took the run over from an owner that died (arch §6)."""

    previous_owner: str
    action: Literal["adopt", "end", "nothing"]  # what it did with what the dead owner left
    reason: str
    steps_lost: int = 0  # steps trained after the last commit and lost with the ended attempt


class PipelineResult(BaseModel):
    status: Literal["completed", "failed", "cancelled"]
    run_id: str
    target_steps: int
    final_step: int = 0
    final_loss: float | None = None
    params_sha256: str | None = None
    checkpoint: CheckpointInfo = Field(default_factory=CheckpointInfo)
    export: ExportInfo = Field(default_factory=ExportInfo)
    faults: list[FaultRecord] = Field(default_factory=list)
    world_changes: list[WorldChangeRecord] = Field(default_factory=list)
    # Nodes confirmed slow (tasks.straggler): reported, replaced or rate-limited.
    stragglers: list[StragglerRecord] = Field(default_factory=list)
    # The newest in-job timeouts rank 0 applied (trainer.timeouts): each value with why.
    timeouts: dict[str, str] = Field(default_factory=dict)
    # How often the newest incarnation's memory saves ran, and why (memory_interval auto).
    memory_interval: str | None = None
    stage_attempts: dict[str, int] = Field(default_factory=dict)
    stage_durations_s: dict[str, float] = Field(default_factory=dict)
    ettr: float | None = None
    # Where the train attempts' wall time went (trainer.records.TimeBreakdown says how).
    train_time: TimeBreakdown | None = None
    wall_s: float = 0.0
    error: str | None = None
    takeover: TakeoverInfo | None = None
