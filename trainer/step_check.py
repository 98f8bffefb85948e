"""The step check (arch §2, "Step check"): before ``optimizer.step()`` every rank's loss and
gradient norm are checked (finite, and within a spike bound over a rolling window) and agreed in
one small collective; a failed step is never applied and is replayed in place.

One float64 vector, ``SLOTS`` per rank, all-reduced with SUM (gloo has no AVG): each rank writes
only its own slots, so the sum hands every rank every rank's values exactly (``x + 0 == x``, and
a NaN stays in the slot of the rank that made it). Under FSDP2 the ranks' gradient shards
partition the parameters, so ``sqrt`` of the summed local sums of squares is the global norm.
The same collective carries each rank's busy time (step start to entering it) and node: the
per-node straggler signal of the ``step`` event.

The decision is pure (:func:`judge`, :func:`next_action` over a :class:`Reading` and a
:class:`Window`); :class:`StepChecker` does the collective, the events and the replay protocol.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist

from trainer.errors import TrainerError, require
from trainer.event_types import NodeTime, StepCheck

if TYPE_CHECKING:
    from torch import nn

    from trainer.events import EventLog

# Per rank: local loss (sum of its micro-batch losses), local grad sum of squares, busy s, node.
SLOTS = 4
# A window of near-identical values has a σ near 0, and then any wobble would be a "spike": the
# spread used is at least this share of the window's mean.
REL_STD_FLOOR = 0.05


@dataclass(frozen=True, kw_only=True)
class StepCheckConfig:
    """The pre-update step check. Defaults are conservative, so that a fault-free run never
    trips: a value is a spike only above ``mean + sigma × max(σ, 5 % of the mean)`` of the last
    ``window`` accepted finite values, judged once ``min_samples`` of them are in (OLMo skips
    beyond 6σ of 128 steps). A non-finite value always fails."""

    enabled: bool = True
    window: int = 128
    sigma: float = 6.0
    min_samples: int = 32
    # After a repeat (a replay failed again): how long the ranks wait, training nothing, for
    # the watcher to take the named node away before they raise StepCheckFailed (a restart
    # from the newest good state). 0: raise at once.
    repeat_wait_s: float = 60.0

    def __post_init__(self) -> None:
        require(
            isinstance(self.window, int) and self.window >= 2,
            "step_check.window",
            f"must be an integer of at least 2 steps, got {self.window!r}",
        )
        require(
            isinstance(self.min_samples, int) and 2 <= self.min_samples <= self.window,
            "step_check.min_samples",
            f"must be an integer from 2 to step_check.window ({self.window}), got "
            f"{self.min_samples!r}",
        )
        require(
            isinstance(self.sigma, (int, float)) and math.isfinite(self.sigma) and self.sigma > 0,
            "step_check.sigma",
            f"must be a positive number of standard deviations (6 is conservative), got "
            f"{self.sigma!r}",
        )
        require(
            isinstance(self.repeat_wait_s, (int, float)) and 0 <= self.repeat_wait_s <= 3600,
            "step_check.repeat_wait_s",
            f"must be 0 to 3600 seconds, got {self.repeat_wait_s!r}",
        )


@dataclass(frozen=True)
class Window:
    """The last accepted finite values of the global loss and grad norm (oldest first). A
    non-finite value never enters: one NaN would poison every bound after it (OLMo froze its
    weights for 129 steps that way)."""

    losses: tuple[float, ...] = ()
    norms: tuple[float, ...] = ()

    def push(self, loss: float | None, norm: float, size: int) -> Window:
        def add(values: tuple[float, ...], x: float | None) -> tuple[float, ...]:
            return values if x is None or not math.isfinite(x) else (*values, x)[-size:]

        return Window(add(self.losses, loss), add(self.norms, norm))


def bound(values: Sequence[float], cfg: StepCheckConfig) -> float | None:
    """The spike bound over ``values``, None while fewer than ``min_samples`` (warm-up)."""
    if len(values) < cfg.min_samples:
        return None
    mean = statistics.fmean(values)
    spread = max(statistics.pstdev(values, mean), REL_STD_FLOOR * abs(mean))
    return mean + cfg.sigma * spread


@dataclass(frozen=True)
class Reading:
    """The reduced vector, per rank: what every rank now knows of the step."""

    losses: tuple[float, ...]  # each rank's sum of its micro-batch losses
    sumsqs: tuple[float, ...]  # each rank's local gradient sum of squares
    busy: tuple[float, ...]  # each rank's seconds from the step's start to the check
    nodes: tuple[int, ...]  # each rank's node (-1: unknown)
    count: int  # micro-batches in the global batch: the loss is the sum over them
    loss_known: bool = True  # False: a script gave no loss; only gradients are checked

    @classmethod
    def of(cls, values: Sequence[float], count: int, *, loss_known: bool = True) -> Reading:
        per = [values[r : r + SLOTS] for r in range(0, len(values), SLOTS)]
        return cls(
            tuple(p[0] for p in per),
            tuple(p[1] for p in per),
            tuple(p[2] for p in per),
            tuple(int(p[3]) for p in per),
            count,
            loss_known,
        )

    @property
    def loss(self) -> float | None:
        # sum, not fsum: fsum raises on inf - inf; a non-finite loss must stay a value
        return sum(self.losses) / self.count if self.loss_known else None

    @property
    def grad_norm(self) -> float:
        total = sum(self.sumsqs)  # NaN/Inf propagate: fsum would raise on inf - inf
        return math.sqrt(total) if total >= 0 else math.nan

    def node_times(self) -> list[NodeTime]:
        """Per node, its slowest rank's busy time (the straggler signal)."""
        worst: dict[int, float] = {}
        for node, busy in zip(self.nodes, self.busy, strict=True):
            worst[node] = max(worst.get(node, 0.0), busy)
        return [NodeTime(node=n, busy_s=round(max(0.0, s), 4)) for n, s in sorted(worst.items())]


@dataclass(frozen=True)
class Judgement:
    ok: bool
    reason: str = ""
    ranks: tuple[int, ...] = ()  # attributable ranks (non-finite values of their own)
    loss: float | None = None
    grad_norm: float | None = None
    bound: float | None = None  # the spike bound that was crossed


def judge(reading: Reading, window: Window, cfg: StepCheckConfig) -> Judgement:
    """Finite on every rank, then within the spike bounds of ``window``. Non-finite values are
    attributed to the ranks whose own slots hold them; a spike of a global value to no rank
    (one copy of the step cannot say whose computation made it)."""
    loss, norm = reading.loss, reading.grad_norm
    bad = tuple(
        r
        for r, (lo, sq) in enumerate(zip(reading.losses, reading.sumsqs, strict=True))
        if not math.isfinite(sq) or (reading.loss_known and not math.isfinite(lo))
    )
    if bad:
        what = "loss or gradient" if reading.loss_known else "gradient"
        ranks = ", ".join(map(str, bad))
        return Judgement(False, f"non-finite {what} on rank {ranks}", bad, loss, norm)
    for name, value, values in (("loss", loss, window.losses), ("grad norm", norm, window.norms)):
        limit = bound(values, cfg)
        if value is not None and limit is not None and value > limit:
            return Judgement(
                False,
                f"{name} spike: {value:.6g} > {limit:.6g} (mean + {cfg.sigma:g}σ of the last "
                f"{len(values)} steps)",
                (),
                loss,
                norm,
                limit,
            )
    return Judgement(True, "", (), loss, norm)


Action = Literal["apply", "transient", "rejected", "repeat"]


def next_action(judgement: Judgement, *, replaying: bool) -> Action:
    """What follows a step's check: ``apply`` (passed), ``transient`` (passed on its replay),
    ``rejected`` (failed: no update, replay in place), ``repeat`` (its replay failed too)."""
    if judgement.ok:
        return "transient" if replaying else "apply"
    return "repeat" if replaying else "rejected"


def repeat_ranks(first: Judgement, again: Judgement) -> tuple[int, ...]:
    """The ranks a repeat is attributed to: those that failed both times (the same place)."""
    return tuple(r for r in again.ranks if r in first.ranks)


class StepCheckFailed(TrainerError, RuntimeError):
    """A step failed its check again on its replay (``repeat``), or a step applied without a
    check ended with a non-finite loss. Not terminal: the layers restart the ranks from the
    newest good state (memory tier, then durable), which nothing trained through it reached."""


def local_grads(model: nn.Module) -> list[torch.Tensor]:
    """This rank's own gradient tensors (an FSDP2 DTensor's local shard)."""
    from torch.distributed.tensor import DTensor

    out = []
    for p in model.parameters():
        g = p.grad
        if g is not None:
            out.append(g.to_local() if isinstance(g, DTensor) else g)
    return out


def sum_of_squares(grads: list[torch.Tensor]) -> float:
    """Σ g² over ``grads``: one fused norm per tensor (``torch._foreach_norm``), summed in
    float64. NaN/Inf propagate."""
    grads = [g for g in grads if g.numel()]
    if not grads:
        return 0.0
    norms = torch._foreach_norm(grads, 2.0)
    return float(torch.stack([n.double() for n in norms]).pow(2).sum().item())


@dataclass
class _Pending:
    step: int
    first: Judgement


@dataclass
class StepChecker:
    """One attempt's step check on one rank: the collective, the window, the replay protocol
    and (rank 0) the ``step_check`` events."""

    cfg: StepCheckConfig
    rank: int
    world_size: int
    node: int
    events: EventLog | None  # rank 0's; None elsewhere
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    # Gray drills (trainer.gray_drills): damage the grads / stretch the busy time before the
    # collective; no-ops without drills.
    corrupt: Callable[[int, list[torch.Tensor]], None] = lambda step, grads: None
    slow: Callable[[int, float], None] = lambda step, busy_s: None
    # Kept alive while a repeat waits to be ended (the in-job heartbeat).
    beat: Callable[[], None] = lambda: None
    window: Window = field(default_factory=Window)
    pending: _Pending | None = None
    checked: int | None = None  # the newest step whose update the check let through
    last: Reading | None = None  # that step's reading (its per-node times)

    def check(self, step: int, model: nn.Module, loss: Any, *, count: int, started: float) -> bool:
        """Every rank, before ``optimizer.step()``: True to apply the update; False when it was
        rejected (the caller computes the same step again). A repeat waits, then raises
        :class:`StepCheckFailed`. ``loss``: this rank's summed micro-batch losses (None: a
        script gave none); ``started``: perf_counter at the (re)computation's start."""
        grads = local_grads(model)
        self.corrupt(step, grads)
        sumsq = sum_of_squares(grads)
        if self.device.type == "cuda":  # the busy time must include the device's work
            torch.cuda.synchronize(self.device)
        self.slow(step, time.perf_counter() - started)
        busy = time.perf_counter() - started
        vector = torch.zeros(SLOTS * self.world_size, dtype=torch.float64)
        known = loss is not None
        mine = float(torch.as_tensor(loss).double().sum().item()) if known else 0.0
        vector[SLOTS * self.rank : SLOTS * (self.rank + 1)] = torch.tensor(
            [mine, sumsq, busy, float(self.node)], dtype=torch.float64
        )
        if self.world_size > 1:
            vector = vector.to(self.device)
            dist.all_reduce(vector)
        reading = Reading.of(vector.cpu().tolist(), count, loss_known=known)
        judgement = judge(reading, self.window, self.cfg)
        pending = self.pending
        replaying = pending is not None and pending.step == step
        action = next_action(judgement, replaying=replaying)
        if action in ("apply", "transient"):
            self.pending = None
            self.window = self.window.push(reading.loss, reading.grad_norm, self.cfg.window)
            self.checked, self.last = step, reading
            if action == "transient":
                self._emit(step, "transient", judgement, reading, pending)
            return True
        if action == "rejected":
            self.pending = _Pending(step, judgement)
            self._emit(step, "rejected", judgement, reading, None)
            return False
        assert pending is not None
        self._emit(step, "repeat", judgement, reading, pending)
        self._wait_to_be_ended()
        raise StepCheckFailed(
            f"step {step} failed its check again on its replay ({judgement.reason}); no "
            "update was applied from it: restarting from the newest good state"
        )

    def refuse(self, step: int, loss: float) -> None:
        """A step applied without a check (a script that never calls
        ``before_optimizer_step(model)``) ended with a non-finite loss: never saved; raise."""
        judgement = Judgement(False, f"non-finite loss {loss} after an unchecked update", (), loss)
        if self.events is not None:
            self.events.emit(
                StepCheck(step=step, verdict="rejected", reason=judgement.reason, loss=None)
            )
        raise StepCheckFailed(
            f"step {step}: the loss is {loss} after an update no check preceded; not saved: "
            "restarting from the newest good state (call session.before_optimizer_step(model) "
            "before optim.step() to have such a step replayed in place instead)"
        )

    def _emit(
        self,
        step: int,
        verdict: Literal["rejected", "transient", "repeat"],
        judgement: Judgement,
        reading: Reading,
        pending: _Pending | None,
    ) -> None:
        if self.events is None:
            return
        ranks = judgement.ranks
        reason = judgement.reason
        if verdict == "transient" and pending is not None:
            ranks, reason = pending.first.ranks, f"replay passed; was: {pending.first.reason}"
        elif verdict == "repeat" and pending is not None:
            ranks = repeat_ranks(pending.first, judgement)
        nodes = sorted({reading.nodes[r] for r in ranks})
        self.events.emit(
            StepCheck(
                step=step,
                verdict=verdict,
                reason=reason,
                ranks=list(ranks),
                nodes=nodes,
                loss=_finite(judgement.loss),
                grad_norm=_finite(judgement.grad_norm),
                bound=judgement.bound,
            )
        )

    def _wait_to_be_ended(self) -> None:
        """A repeat: train nothing for up to ``repeat_wait_s`` while the watcher takes the named
        node away (a spare, the elastic world re-forming, or a stage retry ends these ranks);
        the in-job heartbeat goes on, so the wait is not read as a hang."""
        deadline = time.monotonic() + self.cfg.repeat_wait_s
        while time.monotonic() < deadline:
            self.beat()
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))


def _finite(x: float | None) -> float | None:
    """An event field (JSON has no NaN): a non-finite value is left out."""
    return x if x is not None and math.isfinite(x) else None
