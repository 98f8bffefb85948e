"""The run's Prometheus metrics, served by the process running the flow while the train stage
runs: restarts by layer, recovery seconds, faults, checkpoints, train-stage attempts, ETTR, and
the training series of :class:`trainer.metrics.TrainingSeries` (so one scrape target is enough
for the dashboard on the local backend).

Everything comes from the run's ``events.jsonl``, which the flow already trusts for recovery
times and ETTR (the fold, :class:`trainer.history.RunHistory`): the metrics cannot disagree
with the run report.
:meth:`RunMetrics.observe` counts each event once, however often the file is read again (a
re-attached watcher, a second tail from the start).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from tasks.straggler import Kind as StragglerVerdict
from tasks.straggler import ratios
from trainer.event_read import DROP_REASONS, DropCounts
from trainer.event_types import (
    Checkpoint,
    Event,
    Fault,
    Recovered,
    Restart,
    Resume,
    StageAttempt,
    Step,
    Straggler,
)
from trainer.events import LAYERS
from trainer.faults import KINDS as FAULT_KINDS
from trainer.history import RunHistory
from trainer.metrics import MetricsServer, TrainingSeries
from trainer.rundir import RunDir

_log = logging.getLogger(__name__)

# A recovery is seconds (in-process) to minutes (a stage retry waits for nodes).
RECOVERY_BUCKETS = (1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
# A load is milliseconds (a small model, node memory) to minutes (90 GB from FSx).
LOAD_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
LOAD_SOURCES = ("durable",)


def restart_layer(e: Event) -> str | None:
    """The layer an event says restarted training, if it is a restart: the trainer's
    ``restart`` events (in-process, in-job), and a train-stage attempt after the first (an
    attempt adopted from a dead owner restarts nothing)."""
    if isinstance(e, Restart):
        return e.layer
    if isinstance(e, StageAttempt) and e.stage == "train" and e.attempt > 1 and not e.adopted:
        return "stage-retry"
    return None


class RunMetrics:
    """The metrics of one run, fed event by event (``observe``)."""

    def __init__(self, run_id: str, *, clock: Callable[[], float] = time.time) -> None:
        self.registry = CollectorRegistry()
        self.run_id = run_id
        self.clock = clock
        r = self.registry
        self.series = TrainingSeries(r, run_id)
        self.restarts = Counter(
            "nvrx_restarts",
            "Restarts of training, by the layer that restarted it",
            ["run_id", "layer"],
            registry=r,
        )
        self.recovery = Histogram(
            "nvrx_recovery_seconds",
            "Seconds from a fault until the first step after its recovery, by layer",
            ["run_id", "layer"],
            registry=r,
            buckets=RECOVERY_BUCKETS,
        )
        # Checkpoint loads (a resume's), by the tier they read: "durable" today (issue 29).
        self.load_seconds = Histogram(
            "nvrx_checkpoint_load_seconds",
            "Seconds a resume's checkpoint load took, by the tier it read",
            ["run_id", "source"],
            registry=r,
            buckets=LOAD_BUCKETS,
        )
        self.load_bytes = Counter(
            "nvrx_checkpoint_load_bytes",
            "Bytes resumes read from checkpoints, by the tier they read",
            ["run_id", "source"],
            registry=r,
        )
        self.faults = Counter(
            "nvrx_faults_detected",
            "Faults detected (drills, lost nodes), by kind",
            ["run_id", "kind"],
            registry=r,
        )
        self._straggler_metrics(r, run_id)
        self.checkpoints = Counter(
            "nvrx_checkpoints_committed", "Checkpoints committed", ["run_id"], registry=r
        ).labels(run_id)
        self.last_committed = Gauge(
            "nvrx_checkpoint_last_committed_step",
            "Step of the newest committed checkpoint",
            ["run_id"],
            registry=r,
        ).labels(run_id)
        self.attempts = Counter(
            "nvrx_train_stage_attempts", "Train-stage attempts started", ["run_id"], registry=r
        ).labels(run_id)
        Gauge(
            "nvrx_ettr_ratio",
            "Effective training time ratio: productive step time / train-stage wall time",
            ["run_id"],
            registry=r,
        ).labels(run_id).set_function(lambda: self.ettr() or 0.0)
        # Every layer's and fault kind's series exists from the start at 0, not absent: else
        # a counter's first sample is already 1 and increase() (the dashboard's annotations,
        # the alert rules) never sees the first restart or fault.
        for layer in LAYERS:
            self.restarts.labels(run_id, layer)
            self.recovery.labels(run_id, layer)
        for fault_kind in FAULT_KINDS:
            self.faults.labels(run_id, fault_kind)
        for source in LOAD_SOURCES:
            self.load_seconds.labels(run_id, source)
            self.load_bytes.labels(run_id, source)
        self._seen: set[str] = set()
        self._last_step_t = 0.0
        # The one fold (as the report's and the result's ETTR): bounded in steps.
        self.history = RunHistory()

    def _straggler_metrics(self, r: CollectorRegistry, run_id: str) -> None:
        # Slow nodes (tasks.straggler): each node's busy time over the step's median (every
        # step that carries per-node times), the judge's window score at its verdicts, the
        # verdicts and the evictions they caused.
        self.node_ratio = Gauge(
            "nvrx_node_busy_ratio",
            "A node's busy time in the last step over the median of the job's nodes",
            ["run_id", "node"],
            registry=r,
        )
        self.straggler_score = Gauge(
            "nvrx_straggler_score",
            "A node's window score (busy time over the job's median) at its newest verdict",
            ["run_id", "node"],
            registry=r,
        )
        self.straggler_verdicts = Counter(
            "nvrx_straggler_verdicts",
            "Straggler verdicts: suspect, confirmed, replaced, rate-limited, cleared",
            ["run_id", "verdict"],
            registry=r,
        )
        self.straggler_evictions = Counter(
            "nvrx_straggler_evictions",
            "Nodes taken away for being slow (straggler policy replace)",
            ["run_id"],
            registry=r,
        ).labels(run_id)
        for verdict in StragglerVerdict:
            self.straggler_verdicts.labels(run_id, verdict.value)

    def observe(self, e: Event) -> None:
        if self.history.stale(e):  # a replaced attempt's zombie: not the run's
            return
        if isinstance(e, Step):
            # Only rank 0 writes steps, in order: one seen before (the file read again) is not
            # folded again.
            self.series.observe(e)
            for node, ratio in (ratios((n.node, n.busy_s) for n in e.nodes or ()) or {}).items():
                self.node_ratio.labels(self.run_id, str(node)).set(ratio)
            if e.t > self._last_step_t:
                self._last_step_t = e.t
                self.history.observe(e)
            return
        key = e.model_dump_json()
        if key in self._seen:
            return
        self._seen.add(key)
        self.history.observe(e)
        self.series.observe(e)
        layer = restart_layer(e)
        if layer is not None:
            self.restarts.labels(self.run_id, layer).inc()
        match e:
            case Recovered():
                self.recovery.labels(self.run_id, e.layer).observe(e.recovery_s)
            case Fault():
                self.faults.labels(self.run_id, e.fault_kind).inc()
            case Resume(action="loaded"):
                source = e.source or "durable"
                if e.load_s is not None:
                    self.load_seconds.labels(self.run_id, source).observe(e.load_s)
                if e.bytes is not None:
                    self.load_bytes.labels(self.run_id, source).inc(e.bytes)
            case Straggler():
                self.straggler_score.labels(self.run_id, str(e.node)).set(e.score)
                self.straggler_verdicts.labels(self.run_id, e.verdict).inc()
                if e.verdict == StragglerVerdict.REPLACED:
                    self.straggler_evictions.inc()
            case Checkpoint():
                self.checkpoints.inc()
                self.last_committed.set(e.step)
            case StageAttempt(stage="train"):
                self.attempts.inc()

    def ettr(self) -> float | None:
        """The fold's ``RunHistory.ettr``; while a train attempt runs, its wall time so far
        counts."""
        return self.history.ettr(now=self.clock())


class DroppedLines(Collector):
    """``nvrx_event_lines_dropped_total{reason}``: lines of the run's events file the decoder
    dropped (trainer.event_read): a writer out of contract, or a hostile one, made visible."""

    def __init__(self, run_id: str, counts: DropCounts) -> None:
        self.run_id = run_id
        self.counts = counts

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "nvrx_event_lines_dropped",
            "Lines of events.jsonl dropped by the decoder, by reason",
            labels=["run_id", "reason"],
        )
        for reason in DROP_REASONS:
            family.add_metric([self.run_id, reason], self.counts.by_reason[reason])
        yield family


@contextlib.contextmanager
def serving(
    run_root: Path, run_id: str, *, port: int | None, addr: str, poll_s: float = 0.5
) -> Iterator[RunMetrics | None]:
    """Serve the run's metrics on ``addr:port`` for the duration of the block, following its
    events file from the start; ``port`` None: nothing is served."""
    if port is None:
        yield None
        return
    metrics = RunMetrics(run_id)
    tail = RunDir(run_root).event_reader()
    metrics.registry.register(DroppedLines(run_id, tail.dropped))
    stop = threading.Event()

    def pump() -> None:
        for e in tail.read_new():
            metrics.observe(e)

    def follow() -> None:
        # The follower outlives anything one poll meets: a thread that died here would keep
        # serving stale values with nothing to say so.
        while not stop.wait(poll_s):
            try:
                pump()
            except Exception as e:
                _log.warning("run metrics: reading %s failed: %s", tail.path, e)

    pump()
    server = MetricsServer(metrics.registry, port=port, addr=addr)
    thread = threading.Thread(target=follow, name="nvrx-run-metrics", daemon=True)
    thread.start()
    try:
        yield metrics
    finally:
        stop.set()
        thread.join(5)
        server.close()
