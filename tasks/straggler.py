"""Which node is slow (issue 42, items 2 and 3): a pure judge over the per-node busy times rank
0's step events carry (:class:`trainer.event_types.Step` ``nodes``), with an explicit state and
no I/O or clock of its own. The watcher (:mod:`tasks.train_stage`) feeds it every step event of
its attempt and carries out what it says; ``tests/test_straggler.py`` drives it over recorded
histories.

The rule (settings: :class:`trainer.straggler_config.StragglerConfig`):

- A step's *ratio* for node n is n's busy time over the median busy time of the job's nodes in
  that step. A node's *score* for a window of ``window`` measured steps is the median of its
  ratios: a median of medians, so one slow step (a page fault, a GC pause) moves nothing.
- Suspect from a window scored ``>= enter``; confirmed after ``confirm_windows`` consecutive
  such windows spanning at least ``confirm_s`` seconds; cleared by a window ``< leave``. A
  window between the two keeps the suspicion but breaks the consecutive count.
- Fail open: a step that cannot be measured (no per-node times, a node missing or unknown,
  fewer than two nodes, a checkpoint step, the warm-up after a (re)start) measures nothing: it
  neither counts toward a confirmation nor clears one. A slowdown of every node together moves
  the median with it, and scores nothing.
- ``replace`` evicts at most ``ceil(max_evict_share x nodes_total)`` nodes per
  ``evict_period_s``; a confirmed node past that is reported ``rate-limited`` (and evicted once
  the period allows, if it is still slow then).
- A (re)start or a new world (:func:`restarted`) is a new median: windows and suspicions start
  over after the warm-up; the evictions already made still count for the rate, a new attempt's
  watcher's too (:func:`recorded_evictions`, from the run's ``straggler`` events).
"""

from __future__ import annotations

import enum
import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from trainer.event_types import Event, Step, Straggler
from trainer.straggler_config import StragglerConfig, StragglerPolicy


class Unmeasured(enum.StrEnum):
    """Why a step measured nothing (counted in the state, never judged)."""

    NO_TIMES = "no-times"  # the step event carries no per-node times (no step check)
    MISSING_NODE = "missing-node"  # a node of the world has no time, or a node is unknown
    ONE_NODE = "one-node"  # fewer than two nodes: no median to be slower than
    CHECKPOINT = "checkpoint"  # its save blocked long enough to skew it
    WARM_UP = "warm-up"  # too soon after a (re)start
    NO_TIME = "no-time"  # every node took no time (nothing to divide by)


class Kind(enum.StrEnum):
    SUSPECT = "suspect"
    CONFIRMED = "confirmed"  # policy report: said, the node trains on
    REPLACED = "replaced"  # policy replace: the watcher takes the node away
    RATE_LIMITED = "rate-limited"  # policy replace, but the eviction budget is spent
    CLEARED = "cleared"


@dataclass(frozen=True)
class Sample:
    """One step as the judge reads it: when it ended (the writer's clock), how long it took,
    each node's busy time (as written: a node may be missing, unknown or twice)."""

    step: int
    t: float
    step_s: float
    busy: tuple[tuple[int, float], ...]
    ckpt_blocking_s: float = 0.0

    @classmethod
    def of(cls, e: Step) -> Sample | None:
        """A step event's sample; None when it carries no per-node times."""
        if e.nodes is None:
            return None
        return cls(
            step=e.step,
            t=e.t,
            step_s=e.step_s,
            busy=tuple((n.node, n.busy_s) for n in e.nodes),
            ckpt_blocking_s=e.ckpt_blocking_s or 0.0,
        )


@dataclass(frozen=True)
class Verdict:
    node: int
    kind: Kind
    score: float  # the newest window's score
    scores: tuple[float, ...]  # the windows the verdict rests on, oldest first
    steps: tuple[int, int]  # the first and last step of those windows
    seconds: float  # how long they span
    evidence: str


@dataclass(frozen=True)
class _Track:
    """One node's standing since the world formed."""

    suspect: bool = False
    said: Kind | None = None  # confirmed / replaced / rate-limited: said once until cleared
    streak: tuple[float, ...] = ()  # consecutive window scores >= enter
    since: float = 0.0  # when the streak's first window began (writer's clock)
    from_step: int = 0


@dataclass(frozen=True)
class StragglerState:
    world: frozenset[int] = frozenset()  # the nodes training (empty: the first sample says)
    seen: int = 0  # steps read since the (re)start (the warm-up counts them)
    last_step: int | None = None
    # The open window: per node, the ratios of its measured steps so far.
    ratios: Mapping[int, tuple[float, ...]] = field(default_factory=dict)
    window_since: float = 0.0
    window_from: int = 0
    windows: int = 0  # windows closed since the (re)start
    tracks: Mapping[int, _Track] = field(default_factory=dict)
    evicted_at: tuple[float, ...] = ()  # kept across restarts: the rate limit's
    unmeasured: Mapping[Unmeasured, int] = field(default_factory=dict)


def restarted(s: StragglerState, world: Iterable[int] = ()) -> StragglerState:
    """A (re)start or a new world (a ``train_start``): a new median; only evictions carry."""
    return StragglerState(world=frozenset(world), evicted_at=s.evicted_at, unmeasured=s.unmeasured)


def recorded_evictions(record: Iterable[Event], cfg: StragglerConfig) -> tuple[float, ...]:
    """The ``evicted_at`` a new attempt's watcher starts from: the times of the run's recorded
    evictions (``straggler`` events, verdict ``replaced``, every earlier attempt's), oldest
    first, so that a stage retry does not reset ``max_evict_share`` per ``evict_period_s``.

    Clocks: the judge runs on the writer's clock, the step events' ``t`` (unix seconds), never
    on the watcher's ``clock`` (``time.monotonic``, whose origin is the watching process's and
    means nothing to the next attempt or invocation). A ``straggler`` event's ``t`` is unix
    seconds too: the watcher's ``time.time()`` when it said the verdict, one poll after the step
    whose time the judge used, on a host that NTP keeps within milliseconds of the writer's. So
    it is taken as is, no conversion: its error counts an eviction a little longer, the safe
    side of a rate limit. An eviction older than ``evict_period_s`` before the newest event on
    record can never count again (every step of the new attempt comes after it): left out."""
    if cfg.policy != StragglerPolicy.REPLACE:
        return ()  # this attempt evicts nothing: the record need not be read
    evicted: list[float] = []
    newest = -math.inf
    for e in record:
        newest = max(newest, e.t)
        if isinstance(e, Straggler) and e.verdict == Kind.REPLACED.value:
            evicted.append(e.t)
    return tuple(sorted(t for t in evicted if newest - t < cfg.evict_period_s))


def ratios(busy: Iterable[tuple[int, float]]) -> dict[int, float] | None:
    """Each node's busy time over the step's median of them; None when that says nothing (a
    node twice or unknown, fewer than two nodes, no time at all). Also the metrics' gauge."""
    pairs = list(busy)
    nodes = [n for n, _ in pairs]
    if len(pairs) < 2 or len(set(nodes)) != len(nodes) or min(nodes) < 0:
        return None
    median = statistics.median(b for _, b in pairs)
    if median <= 0:
        return None
    return {n: b / median for n, b in pairs}


def judge(
    s: StragglerState,
    sample: Sample | None,
    now: float,
    cfg: StragglerConfig,
    *,
    nodes_total: int,
) -> tuple[StragglerState, list[Verdict]]:
    """One step read (``sample`` None: it carried no per-node times), at ``now`` (the writer's
    clock, as the sample's ``t``): the new state and what is to be said or done, most slow
    first. ``nodes_total``: the job's nodes, for the eviction rate."""
    if cfg.policy == StragglerPolicy.OFF:
        return s, []
    if sample is not None and s.last_step is not None and sample.step <= s.last_step:
        s = restarted(s, s.world)  # a replay: a restart nobody said, judged as one
    why, measured = _measure(s, sample, cfg)
    if sample is not None:
        s = replace(s, seen=s.seen + 1, last_step=sample.step)
    if why is not None:
        return replace(s, unmeasured={**s.unmeasured, why: s.unmeasured.get(why, 0) + 1}), []
    assert sample is not None and measured is not None
    if not s.ratios:
        s = replace(s, window_since=sample.t - sample.step_s, window_from=sample.step)
    s = replace(
        s,
        world=s.world or frozenset(measured),
        ratios={n: (*s.ratios.get(n, ()), r) for n, r in measured.items()},
    )
    if len(next(iter(s.ratios.values()))) < cfg.window:
        return s, []
    return _close_window(s, sample.step, now, cfg, nodes_total)


def _measure(
    s: StragglerState, sample: Sample | None, cfg: StragglerConfig
) -> tuple[Unmeasured | None, dict[int, float] | None]:
    """Why ``sample`` measures nothing, or its ratios."""
    if sample is None:
        return Unmeasured.NO_TIMES, None
    if s.seen < cfg.warmup_steps:
        return Unmeasured.WARM_UP, None
    nodes = {n for n, _ in sample.busy}
    if len(nodes) < 2 and (not s.world or len(s.world) < 2):
        return Unmeasured.ONE_NODE, None
    if (s.world and nodes != s.world) or len(nodes) != len(sample.busy) or min(nodes) < 0:
        return Unmeasured.MISSING_NODE, None
    measured = ratios(sample.busy)
    if measured is None:
        return Unmeasured.NO_TIME, None
    median = statistics.median(b for _, b in sample.busy)
    if sample.ckpt_blocking_s > cfg.ckpt_share * median:
        return Unmeasured.CHECKPOINT, None
    return None, measured


def _close_window(
    s: StragglerState, step: int, now: float, cfg: StragglerConfig, nodes_total: int
) -> tuple[StragglerState, list[Verdict]]:
    scores = {n: statistics.median(rs) for n, rs in s.ratios.items()}
    window = (s.window_since, s.window_from)
    s = replace(s, ratios={}, windows=s.windows + 1)
    tracks = dict(s.tracks)
    verdicts: list[Verdict] = []
    evicted = list(s.evicted_at)
    budget = math.ceil(cfg.max_evict_share * max(nodes_total, 1))
    for node in sorted(scores, key=lambda n: -scores[n]):
        score = scores[node]
        t = tracks.get(node, _Track())
        kind: Kind | None = None
        if score >= cfg.enter:
            if not t.streak:
                t = replace(t, since=window[0], from_step=window[1])
            t = replace(t, streak=(*t.streak, score))
            if not t.suspect:
                t, kind = replace(t, suspect=True), Kind.SUSPECT
            long_enough = now - t.since >= cfg.confirm_s
            if len(t.streak) >= cfg.confirm_windows and long_enough:
                if cfg.policy == StragglerPolicy.REPORT:
                    kind = Kind.CONFIRMED if t.said is None else kind
                elif t.said in (None, Kind.RATE_LIMITED):
                    recent = [x for x in evicted if now - x < cfg.evict_period_s]
                    if len(recent) < budget:
                        kind = Kind.REPLACED
                        evicted.append(now)
                    elif t.said is None:
                        kind = Kind.RATE_LIMITED
                if kind in (Kind.CONFIRMED, Kind.REPLACED, Kind.RATE_LIMITED):
                    t = replace(t, said=kind)
        elif score < cfg.leave:
            if t.suspect:
                kind = Kind.CLEARED
            t = _Track()
        else:  # between leave and enter: still suspect, but no longer consecutive
            t = replace(t, streak=())
        tracks[node] = t
        if kind is not None:
            verdicts.append(_verdict(node, kind, score, t, step, now, len(scores), cfg))
    return replace(s, tracks=tracks, evicted_at=tuple(evicted)), verdicts


def _verdict(
    node: int, kind: Kind, score: float, t: _Track, step: int, now: float, n: int,
    cfg: StragglerConfig,
) -> Verdict:  # fmt: skip
    scores = t.streak or (score,)
    first = t.from_step if t.streak else step - cfg.window + 1
    seconds = now - t.since if t.streak else 0.0
    listed = ", ".join(f"{x:.2f}" for x in scores)
    evidence = (
        f"node {node} took {score:.2f}x the median busy time of {n} nodes; "
        f"{len(scores)} window(s) of {cfg.window} steps >= {cfg.enter} "
        f"(scores {listed}) over steps {first}-{step}, {seconds:.1f} s"
    )
    if kind in (Kind.CONFIRMED, Kind.REPLACED, Kind.RATE_LIMITED) and step > first:
        bound, _ = cfg.detection_bound(seconds / (step - first + 1))  # at the pace it ran
        evidence += f"; the stated bound at this pace: {bound} measured steps"
    if kind == Kind.CLEARED:
        evidence = f"node {node} back to {score:.2f}x the median (< {cfg.leave}) at step {step}"
    return Verdict(node, kind, round(score, 4), scores, (first, step), round(seconds, 3), evidence)


def event(v: Verdict, cfg: StragglerConfig) -> Straggler:
    """The ``straggler`` event that says ``v`` (the watcher emits it)."""
    return Straggler(
        node=v.node,
        verdict=v.kind.value,
        score=v.score,
        scores=list(v.scores),
        window=cfg.window,
        steps=list(v.steps),
        seconds=v.seconds,
        policy=cfg.policy.value,
        evidence=v.evidence,
    )
