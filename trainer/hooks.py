"""Fault tolerance beside the training loop: composed step hooks.

The loop calls four points and knows nothing of what hangs on them::

    hooks.on_step_start(step)            # before the step's forward pass
    hooks.on_step_end(StepEnd(...))      # after the optimizer step (and a save, if one started)
    hooks.on_save_started(step)          # a save of `step` was handed to the async writer
    hooks.on_commit(step, path)          # rank 0: checkpoint `step` is committed at `path`

Drills, ft_launcher heartbeats and step/recovery events are each one small hook; :class:`Hooks`
composes them (as NVRx's ``Compose`` does). Script mode gives a user's loop the same hooks.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.event_types import Fault, NodeTime, Recovered, Step
from trainer.events import EventLog
from trainer.faults import FaultInjector, FaultKind, FaultSpec, flip_bytes
from trainer.rundir import RunDir


@dataclass(frozen=True)
class StepEnd:
    step: int
    loss: float
    step_s: float
    tokens: int  # tokens in the global batch of this step
    ckpt_blocking_s: float | None = None  # set when a save started at this step
    # Per node, its slowest rank's busy time (trainer.step_check); None: the step was unchecked.
    nodes: list[NodeTime] | None = None


class Hook:
    """Base class: every point is a no-op; a hook overrides the ones it needs."""

    def on_step_start(self, step: int) -> None:
        pass

    def on_step_end(self, end: StepEnd) -> None:
        pass

    def on_save_started(self, step: int) -> None:
        pass

    def on_commit(self, step: int, path: Path) -> None:
        pass


class Hooks(Hook):
    """Calls each hook in order at every point."""

    def __init__(self, *hooks: Hook) -> None:
        self.hooks = list(hooks)

    def on_step_start(self, step: int) -> None:
        for h in self.hooks:
            h.on_step_start(step)

    def on_step_end(self, end: StepEnd) -> None:
        for h in self.hooks:
            h.on_step_end(end)

    def on_save_started(self, step: int) -> None:
        for h in self.hooks:
            h.on_save_started(step)

    def on_commit(self, step: int, path: Path) -> None:
        for h in self.hooks:
            h.on_commit(step, path)


class FaultDrills(Hook):
    """Injected faults (tests, benchmarks, game days): at a step's start, right after a save was
    handed to the writer (``phase=checkpoint``), and corrupting a committed checkpoint."""

    def __init__(
        self,
        specs: tuple[FaultSpec, ...],
        run_root: Path,
        events: EventLog,
        *,
        rank: int,
        step_timeout: Callable[[], float | None] | None = None,
        node_memory: Any = None,
    ):
        self.events = events
        self.rank = rank
        # The rank's node memory (trainer.checkpointing.node_copy), which corrupt-memory damages.
        self.node_memory = node_memory
        # The step section's timeout in force (the heartbeat's): a hang's event states it.
        self.step_timeout = step_timeout
        self.fence = RunDir.from_env(run_root).fence(events)
        self.injector = FaultInjector(
            specs, run_root, rank=rank, on_fire=self._fired, guard=self.fence.hold
        )

    def _fired(self, spec: FaultSpec) -> None:
        bound = self.step_timeout() if self.step_timeout and spec.kind is FaultKind.HANG else None
        extra: dict[str, Any] = {} if bound is None else {"bound_s": bound}
        if spec.kind is FaultKind.CORRUPT_MEMORY:
            extra["file"] = self._damage_node_memory(spec)
        event = self._fault(spec, spec.step, **extra)
        # Open until the first step after the restart closes it (before the fault fires).
        if not spec.is_damage:
            with self.fence.hold(f"record the fault {spec}"):
                RunDir(self.events.path.parent).open_fault(event)

    def _damage_node_memory(self, spec: FaultSpec) -> str | None:
        """Flip bytes in every generation of this rank's own node-memory copies; the newest's
        path (in the event), None (``file: null``) where the node has none to damage."""
        if self.node_memory is None:
            return None
        self.node_memory.wait()  # a save's digest in flight would vouch for the damaged bytes
        held, _ = self.node_memory.headers()
        for step in sorted(held):
            flip_bytes(self.node_memory.bin_path(held[step].generation))
        return str(self.node_memory.bin_path(held[max(held)].generation)) if held else None

    def on_offer(self, peer_headers: dict[int, dict[int, Any]]) -> None:
        """At a resume, once the peer copies this node holds were listed (``peer_headers``: by
        the rank that wrote them, by step): a due ``corrupt-peer`` drill damages the newest."""
        held = [
            (step, src, h) for src, by_step in peer_headers.items() for step, h in by_step.items()
        ]
        if not held or self.node_memory is None:
            return
        step, src, header = max(held, key=lambda x: (x[0], x[1]))
        spec = self.injector.damage_due(FaultKind.CORRUPT_PEER, step)
        if spec is None:
            return
        path = self.node_memory.bin_path(header.generation, self.node_memory.peer_dir(src))
        flip_bytes(path)
        self._fault(spec, spec.step, file=str(path), copy_of_rank=src, copy_step=step)

    def on_step_start(self, step: int) -> None:
        self.injector.maybe_fire(step)

    def on_save_started(self, step: int) -> None:
        self.injector.maybe_fire(step, phase="checkpoint")

    def on_commit(self, step: int, path: Path) -> None:
        spec = self.injector.damage_due(FaultKind.CORRUPT_CHECKPOINT, step)
        if spec is None:
            return
        victim = sorted(path.glob("*.distcp"))[0]
        flip_bytes(victim)
        self._fault(spec, step, file=str(victim))

    def _fault(self, spec: FaultSpec, step: int, **extra: Any) -> Fault:
        """The ``fault`` event of a drill this rank carried out."""
        fault = Fault(
            fault=str(spec), fault_kind=spec.kind.value, step=step, rank=self.rank, **extra
        )
        return self.events.emit(fault)


class Heartbeats(Hook):
    """ft_launcher heartbeats (``RankMonitorClient``), one per finished step."""

    def __init__(self, heartbeat: Any) -> None:
        self.heartbeat = heartbeat

    def on_step_end(self, end: StepEnd) -> None:
        self.heartbeat.beat()


class StepEvents(Hook):
    """Rank 0: a ``step`` event per step, and after the first step since a restart a
    ``recovered`` event closing every open fault (what recovery times are measured from)."""

    def __init__(
        self,
        events: EventLog,
        *,
        first_step: int,
        recovery_layer: str | None,
        began: float,
        buffered: bool = True,
    ):
        self.events = events
        self.first_step = first_step
        self.layer = recovery_layer
        self.began = began
        # Unbuffered when a launcher-side drill (node-loss@step=N) waits to see step N.
        self.buffered = buffered

    def on_step_end(self, end: StepEnd) -> None:
        # A script may not say how many tokens a step has.
        counted = bool(end.tokens) and end.step_s > 0
        # The first step after a (re)start goes out at once: a recovery ends with it.
        at_once = not self.buffered or end.step == self.first_step
        emit = self.events.emit if at_once else self.events.buffer
        # Left out (not null) when the step was unchecked: a reader tells them apart.
        extra: dict[str, Any] = {} if end.nodes is None else {"nodes": end.nodes}
        emit(
            Step(
                step=end.step,
                loss=round(end.loss, 6),
                step_s=round(end.step_s, 4),
                ckpt_blocking_s=None
                if end.ckpt_blocking_s is None
                else round(end.ckpt_blocking_s, 4),
                tokens_per_s=round(end.tokens / end.step_s, 1) if counted else None,
                tokens=end.tokens if counted else None,
                **extra,
            )
        )
        if end.step == self.first_step and self.layer is not None:
            emit_recoveries(self.events, self.layer, end.step, began=self.began)


def emit_recoveries(events: EventLog, layer: str, step: int, *, began: float) -> None:
    """Close every fault recorded since the last recovery and before this incarnation
    ``began``, attributing it to ``layer``. A fault recorded after that is not one this
    incarnation recovered from: another rank may fire its drill at the next step while rank 0
    is still here (seen: a stall at step 12 claimed by the first step after an exception's
    restart, 2 ms before it fired, its real recovery then claiming nothing)."""
    run_dir = RunDir.from_env(events.path.parent)
    retry_t = run_dir.retry_began()
    now = time.time()
    fence = run_dir.fence(events)
    for path, f in run_dir.open_faults():
        if f.t >= began:
            continue
        # Said and closed under the fence: a replaced attempt's rank 0 claims no recovery.
        with fence.hold(f"close the fault {f.fault}"):
            events.emit(
                Recovered(
                    # A fault from before the newest train-stage attempt began was carried over by
                    # the stage retry, whatever restarts that attempt needed on its own before this
                    # step (an adopted attempt is the same attempt, watched by another invocation).
                    layer="stage-retry" if f.t < retry_t else layer,
                    fault=f.fault,
                    fault_kind=f.fault_kind,
                    fault_step=f.step,
                    rank=f.rank,
                    step=step,
                    recovery_s=round(max(0.0, now - f.t), 3),
                )
            )
            path.unlink(missing_ok=True)
