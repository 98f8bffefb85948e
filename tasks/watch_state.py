"""What the train-stage watcher knows of one attempt, and every decision it takes, as pure
transitions over an explicit state (arch §4): no I/O, no clock of its own. The shell
(:func:`tasks.train_stage.run_attempt`) reads, passes its monotonic time in, and carries out what
a transition decides; ``tests/test_watch_state.py`` drives them over recorded histories.

The decisions: which node drills are due (:func:`due`); the path a loss takes is
:func:`tasks.loss_policy.decide`'s, :func:`lost` records it; which training nodes went silent
(:func:`silent`: alive to the process table, silent to the job, judged from their beat files);
whether to go on, stop, or time out (:func:`tick`).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from tasks.loss_policy import LossDecision, LossPath
from trainer.event_types import Event, Fatal, Handoff, Step, StepCheck, TrainStart
from trainer.faults import FaultSpec
from trainer.node_beat import is_done, is_leaving


class Tick(enum.Enum):
    CONTINUE = "continue"
    ENDED = "ended"  # nothing of the attempt runs any more: judge it
    STOP_LOST = "stop-lost"  # a node is gone for good and the survivors only wait: stop them
    STOP_WAITED = "stop-waited"  # no node returned within the survivors' wait: stop them
    TIMED_OUT = "timed-out"  # the attempt's deadline passed: stop it


@dataclass(frozen=True)
class Beat:
    """A node's newest beat as the watcher last saw it change."""

    token: str  # what its beat file said (any change is a sign of life)
    changed_at: float  # watcher's monotonic clock

    @property
    def done(self) -> bool:
        """The node's agent said its last beat on a normal exit: ended, never silent."""
        return is_done(self.token)

    @property
    def leaving(self) -> bool:
        """The node's agent was told to go (an eviction's notice) and has not ended yet."""
        return is_leaving(self.token)


@dataclass(frozen=True)
class WatchState:
    started: float  # monotonic, when the watch began
    deadline_s: float | None  # None: no deadline
    # After a loss only a stage retry recovers, how long the survivors may run on (what the
    # backend needs to see the loss as a real one looks; Job.loss_grace_s).
    loss_grace_s: float = 0.0
    # How long survivors below the minimum may wait for a node to return (tasks.loss_policy).
    wait_s: float = 0.0
    min_nodes: int = 1  # the fewest nodes the job trains on (a world this size ends a wait)
    # Past the survivors' own wait, how long before the watcher stops what is left.
    wait_grace_s: float = 10.0
    # A node whose beat has not changed for this long, while another node's has, is taken
    # away as lost (None: silence is not judged).
    silence_s: float | None = None
    epoch: int | None = None  # the attempt's: only its own fatal error decides
    drills: tuple[FaultSpec, ...] = ()  # node drills not carried out yet, in step order
    fatal: str | None = None  # the attempt's first fatal error
    lost: frozenset[int] = frozenset()
    # Lost nodes the job has re-formed without (a train_start came after the loss): a
    # node-return drill counts its steps from then on.
    reformed: frozenset[int] = frozenset()
    # The nodes training now (the last train_start says); empty: not known.
    world_nodes: frozenset[int] = frozenset()
    world_at: float | None = None  # when that train_start was read (monotonic)
    last_step: int | None = None
    loss_at: float | None = None  # a loss only a stage retry recovers: when (monotonic)
    # A node evicted with notice is saving the step in flight (trainer.notice): the stop after
    # such a loss waits for that hand-off (a ``handoff`` event) until then (monotonic).
    hold_until: float | None = None
    waiting_until: float | None = None  # end of the survivors' wait for a node (monotonic)
    wait_began: float = 0.0  # when it began (epoch seconds, as events carry)
    beats: Mapping[int, Beat] = field(default_factory=dict)
    beats_read_at: float | None = None  # the newest successful read of the beat files
    frozen: Mapping[int, str] = field(default_factory=dict)  # node -> freeze drill's spec
    timed_out: bool = False


def mine(s: WatchState, e: Event) -> bool:
    """Is ``e`` this attempt's? Only events carrying its epoch are (an unfenced attempt's carry
    none): another epoch's (a replaced attempt's zombie, another run's pod on the same FSx) or
    one without an epoch decides nothing, counts no step and fires no drill."""
    return e.epoch == s.epoch


def observe(s: WatchState, e: Event, now: float) -> WatchState:
    """One event of the attempt, as read (validated: :mod:`trainer.event_types`); any other
    attempt's changes nothing."""
    if not mine(s, e):
        return s
    if isinstance(e, Fatal) and s.fatal is None:
        return replace(s, fatal=e.error)
    if isinstance(e, TrainStart) and "nodes" in e.model_fields_set:  # a world it names
        named = frozenset(e.nodes)
        # -1: a worker no backend told its node; then which nodes train is unknown.
        world = named if all(n >= 0 for n in named) else frozenset()
        waiting_until = s.waiting_until
        if len(named) >= s.min_nodes and e.t > s.wait_began:
            waiting_until = None  # a node returned in time: the world re-formed
        return replace(
            s,
            world_nodes=world,
            world_at=now,
            reformed=s.reformed | s.lost,
            # A lost node training again (its replacement joined): a later loss is new.
            lost=s.lost - world,
            waiting_until=waiting_until,
            # A new world: every node's silence counts from now (a node re-forming it may have
            # waited in the rendezvous with its beat unread).
            beats={n: Beat(b.token, now) for n, b in s.beats.items()},
        )
    if isinstance(e, Step):
        return replace(s, last_step=max(e.step, s.last_step or 0))
    if isinstance(e, Handoff):  # the evicted node's step is committed: no more to wait for
        return replace(s, hold_until=None)
    return s


def condemned(s: WatchState, e: Event) -> list[int]:
    """Nodes a step check found bad (trainer.step_check: a step rejected, replayed in place and
    rejected again, attributed to them): to be taken away as lost, so a spare replaces them or
    the world re-forms without them. A node not known (-1) or lost already is not."""
    if not (mine(s, e) and isinstance(e, StepCheck) and e.verdict == "repeat"):
        return []
    return sorted({n for n in e.nodes if n >= 0} - s.lost)


def due(s: WatchState, at_step: int | None = None) -> FaultSpec | None:
    """The next node drill to carry out now, if any: on reading a step event (``at_step``, its
    step: drills count steps as they are read, so a world re-formed after a loss counts its own,
    not the dying world's last ones read late), or at any time for a return the survivors wait
    for. The shell claims it (fire-once per run), calls :func:`drop` and carries it out."""
    for spec in s.drills:
        node = spec.target_node
        if spec.returns_node:
            # While the survivors wait no world trains, so no step would reach it: now.
            if s.waiting_until is not None and node in s.lost:
                return spec
            if node not in s.reformed:
                continue
        if at_step is not None and at_step >= spec.step:
            return spec
    return None


def drop(s: WatchState, spec: FaultSpec) -> WatchState:
    return replace(s, drills=tuple(d for d in s.drills if d != spec))


def frozen(s: WatchState, node: int, spec: FaultSpec) -> WatchState:
    """A freeze drill stopped every process of ``node``: nothing is said (a real freeze says
    nothing either); its silence will be noticed, and named after the drill."""
    return replace(s, frozen={**s.frozen, node: str(spec)})


def returned(s: WatchState, node: int) -> WatchState:
    return replace(s, lost=s.lost - {node}, reformed=s.reformed - {node})


def lost(
    s: WatchState,
    node: int,
    decision: LossDecision,
    *,
    drilled: bool,
    now: float,
    wall: float,
    notice_s: float | None = None,
) -> WatchState:
    """Node ``node`` is gone (``drilled``: the watcher took it away itself), on the path
    ``decision`` says; ``notice_s``: it was evicted with that much notice, and is saving the
    step in flight meanwhile (a stop waits for its hand-off, or for that long)."""
    s = replace(s, lost=s.lost | {node})
    if decision.idle_spare:
        return s
    if decision.path == LossPath.STAGE_RETRY and drilled:
        # A loss the backend saw ends the attempt through its own classification.
        if s.loss_at is not None:
            return s
        hold = now + notice_s if notice_s is not None else None
        return replace(s, loss_at=now, hold_until=hold)
    if decision.path == LossPath.NODE_WAIT and s.waiting_until is None:
        # The survivors give up after their join timeout (and the attempt ends in a node
        # loss, so a stage retry); the watcher stops whatever is left a little later.
        return replace(s, waiting_until=now + s.wait_s + s.wait_grace_s, wait_began=wall)
    return s


def beat(s: WatchState, tokens: Mapping[int, str], now: float) -> WatchState:
    """The beat files as just read (node -> content): a changed one is a sign of life."""
    beats = dict(s.beats)
    for node, token in tokens.items():
        old = beats.get(node)
        if old is None or old.token != token:
            beats[node] = Beat(token, now)
    return replace(s, beats=beats, beats_read_at=now)


def leaving(s: WatchState) -> list[int]:
    """Nodes whose agent says they were told to go (an eviction's SIGTERM: trainer.node_beat),
    not taken away yet: to be recorded as evicted with notice, and waited for."""
    return sorted(n for n, b in s.beats.items() if b.leaving and n not in s.lost)


def quiet(s: WatchState, now: float) -> frozenset[int]:
    """Nodes of the attempt (training, or waiting as spares: every node that beats) whose beat
    has not changed for ``silence_s``, on the newest successful read; a node lost already, or
    one whose agent said it finished, is not. No spare is offered from these."""
    if s.silence_s is None or s.world_at is None or s.beats_read_at is None:
        return frozenset()
    at = s.beats_read_at

    def quiet_since(node: int) -> float:
        b = s.beats.get(node)
        return max(s.world_at or 0.0, b.changed_at if b is not None else 0.0)

    return frozenset(n for n in _judged(s) if at - quiet_since(n) > s.silence_s)


def _judged(s: WatchState) -> frozenset[int]:
    finished = {n for n, b in s.beats.items() if b.done}
    return frozenset((s.world_nodes | set(s.beats)) - s.lost - finished)


def silent(s: WatchState, now: float) -> list[int]:
    """Nodes whose beat has not changed for ``silence_s`` while another's has: to be taken away
    as lost. Judged over every node that beats, not only the world's (a frozen node the
    rendezvous already dropped must still be ended, a frozen spare is lost too); a node that
    finished is never silent (its last beat says ``done``). No verdict while the world
    re-forms (a loss being recovered, survivors waiting), when the beat files could not be read
    lately, with fewer than two nodes to compare, or when every node is silent at once (a
    machine-wide stall, or the watcher's own reads stalled)."""
    if s.silence_s is None or s.world_at is None or len(s.world_nodes) < 1:
        return []
    if s.loss_at is not None or s.waiting_until is not None:
        return []
    # Judged on the newest successful read: a read stuck on a hung mount proves nothing.
    if s.beats_read_at is None or now - s.beats_read_at > s.silence_s / 2:
        return []
    nodes = _judged(s)
    out = quiet(s, now)
    if len(nodes) < 2 or len(out) == len(nodes):
        return []
    return sorted(out)


def tick(s: WatchState, now: float, *, running: bool) -> tuple[WatchState, Tick]:
    """After a poll: go on, or how the watch ends."""
    if not running:
        return s, Tick.ENDED
    # After the watcher takes a node away and too few remain (tasks.loss_policy), the
    # survivors fail their collectives and then wait in rendezvous (bounded by ft_launcher's
    # join timeout). The watcher knows the node is gone: it stops them (after the backend's
    # grace) instead of waiting; after an eviction with notice, once its hand-off is done.
    held = s.hold_until is not None and now < s.hold_until
    if s.loss_at is not None and now - s.loss_at >= s.loss_grace_s and not held:
        return s, Tick.STOP_LOST
    if s.waiting_until is not None and now > s.waiting_until:
        return s, Tick.STOP_WAITED  # no node returned in time: the stage retry
    if s.deadline_s is not None and now - s.started > s.deadline_s:
        return replace(s, timed_out=True), Tick.TIMED_OUT
    return s, Tick.CONTINUE
