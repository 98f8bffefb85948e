"""Typed, validated trainer configuration.

Every config object is keyword-only and checks itself at construction: a bad value raises
:class:`ConfigError` naming the field and what to change, before any process group starts.
Named model sizes are plain functions (``tiny()``, ``gpt_100m()``, ``gpt_8b()``) derived by
copy-and-change, not piles of flags.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.checkpointing.config import (
    MOVED,
    CheckpointConfig,
)
from trainer.errors import ConfigError, require
from trainer.faults import FaultSpec, parse_faults

if TYPE_CHECKING:
    from trainer.workload import Workload


# ----------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A GPT-style decoder-only transformer."""

    name: str
    vocab_size: int
    seq_len: int
    d_model: int
    n_layers: int
    n_heads: int
    d_ff: int
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads", "d_ff"):
            value = getattr(self, name)
            require(
                isinstance(value, int) and value >= 1,
                f"model.{name}",
                f"must be a positive integer, got {value!r}",
            )
        require(
            self.d_model % self.n_heads == 0,
            "model.n_heads",
            f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})",
        )
        require(
            0.0 <= self.dropout < 1.0, "model.dropout", f"must be in [0, 1), got {self.dropout}"
        )

    def num_params(self) -> int:
        """Exact parameter count of :class:`trainer.model.GPT` for this config."""
        d, f, v, s = self.d_model, self.d_ff, self.vocab_size, self.seq_len
        per_block = (
            2 * 2 * d  # two LayerNorms (weight + bias)
            + 3 * d * d
            + 3 * d  # qkv projection
            + d * d
            + d  # attention output projection
            + d * f
            + f
            + f * d
            + d  # MLP
        )
        return v * d + s * d + self.n_layers * per_block + 2 * d + d * v


def tiny() -> ModelConfig:
    """A few hundred thousand parameters: one training step in well under a second on one core."""
    return ModelConfig(
        name="tiny", vocab_size=512, seq_len=64, d_model=64, n_layers=2, n_heads=4, d_ff=256
    )


def gpt_100m() -> ModelConfig:
    """~110M parameters (GPT-2 small shape with a 16k vocabulary): the single-GPU smoke size."""
    return ModelConfig(
        name="100m",
        vocab_size=16384,
        seq_len=1024,
        d_model=768,
        n_layers=12,
        n_heads=12,
        d_ff=3072,
    )


def gpt_8b() -> ModelConfig:
    """~7.5B parameters, the 8B class (Llama-3-8B width, depth and vocabulary).

    For p5.48xlarge nodes (8x H100 80 GB each), FSDP2 over >= 2 nodes; not run on CPU machines.
    Global batch is set in TrainConfig."""
    return dataclasses.replace(
        gpt_100m(),
        name="8b",
        vocab_size=128256,
        seq_len=8192,
        d_model=4096,
        n_layers=32,
        n_heads=32,
        d_ff=16384,
    )


MODEL_SIZES: dict[str, Callable[[], ModelConfig]] = {
    "tiny": tiny,
    "100m": gpt_100m,
    "8b": gpt_8b,
}


def model_config(name: str) -> ModelConfig:
    if name not in MODEL_SIZES:
        raise ConfigError(
            "model", f"unknown model size {name!r}; choose one of {sorted(MODEL_SIZES)}"
        )
    return MODEL_SIZES[name]()


# ----------------------------------------------------------------------------------------------
# Fault layers
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class InProcessConfig:
    """In-process restart (``nvidia_resiliency_ext.inprocess.Wrapper``).

    gloo collectives cannot be aborted, so ``pg_timeout_s`` (how long a collective waits for a
    silent peer) must be below ``soft_timeout_s``: the healthy ranks must leave the collective by
    themselves before the Wrapper escalates to killing ranks.
    """

    enabled: bool = True
    pg_timeout_s: float = 3.0
    soft_timeout_s: float = 8.0
    hard_timeout_s: float = 16.0
    heartbeat_timeout_s: float = 12.0
    barrier_timeout_s: float = 60.0
    completion_timeout_s: float = 60.0
    max_restarts: int = 5
    # NVRx's polling periods (monitor thread, monitor process, progress watchdog, its own
    # heartbeat), 1 s by default: every restart and every clean exit waits up to one of them
    # several times over. A quarter second costs nothing measurable on the loop.
    monitor_interval_s: float = 0.25
    # How long the Wrapper waits after a fault for other ranks to report theirs before it
    # restarts (NVRx default 1 s, all of it on the exception-recovery path).
    last_call_wait_s: float = 0.25
    # SIGTERM to SIGKILL when the monitor process terminates an unresponsive rank (NVRx default
    # 5 s; a rank that ignores SIGTERM, or a stopped one, waits all of it).
    termination_grace_s: float = 1.0

    def __post_init__(self) -> None:
        for name in (
            "pg_timeout_s",
            "soft_timeout_s",
            "hard_timeout_s",
            "heartbeat_timeout_s",
            "barrier_timeout_s",
            "completion_timeout_s",
            "monitor_interval_s",
            "last_call_wait_s",
            "termination_grace_s",
        ):
            value = getattr(self, name)
            require(value > 0, f"inprocess.{name}", f"must be > 0 seconds, got {value}")
        require(
            self.max_restarts >= 0,
            "inprocess.max_restarts",
            f"must be >= 0, got {self.max_restarts}",
        )
        if not self.enabled:
            return
        require(
            self.pg_timeout_s < self.soft_timeout_s,
            "inprocess.pg_timeout_s",
            f"must be below inprocess.soft_timeout_s ({self.pg_timeout_s} >= "
            f"{self.soft_timeout_s}): gloo collectives cannot be aborted, so a peer stuck in one "
            "must time out by itself before the Wrapper's soft timeout",
        )
        require(
            self.soft_timeout_s < self.hard_timeout_s < self.barrier_timeout_s,
            "inprocess.hard_timeout_s",
            "timeouts must nest: soft_timeout_s < hard_timeout_s < barrier_timeout_s, got "
            f"{self.soft_timeout_s} / {self.hard_timeout_s} / {self.barrier_timeout_s}",
        )
        require(
            1.0 < self.heartbeat_timeout_s < self.barrier_timeout_s,
            "inprocess.heartbeat_timeout_s",
            f"must be between 1 s and barrier_timeout_s ({self.barrier_timeout_s})",
        )
        require(
            self.monitor_interval_s < min(self.soft_timeout_s, self.heartbeat_timeout_s),
            "inprocess.monitor_interval_s",
            f"must be below soft_timeout_s and heartbeat_timeout_s, got {self.monitor_interval_s}",
        )


# ft_launcher section names (trainer.resilience.Heartbeat opens them): the steps, a checkpoint
# save and commit, a checkpoint load. Anything else (start-up, an in-process restart) is "out of
# section", which has its own timeout.
STEP_SECTION = "step"
CHECKPOINT_SECTION = "checkpoint"
LOAD_SECTION = "load"


def backstop(out_of_section_s: float, longest_section_s: float) -> float:
    """The heartbeat timeout auto: a beat goes out at every section's end and step-section
    renewal (trainer.resilience.Heartbeat), so no healthy gap between two beats is longer than
    an out-of-section stretch and the longest section after it."""
    return out_of_section_s + longest_section_s


# An in-job timeout the worker derives from what its incarnation measures (trainer.timeouts).
AUTO = "auto"
Timeout = float | str  # seconds, or AUTO
# The in-job timeouts that may be AUTO (every one the run form exposes).
AUTO_TIMEOUTS = (
    "initial_heartbeat_timeout_s",
    "heartbeat_timeout_s",
    "step_timeout_s",
    "checkpoint_timeout_s",
    "load_timeout_s",
    "out_of_section_timeout_s",
    "node_silence_s",
)


@dataclass(frozen=True, kw_only=True)
class InJobConfig:
    """In-job restart: ``ft_launcher`` + ``RankMonitorClient`` heartbeats.

    Every timeout (:data:`AUTO_TIMEOUTS`) is ``"auto"`` by default: until the incarnation has
    measured what a timeout covers it is ``startup_allowance_s`` (interpreter start, the model
    build, the first steps and the first save, which no earlier run of this job predicts), then
    ``timeout_multiple`` x the longest such stretch measured, between its floor and the
    allowance (trainer.timeouts). A number pins a timeout: the step timeout is then the ceiling
    the learned one stays under (as the allowance is for ``auto``), every other one is fixed.
    """

    enabled: bool = True
    max_restarts: int = 3
    # What every auto timeout is until measured: a model whose build or first step takes longer
    # needs more (or those timeouts pinned).
    startup_allowance_s: float = 600.0
    initial_heartbeat_timeout_s: Timeout = AUTO
    # The backstop: no heartbeat for this long kills the rank whatever section it is in. A beat
    # goes out at every section's end and every step-section renewal, so it must cover the
    # out-of-section timeout and the longest section (auto: their sum).
    heartbeat_timeout_s: Timeout = AUTO
    # How often ft_launcher polls its workers: a worker's death, and its clean exit, wait for it.
    monitor_interval_s: float = 0.25
    workers_stop_timeout_s: float = 5.0
    # Survivors of a lost node wait this long in rendezvous before ft_launcher gives up (exit 1).
    rdzv_join_timeout_s: float = 20.0
    # Elastic jobs (trainer.elastic): once the range's minimum has joined, how long the
    # rendezvous waits for more nodes before it closes the round; and how often a node renews
    # its membership, and how many renewals it may miss before it is dropped (a dead node holds
    # its place in the world that long: the survivors re-form after it).
    rdzv_last_call_s: float = 2.0
    rdzv_keep_alive_s: float = 1.0
    rdzv_keep_alive_misses: int = 3
    # Hang detection by section (trainer.resilience.Heartbeat): the steps, reported at most once
    # per heartbeat_interval_s; a checkpoint save and commit; a checkpoint load; and everything
    # else (start-up, an in-process restart).
    heartbeat_interval_s: float = 1.0
    step_timeout_s: Timeout = AUTO
    checkpoint_timeout_s: Timeout = AUTO
    load_timeout_s: Timeout = AUTO
    out_of_section_timeout_s: Timeout = AUTO
    # How often each node's rank monitor checks those timeouts (NVRx default 5 s).
    check_interval_s: float = 0.25
    # Learning (trainer.timeouts): the step timeout once learn_after_sections step sections have
    # closed after the first (the warm-up: compilation, allocator growth), timeout_multiple x the
    # longest, at least step_timeout_floor_s; the checkpoint, load and out-of-section timeouts
    # timeout_multiple x the longest such section seen (rising when a longer one comes), at
    # least section_floor_s. 0 sections: nothing is learned, the allowance (or the pinned
    # values) stay in force.
    learn_after_sections: int = 10
    timeout_multiple: float = 5.0
    step_timeout_floor_s: float = 3.0
    section_floor_s: float = 30.0
    # A node that stops without dying (a frozen host, a partition) stops its beat file
    # (trainer.node_beat, rewritten every heartbeat_interval_s); the watcher takes a training
    # node away as lost once its beat has not changed for this long while another node's has.
    # It must cover the longest stretch a node's first worker is gone for good reasons: an
    # in-job respawn (stop, rendezvous, interpreter start, the model build). Auto: measured
    # from the attempt's own start (tasks.watch_state.SilenceRule).
    node_silence_s: Timeout = AUTO

    def __post_init__(self) -> None:
        require(
            self.max_restarts >= 0, "injob.max_restarts", f"must be >= 0, got {self.max_restarts}"
        )
        for name in AUTO_TIMEOUTS:
            value = getattr(self, name)
            ok = value == AUTO or (
                isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
            )
            require(
                ok, f"injob.{name}", f"must be 'auto' or a number of seconds > 0, got {value!r}"
            )
        for name in (
            "startup_allowance_s",
            "monitor_interval_s",
            "workers_stop_timeout_s",
            "rdzv_join_timeout_s",
            "rdzv_last_call_s",
            "rdzv_keep_alive_s",
            "heartbeat_interval_s",
            "check_interval_s",
            "section_floor_s",
        ):
            value = getattr(self, name)
            require(value > 0, f"injob.{name}", f"must be > 0 seconds, got {value}")
        require(
            isinstance(self.rdzv_keep_alive_misses, int) and self.rdzv_keep_alive_misses >= 1,
            "injob.rdzv_keep_alive_misses",
            f"must be a whole number >= 1, got {self.rdzv_keep_alive_misses!r}",
        )
        require(
            self.rdzv_keep_alive_s * self.rdzv_keep_alive_misses < self.rdzv_join_timeout_s,
            "injob.rdzv_join_timeout_s",
            f"must exceed injob.rdzv_keep_alive_s x injob.rdzv_keep_alive_misses "
            f"({self.rdzv_keep_alive_s * self.rdzv_keep_alive_misses} s): the survivors of a "
            "loss wait that long for the dead node to be dropped before they re-form",
        )
        require(
            self.pinned("node_silence_s") is None
            or self.seconds("node_silence_s") > 2 * self.heartbeat_interval_s,
            "injob.node_silence_s",
            f"must exceed twice injob.heartbeat_interval_s ({self.heartbeat_interval_s} s), how "
            f"often a node rewrites its beat, got {self.node_silence_s}",
        )
        require(
            self.seconds("heartbeat_timeout_s") <= self.seconds("initial_heartbeat_timeout_s"),
            "injob.initial_heartbeat_timeout_s",
            "must be >= injob.heartbeat_timeout_s: the first heartbeat comes after start-up and "
            "the checkpoint load",
        )
        require(
            self.heartbeat_interval_s < self.seconds("step_timeout_s"),
            "injob.step_timeout_s",
            f"must exceed injob.heartbeat_interval_s ({self.heartbeat_interval_s} s): the step "
            "section is renewed once per interval",
        )
        require(
            isinstance(self.learn_after_sections, int)
            and not isinstance(self.learn_after_sections, bool)
            and self.learn_after_sections >= 0,
            "injob.learn_after_sections",
            f"must be a whole number >= 0 (0: nothing is learned), got "
            f"{self.learn_after_sections!r}",
        )
        require(
            self.timeout_multiple >= 2,
            "injob.timeout_multiple",
            f"must be >= 2 (a step only a little slower than the slowest seen is not a hang), "
            f"got {self.timeout_multiple}",
        )
        step = self.seconds("step_timeout_s")
        require(
            self.heartbeat_interval_s < self.step_timeout_floor_s <= step,
            "injob.step_timeout_floor_s",
            f"must exceed injob.heartbeat_interval_s ({self.heartbeat_interval_s} s) and be at "
            f"most injob.step_timeout_s ({step} s), got {self.step_timeout_floor_s}",
        )
        longest = max(self.section_timeouts().values())
        require(
            self.seconds("heartbeat_timeout_s") >= longest,
            "injob.heartbeat_timeout_s",
            f"must be >= every section timeout ({longest} s): no heartbeat goes out during a "
            "checkpoint save or load, and the heartbeat timeout is checked in every section",
        )

    def pinned(self, name: str) -> float | None:
        """The timeout ``name`` as the operator pinned it; None where it is auto."""
        value = getattr(self, name)
        return None if value == AUTO else float(value)

    def seconds(self, name: str) -> float:
        """The timeout ``name`` at launch, before this incarnation measured anything: the pinned
        value, or the start-up allowance (the heartbeat backstop auto: the out-of-section
        timeout plus the longest section's, see ``heartbeat_timeout_s``)."""
        value = self.pinned(name)
        if value is not None:
            return value
        if name == "heartbeat_timeout_s":
            return backstop(
                self.seconds("out_of_section_timeout_s"), max(self.section_timeouts().values())
            )
        if name == "initial_heartbeat_timeout_s":
            backstop_s = self.seconds("heartbeat_timeout_s")
            return max(backstop_s, self.seconds("out_of_section_timeout_s"))
        return self.startup_allowance_s

    def section_timeouts(self) -> dict[str, float]:
        """``--ft-rank-section-timeouts`` (at launch)."""
        return {
            STEP_SECTION: self.seconds("step_timeout_s"),
            CHECKPOINT_SECTION: self.seconds("checkpoint_timeout_s"),
            LOAD_SECTION: self.seconds("load_timeout_s"),
        }


class Device(enum.StrEnum):
    AUTO = "auto"  # CUDA + NCCL when a GPU is present, else CPU + gloo
    CPU = "cpu"
    CUDA = "cuda"


# ----------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    run_root: Path
    data_dir: Path
    # What to train (trainer.workload): a built-in name or 'package.module:attr', and its options
    # (validated by the workload's own options model).
    workload: str = "gpt-tiny"
    workload_options: dict[str, Any] = field(default_factory=dict)
    # Script mode (workload "script:PATH"): the script's own arguments; {run_root}, {data_dir},
    # {steps}, {global_batch} and {seed} are replaced by this config's values.
    script_args: tuple[str, ...] = ()
    steps: int = 20
    global_batch: int = 8
    # Elastic jobs (trainer.elastic): the global batch is split into this many micro-batches
    # whatever the world size (the largest world's rank count), each rank accumulating its
    # share. None: one micro-batch per rank (a fixed-size job).
    micro_batches: int | None = None
    lr: float = 3e-3
    weight_decay: float = 0.01
    seed: int = 1234
    device: Device = Device.AUTO
    # CUDA only: deterministic kernels (torch.use_deterministic_algorithms, a fixed cuBLAS
    # workspace), so that a recovered run can be bitwise equal to a fault-free one, as on the
    # CPU. Off by default: measured on an H200 (benchmarks/results/gpu_check.json), two
    # fault-free CUDA runs already differ in the last bits without it, and it slows some kernels.
    deterministic: bool = False
    # Every checkpoint setting: the durable tier, the memory tiers, how a run resumes
    # (trainer.checkpointing.config).
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    verify_data: bool = True
    # Set by the pipeline after hydration verified every shard: the workers then check that the
    # manifest is still that one and the shards' sizes, not every shard's digest (arch §3).
    data_manifest_sha256: str | None = None
    # Drills, parsed where the config is made (a spec's text is its form in a config file).
    faults: tuple[FaultSpec, ...] = ()
    inprocess: InProcessConfig = field(default_factory=InProcessConfig)
    injob: InJobConfig = field(default_factory=InJobConfig)
    # False when the config is built for workers elsewhere (an EKS pod's /fsx): paths are then
    # checked by the workers, not here.
    local_paths: bool = True
    # Rank 0's Prometheus endpoint (trainer.metrics): off unless a port is given.
    metrics_port: int | None = None
    metrics_addr: str = "127.0.0.1"
    # Every node's first worker serves on metrics_port too (trainer.metrics.NodeMetrics), where
    # each node is a scrape target of its own (EKS pods); off where simulated nodes share a host.
    metrics_every_node: bool = False

    def __post_init__(self) -> None:
        # The one parse of the drills the workers get: a config file (and a caller) gives their
        # text, and from here inward they are FaultSpecs.
        object.__setattr__(self, "faults", parse_faults(self.faults))
        require(self.steps >= 1, "steps", f"must be a positive number of steps, got {self.steps}")
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
        require(
            isinstance(self.checkpoint, CheckpointConfig),
            "checkpoint",
            "must be a CheckpointConfig (a mapping in a config file)",
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
        require(str(self.run_root) != "", "run_root", "set the run directory (shared filesystem)")
        require(
            not self.local_paths or self.data_dir.is_dir(),
            "data_dir",
            f"dataset directory {str(self.data_dir)!r} does not exist; write one with "
            "`python -m trainer.data --out DIR` or hydrate it first",
        )
        for spec in self.faults:
            require(
                not spec.needs_node_memory or self.checkpoint.memory.enabled,
                "faults",
                f"{spec} damages a node-memory copy, and checkpoint.memory.interval 0 makes "
                "none: set it to 1 or more, or drop the drill",
            )
        if self.inprocess.enabled and self.injob.enabled:
            # arch §2: an inner layer must get its chance before the outer one gives up.
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
        """The lowest step-section timeout a learned one may be (trainer.timeouts):
        ``injob.step_timeout_floor_s``, and with both layers on more than the in-process layer's
        window for a stalled step (``inprocess.pg_timeout_s + injob.heartbeat_interval_s``, the
        same rule as for ``injob.step_timeout_s``, with the defaults' 0.5 s margin), never above
        ``injob.step_timeout_s``."""
        floor = self.injob.step_timeout_floor_s
        if self.inprocess.enabled and self.injob.enabled:
            floor = max(floor, self.inprocess.pg_timeout_s + self.injob.heartbeat_interval_s + 0.5)
        return min(floor, self.injob.seconds("step_timeout_s"))

    def out_of_section_floor(self) -> float:
        """The lowest out-of-section timeout a learned one may be (trainer.timeouts):
        ``injob.section_floor_s``, and with both layers on more than an in-process restart may
        take (``inprocess.hard_timeout_s + inprocess.barrier_timeout_s``: the Wrapper's
        detection, then its wait for every rank), never above the launch value."""
        floor = self.injob.section_floor_s
        if self.inprocess.enabled and self.injob.enabled:
            floor = max(floor, self.inprocess.hard_timeout_s + self.inprocess.barrier_timeout_s)
        return min(floor, self.injob.seconds("out_of_section_timeout_s"))

    @property
    def is_script(self) -> bool:
        """Script mode: a user's training script runs under the layers (``trainer.script``)."""
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
        """Hash of everything that determines the trained parameters (not paths or timeouts).

        Stored in every checkpoint manifest, so a checkpoint is never resumed by a run whose
        model or optimisation settings differ.
        """
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
        for name, kind in (("inprocess", InProcessConfig), ("injob", InJobConfig)):
            if name in data:
                sub = data.pop(name)
                require(isinstance(sub, dict), name, "must be a mapping")
                _check_keys(kind, sub, f"{name}.")
                nested[name] = kind(**sub)
        try:
            if "run_root" in data:
                data["run_root"] = Path(data["run_root"])
            if "data_dir" in data:
                data["data_dir"] = Path(data["data_dir"])
            if "device" in data:
                data["device"] = Device(data["device"])
        except ValueError as e:
            raise ConfigError("config", str(e)) from e
        if "script_args" in data:
            data["script_args"] = tuple(data["script_args"])

        return cls(**data, **nested)


CONFIG_FORMAT = "nvrx-train-config-v1"


def _check_keys(kind: type, data: dict[str, Any], prefix: str) -> None:
    known = {f.name for f in dataclasses.fields(kind)}
    for key in data:
        require(key in known, f"{prefix}{key}", f"unknown field; known: {sorted(known)}")


def config_file(run_root: Path, attempt: int) -> Path:
    """Where the config of one train-stage attempt lives (what every worker reads)."""
    return Path(run_root) / "config" / f"train-attempt{attempt}.json"


def config_text(cfg: TrainConfig) -> str:
    """``cfg`` as the JSON workers read (a file, or a ConfigMap's value on EKS)."""
    return json.dumps({"format": CONFIG_FORMAT, **cfg.to_dict()}, indent=1) + "\n"


def save_config(cfg: TrainConfig, path: Path) -> Path:
    """Write ``cfg`` atomically as JSON (the one serialized form workers read)."""
    import os

    path = Path(path).absolute()  # workers may run in another directory
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(config_text(cfg))
    os.replace(tmp, path)
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
