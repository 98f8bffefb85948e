"""The ``ft_launcher`` command line for a training config: one source for tests, the local
backend and the EKS Job template.

Spellings are the ones that work on NVRx 0.4.1 and still on 0.7.0 (not ``--ft-param-*``).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

from trainer.config import TrainConfig
from trainer.elastic import NodeRange
from trainer.rundir import Layout


@dataclass(frozen=True, kw_only=True)
class LaunchSpec:
    nnodes: int = 1  # the most nodes the job trains on
    # An elastic job (trainer.elastic) re-forms on as few as this many (None: exactly nnodes).
    min_nodes: int | None = None
    nproc_per_node: int = 2
    # The rendezvous store runs apart from every agent (the local backend's elastic jobs): no
    # agent hosts it, so any node may be lost. False: the agent at the endpoint hosts it.
    external_store: bool = False
    spares: int = 0  # hot spare agents launched beyond nnodes (they wait in the rendezvous)
    rdzv_endpoint: str = "127.0.0.1:29500"
    rdzv_id: str = "nvrx"
    # Set on CPU hosts with NVRx >= 0.7 (GPU memory reclaim waits for NVML otherwise).
    cpu_only: bool = True

    @property
    def elastic(self) -> bool:
        """The world may change size or membership in-job (a range, or spares waiting)."""
        return (self.min_nodes is not None and self.min_nodes < self.nnodes) or self.spares > 0

    @property
    def launched(self) -> int:
        """Agents started: the most nodes the job trains on, and the spares."""
        return self.nnodes + self.spares


def ft_launcher_argv(
    cfg: TrainConfig, spec: LaunchSpec, trainer_args: list[str], *, portable: bool = False
) -> list[str]:
    """``portable``: the programs as a container image's PATH has them, not this machine's."""
    inj = cfg.injob
    low = spec.nnodes if spec.min_nodes is None else spec.min_nodes
    argv = [
        *launcher_command(cfg, spec, portable=portable),
        f"--nnodes={NodeRange(low, spec.nnodes)}",  # N, or MIN:MAX for an elastic job
        f"--nproc-per-node={spec.nproc_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={spec.rdzv_endpoint}",
        f"--rdzv-id={spec.rdzv_id}",
        f"--rdzv-conf={rdzv_conf(cfg, spec)}",
        f"--max-restarts={inj.max_restarts}",
        f"--monitor-interval={inj.monitor_interval_s}",
        f"--workers-stop-timeout={int(inj.workers_stop_timeout_s)}",
        # An eviction's SIGTERM: the workers end within the grace, not NVRx's 1800 s default.
        f"--term-timeout={inj.term_timeout_s}",
        f"--ft-initial-rank-heartbeat-timeout={inj.seconds('initial_heartbeat_timeout_s')}",
        f"--ft-rank-heartbeat-timeout={inj.seconds('heartbeat_timeout_s')}",
        "--ft-rank-section-timeouts="
        + ",".join(f"{name}:{t}" for name, t in inj.section_timeouts().items()),
        f"--ft-rank-out-of-section-timeout={inj.seconds('out_of_section_timeout_s')}",
        f"--ft-workload-check-interval={inj.check_interval_s}",
        "--ft-enable-nic-monitor=false",
    ]
    if spec.cpu_only and _nvrx_major_minor() >= (0, 7):
        argv.append("--ft-gpu-memory-reclaim-timeout=0")
    return [*argv, *trainer_args]


def launcher_command(cfg: TrainConfig, spec: LaunchSpec, *, portable: bool = False) -> list[str]:
    """NVRx's launcher through :mod:`trainer.agent`: the node's beat from the process that
    outlives its workers' respawns, and for an elastic job the shorter rendezvous keep-alive a
    dead node is dropped after."""
    inj = cfg.injob
    python = "python" if portable else sys.executable
    argv = [python, "-m", "trainer.agent"]
    if spec.elastic:
        argv += ["--keep-alive", f"{inj.rdzv_keep_alive_s:g}:{inj.rdzv_keep_alive_misses}"]
    argv += ["--beat", f"{cfg.run_root}:{inj.heartbeat_interval_s:g}"]
    if any(f.freezes_node for f in cfg.faults):
        argv += ["--freeze-drill", "yes"]  # the beat thread looks for the drill's marker
    return [*argv, "--"]


def rdzv_conf(cfg: TrainConfig, spec: LaunchSpec) -> str:
    """``--rdzv-conf`` (keys of NVRx's rendezvous, ``_ft_rendezvous``; whole seconds)."""
    inj = cfg.injob
    conf: dict[str, object] = {
        # Bounded wait for a lost node: without it survivors wait in rendezvous forever.
        "join_timeout": int(inj.rdzv_join_timeout_s),
    }
    if spec.min_nodes is not None and spec.min_nodes < spec.nnodes:
        conf["last_call_timeout"] = max(1, round(inj.rdzv_last_call_s))
    if spec.external_store:
        conf["is_host"] = "false"
    return ",".join(f"{k}={v}" for k, v in conf.items())


def _nvrx_major_minor() -> tuple[int, int]:
    from trainer.nvrx_compat import version

    try:
        major, minor = version().split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return (0, 0)


CONFIG_ENV = "NVRX_CONFIG"  # the attempt's config file, for script mode (trainer.script)


def trainer_args(cfg: TrainConfig, config_path: Path) -> list[str]:
    """What ft_launcher runs in each worker: the trainer reading the attempt's config file, or
    the user's script with its own arguments (it finds the config through ``NVRX_CONFIG``)."""
    if cfg.is_script:
        return [str(cfg.script_path), *cfg.expanded_script_args()]
    return ["-m", "trainer", f"--config={config_path}"]


def worker_env(config_path: Path) -> dict[str, str]:
    """Environment every worker needs besides the launcher's own."""
    return {CONFIG_ENV: str(config_path)}


def main(argv: list[str] | None = None) -> int:
    """``python -m trainer.launch [--nnodes N] [--nproc-per-node P] [--rdzv-endpoint H:P]
    [--rdzv-id ID] TRAINER_ARGS...``: validate the config here, then exec ft_launcher."""
    import argparse

    from trainer.config import ConfigError, save_config
    from trainer.errors import ExitCode
    from trainer.faults import FaultSpecError
    from trainer.worker_cli import build_parser, config_from_args

    p = argparse.ArgumentParser(prog="python -m trainer.launch", add_help=False)
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--nproc-per-node", type=int, default=2)
    p.add_argument("--rdzv-endpoint", default="127.0.0.1:29500")
    p.add_argument("--rdzv-id", default="nvrx")
    launch, rest = p.parse_known_args(argv)
    try:
        cfg = config_from_args(build_parser("python -m trainer.launch").parse_args(rest))
    except (ConfigError, FaultSpecError) as e:
        print(f"error: invalid configuration: {e}", file=sys.stderr)
        return ExitCode.CONFIG
    spec = LaunchSpec(
        nnodes=launch.nnodes,
        nproc_per_node=launch.nproc_per_node,
        rdzv_endpoint=launch.rdzv_endpoint,
        rdzv_id=launch.rdzv_id,
    )
    path = save_config(cfg, cfg.run_root / Layout.CONFIG / "launch.json")
    argv_out = ft_launcher_argv(cfg, spec, trainer_args(cfg, path))
    os.environ.update(worker_env(path))
    print(" ".join(argv_out), file=sys.stderr, flush=True)
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    os.execv(argv_out[0], argv_out)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())


def incarnation(env: dict[str, str] | None = None) -> str | None:
    """This worker group: the rendezvous id and the group's restart count (every node's agent
    restarts its group together); None when not under a launcher."""
    env = dict(os.environ) if env is None else env
    run = env.get("TORCHELASTIC_RUN_ID")
    return None if not run else f"{run}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
