"""Rank 0's Prometheus metrics: ``nvrx_train_*`` and ``nvrx_checkpoint_*`` on a scrape endpoint.

Fed from the events rank 0 already makes (``EventLog.observers``: the step, loss and tokens/s of
a ``step``, a ``checkpoint``'s seconds, a ``restart``'s layer), they cost the loop a few
in-memory updates a step: no collective, no I/O (a scrape reads on the server's own thread).

One endpoint per worker process (:func:`start_endpoint`): an in-process restart keeps it; an
in-job restart's new process binds the port again (:class:`MetricsServer` retries while the old
one exits). :class:`TrainingSeries` is also what the flow side (``tasks.metrics``) maps the same
events with, so a series means the same thing on either endpoint.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from trainer.event_types import Checkpoint, Event, Restart, Step

log = logging.getLogger(__name__)

# Seconds a save blocks the loop (the device-to-host copy): the target is well under a second.
BLOCKING_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# From save() until the checkpoint is committed (written, manifest, rename) while training goes on.
COMMIT_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


def build_versions() -> dict[str, str]:
    """nvrx-pipeline's version and the torch, NVRx and Prefect it runs with."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for label, dist in (
        ("version", "nvrx-pipeline"),
        ("torch", "torch"),
        ("nvrx", "nvidia-resiliency-ext"),
        ("prefect", "prefect"),
    ):
        try:
            out[label] = version(dist)
        except PackageNotFoundError:
            out[label] = "not installed"
    return out


class TrainingSeries:
    """The training view of a run (step, loss, tokens/s, checkpoint timings), labelled with the
    run id, from ``step`` and ``checkpoint`` events."""

    def __init__(self, registry: CollectorRegistry, run_id: str) -> None:
        def gauge(name: str, doc: str) -> Any:
            return Gauge(name, doc, ["run_id"], registry=registry).labels(run_id)

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, ["run_id"], registry=registry).labels(run_id)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(name, doc, ["run_id"], registry=registry, buckets=buckets).labels(
                run_id
            )

        self.step = gauge("nvrx_train_step", "The last step trained (rank 0)")
        # rate() of this is the step rate, without the jump back a replay gives the gauge.
        self.steps = counter("nvrx_train_steps", "Steps trained, replays after a restart included")
        self._last_step_t = float("-inf")
        self.loss = gauge("nvrx_train_loss", "Loss of the last step, averaged over the ranks")
        self.tokens_per_s = gauge(
            "nvrx_train_tokens_per_second", "Tokens per second of the last step, all ranks"
        )
        # The convention for a rate: a counter, which rate() turns into tokens/s over any window
        # (the gauge above is the last step's alone).
        self.tokens = counter(
            "nvrx_train_tokens", "Tokens trained, all ranks, replays after a restart included"
        )
        self.blocking = histogram(
            "nvrx_checkpoint_blocking_seconds",
            "Seconds a committed checkpoint's save blocked the training loop",
            BLOCKING_BUCKETS,
        )
        self.commit_latency = histogram(
            "nvrx_checkpoint_commit_latency_seconds",
            "Seconds from a checkpoint's save until it was committed",
            COMMIT_BUCKETS,
        )
        build_info(registry, run_id)

    def observe(self, e: Event) -> None:
        if isinstance(e, Step):
            # Only rank 0 writes steps, in order: one seen before (the file read again) is not
            # counted again.
            if e.t > self._last_step_t:
                self._last_step_t = e.t
                self.steps.inc()
                if e.tokens:
                    self.tokens.inc(e.tokens)
            self.step.set(e.step)
            if e.loss is not None:
                self.loss.set(e.loss)
            if e.tokens_per_s is not None:  # a script may not say its tokens
                self.tokens_per_s.set(e.tokens_per_s)
        elif isinstance(e, Checkpoint):
            self.blocking.observe(e.blocking_s)
            if e.total_s is not None:
                self.commit_latency.observe(e.total_s)


class Rank0Metrics:
    """Rank 0's endpoint: the training series and this process's in-process restarts."""

    def __init__(self, run_id: str) -> None:
        self.registry = CollectorRegistry()  # ours alone: no process or platform collectors
        self.series = TrainingSeries(self.registry, run_id)
        self.inprocess_restarts = Counter(
            "nvrx_train_inprocess_restarts",
            "In-process restarts of this rank-0 process (NVRx Wrapper)",
            ["run_id"],
            registry=self.registry,
        ).labels(run_id)

    def observe(self, e: Event) -> None:
        self.series.observe(e)
        if isinstance(e, Restart) and e.layer == "inprocess":
            self.inprocess_restarts.inc()


def rank_gauge(registry: CollectorRegistry, run_id: str) -> Any:
    return Gauge(
        "nvrx_train_rank",
        "Global rank of this pod's first worker (0: the pod serving the training series)",
        ["run_id"],
        registry=registry,
    ).labels(run_id)


def build_info(registry: CollectorRegistry, run_id: str) -> None:
    """The conventional build-info series (value 1): which versions a target runs, for a
    dashboard's table and for joins (``* on(run_id) group_left(version)``)."""
    Info("nvrx_build", "Versions this process runs", ["run_id"], registry=registry).labels(
        run_id
    ).info(build_versions())


class MetricsServer:
    """A scrape endpoint for one registry on ``addr:port``. A port still held (the previous
    incarnation exiting, another run) is retried in the background for ``retry_s``, then given
    up with a warning: metrics never stop training or a flow."""

    def __init__(
        self, registry: CollectorRegistry, *, port: int, addr: str, retry_s: float = 30.0
    ) -> None:
        self.registry, self.port, self.addr = registry, port, addr
        self._httpd: Any = None
        self._closed = threading.Event()
        self._lock = threading.Lock()
        if not self._try_bind(warn=True):
            threading.Thread(
                target=self._retry, args=(retry_s,), name="nvrx-metrics-bind", daemon=True
            ).start()

    @property
    def serving(self) -> bool:
        return self._httpd is not None

    def _try_bind(self, *, warn: bool) -> bool:
        from prometheus_client import start_http_server

        with self._lock:
            if self._closed.is_set():
                return True  # closed before it ever bound: stop trying
            try:
                self._httpd, _ = start_http_server(self.port, self.addr, registry=self.registry)
            except OSError as e:
                if e.errno != errno.EADDRINUSE:
                    log.warning("metrics endpoint %s:%s not started: %s", self.addr, self.port, e)
                    return True  # nothing to wait for
                if warn:
                    log.warning(
                        "metrics port %s:%s is in use; retrying in the background (set "
                        "metrics_port to a free port, or None to turn metrics off)",
                        self.addr,
                        self.port,
                    )
                return False
            return True

    def _retry(self, retry_s: float) -> None:
        deadline = time.monotonic() + retry_s
        while not self._closed.wait(0.5):
            if self._try_bind(warn=False):
                return
            if time.monotonic() > deadline:
                log.warning("metrics port %s:%s stayed in use: no endpoint", self.addr, self.port)
                return

    def close(self) -> None:
        """Idempotent; the port is free again when it returns."""
        with self._lock:
            self._closed.set()
            httpd, self._httpd = self._httpd, None
        if httpd is not None:
            httpd.shutdown()
            httpd.server_close()


def start_endpoint(cfg: Any, rank: int, local_rank: int, events: Any) -> MetricsServer | None:
    """This worker's endpoint, if it has one (``cfg`` a TrainConfig; the run directory is named
    by the run id): rank 0's, fed by its event log's observers; or, with
    ``cfg.metrics_every_node``, a node's first worker's: its versions and its rank, so that no
    training pod is a target refusing the scrape (``up == 0``, ``TargetDown``) and
    ``nvrx_train_rank == 0`` names the pod with rank 0's series (the training series stay rank
    0's alone: a dashboard summing pods counts nothing twice)."""
    if cfg.metrics_port is None or (rank != 0 and not (cfg.metrics_every_node and local_rank == 0)):
        return None
    run_id = cfg.run_root.name
    if rank == 0:
        metrics = Rank0Metrics(run_id)
        events.observers.append(metrics.observe)
        registry = metrics.registry
    else:
        registry = CollectorRegistry()
        build_info(registry, run_id)
    rank_gauge(registry, run_id).set(rank)
    return MetricsServer(registry, port=cfg.metrics_port, addr=cfg.metrics_addr)
