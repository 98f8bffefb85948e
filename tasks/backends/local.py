"""The embedded default: N simulated nodes on 127.0.0.1, each an ``ft_launcher`` agent in its own
session with ``--nproc-per-node`` CPU workers, joined by a c10d rendezvous (DESIGN §4).

Node loss is simulated by killing one agent's whole process *tree* (agent, its rank monitor, its
workers and their checkpoint writers): ft_launcher starts workers in sessions of their own, so a
process-group kill would miss them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from tasks.backends.base import JobStatus, LaunchRequest
from trainer.config import config_file, save_config
from trainer.launch import LaunchSpec, ft_launcher_argv, trainer_args, worker_env

_REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def kill_tree(pid: int) -> None:
    """SIGKILL a process and every descendant (collected first: children re-parent on death)."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(signal.SIGKILL)
    psutil.wait_procs(procs, timeout=10)


@dataclass
class LocalJob:
    request: LaunchRequest
    agents: dict[int, subprocess.Popen[bytes]]
    logs: dict[int, Path]
    lost: set[int] = field(default_factory=set)
    stopped: set[int] = field(default_factory=set)

    def status(self) -> JobStatus:
        codes = {n: p.poll() for n, p in self.agents.items()}
        return JobStatus(
            exit_codes=codes, lost_nodes=set(self.lost), stopped_nodes=set(self.stopped)
        )

    def lose_node(self, node: int) -> None:
        if node not in self.agents:
            raise ValueError(
                f"node-loss fault names node {node}, the job has nodes 0..{len(self.agents) - 1}"
            )
        self.lost.add(node)
        kill_tree(self.agents[node].pid)
        self.agents[node].wait()

    def stop(self) -> None:
        for node, proc in self.agents.items():
            if proc.poll() is None:
                self.stopped.add(node)
                kill_tree(proc.pid)
            proc.wait()


class LocalBackend:
    name = "local"

    def launch(self, request: LaunchRequest) -> LocalJob:
        cfg = request.cfg
        spec = LaunchSpec(
            nnodes=request.nodes,
            nproc_per_node=request.nproc_per_node,
            rdzv_endpoint=f"127.0.0.1:{free_port()}",
            rdzv_id=f"{request.run_id}-attempt{request.attempt}",
        )
        config = save_config(cfg, config_file(cfg.run_root, request.attempt))
        argv = ft_launcher_argv(cfg, spec, trainer_args(cfg, config))
        env = {**os.environ, **worker_env(config)}
        env["NVRX_STAGE_ATTEMPT"] = str(request.attempt)
        # All simulated nodes share this host's cores.
        workers = request.nodes * request.nproc_per_node
        env["NVRX_CPU_THREADS"] = str(max(1, (os.cpu_count() or 1) // workers))
        env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_REPO), env.get("PYTHONPATH")]))
        log_dir = cfg.run_root / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        agents: dict[int, subprocess.Popen[bytes]] = {}
        logs: dict[int, Path] = {}
        for node in range(request.nodes):
            logs[node] = log_dir / f"attempt{request.attempt}-node{node}.log"
            with open(logs[node], "wb") as log:
                agents[node] = subprocess.Popen(
                    argv,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    cwd=_REPO,
                    start_new_session=True,  # one "node" = one session we can take down whole
                )
        return LocalJob(request, agents, logs)
