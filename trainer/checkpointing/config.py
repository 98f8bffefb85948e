"""Every checkpoint setting in one typed config (issue 40, item 1), validated at construction and
decided once: the durable tier (a committed checkpoint on the shared filesystem every
``durable.interval`` steps) and the memory tiers (a memory save every ``memory.interval``
steps: the process's own copy, node memory and the peer copies), and how a run resumes. The
rest of the code asks this config, never the raw numbers, whether a tier is on and when a save
is due."""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from trainer.errors import ConfigError, require


class ResumePolicy(enum.StrEnum):
    AUTO = "auto"  # resume from the newest valid checkpoint; fail if some exist but none is valid
    FRESH = "fresh"  # ignore existing checkpoints and start at step 0 (explicit opt-in)


@dataclass(frozen=True, kw_only=True)
class DurableConfig:
    """The committed checkpoint on the shared filesystem (arch §3)."""

    interval: int = 5  # a save every this many steps, and at the last
    keep_last: int = 3  # committed checkpoints kept
    timeout_s: float = 300.0  # a save's write and commit, at most
    verify_on_resume: bool = True  # digest every file of the checkpoint a resume reads

    def __post_init__(self) -> None:
        require(
            _whole(self.interval) and self.interval >= 1,
            "checkpoint.durable.interval",
            f"a checkpoint every N steps needs N >= 1, got {self.interval!r}",
        )
        require(
            _whole(self.keep_last) and self.keep_last >= 2,
            "checkpoint.durable.keep_last",
            "keep at least 2 checkpoints (one stays valid if the newest turns out damaged), "
            f"got {self.keep_last!r}: set it to 2 or more",
        )
        require(self.timeout_s > 0, "checkpoint.durable.timeout_s", "must be > 0 seconds")

    def due(self, step: int, last_step: int) -> bool:
        return step % self.interval == 0 or step == last_step


AUTO = "auto"


@dataclass(frozen=True, kw_only=True)
class MemoryConfig:
    """The memory tiers (arch §3): the process's own copy of the last durable save, node memory
    and the peer copies, all from a memory save every ``interval`` steps: ``"auto"`` (the
    default: each incarnation measures what a save costs against its steps and chooses,
    :mod:`~trainer.checkpointing.memory_cadence`), a number of steps, or 0 (none of them, every
    resume reads the durable checkpoint). ``budget``: the share of a step a memory save may
    cost under auto."""

    interval: int | str = AUTO
    budget: float = 0.02

    def __post_init__(self) -> None:
        require(
            self.interval == AUTO or (_whole(self.interval) and int(self.interval) >= 0),
            "checkpoint.memory.interval",
            f"must be 'auto' or a whole number of steps >= 0 (0 turns the memory tiers off), "
            f"got {self.interval!r}",
        )
        require(
            0 < self.budget < 1,
            "checkpoint.memory.budget",
            f"must be a share of the step time in (0, 1), got {self.budget!r}",
        )

    @property
    def enabled(self) -> bool:
        return self.interval != 0

    @property
    def auto(self) -> bool:
        return self.interval == AUTO


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    durable: DurableConfig = field(default_factory=DurableConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    resume: ResumePolicy = ResumePolicy.AUTO

    def __post_init__(self) -> None:
        require(
            isinstance(self.resume, ResumePolicy),
            "checkpoint.resume",
            f"must be one of {[p.value for p in ResumePolicy]}, got {self.resume!r}",
        )

    @property
    def reads_memory_tiers(self) -> bool:
        """Whether a resume may read a memory tier: they exist, and the run resumes (``fresh``
        starts over from nothing)."""
        return self.memory.enabled and self.resume == ResumePolicy.AUTO

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "resume": self.resume.value}

    @classmethod
    def from_dict(cls, data: Any) -> CheckpointConfig:
        """The inverse of :meth:`to_dict`; unknown keys are refused, naming them."""
        require(isinstance(data, dict), "checkpoint", "must be a mapping")
        _known(data, {"durable", "memory", "resume"}, "checkpoint.")
        durable = data.get("durable", {})
        memory = data.get("memory", {})
        require(isinstance(durable, dict), "checkpoint.durable", "must be a mapping")
        require(isinstance(memory, dict), "checkpoint.memory", "must be a mapping")
        _known(durable, {f.name for f in fields(DurableConfig)}, "checkpoint.durable.")
        _known(memory, {f.name for f in fields(MemoryConfig)}, "checkpoint.memory.")
        try:
            resume = ResumePolicy(data.get("resume", ResumePolicy.AUTO))
        except ValueError as e:
            raise ConfigError("checkpoint.resume", str(e)) from e
        return cls(durable=DurableConfig(**durable), memory=MemoryConfig(**memory), resume=resume)


# Where the checkpoint fields of a flat config (before issue 40) went.
MOVED = {
    "ckpt_interval": "checkpoint.durable.interval",
    "keep_last": "checkpoint.durable.keep_last",
    "ckpt_timeout_s": "checkpoint.durable.timeout_s",
    "verify_checkpoint_on_resume": "checkpoint.durable.verify_on_resume",
    "memory_interval": "checkpoint.memory.interval",
    "resume": "checkpoint.resume",
}


def _whole(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _known(data: Iterable[str], known: set[str], prefix: str) -> None:
    for key in data:
        require(key in known, f"{prefix}{key}", f"unknown field; known: {sorted(known)}")
