"""The embedded default: N simulated nodes on 127.0.0.1, each an ``ft_launcher`` agent in its own
session with ``--nproc-per-node`` CPU workers, joined by a c10d rendezvous (arch §4). An
attempt's processes share a network namespace of their own (:mod:`tasks.backends.netns`): their
stores are out of reach of everything else on the machine.

Node loss is simulated by killing one agent's whole process *tree* (agent, its rank monitor, its
workers and their checkpoint writers): ft_launcher starts workers in sessions of their own, so a
process-group kill would miss them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from tasks.backends import node_memory
from tasks.backends.base import (
    Hydrated,
    HydrateRequest,
    LaunchRequest,
    Placement,
)
from tasks.backends.local_devices import node_gpus
from tasks.backends.local_nodes import (
    REPO,
    NodeProcess,
    NodeStarter,
    free_port,
    kill_tree,
    start_store,
)
from tasks.backends.netns import PrivateNetwork, open_network, support
from tasks.checks import CheckResult
from tasks.classify import Observation, Outcome
from tasks.ownership import processes
from tasks.ownership.lease import RunLease
from tasks.secrets import resolve_local, scrubbed
from trainer.config import save_config
from trainer.event_types import Event, TrainStart
from trainer.fence import EPOCH_ENV
from trainer.launch import LaunchSpec, ft_launcher_argv, trainer_args, worker_env
from trainer.rundir import Layout


@dataclass
class LocalJob:
    request: LaunchRequest
    nodes: dict[int, NodeProcess]
    lost: set[int] = field(default_factory=set)  # killed by a drill, not exited
    stopped: set[int] = field(default_factory=set)  # stopped by the watcher (``stop``)
    invocation: str = ""  # the tag its processes carry (the dead owner's, when adopted)
    recorder: RunLease | None = None
    # Starts simulated node n (again); None for an adopted job (its launcher's argv is gone).
    start: Callable[[int], NodeProcess] | None = None
    deferred: list[int] = field(default_factory=list)  # spares, started once the world formed
    store: subprocess.Popen[bytes] | None = None  # the rendezvous store, when it runs apart
    store_host: int | None = 0  # the node hosting it otherwise (the first agent to start)
    # The attempt's own network (None: the host's, where user namespaces are not allowed).
    network: PrivateNetwork | None = None
    poll_s: float = 0.2
    # The watcher kills the node's process tree itself: nothing more to wait for.
    loss_grace_s: float = 0.0
    _ended: bool = False  # stop() has run

    @property
    def name(self) -> str:
        return f"attempt {self.request.attempt} ({len(self.nodes)} simulated node(s))"

    @property
    def attempt(self) -> int:
        return self.request.attempt

    def _running(self) -> set[int]:
        up = {n for n, p in self.nodes.items() if p.poll() is None}
        return up - self.stopped - self.lost

    def running(self) -> bool:
        return bool(self._running())

    def observation(self) -> Observation:
        return Observation(
            exit_codes={n: None if n in self.stopped else p.poll() for n, p in self.nodes.items()},
            lost=frozenset(self.lost),
            where="logs: "
            + str(self.request.cfg.run_root / Layout.attempt_log(self.attempt, "node*.log")),
        )

    def finish(self, outcome: Outcome) -> dict[str, Any]:
        self.stop()
        return {}

    def observe(self, event: Event) -> None:
        if self.deferred and isinstance(event, TrainStart) and self.start is not None:
            for node in self.deferred:
                self.nodes[node] = self.start(node)
            self.deferred.clear()

    def alive_nodes(self) -> frozenset[int]:
        return frozenset(self._running() | set(self.deferred))

    def losses(self) -> frozenset[int]:
        # A simulated node is lost only by the drill, which the watcher carries out itself.
        return frozenset()

    def absorb(self, node: int) -> None:
        # Nothing to tell: the end is judged by the last world's exit codes (tasks.classify),
        # and a node outside it decides nothing.
        return None

    def lose_node(self, node: int) -> None:
        if node not in self.nodes:
            raise ValueError(
                f"node-loss fault names node {node}, the job has nodes "
                f"0..{self.request.launched - 1}"
                + (" (spares not started yet)" if node in self.deferred else "")
            )
        self.lost.add(node)
        kill_tree(self.nodes[node].pid)
        self.nodes[node].wait()
        # Its memory goes with it: no later resume may read a lost node's node-memory copy.
        node_memory.forget_node(*self._memory_key, node)

    @property
    def _memory_key(self) -> tuple[Path, int, str]:
        return (self.request.cfg.run_root, self.attempt, self.invocation or self.request.invocation)

    def evict_node(self, node: int, grace_s: float) -> None:
        """A node told to go (a drain, a spot reclaim): SIGTERM to its agent, as the kubelet
        sends a pod's first process, and SIGKILL to whatever of it is left ``grace_s`` later.
        Returns at once: the node uses its notice while the watch goes on."""
        if node not in self.nodes or self.nodes[node].poll() is not None:
            raise ValueError(f"node-evict names node {node}, which is not running")
        self.lost.add(node)
        proc = self.nodes[node]
        # The recorded process is the exit-code shell; the agent is its child.
        for child in _children(proc.pid):
            with contextlib.suppress(psutil.NoSuchProcess):
                child.send_signal(signal.SIGTERM)

        def after_grace() -> None:
            deadline = time.monotonic() + grace_s
            while proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            kill_tree(proc.pid)
            proc.wait()
            node_memory.forget_node(*self._memory_key, node)

        threading.Thread(target=after_grace, name=f"evict node {node}", daemon=True).start()

    def restore_node(self, node: int) -> None:
        if node not in self.lost:
            raise ValueError(f"node-return names node {node}, which is not lost")
        if self.start is None:
            raise ValueError("node-return: this attempt was adopted; its nodes cannot be started")
        self.lost.discard(node)
        self.nodes[node] = self.start(node)

    def stop(self) -> None:
        if self._ended:  # idempotent: the process-table sweep below is not cheap
            return
        self._ended = True
        for node, proc in self.nodes.items():
            if proc.poll() is None:
                self.stopped.add(node)
                kill_tree(proc.pid)
            proc.wait()
        if self.store is not None:
            kill_tree(self.store.pid)
            self.store.wait()
        if self.network is not None:
            self.network.close()
        node_memory.forget_attempt(*self._memory_key)
        # Whatever escaped its node's tree (a worker whose agent died first) goes too.
        processes.end(
            [
                t.process
                for t in processes.tagged(self.request.cfg.run_root)
                if t.invocation == self.invocation
            ]
        )
        if self.recorder is not None:
            self.recorder.forget({"kind": "node", "attempt": self.request.attempt})


class LocalBackend:
    name = "local"

    def __init__(
        self,
        state_dir: Path | str = ".state",
        *,
        lease: RunLease | None = None,
        log: Callable[[str], None] = lambda msg: None,
    ) -> None:
        self.state_dir = Path(state_dir).absolute()
        self.placement = Placement(shared_root=self.state_dir / "fsx")
        self.lease = lease
        self.log = log
        self._said_shared = False

    def preflight(self, req: Any, s3: dict[str, Any]) -> list[CheckResult]:
        from tasks.preflight.checks import run_checks
        from tasks.preflight.local import gather_local

        return run_checks(gather_local(state_dir=self.state_dir, **s3), req)

    def hydrate(
        self, request: HydrateRequest, progress: Callable[[int, int, str], None]
    ) -> Hydrated:
        from tasks.hydrate import hydrate_dataset
        from tasks.hydrate_weights import hydrate_weights
        from tasks.storage.s3 import s3fs_filesystem

        fs = s3fs_filesystem(request.s3)
        r = hydrate_dataset(fs, request.bucket, request.prefix, request.data_dir, progress=progress)
        detail = (
            f"{r.files} files, {r.downloaded} downloaded, {r.skipped} already present and verified"
        )
        if request.weights is not None:
            pin = request.weights_pin
            w = hydrate_weights(fs, request.weights[0], request.weights[1], pin=pin)
            pinned = "pinned" if pin.sha256 else "NOT pinned (no initial_weights.sha256)"
            detail += (
                f"; initial weights {w.source} -> {w.dest}: {w.files} files, "
                f"{w.downloaded} downloaded, sha256 {w.manifest_sha256} {pinned}"
            )
        return Hydrated.of(r, detail)

    def reattach(self, request: LaunchRequest) -> LocalJob | None:
        """The nodes the dead owner started for its attempt, watched from here on, when the
        takeover found them healthy (arch §6)."""
        held = self.lease
        if held is None or held.adoptable is None or held.takeover is None:
            return None
        plan, held.adoptable = held.adoptable, None  # taken once
        request = dataclasses.replace(request, attempt=plan.attempt)
        self.log(f"train attempt {plan.attempt}: adopted from the previous owner: {plan.reason}")
        nodes = {r.node: NodeProcess.from_record(r, request.cfg.run_root) for r in plan.nodes}
        for n in nodes.values():
            held.record(n.record(plan.attempt))
        invocation = held.takeover.owner.invocation
        return LocalJob(request, nodes, invocation=invocation, recorder=held)

    def cleanup(self, run_id: str, run_root: Path) -> list[str]:
        """End every process of the run but a live other owner's, remove their node memory,
        and stop the state directory's S3 server when no live invocation uses it any more."""
        from tasks.ownership.lease import live_owner
        from tasks.storage.local_s3 import sweep

        keep = live_owner(run_root)
        ended = processes.end_invocations(run_root, keep=keep)
        memory = node_memory.forget(run_root, keep=keep)
        stopped = sweep(self.state_dir)
        return (
            [f"pid {p}" for p in ended]
            + [f"node memory {m.name}" for m in memory]
            + ([f"S3 server pid {stopped}"] if stopped else [])
        )

    def launch(self, request: LaunchRequest) -> LocalJob:
        cfg = request.cfg
        elastic = request.node_range.elastic or request.spares > 0
        spec = LaunchSpec(
            nnodes=request.nodes,
            min_nodes=request.node_range.min,
            spares=request.spares,
            nproc_per_node=request.nproc_per_node,
            rdzv_endpoint=f"127.0.0.1:{free_port()}",
            # A job whose world changes in-job keeps its rendezvous store apart from every
            # node, so that any node may be lost (tasks.backends.rdzv_store).
            external_store=elastic,
            # Unique per invocation too: a later invocation of the run (a re-run, a takeover)
            # starts its attempts at 1 again, and the workers tell an in-job respawn by seeing
            # their rendezvous id in the events already.
            rdzv_id=f"{request.run_id}-attempt{request.attempt}-{request.invocation[:8]}",
        )
        config = save_config(cfg, cfg.run_root / Layout.train_config(request.attempt))
        argv = ft_launcher_argv(cfg, spec, trainer_args(cfg, config))
        env = _worker_env(request, config)
        # Each simulated node its own GPUs (its ranks' LOCAL_RANK indexes its own list), before
        # any process starts; None: CPU workers.
        gpus = node_gpus(cfg.device, nodes=request.launched, nproc_per_node=request.nproc_per_node)
        (cfg.run_root / Layout.LOGS).mkdir(parents=True, exist_ok=True)
        network = self._network(
            request, env, cfg.run_root / Layout.attempt_log(request.attempt, "net.log")
        )
        # The job exists before its first process does, so that a launch failing part-way
        # (a node that cannot start, the store's port taken) ends what it started: the nodes so
        # far, the rendezvous store, the network's namespace holder (LocalJob.stop).
        job = LocalJob(request, {}, invocation=request.invocation, network=network)
        try:
            enter = network.enter() if network is not None else []
            start = NodeStarter(
                run_root=cfg.run_root,
                attempt=request.attempt,
                enter=enter,
                argv=argv,
                env=env,
                memory=node_memory.prepare(cfg.run_root, request.attempt, request.invocation),
                gpus=gpus,
                recorder=self.lease,
            )
            if spec.external_store:
                rdzv_log = cfg.run_root / Layout.attempt_log(request.attempt, "rdzv.log")
                job.store = start_store(spec.rdzv_endpoint, env, rdzv_log, enter=enter)
                job.store_host = None
            job.recorder, job.start = self.lease, start
            # The nodes the job trains on start now; hot spares once those formed the world
            # (the first ``train_start``), so that they are the ones waiting in the rendezvous.
            for node in range(request.nodes):
                job.nodes[node] = start(node)
        except BaseException:
            job.stop()
            raise
        job.deferred = list(range(request.nodes, request.launched))
        return job

    def _network(
        self, request: LaunchRequest, env: dict[str, str], log: Path
    ) -> PrivateNetwork | None:
        """The attempt's own network namespace, rank 0's metrics port published from it; None
        (the host's network, said once) where this machine allows no user namespaces."""
        why_not = support()
        if why_not is not None:
            if not self._said_shared:
                self._said_shared = True
                self.log(
                    "simulated nodes share this machine's network, their stores open to its "
                    f"other processes: {why_not}"
                )
            return None
        return open_network(env=env, cwd=REPO, log=log, publish=request.cfg.metrics_port)


def _children(pid: int) -> list[psutil.Process]:
    try:
        return list(psutil.Process(pid).children())
    except psutil.NoSuchProcess:
        return []


def _worker_env(request: LaunchRequest, config: Path) -> dict[str, str]:
    """Every simulated node's environment. A clean one: none of the orchestrator's credentials,
    and the run's declared secrets only (tasks.secrets), resolved now from Prefect's Secret
    blocks."""
    env = {**scrubbed(os.environ), **worker_env(config), **resolve_local(request.secrets)}
    env["NVRX_STAGE_ATTEMPT"] = str(request.attempt)
    env.pop(EPOCH_ENV, None)
    if request.epoch is not None:  # the attempt's (trainer.fence)
        env[EPOCH_ENV] = str(request.epoch)
    # All simulated nodes share this host's cores. Sized for the full world and kept when
    # an elastic job shrinks: results are bitwise reproducible for one thread count only.
    workers = request.nodes * request.nproc_per_node
    env["NVRX_CPU_THREADS"] = str(max(1, (os.cpu_count() or 1) // workers))
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.update(processes.tags(request.cfg.run_root, request.invocation))
    return env
