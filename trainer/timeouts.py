"""In-job timeouts derived from what this incarnation measures (issue 40, item 0; the rules and
the measurements behind them: docs/architecture.md §2, "Every in-job timeout scales with the
work").

Until measured an ``auto`` timeout is the start-up allowance; then the step timeout is learned
once per incarnation from ``learn_after`` step sections after the warm-up, and the checkpoint,
load and out-of-section timeouts rise with the longest such stretch seen (never fall); the
heartbeat backstop is the out-of-section timeout plus the longest section's. Each is bounded
(floor, pin or allowance) and, unlike NVRx's ``calculate_and_set_section_timeouts``, needs no
collective. A pinned timeout never changes (the step's caps it). :class:`TimeoutPolicy` and
:class:`Observed` decide; ``trainer.resilience.Heartbeat`` applies the result. Each incarnation
learns afresh: a shrunk world or a slower node has other steps.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from trainer.config import TrainConfig
from trainer.event_types import TimeoutsSet
from trainer.layer_config import AUTO_TIMEOUTS, backstop

STEP, CHECKPOINT, LOAD, OUT_OF_SECTION = "step", "checkpoint", "load", "out_of_section"
SECTIONS = (STEP, CHECKPOINT, LOAD, OUT_OF_SECTION)


@dataclass(frozen=True)
class Derived:
    """One timeout in force and why it is that."""

    seconds: float
    why: str  # "pinned", "start-up allowance", or how it was learned


@dataclass(frozen=True)
class Timeouts:
    """Every in-job timeout of one rank's monitor."""

    step: Derived
    checkpoint: Derived
    load: Derived
    out_of_section: Derived
    heartbeat: Derived
    initial: Derived

    def sections(self) -> dict[str, float]:
        return {
            STEP: self.step.seconds,
            CHECKPOINT: self.checkpoint.seconds,
            LOAD: self.load.seconds,
        }

    def values(self) -> tuple[float, ...]:
        return tuple(getattr(self, f.name).seconds for f in dataclasses.fields(self))

    def event(self, applied: bool) -> TimeoutsSet:
        """The ``timeouts`` event rank 0 says them in (``applied``: the rank monitor took them)."""
        seconds = {f"{k}_timeout_s": getattr(self, k).seconds for k in (*SECTIONS, "heartbeat")}
        return TimeoutsSet(**seconds, applied=applied, detail=self.describe())

    def describe(self) -> dict[str, str]:
        """Each timeout's value and why, as the event and the report say it."""
        return {
            f.name: f"{getattr(self, f.name).seconds:.2f} s: {getattr(self, f.name).why}"
            for f in dataclasses.fields(self)
        }


@dataclass(frozen=True)
class Observed:
    """What an incarnation has measured: immutable, grown by :meth:`with_section`."""

    warmup_left: int = 1  # step sections still to skip
    step_sample: tuple[float, ...] = ()  # the step sections after the warm-up, until learned
    longest: tuple[tuple[str, float], ...] = ()  # per other section kind, the longest seen

    def with_section(self, kind: str, seconds: float, *, sample: int) -> Observed:
        seconds = max(0.0, seconds)
        if kind == STEP:
            if self.warmup_left:
                return dataclasses.replace(self, warmup_left=self.warmup_left - 1)
            if len(self.step_sample) >= sample:
                return self  # decided: the sample no longer grows
            return dataclasses.replace(self, step_sample=(*self.step_sample, seconds))
        old = dict(self.longest)
        if seconds <= old.get(kind, -1.0):
            return self
        return dataclasses.replace(self, longest=tuple(sorted({**old, kind: seconds}.items())))

    def longest_of(self, kind: str) -> float | None:
        return dict(self.longest).get(kind)


@dataclass(frozen=True)
class TimeoutPolicy:
    """How each timeout is derived (from the config: :meth:`of`)."""

    allowance_s: float
    multiple: float
    learn_after: int  # step sections after the warm-up; 0: nothing is learned
    step_floor_s: float
    section_floor_s: float
    out_of_section_floor_s: float
    pinned: tuple[tuple[str, float], ...]  # config field -> pinned seconds
    launch: tuple[tuple[str, float], ...]  # config field -> seconds at launch
    warmup: int = 1

    @classmethod
    def of(cls, cfg: TrainConfig) -> TimeoutPolicy:
        inj = cfg.injob
        pinned = tuple((name, v) for name in AUTO_TIMEOUTS if (v := inj.pinned(name)) is not None)
        launch = tuple((name, inj.seconds(name)) for name in AUTO_TIMEOUTS)
        return cls(
            allowance_s=inj.startup_allowance_s,
            multiple=inj.timeout_multiple,
            learn_after=inj.learn_after_sections,
            step_floor_s=cfg.step_timeout_floor(),
            section_floor_s=inj.section_floor_s,
            out_of_section_floor_s=cfg.out_of_section_floor(),
            pinned=pinned,
            launch=launch,
        )

    def _pin(self, name: str) -> float | None:
        return dict(self.pinned).get(name)

    def _launch(self, name: str) -> Derived:
        """What ft_launcher was given (``InJobConfig.seconds``) and why."""
        seconds = dict(self.launch)[name]
        if self._pin(name) is not None:
            return Derived(seconds, "pinned")
        if name in ("heartbeat_timeout_s", "initial_heartbeat_timeout_s"):
            return Derived(seconds, "the out-of-section timeout + the longest section's")
        return Derived(seconds, "start-up allowance")

    def at_start(self) -> Timeouts:
        """The launch values, which a new incarnation resets its rank monitor to (it outlives
        the workers and may hold the last one's)."""
        return Timeouts(
            step=self._launch("step_timeout_s"),
            checkpoint=self._launch("checkpoint_timeout_s"),
            load=self._launch("load_timeout_s"),
            out_of_section=self._launch("out_of_section_timeout_s"),
            heartbeat=self._launch("heartbeat_timeout_s"),
            initial=self._launch("initial_heartbeat_timeout_s"),
        )

    def derive(self, obs: Observed) -> Timeouts | None:
        """The timeouts these measurements give; None until the step sample is complete."""
        if self.learn_after == 0 or len(obs.step_sample) < self.learn_after:
            return None
        ceiling = self._pin("step_timeout_s") or self.allowance_s
        step = _learn(
            "step sections", obs.step_sample, self.multiple, min(self.step_floor_s, ceiling),
            ceiling,
        )  # fmt: skip
        return self._complete(
            step=step,
            checkpoint=self._section(
                "checkpoint_timeout_s", "checkpoint sections", obs, CHECKPOINT
            ),
            load=self._section("load_timeout_s", "loads", obs, LOAD),
            out_of_section=self._section(
                "out_of_section_timeout_s", "out-of-section stretches", obs, OUT_OF_SECTION
            ),
        )

    def _section(self, name: str, what: str, obs: Observed, kind: str) -> Derived:
        pinned = self._launch(name)
        longest = obs.longest_of(kind)
        if pinned.why == "pinned" or longest is None:
            return pinned
        floor = self.out_of_section_floor_s if kind == OUT_OF_SECTION else self.section_floor_s
        ceiling = self.allowance_s
        return _learn(what, (longest,), self.multiple, min(floor, ceiling), ceiling)

    def _complete(
        self, *, step: Derived, checkpoint: Derived, load: Derived, out_of_section: Derived
    ) -> Timeouts:
        longest = max(step.seconds, checkpoint.seconds, load.seconds)
        heartbeat = _pinned_or(
            self._pin("heartbeat_timeout_s"),
            Derived(backstop(out_of_section.seconds, longest), "the out-of-section timeout + "
                    "the longest section's"),
        )  # fmt: skip
        initial = _pinned_or(
            self._pin("initial_heartbeat_timeout_s"),
            Derived(max(heartbeat.seconds, out_of_section.seconds), "as the backstop"),
        )
        return Timeouts(step, checkpoint, load, out_of_section, heartbeat, initial)


def _pinned_or(value: float | None, derived: Derived) -> Derived:
    return derived if value is None else Derived(value, "pinned")


def _learn(
    what: str, sample: tuple[float, ...], multiple: float, floor_s: float, ceiling_s: float
) -> Derived:
    slowest = max(sample)
    raw = multiple * slowest
    why = f"{multiple:g} x the longest of {len(sample)} {what} ({slowest:.3f} s)"
    if len(sample) == 1:
        why = f"{multiple:g} x the longest of the {what} ({slowest:.3f} s)"
    if raw < floor_s:
        return Derived(round(floor_s, 3), why + ", raised to the floor")
    if raw > ceiling_s:
        return Derived(round(ceiling_s, 3), why + ", capped at the ceiling")
    return Derived(round(raw, 3), why)


class TimeoutLearner:
    """The mutable shell over :class:`TimeoutPolicy`: sees each closed section's length and
    returns the timeouts whenever they change."""

    def __init__(self, policy: TimeoutPolicy) -> None:
        self.policy = policy
        self.observed = Observed(warmup_left=policy.warmup)
        self.in_force = policy.at_start()
        self.learned = False

    def observe(self, kind: str, seconds: float) -> Timeouts | None:
        if kind not in SECTIONS:
            raise ValueError(f"unknown section {kind!r}")
        if kind == STEP and self.learned:
            return None  # decided once per incarnation: nothing to derive at each renewal
        self.observed = self.observed.with_section(kind, seconds, sample=self.policy.learn_after)
        new = self.policy.derive(self.observed)
        if new is None or (self.learned and new.values() == self.in_force.values()):
            return None
        self.learned = True
        self.in_force = new
        return new
