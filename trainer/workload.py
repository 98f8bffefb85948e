"""The workload API: what the three fault-tolerance layers wrap (public; the walk-through with
an example is docs/training.md, "Your own training"; ``trainer/workloads/gpt.py`` is a complete
one).

A workload (:class:`WorkloadSpec`: plain functions and a pydantic model of its options) says how
to build the model, which module classes FSDP2 shards one by one, the optimizer, the loss, and a
data source whose batch depends only on (seed, step, rank, world), so a resume sees exactly the
data it would have. The trainer owns the rest. ``workload`` names a built-in (:data:`BUILTIN`)
or any importable ``package.module:attr``; ``workload_options`` are validated by its options
model. Options may declare ``mixed_precision: "none" | "bf16"`` and
``activation_checkpointing: bool``, applied when sharding (bf16 on CUDA only).
"""

from __future__ import annotations

import functools
import importlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from pydantic import BaseModel, ValidationError
from torch import nn
from torch.optim import Optimizer

from trainer.errors import ConfigError


class DataSource(Protocol):
    """Token batches as a pure function of (step, rank, world); ``state_at``/``check_state`` let
    a checkpoint record the position and a resume prove the data order did not change."""

    vocab_size: int

    def batch(self, step: int, rank: int, world_size: int) -> tuple[np.ndarray, np.ndarray]: ...

    def state_at(self, step: int) -> Any: ...

    def check_state(self, state: Mapping[str, object], step: int) -> None: ...


@dataclass(frozen=True, kw_only=True)
class DataSettings:
    data_dir: Path
    seq_len: int
    global_batch: int
    seed: int
    verify: bool = True
    # The manifest digest hydration verified every shard against: then sizes are checked only.
    verified_manifest: str | None = None


@dataclass(frozen=True, kw_only=True)
class OptimSettings:
    lr: float
    weight_decay: float


def adamw(model: nn.Module, s: OptimSettings) -> Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=s.weight_decay)


def token_shards(s: DataSettings) -> DataSource:
    """The dataset format of ``trainer.data`` (``dataset.json`` + token shards)."""
    from trainer.sampler import StepSampler

    return StepSampler(
        s.data_dir,
        seq_len=s.seq_len,
        global_batch=s.global_batch,
        seed=s.seed,
        verify=s.verify,
        verified_manifest=s.verified_manifest,
    )


@dataclass(frozen=True, kw_only=True)
class WorkloadSpec:
    """What a workload provides. Every callable gets the validated options object first."""

    name: str
    options: type[BaseModel]
    build_model: Callable[[Any, torch.device], nn.Module]
    block_classes: Callable[[Any], tuple[type[nn.Module], ...]]
    loss: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
    vocab_size: Callable[[Any], int]
    seq_len: Callable[[Any], int]
    build_optimizer: Callable[[nn.Module, OptimSettings], Optimizer] = adamw
    data_source: Callable[[DataSettings], DataSource] = token_shards
    # Write the full (unsharded, CPU) model as a self-contained directory other tools load
    # (e.g. Hugging Face layout); None: the export ships one model.safetensors.
    export_pretrained: Callable[[Any, nn.Module, Path], None] | None = None
    description: str = ""


# Built-ins: name -> (spec, default options), imported on use (GPT never imports transformers).
BUILTIN: dict[str, tuple[str, dict[str, Any]]] = {
    "gpt-tiny": ("trainer.workloads.gpt:SPEC", {"size": "tiny"}),
    "gpt-100m": ("trainer.workloads.gpt:SPEC", {"size": "100m"}),
    "gpt-8b": ("trainer.workloads.gpt:SPEC", {"size": "8b"}),
    "llama-tiny": ("trainer.workloads.llama:SPEC", {"size": "tiny"}),
    "llama-1b": ("trainer.workloads.llama:SPEC", {"size": "1b"}),
    "llama3-8b": ("trainer.workloads.llama:SPEC", {"size": "8b"}),
}
SCRIPT_PREFIX = "script:"


def safe_to_name_from_file(ref: str) -> bool:
    """May a workload named by an untrusted file (a checkpoint's manifest) be used unconfirmed?
    Built-ins only: a file on the shared filesystem must not choose code to import (``script:``
    names a script nothing here runs)."""
    return ref in BUILTIN or ref.startswith(SCRIPT_PREFIX)


def _import_spec(target: str) -> WorkloadSpec:
    module_name, _, attr = target.partition(":")
    if not module_name or not attr or not all(p.isidentifier() for p in module_name.split(".")):
        raise ConfigError(
            "workload",
            f"{target!r} is not a built-in workload ({', '.join(sorted(BUILTIN))}) nor a "
            "reference of the form 'package.module:attribute'",
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(
            "workload",
            f"cannot import module {module_name!r} ({e}); make it importable where the workers "
            "run (install it, or add its directory to PYTHONPATH; on EKS, bake it into the image)",
        ) from e
    spec = getattr(module, attr, None)
    if spec is None:
        raise ConfigError("workload", f"module {module_name!r} has no attribute {attr!r}")
    if not isinstance(spec, WorkloadSpec):
        raise ConfigError(
            "workload",
            f"{target!r} is a {type(spec).__name__}, not a trainer.workload.WorkloadSpec",
        )
    return spec


def _validate_options(spec: WorkloadSpec, options: Mapping[str, Any]) -> BaseModel:
    known = set(spec.options.model_fields)
    for key in options:
        if key not in known:
            raise ConfigError(
                f"workload_options.{key}",
                f"unknown option of workload {spec.name!r}; it takes {sorted(known)}",
            )
    try:
        return spec.options.model_validate(dict(options))
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        raise ConfigError(
            f"workload_options.{loc}" if loc else "workload_options", err["msg"]
        ) from None


@dataclass(frozen=True)
class Workload:
    """A spec bound to its validated options: what the trainer calls."""

    ref: str  # as the user named it (a built-in name or 'module:attr')
    spec: WorkloadSpec
    options: BaseModel

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def vocab_size(self) -> int:
        return int(self.spec.vocab_size(self.options))

    @property
    def seq_len(self) -> int:
        return int(self.spec.seq_len(self.options))

    def options_dict(self) -> dict[str, Any]:
        return dict(self.options.model_dump(mode="json"))

    def describe(self) -> dict[str, Any]:
        """What the checkpoint manifest records of the workload (JSON)."""
        return {"ref": self.ref, "name": self.name, "options": self.options_dict()}

    def build_model(self, device: torch.device | str) -> nn.Module:
        return self.spec.build_model(self.options, torch.device(device))

    def build_optimizer(self, model: nn.Module, settings: OptimSettings) -> Optimizer:
        return self.spec.build_optimizer(model, settings)

    def loss(self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.spec.loss(model, inputs, targets)

    def data_source(self, settings: DataSettings) -> DataSource:
        return self.spec.data_source(settings)

    def shard(self, model: nn.Module, *, device: torch.device, world_size: int) -> nn.Module:
        """FSDP2 ``fully_shard`` on every outermost block, then the root; activation
        checkpointing wraps each block first; bf16 mixed precision (fp32 reductions) on CUDA."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        blocks = self.spec.block_classes(self.options)
        if not blocks:
            raise ConfigError("workload", f"workload {self.name!r} names no block classes")
        targets = _outermost(model, blocks)
        if not targets:
            names = ", ".join(b.__name__ for b in blocks)
            raise ConfigError(
                "workload", f"workload {self.name!r}: the model has no module of type {names}"
            )
        if getattr(self.options, "activation_checkpointing", False):
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
                apply_activation_checkpointing,
            )

            apply_activation_checkpointing(
                model, check_fn=lambda m: isinstance(m, blocks) and m in targets
            )
            targets = _outermost(model, blocks)
        kwargs: dict[str, Any] = {}
        if getattr(self.options, "mixed_precision", "none") == "bf16" and device.type == "cuda":
            kwargs["mp_policy"] = MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, reduce_dtype=torch.float32
            )
        mesh = init_device_mesh(device.type, (world_size,))
        for block in targets:
            fully_shard(block, mesh=mesh, **kwargs)
        fully_shard(model, mesh=mesh, **kwargs)
        return model

    def export_pretrained(self, model: nn.Module, out: Path) -> bool:
        """Write the consolidated model in the workload's own layout; False when it has none."""
        if self.spec.export_pretrained is None:
            return False
        self.spec.export_pretrained(self.options, model, out)
        return True


def _outermost(model: nn.Module, blocks: tuple[type[nn.Module], ...]) -> list[nn.Module]:
    """Modules of the block types that are not inside another one (module order)."""
    out: list[nn.Module] = []

    def visit(m: nn.Module) -> None:
        for child in m.children():
            if isinstance(child, blocks):
                out.append(child)
            else:
                visit(child)

    visit(model)
    return out


def load_workload(ref: str, options: Mapping[str, Any] | None = None) -> Workload:
    """Resolve a workload reference and validate its options; errors name the field."""
    return _load(ref, json.dumps(dict(options or {}), sort_keys=True))


@functools.lru_cache(maxsize=32)
def _load(ref: str, options_json: str) -> Workload:
    if not isinstance(ref, str) or not ref.strip():
        raise ConfigError("workload", "name a workload, e.g. 'gpt-tiny' or 'my_pkg.mod:spec'")
    if ref.startswith(SCRIPT_PREFIX):
        raise ConfigError(
            "workload", f"{ref!r} is a training script: it is launched as is, not loaded"
        )
    target, defaults = BUILTIN.get(ref, (ref, {}))
    spec = _import_spec(target)
    return Workload(ref, spec, _validate_options(spec, {**defaults, **json.loads(options_json)}))
