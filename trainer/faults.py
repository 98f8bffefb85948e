"""Fault injection for tests, benchmarks and game days (the spec, ``KIND@step=N[,rank=R]
[,node=K][,phase=checkpoint]``, and its kinds: arch §5, "Fault spec").

The trainer fires ``exception`` (in-process recovery), ``stall`` (stuck in Python, as on a
collective its peers never join), ``hang`` (SIGSTOP: no heartbeats; only in-job recovery helps),
``sigkill`` (``phase=checkpoint``: while the save's shards are written, before the commit) and the
damage kinds, which restart nothing and are noticed by the resume that reads the copy:
``corrupt-checkpoint``, ``corrupt-memory`` (every generation of the rank's node-memory copies;
a ``sigkill`` at the same step, listed after it, makes that resume happen at once) and
``corrupt-peer`` (name the rank whose node holds the lost node's peer copies: the previous
node's, ``tiers.peer_ring``). ``node-loss``, ``node-return`` and ``node-freeze`` are the
watcher's, through the backend.

A spec is parsed once where it enters (:func:`parse_fault`) into a frozen :class:`FaultSpec`
whose predicates its readers ask. A fault fires once per run: its marker under
``<run_root>/faults/`` is created atomically *before* it fires, so its restart does not refire it.
"""

from __future__ import annotations

import contextlib
import enum
import os
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from trainer.errors import TrainerError
from trainer.rundir import RunDir


class FaultKind(enum.StrEnum):
    EXCEPTION = "exception"
    STALL = "stall"
    HANG = "hang"
    SIGKILL = "sigkill"
    NODE_LOSS = "node-loss"
    NODE_RETURN = "node-return"
    NODE_FREEZE = "node-freeze"
    CORRUPT_CHECKPOINT = "corrupt-checkpoint"
    CORRUPT_MEMORY = "corrupt-memory"
    CORRUPT_PEER = "corrupt-peer"
    NODE_EVICT = "node-evict"
    SLOW = "slow"
    CORRUPT_GRAD = "corrupt-grad"


class Phase(enum.StrEnum):
    STEP = "step"  # at the start of the step
    CHECKPOINT = "checkpoint"  # right after the step's save was handed to the async writer


KINDS = tuple(FaultKind)
# The watcher's, carried out through the backend (its BackendType.drills), not the trainer's.
NODE_KINDS = (
    FaultKind.NODE_LOSS,
    FaultKind.NODE_RETURN,
    FaultKind.NODE_FREEZE,
    FaultKind.NODE_EVICT,
)
# Damage, not a failure: nothing restarts for it, and no recovery closes it; the next resume
# that would read the damaged copy notices it (and says so in a resume event). Event readers
# compare their ``fault_kind`` strings against these (a StrEnum member equals its value).
DAMAGE_KINDS = (FaultKind.CORRUPT_CHECKPOINT, FaultKind.CORRUPT_MEMORY, FaultKind.CORRUPT_PEER)
# Damage a resume finds, not a step: never fired at a step's start.
RESUME_KINDS = (FaultKind.CORRUPT_CHECKPOINT, FaultKind.CORRUPT_PEER)
# Gray faults the trainer plays from their step on (not once at a step's start): a node that
# runs slow, gradients that come out corrupted (once, or ``every`` step on the node).
GRAY_KINDS = (FaultKind.SLOW, FaultKind.CORRUPT_GRAD)
USAGE = "KIND@step=N[,rank=R][,node=K][,phase=checkpoint][,factor=F][,every]"
FIELDS = ("step", "rank", "node", "phase", "factor", "every")
MAX_SLOW_FACTOR = 100.0


class FaultSpecError(TrainerError, ValueError):
    pass


class InjectedFault(TrainerError, RuntimeError):
    """The exception raised by an ``exception`` fault."""


@dataclass(frozen=True)
class FaultSpec:
    """One drill, parsed once where it enters (the run form's validation, the worker's config)
    and passed inward typed; what each reader asks of it is a predicate here."""

    kind: FaultKind
    step: int
    rank: int | None = None
    node: int | None = None
    phase: Phase = Phase.STEP
    factor: float | None = None  # slow: how many times its steps take
    every: bool = False  # corrupt-grad: on every step from ``step`` on, not once

    @property
    def is_node_fault(self) -> bool:
        """The watcher carries it out through the backend (the trainer never fires it)."""
        return self.kind in NODE_KINDS

    @property
    def kills_node(self) -> bool:
        return self.kind is FaultKind.NODE_LOSS

    @property
    def returns_node(self) -> bool:
        return self.kind is FaultKind.NODE_RETURN

    @property
    def freezes_node(self) -> bool:
        return self.kind is FaultKind.NODE_FREEZE

    @property
    def evicts_node(self) -> bool:
        """SIGTERM to the node's launcher, SIGKILL after the grace period (a drain, a spot
        reclaim): a loss with notice."""
        return self.kind is FaultKind.NODE_EVICT

    @property
    def takes_node_away(self) -> bool:
        """A loss, a freeze (noticed as a loss) or an eviction: the node is down until a
        node-return."""
        return self.kills_node or self.freezes_node or self.evicts_node

    @property
    def is_gray(self) -> bool:
        """Played by the trainer on every step from ``step`` on (``slow``, ``corrupt-grad``),
        through the step check, not fired once at a step's start."""
        return self.kind in GRAY_KINDS

    @property
    def slows(self) -> bool:
        return self.kind is FaultKind.SLOW

    @property
    def corrupts_grad(self) -> bool:
        return self.kind is FaultKind.CORRUPT_GRAD

    def targets(self, *, rank: int, node: int | None) -> bool:
        """Whether it plays on this rank: the node named (every rank of it), else the rank
        (rank 0 when neither is named)."""
        if self.node is not None and not self.is_node_fault:
            return node == self.node
        return self.target_rank == rank

    @property
    def needs_other_nodes(self) -> bool:
        """Noticed only against the other nodes (their beats, their step times): the job must
        train on 2 or more."""
        return self.freezes_node or self.slows

    @property
    def is_damage(self) -> bool:
        return self.kind in DAMAGE_KINDS

    @property
    def at_resume(self) -> bool:
        """Fired by the resume that would read the damaged copy, not at a step's start."""
        return self.kind in RESUME_KINDS

    @property
    def needs_node_memory(self) -> bool:
        """Damages a node-memory copy: needs checkpoint.memory.interval >= 1."""
        return self.kind in (FaultKind.CORRUPT_MEMORY, FaultKind.CORRUPT_PEER)

    @property
    def target_rank(self) -> int:
        return 0 if self.rank is None else self.rank

    @property
    def target_node(self) -> int:
        return 0 if self.node is None else self.node

    def _fields(self) -> list[tuple[str, object]]:
        fields: list[tuple[str, object]] = [("step", self.step)]
        fields += [(k, v) for k, v in (("rank", self.rank), ("node", self.node)) if v is not None]
        fields += [("phase", self.phase.value)] if self.phase is not Phase.STEP else []
        fields += [("factor", f"{self.factor:g}")] if self.factor is not None else []
        return fields + ([("every", "")] if self.every else [])

    @property
    def slug(self) -> str:
        # "checkpoint", not "phasecheckpoint": the drills' marker names stay as they were.
        return "-".join(
            [self.kind.value, *(f"{k}{v}".removeprefix("phase") for k, v in self._fields())]
        )

    def __str__(self) -> str:
        return f"{self.kind.value}@" + ",".join(
            f"{k}={v}" if k != "every" else k for k, v in self._fields()
        )


def parse_fault(spec: str | FaultSpec) -> FaultSpec:
    """Parse ``KIND@step=N[,rank=R][,node=K][,phase=P][,factor=F][,every]`` (a spec already
    parsed is returned as it is). Each error names the spec, the field at fault and the fix."""
    if isinstance(spec, FaultSpec):
        return spec
    kind_text, sep, rest = spec.strip().partition("@")

    def bad(field: str, fix: str) -> FaultSpecError:
        return FaultSpecError(f"invalid fault spec {spec!r}: {field}: {fix} (expected {USAGE})")

    try:
        kind = FaultKind(kind_text)
    except ValueError:
        raise bad("kind", f"{kind_text!r} is not one; use one of {', '.join(KINDS)}") from None
    if not sep:
        raise bad("step", f"missing; add @step=N, the step at which the {kind} fires")
    fields: dict[str, str] = {}
    for item in rest.split(","):
        key, eq, value = (part.strip() for part in item.partition("="))
        if key not in FIELDS:
            raise bad(key or "field", f"unknown; the fields are {', '.join(FIELDS)}")
        if key == "every":  # a flag, no value
            if eq or key in fields:
                raise bad(key, "give it once, as a bare flag: ,every")
        elif not eq or key in fields:
            raise bad(key, "give it once, as key=value")
        fields[key] = value
    if "step" not in fields:
        raise bad("step", f"missing; add step=N, the step at which the {kind} fires")
    ints = {key: _count(fields[key], key, bad) for key in ("step", "rank", "node") if key in fields}
    if ints["step"] < 1:
        raise bad("step", "must be 1 or more (steps count from 1)")
    try:
        phase = Phase(fields.get("phase", "step"))
    except ValueError:
        raise bad("phase", "must be step or checkpoint") from None
    if phase is not Phase.STEP and kind is not FaultKind.SIGKILL:
        raise bad("phase", "phase=checkpoint applies to sigkill only; drop it")
    if kind in NODE_KINDS and "rank" in ints:
        raise bad("rank", f"{kind} takes node=K, not rank=R")
    factor = _factor(fields, kind, bad)
    if "every" in fields and kind is not FaultKind.CORRUPT_GRAD:
        raise bad("every", "applies to corrupt-grad only; drop it")
    if kind in GRAY_KINDS and "rank" in ints and "node" in ints:
        raise bad("node", f"{kind} takes rank=R or node=K, not both")
    if kind is FaultKind.SLOW and "node" not in ints:
        raise bad("node", "missing; slow needs node=K, the node whose steps slow down")
    return FaultSpec(
        kind, ints["step"], ints.get("rank"), ints.get("node"), phase, factor, "every" in fields
    )


def _factor(
    fields: dict[str, str], kind: FaultKind, bad: Callable[[str, str], FaultSpecError]
) -> float | None:
    if kind is not FaultKind.SLOW:
        if "factor" in fields:
            raise bad("factor", "applies to slow only; drop it")
        return None
    if "factor" not in fields:
        raise bad("factor", "missing; add factor=F, how many times longer its steps take (e.g. 3)")
    try:
        factor = float(fields["factor"])
    except ValueError:
        raise bad("factor", f"{fields['factor']!r} must be a number") from None
    if not 1.0 < factor <= MAX_SLOW_FACTOR:  # also refuses nan and inf
        raise bad("factor", f"{factor:g} is out of range: more than 1, at most {MAX_SLOW_FACTOR:g}")
    return factor


def _count(text: str, key: str, bad: Callable[[str, str], FaultSpecError]) -> int:
    try:
        value = int(text)
    except ValueError:
        raise bad(key, f"{text!r} must be an integer") from None
    if value < 0:
        raise bad(key, f"{value} is out of range: {key}s count from 0")
    return value


def parse_faults(specs: Iterable[str | FaultSpec]) -> tuple[FaultSpec, ...]:
    return tuple(map(parse_fault, specs))


class FaultInjector:
    """Fires the trainer-side faults of a run, each at most once per run."""

    def __init__(
        self,
        specs: tuple[FaultSpec, ...],
        run_root: Path,
        *,
        rank: int,
        on_fire: Callable[[FaultSpec], None] | None = None,
        guard: Callable[[str], contextlib.AbstractContextManager[None]] | None = None,
    ) -> None:
        self.specs = [s for s in specs if not s.is_node_fault]
        self.run_dir = RunDir(run_root)
        self.rank = rank
        self.on_fire = on_fire
        # The writer's fence (trainer.fence.Fence.hold): a replaced attempt's rank claims no
        # drill of the live one.
        self.guard = guard or (lambda action: contextlib.nullcontext())

    def _claim(self, spec: FaultSpec) -> bool:
        with self.guard(f"claim the drill {spec}"):
            return self.run_dir.claim(spec.slug)

    def _due(self, spec: FaultSpec, step: int, phase: str) -> bool:
        return spec.phase == phase and spec.step == step and spec.target_rank == self.rank

    def maybe_fire(self, step: int, phase: str = "step") -> None:
        """Called by every rank at ``step`` (the step being computed) in each phase."""
        for spec in self.specs:
            if spec.at_resume or spec.is_gray or not self._due(spec, step, phase):
                continue
            if not self._claim(spec):
                continue
            if self.on_fire is not None:
                self.on_fire(spec)
            _fire(spec)

    def damage_due(self, kind: FaultKind, reached: int) -> FaultSpec | None:
        """The damage drill of ``kind`` (``RESUME_KINDS``) to apply now, claimed, if one is due
        on this rank for a copy of step ``reached``, at or after its step: a checkpoint just
        committed (``corrupt-checkpoint``: rank 0, which commits), the newest peer copy a
        resume lists (``corrupt-peer``: on the rank named; a first start holds none)."""
        for spec in self.specs:
            if (
                spec.kind == kind
                and spec.target_rank == self.rank
                and reached >= spec.step
                and self._claim(spec)
            ):
                return spec
        return None


def _fire(spec: FaultSpec) -> None:
    if spec.kind is FaultKind.EXCEPTION:
        raise InjectedFault(f"injected fault {spec}")
    if spec.kind is FaultKind.STALL:
        # Interruptible: the Wrapper's monitor thread raises its restart exception in here.
        while True:
            time.sleep(0.05)
    if spec.kind is FaultKind.SIGKILL:
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # never reached: SIGKILL is not deliverable late
    if spec.kind is FaultKind.HANG:
        # Stop the whole process, as a rank wedged in a native call would be: its heartbeats
        # stop, and no Python-level interruption can reach it.
        os.kill(os.getpid(), signal.SIGSTOP)
        while True:  # if someone sends SIGCONT, stay hung rather than silently resuming
            time.sleep(3600)


def flip_bytes(path: Path, *, offset: int | None = None, count: int = 16) -> None:
    """Invert ``count`` bytes of ``path`` in place (middle of the file by default)."""
    size = path.stat().st_size
    if size == 0:
        raise ValueError(f"cannot corrupt empty file {path}")
    start = size // 2 if offset is None else offset
    count = min(count, size - start)
    with open(path, "r+b") as f:
        f.seek(start)
        data = f.read(count)
        f.seek(start)
        f.write(bytes(b ^ 0xFF for b in data))
        f.flush()
        os.fsync(f.fileno())
