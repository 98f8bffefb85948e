"""The fault layers' settings, validated at construction so that the timeouts nest: the
in-process restart (:class:`InProcessConfig`) and the in-job layer (:class:`InJobConfig`), whose
timeouts a worker may derive itself (``auto``, :mod:`trainer.timeouts`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from trainer.errors import require


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
    # NVRx's polling periods (1 s by default): every restart and clean exit waits up to one of
    # them several times over; a quarter second costs nothing measurable on the loop.
    monitor_interval_s: float = 0.25
    # The Wrapper's wait after a fault for other ranks' (NVRx: 1 s, all on the recovery path).
    last_call_wait_s: float = 0.25
    # SIGTERM to SIGKILL for an unresponsive rank (NVRx: 5 s, all of it for a stopped rank).
    termination_grace_s: float = 1.0

    def __post_init__(self) -> None:
        for name in (f.name for f in dataclasses.fields(self) if f.name.endswith("_s")):
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


# ft_launcher's sections (trainer.resilience.Heartbeat); anything else (start-up, an in-process
# restart) is "out of section", with its own timeout.
STEP_SECTION = "step"
CHECKPOINT_SECTION = "checkpoint"
LOAD_SECTION = "load"


def backstop(out_of_section_s: float, longest_section_s: float) -> float:
    """The heartbeat timeout auto: a beat goes out at every section's end and step renewal, so
    no healthy gap is longer than an out-of-section stretch and the longest section after it."""
    return out_of_section_s + longest_section_s


# An in-job timeout the worker derives from what its incarnation measures (trainer.timeouts).
AUTO = "auto"
# node_silence_s auto: this many beats missed. Fewer than 3 would read one late write on a
# loaded filesystem, plus the watcher's poll, as a freeze; 5 stays within the 10 s target at
# the 1 s beat with room for both.
SILENCE_BEATS = 5
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

    Every timeout (:data:`AUTO_TIMEOUTS`) is ``"auto"`` by default: ``startup_allowance_s`` until
    the incarnation has measured what it covers, then ``timeout_multiple`` x the longest such
    stretch, between its floor and the allowance (trainer.timeouts). A number pins a timeout
    (for the step timeout: the ceiling the learned one stays under)."""

    enabled: bool = True
    max_restarts: int = 3
    # A model whose build or first step takes longer needs more (or the timeouts pinned).
    startup_allowance_s: float = 600.0
    initial_heartbeat_timeout_s: Timeout = AUTO
    # The backstop: no heartbeat for this long kills the rank whatever section it is in (auto:
    # the out-of-section timeout + the longest section's, see backstop()).
    heartbeat_timeout_s: Timeout = AUTO
    # How often ft_launcher polls its workers: a death, and a clean exit, wait for it.
    monitor_interval_s: float = 0.25
    workers_stop_timeout_s: float = 5.0
    # Survivors of a lost node wait this long in rendezvous before ft_launcher gives up (exit 1).
    rdzv_join_timeout_s: float = 20.0
    # Elastic jobs: how long the rendezvous waits for more nodes once the minimum has joined;
    # how often a node renews its membership, and how many renewals it may miss before it is
    # dropped (the survivors re-form only after that).
    rdzv_last_call_s: float = 2.0
    rdzv_keep_alive_s: float = 1.0
    rdzv_keep_alive_misses: int = 3
    # Hang detection by section: the steps (reported at most once per heartbeat_interval_s), a
    # checkpoint save and commit, a load, and everything else.
    heartbeat_interval_s: float = 1.0
    step_timeout_s: Timeout = AUTO
    checkpoint_timeout_s: Timeout = AUTO
    load_timeout_s: Timeout = AUTO
    out_of_section_timeout_s: Timeout = AUTO
    # How often each node's rank monitor checks those timeouts (NVRx default 5 s).
    check_interval_s: float = 0.25
    # Learning (trainer.timeouts): the step timeout after learn_after_sections step sections past
    # the warm-up one; the others from the longest such section seen (rising, never falling).
    # 0 sections: nothing is learned.
    learn_after_sections: int = 10
    timeout_multiple: float = 5.0
    step_timeout_floor_s: float = 3.0
    section_floor_s: float = 30.0
    # A frozen node's beat file (trainer.node_beat, written by its agent, which lives through
    # every respawn) stops changing; the watcher takes it as lost after this long while another
    # node's beat changes. Auto: SILENCE_BEATS beats.
    node_silence_s: Timeout = AUTO

    def __post_init__(self) -> None:
        self._check_values()
        self._check_nesting()

    def _check_values(self) -> None:
        """Each field on its own: a count, a number of seconds, or ``auto``."""
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
        # Every other number of seconds (the step floor is checked against the interval below).
        skip = {*AUTO_TIMEOUTS, "step_timeout_floor_s"}
        for name in (f.name for f in dataclasses.fields(self) if f.name.endswith("_s")):
            if name not in skip:
                value = getattr(self, name)
                require(value > 0, f"injob.{name}", f"must be > 0 seconds, got {value}")
        require(
            isinstance(self.rdzv_keep_alive_misses, int) and self.rdzv_keep_alive_misses >= 1,
            "injob.rdzv_keep_alive_misses",
            f"must be a whole number >= 1, got {self.rdzv_keep_alive_misses!r}",
        )

    def _check_nesting(self) -> None:
        """The fields against each other: the timeouts nest as the layers need."""
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
        """The timeout ``name`` at launch: the pinned value, or the start-up allowance (the
        heartbeat ones: :func:`backstop`)."""
        value = self.pinned(name)
        if value is not None:
            return value
        if name == "node_silence_s":
            return SILENCE_BEATS * self.heartbeat_interval_s
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
