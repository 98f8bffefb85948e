"""Fault injection for tests, benchmarks and game days.

Spec (arch §5): ``KIND@step=N`` with optional ``,rank=R`` / ``,node=K`` and, for ``sigkill``,
``,phase=checkpoint`` (kill right after the save at step N was handed to the async writer, while
its shards are being written and before the commit).

Kinds handled by the trainer:
- ``exception``: raises :class:`InjectedFault` in the rank (recovered in-process).
- ``stall``: the rank stops making progress in Python (as one waiting forever on a collective
  its peers never join). Peers' collectives time out, and the in-process layer interrupts the
  stalled rank and restarts every rank in place (recovered in-process).
- ``hang``: the rank stops dead (SIGSTOP to itself), as a rank wedged in native code does: no
  heartbeats, no progress; only killing it helps (recovered in-job by ft_launcher).
- ``sigkill``: the rank SIGKILLs itself (recovered in-job).
- ``corrupt-checkpoint``: after the first checkpoint at or beyond step N commits, flip bytes in one
  of its shards (detected on the next resume, which falls back to the previous checkpoint).
- ``corrupt-memory``: at the start of step N, flip bytes in every generation of the rank's own
  node-memory copies (``trainer.checkpointing.node_copy``) and carry on; the next resume that
  would read them finds their digests wrong and falls back, past node memory, to the next tier.
  Give a second fault at the same step (``sigkill@step=N``, listed after it) to make that resume
  happen at once.
- ``corrupt-peer``: at the first resume after step N, on rank R, flip bytes in the newest peer
  copy rank R's node holds (another node's rank's shard), after the resume listed it; the rank
  it belongs to finds the digest wrong when the copy reaches it, and the resume falls back to
  the next newest copy (the older generation) or tier. Name the rank whose node holds the lost
  node's peer copies (the previous node's, ``tiers.peer_ring``).
``node-loss``, ``node-return`` and ``node-freeze`` are carried out by the watcher through the
backend, not here: it kills a whole node, starts a lost one again (a replacement joining an
elastic job), or stops every process of a node without ending any (SIGSTOP: a frozen host, a
partition), which the watcher must then notice by itself (``tasks.watch_state.silent``). Which
of them a backend can carry out is its ``BackendType.drills``.

A fault fires once per run: a marker file under ``<run_root>/faults/`` is created atomically
*before* it fires, so the restart it causes does not fire it again.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from trainer.errors import TrainerError

KINDS = (
    "exception",
    "stall",
    "hang",
    "sigkill",
    "node-loss",
    "node-return",
    "node-freeze",
    "corrupt-checkpoint",
    "corrupt-memory",
    "corrupt-peer",
)
NODE_KINDS = ("node-loss", "node-return", "node-freeze")  # the watcher's, not the trainer's
TRAINER_KINDS = (
    "exception",
    "stall",
    "hang",
    "sigkill",
    "corrupt-checkpoint",
    "corrupt-memory",
    "corrupt-peer",
)
# Damage, not a failure: nothing restarts for it, and no recovery closes it; the next resume
# that would read the damaged copy notices it (and says so in a resume event).
DAMAGE_KINDS = ("corrupt-checkpoint", "corrupt-memory", "corrupt-peer")
# Damage a resume finds, not a step: never fired at a step's start.
RESUME_KINDS = ("corrupt-checkpoint", "corrupt-peer")
PHASES = ("step", "checkpoint")


class FaultSpecError(TrainerError, ValueError):
    pass


class InjectedFault(TrainerError, RuntimeError):
    """The exception raised by an ``exception`` fault."""


@dataclass(frozen=True)
class FaultSpec:
    kind: str
    step: int
    rank: int | None = None
    node: int | None = None
    phase: str = "step"

    @property
    def slug(self) -> str:
        parts = [self.kind, f"step{self.step}"]
        if self.rank is not None:
            parts.append(f"rank{self.rank}")
        if self.node is not None:
            parts.append(f"node{self.node}")
        if self.phase != "step":
            parts.append(self.phase)
        return "-".join(parts)

    def __str__(self) -> str:
        out = f"{self.kind}@step={self.step}"
        if self.rank is not None:
            out += f",rank={self.rank}"
        if self.node is not None:
            out += f",node={self.node}"
        if self.phase != "step":
            out += f",phase={self.phase}"
        return out


def parse_fault(spec: str) -> FaultSpec:
    """Parse ``KIND@step=N[,rank=R][,node=K][,phase=P]``; errors say what a valid spec is."""
    usage = (
        f"invalid fault spec {spec!r}: expected KIND@step=N[,rank=R][,node=K], KIND one of "
        f"{', '.join(KINDS)}"
    )
    kind, sep, rest = spec.strip().partition("@")
    if not sep or kind not in KINDS:
        raise FaultSpecError(usage)
    fields: dict[str, str] = {}
    for item in rest.split(","):
        key, eq, value = item.strip().partition("=")
        if not eq or key not in ("step", "rank", "node", "phase") or key in fields:
            raise FaultSpecError(usage)
        fields[key] = value.strip()
    if "step" not in fields:
        raise FaultSpecError(usage)
    ints: dict[str, int] = {}
    for key in ("step", "rank", "node"):
        if key in fields:
            try:
                ints[key] = int(fields[key])
            except ValueError:
                raise FaultSpecError(f"{usage} ({key} must be an integer)") from None
            if ints[key] < 0 or (key == "step" and ints[key] < 1):
                raise FaultSpecError(f"{usage} ({key} out of range)")
    phase = fields.get("phase", "step")
    if phase not in PHASES or (phase != "step" and kind != "sigkill"):
        raise FaultSpecError(f"{usage} (phase=checkpoint applies to sigkill only)")
    if kind in NODE_KINDS and "rank" in ints:
        raise FaultSpecError(f"{usage} ({kind} takes node=K, not rank=R)")
    return FaultSpec(
        kind=kind, step=ints["step"], rank=ints.get("rank"), node=ints.get("node"), phase=phase
    )


def claim(run_root: Path, spec: FaultSpec) -> bool:
    """Atomically record that ``spec`` fired in this run; False when it already has (in an
    earlier life of a worker, or an earlier attempt of the stage)."""
    marker_dir = Path(run_root) / "faults"
    marker_dir.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(marker_dir / f"{spec.slug}.fired", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(f"{time.time()}\n")
        f.flush()
        os.fsync(f.fileno())
    return True


class FaultInjector:
    """Fires the trainer-side faults of a run, each at most once per run."""

    def __init__(
        self,
        specs: tuple[str, ...] | list[str],
        run_root: Path,
        *,
        rank: int,
        on_fire: Callable[[FaultSpec], None] | None = None,
        guard: Callable[[str], contextlib.AbstractContextManager[None]] | None = None,
    ) -> None:
        self.specs = [s for s in map(parse_fault, specs) if s.kind in TRAINER_KINDS]
        self.marker_dir = Path(run_root) / "faults"
        self.rank = rank
        self.on_fire = on_fire
        # The writer's fence (trainer.fence.Fence.hold): a replaced attempt's rank claims no
        # drill of the live one.
        self.guard = guard or (lambda action: contextlib.nullcontext())

    def _claim(self, spec: FaultSpec) -> bool:
        with self.guard(f"claim the drill {spec}"):
            return claim(self.marker_dir.parent, spec)

    def _due(self, spec: FaultSpec, step: int, phase: str) -> bool:
        target_rank = 0 if spec.rank is None else spec.rank
        return spec.phase == phase and spec.step == step and target_rank == self.rank

    def maybe_fire(self, step: int, phase: str = "step") -> None:
        """Called by every rank at ``step`` (the step being computed) in each phase."""
        for spec in self.specs:
            if spec.kind in RESUME_KINDS or not self._due(spec, step, phase):
                continue
            if not self._claim(spec):
                continue
            if self.on_fire is not None:
                self.on_fire(spec)
            _fire(spec)

    def damage_due(self, kind: str, reached: int) -> FaultSpec | None:
        """The damage drill of ``kind`` (``RESUME_KINDS``) to apply now, claimed, if one is due
        on this rank for a copy of step ``reached``, at or after its step: a checkpoint just
        committed (``corrupt-checkpoint``: rank 0, which commits), the newest peer copy a
        resume lists (``corrupt-peer``: on the rank named; a first start holds none)."""
        for spec in self.specs:
            if (
                spec.kind == kind
                and (spec.rank or 0) == self.rank
                and reached >= spec.step
                and self._claim(spec)
            ):
                return spec
        return None


def _fire(spec: FaultSpec) -> None:
    if spec.kind == "exception":
        raise InjectedFault(f"injected fault {spec}")
    if spec.kind == "stall":
        # Interruptible: the Wrapper's monitor thread raises its restart exception in here.
        while True:
            time.sleep(0.05)
    if spec.kind == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # never reached: SIGKILL is not deliverable late
    if spec.kind == "hang":
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
