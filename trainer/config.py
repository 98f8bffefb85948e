"""Typed, validated trainer configuration: :class:`TrainConfig`, the whole run as a worker sees
it (one file per attempt), checked at construction (:class:`ConfigError` names the field and the
fix). Its sections: :mod:`trainer.layer_config`, :mod:`trainer.checkpointing.config`."""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.checkpointing.config import (
    MOVED,
    CheckpointConfig,
)
from trainer.checkpointing.manifest import WorkloadRef
from trainer.errors import ConfigError, require
from trainer.faults import FaultSpec, parse_faults
from trainer.layer_config import InJobConfig, InProcessConfig
from trainer.run_files import write_text_atomic
from trainer.step_check import StepCheckConfig
from trainer.straggler_config import StragglerConfig

if TYPE_CHECKING:
    from trainer.workload import Workload


class Device(enum.StrEnum):
    AUTO = "auto"  # CUDA + NCCL when a GPU is present, else CPU + gloo
    CPU = "cpu"
    CUDA = "cuda"


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    run_root: Path
    data_dir: Path
    # What to train (trainer.workload): a built-in or 'package.module:attr', and its options.
    workload: str = "gpt-tiny"
    workload_options: dict[str, Any] = field(default_factory=dict)
    # Script mode (workload "script:PATH"): the script's own arguments; {run_root}, {data_dir},
    # {steps}, {global_batch} and {seed} are replaced by this config's values.
    script_args: tuple[str, ...] = ()
    steps: int = 20
    global_batch: int = 8
    # Elastic jobs: the global batch's micro-batches on any world (the largest world's rank
    # count), each rank accumulating its share. None: one per rank (a fixed-size job).
    micro_batches: int | None = None
    lr: float = 3e-3
    weight_decay: float = 0.01
    seed: int = 1234
    device: Device = Device.AUTO
    # CUDA only: deterministic kernels, so a recovered run can be bitwise equal to a fault-free
    # one. Off by default: it slows some kernels (without it two fault-free H200 runs differ in
    # the last bits: benchmarks/results/gpu_check.json).
    deterministic: bool = False
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    verify_data: bool = True
    # Set after hydration verified every shard: workers then check the manifest is still that
    # one and the shards' sizes, not every digest (arch §3).
    data_manifest_sha256: str | None = None
    faults: tuple[FaultSpec, ...] = ()
    inprocess: InProcessConfig = field(default_factory=InProcessConfig)
    injob: InJobConfig = field(default_factory=InJobConfig)
    # The watcher's straggler detector and what a confirmed slow node costs it (issue 42).
    straggler: StragglerConfig = field(default_factory=StragglerConfig)
    # The pre-update step check (trainer.step_check): finite, no spike, agreed by every rank.
    step_check: StepCheckConfig = field(default_factory=StepCheckConfig)
    # False when built for workers elsewhere (an EKS pod's /fsx): they check the paths.
    local_paths: bool = True
    # Rank 0's Prometheus endpoint (trainer.metrics): off unless a port is given.
    metrics_port: int | None = None
    metrics_addr: str = "127.0.0.1"
    # Every node's first worker serves on metrics_port too (EKS pods are scrape targets of their
    # own); off where simulated nodes share a host.
    metrics_every_node: bool = False

    def __post_init__(self) -> None:
        # The one parse of the drills (a config file gives their text): inward, FaultSpecs.
        object.__setattr__(self, "faults", parse_faults(self.faults))
        require(self.steps >= 1, "steps", f"must be a positive number of steps, got {self.steps}")
        self._check_batch()
        require(
            isinstance(self.checkpoint, CheckpointConfig),
            "checkpoint",
            "must be a CheckpointConfig (a mapping in a config file)",
        )
        require(
            isinstance(self.straggler, StragglerConfig),
            "straggler",
            "must be a StragglerConfig (a mapping in a config file)",
        )
        require(
            self.metrics_port is None
            or (isinstance(self.metrics_port, int) and 1 <= self.metrics_port <= 65535),
            "metrics_port",
            f"must be a TCP port (1-65535), or None to turn rank 0's metrics off, got "
            f"{self.metrics_port!r}",
        )
        require(
            bool(self.metrics_addr),
            "metrics_addr",
            "set the address rank 0's metrics listen on (127.0.0.1, or 0.0.0.0 in a pod)",
        )
        self._check_workload()
        require(str(self.run_root) != "", "run_root", "set the run directory (shared filesystem)")
        require(
            not self.local_paths or self.data_dir.is_dir(),
            "data_dir",
            f"dataset directory {str(self.data_dir)!r} does not exist; write one with "
            "`python -m trainer.data --out DIR` or hydrate it first",
        )
        require(
            isinstance(self.step_check, StepCheckConfig),
            "step_check",
            "must be a StepCheckConfig (a mapping in a config file)",
        )
        for spec in self.faults:
            require(
                not spec.is_gray or self.step_check.enabled,
                "faults",
                f"{spec} is played inside the step check, and step_check.enabled is false: "
                "turn the check on, or drop the drill",
            )
            require(
                not spec.needs_node_memory or self.checkpoint.memory.enabled,
                "faults",
                f"{spec} damages a node-memory copy, and checkpoint.memory.interval 0 makes "
                "none: set it to 1 or more, or drop the drill",
            )
        if self.inprocess.enabled and self.injob.enabled:
            self._check_layers_nest()

    def _check_batch(self) -> None:
        """The batch, the learning rate, and the micro-batches the global batch splits into."""
        require(self.global_batch >= 1, "global_batch", f"must be >= 1, got {self.global_batch}")
        require(self.lr > 0, "lr", f"must be > 0, got {self.lr}")
        if self.micro_batches is not None:
            require(
                isinstance(self.micro_batches, int) and self.micro_batches >= 1,
                "micro_batches",
                f"must be a positive number of micro-batches or None, got {self.micro_batches!r}",
            )
            require(
                self.global_batch % self.micro_batches == 0,
                "global_batch",
                f"{self.global_batch} is not divisible into {self.micro_batches} micro-batches "
                "(the largest world size of an elastic job); pick a multiple of it",
            )

    def _check_workload(self) -> None:
        """A script, or a workload whose options it validates now (naming the field)."""
        require(
            isinstance(self.workload_options, dict),
            "workload_options",
            f"must be a mapping of option names to values, got {type(self.workload_options)}",
        )
        if self.is_script:
            require(
                not self.workload_options,
                "workload_options",
                "a training script takes script_args, not workload options",
            )
            require(
                not self.local_paths or self.script_path.is_file(),
                "workload",
                f"training script {str(self.script_path)!r} not found",
            )
        else:
            require(not self.script_args, "script_args", "only a script: workload takes them")
            _ = self.wl  # resolve the workload and validate its options now, naming the field

    def _check_layers_nest(self) -> None:
        """arch §2: an inner layer must get its chance before the outer one gives up."""
        require(
            self.inprocess.hard_timeout_s < self.injob.seconds("heartbeat_timeout_s"),
            "injob.heartbeat_timeout_s",
            f"must exceed inprocess.hard_timeout_s ({self.inprocess.hard_timeout_s} s) so "
            "that an in-process restart completes before ft_launcher declares the rank dead",
        )
        require(
            self.inprocess.hard_timeout_s < self.injob.seconds("out_of_section_timeout_s"),
            "injob.out_of_section_timeout_s",
            f"must exceed inprocess.hard_timeout_s ({self.inprocess.hard_timeout_s} s): an "
            "in-process restart runs out of section",
        )
        # A rank stalled in a step: its peers' collectives time out (pg_timeout_s) and the
        # in-process layer restarts every rank in place, before ft_launcher's step timeout
        # (counted from the section's renewal, up to one interval before the stall) kills it.
        window = self.inprocess.pg_timeout_s + self.injob.heartbeat_interval_s
        require(
            window < self.injob.seconds("step_timeout_s"),
            "injob.step_timeout_s",
            f"must exceed inprocess.pg_timeout_s + injob.heartbeat_interval_s ({window} s) "
            "so that a stalled step is restarted in-process before ft_launcher kills the rank",
        )

    def step_timeout_floor(self) -> float:
        """The lowest learned step timeout (trainer.timeouts): with both layers on, above the
        in-process window for a stalled step (the rule for ``injob.step_timeout_s``, plus the
        defaults' 0.5 s margin); never above ``injob.step_timeout_s``."""
        floor = self.injob.step_timeout_floor_s
        if self.inprocess.enabled and self.injob.enabled:
            floor = max(floor, self.inprocess.pg_timeout_s + self.injob.heartbeat_interval_s + 0.5)
        return min(floor, self.injob.seconds("step_timeout_s"))

    def out_of_section_floor(self) -> float:
        """The lowest learned out-of-section timeout: with both layers on, above what an
        in-process restart may take (the Wrapper's detection, then its wait for every rank);
        never above the launch value."""
        floor = self.injob.section_floor_s
        if self.inprocess.enabled and self.injob.enabled:
            floor = max(floor, self.inprocess.hard_timeout_s + self.inprocess.barrier_timeout_s)
        return min(floor, self.injob.seconds("out_of_section_timeout_s"))

    @property
    def is_script(self) -> bool:
        """A user's training script runs under the layers (``trainer.script``)."""
        return self.workload.startswith("script:")

    @property
    def script_path(self) -> Path:
        return Path(self.workload.removeprefix("script:"))

    def expanded_script_args(self) -> list[str]:
        values = {
            "run_root": str(self.run_root),
            "data_dir": str(self.data_dir),
            "steps": str(self.steps),
            "global_batch": str(self.global_batch),
            "seed": str(self.seed),
        }
        out = []
        for arg in self.script_args:
            for key, value in values.items():
                arg = arg.replace("{" + key + "}", value)
            out.append(arg)
        return out

    @property
    def wl(self) -> Workload:
        """The workload, resolved and its options validated (cached per reference+options)."""
        from trainer.workload import load_workload

        return load_workload(self.workload, self.workload_options)

    def workload_ref(self) -> WorkloadRef:
        """The workload by reference, as validation and export rebuild it."""
        return WorkloadRef(self.workload, {} if self.is_script else self.wl.options_dict())

    def workload_record(self) -> dict[str, Any]:
        """What a checkpoint manifest says of the workload that wrote it."""
        if self.is_script:
            return {
                "ref": self.workload,
                "name": "script",
                "options": {},
                "args": list(self.script_args),
            }
        return self.wl.describe()

    def micro_batch_count(self, world_size: int) -> int:
        """How many micro-batches a global batch is split into on a world of ``world_size``:
        ``micro_batches`` for an elastic job (at least one per rank), else one per rank."""
        if self.micro_batches is None:
            if self.global_batch % world_size != 0:
                raise ConfigError(
                    "global_batch",
                    f"{self.global_batch} is not divisible by the world size {world_size}; "
                    "pick a multiple of the number of ranks",
                )
            return world_size
        if world_size > self.micro_batches:
            raise ConfigError(
                "micro_batches",
                f"a world of {world_size} ranks is larger than the {self.micro_batches} "
                "micro-batches of a global batch (the elastic range's largest world); raise "
                "the node range's maximum",
            )
        return self.micro_batches

    def micro_batch_size(self, world_size: int) -> int:
        """Sequences one micro-batch holds (a rank's whole share on a full-size world)."""
        return self.global_batch // self.micro_batch_count(world_size)

    def fingerprint(self) -> str:
        """Hash of what determines the trained parameters (not paths or timeouts): in every
        checkpoint manifest, so no run with another model or optimisation resumes it."""
        relevant = {
            "workload": {"script": self.workload, "args": list(self.script_args)}
            if self.is_script
            else {"name": self.wl.name, "options": self.wl.options_dict()},
            "global_batch": self.global_batch,
            "lr": self.lr,
            "weight_decay": self.weight_decay,
            "seed": self.seed,
        }
        blob = json.dumps(relevant, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        """Every field, JSON-ready; :meth:`from_dict` gives back an equal config."""
        out = dataclasses.asdict(self)
        out["run_root"] = str(self.run_root)
        out["data_dir"] = str(self.data_dir)
        out["device"] = self.device.value
        out["checkpoint"] = self.checkpoint.to_dict()
        out["straggler"]["policy"] = self.straggler.policy.value
        out["faults"] = [str(spec) for spec in self.faults]
        out["script_args"] = list(self.script_args)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        """The inverse of :meth:`to_dict`. Unknown keys are refused (a typo must not fall back
        to a default silently); missing keys take the defaults."""
        data = dict(data)
        data.pop("format", None)
        for old, new in MOVED.items():
            require(old not in data, old, f"moved to {new} (issue 40): set that instead")
        _check_keys(cls, data, "")
        nested: dict[str, Any] = {}
        if "checkpoint" in data:
            nested["checkpoint"] = CheckpointConfig.from_dict(data.pop("checkpoint"))
        sections = (
            ("inprocess", InProcessConfig),
            ("injob", InJobConfig),
            ("straggler", StragglerConfig),
            ("step_check", StepCheckConfig),
        )
        for name, kind in sections:
            if name in data:
                sub = data.pop(name)
                require(isinstance(sub, dict), name, "must be a mapping")
                _check_keys(kind, sub, f"{name}.")
                nested[name] = kind(**sub)
        kinds = {"run_root": Path, "data_dir": Path, "device": Device, "script_args": tuple}
        try:
            data.update({k: kind(data[k]) for k, kind in kinds.items() if k in data})
        except ValueError as e:
            raise ConfigError("config", str(e)) from e
        return cls(**data, **nested)


CONFIG_FORMAT = "nvrx-train-config-v1"


def _check_keys(kind: type, data: dict[str, Any], prefix: str) -> None:
    known = {f.name for f in dataclasses.fields(kind)}
    for key in data:
        require(key in known, f"{prefix}{key}", f"unknown field; known: {sorted(known)}")


def config_text(cfg: TrainConfig) -> str:
    """``cfg`` as the JSON workers read (a file, or a ConfigMap's value on EKS)."""
    return json.dumps({"format": CONFIG_FORMAT, **cfg.to_dict()}, indent=1) + "\n"


def save_config(cfg: TrainConfig, path: Path) -> Path:
    """Write ``cfg`` atomically as JSON (the one serialized form workers read)."""
    path = Path(path).absolute()  # workers may run in another directory
    write_text_atomic(path, config_text(cfg))
    return path


def load_config(path: Path) -> TrainConfig:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError("config", f"cannot read training config {path}: {e}") from e
    require(
        isinstance(data, dict) and data.get("format") == CONFIG_FORMAT,
        "config",
        f"{path} is not a training config (format {CONFIG_FORMAT!r} expected)",
    )
    return TrainConfig.from_dict(data)
