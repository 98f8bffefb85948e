"""The fair baseline: plain ``torchrun --max-restarts`` + the same FSDP2 model + synchronous DCP.

What users would otherwise run, built from the same parts as ours wherever the part is not one
of the resilience layers being compared:

- the model, its FSDP2 sharding, the optimizer and the loss come from the same workload
  (``trainer.workload``, through ``TrainConfig(...).wl``), with the same seeds, data source,
  global batch and learning rate (``TrainConfig``'s defaults);
- the process-group timeout is ours (``InProcessConfig().pg_timeout_s`` unless
  ``--pg-timeout-s`` says otherwise), and checkpoint collectives run on their own gloo group
  with ours' checkpoint timeout (``DurableConfig.timeout_s``), as the trainer does;
- checkpoints are synchronous ``torch.distributed.checkpoint.save`` (every rank writes its own
  shard, fsynced: ``FileSystemWriter(sync_files=True)``) of ``get_state_dict(model, optim)``
  into ``<run_root>/baseline_ckpt/step_NNNNNNNNN.tmp``; once every rank is done, rank 0 writes
  a ``COMMITTED`` marker, fsyncs and renames the directory to ``step_NNNNNNNNN`` (then fsyncs the
  parent). Only renamed directories with the marker are ever loaded, so a save torn by a fault
  (``sigkill@step=N,phase=checkpoint`` kills right after the shards are written and before the
  rename) is never loaded: the resume takes the previous commit. Resume: ``dcp.load`` +
  ``set_state_dict``.

No heartbeats and no in-process restart: a hang is only noticed when a collective times out, and
every fault restarts all workers through torchrun.

``--ft-sections`` makes it the *bare NVRx* baseline: the same program under ``ft_launcher``
(:func:`ft_launcher_job`: ours' launcher flags and timeouts, ``trainer.launch.ft_launcher_argv``)
with a ``RankMonitorClient`` that opens the ``step`` section around every step, the ``checkpoint``
section around every save and the ``load`` section around the resume: the in-job layer exactly
as NVRx documents it, without the rest of the product (no in-process restart, no async
checkpoints, no per-interval section renewal: a hang is caught ``step_timeout_s`` after the hung
step began). A ``hang`` stops the rank dead (SIGSTOP), as
ours' drill does, so torchrun must SIGKILL it (its agent first waits for a SIGTERM it cannot
deliver). ``--parallel ddp`` keeps the old DDP variant (same workload model, not sharded).

Writes the same ``events.jsonl`` kinds as the trainer (``worker_start``, ``resume``, ``step``,
``checkpoint``, ``fault``, ``train_end``) so one analysis (benchmarks/recovery_time.py,
benchmarks/ettr.py, ``trainer.timeline.recovery_phases``) reads both.

Run under torchrun (from the repo root)::

    torchrun --nproc-per-node 2 --max-restarts 3 benchmarks/baseline_trainer.py \\
        --run-root /tmp/b --data-dir DATA --steps 200 --ckpt-interval 20 \\
        --fault exception@step=50,rank=1
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import hashlib
import json
import os
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from trainer.checkpointing import fsync_path
from trainer.checkpointing.config import CheckpointConfig, DurableConfig
from trainer.config import InProcessConfig, TrainConfig
from trainer.event_types import Checkpoint, Fault, Resume, Step, TrainEnd, WorkerStart
from trainer.events import EventLog
from trainer.faults import FaultSpec, parse_fault
from trainer.layer_config import CHECKPOINT_SECTION, LOAD_SECTION, STEP_SECTION
from trainer.rundir import RunDir
from trainer.worker import process_start_time, workload_data
from trainer.workload import OptimSettings

COMMITTED = "COMMITTED"
CKPT_DIR = "baseline_ckpt"
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
_DURABLE = DurableConfig()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run-root", type=Path, required=True)
    p.add_argument("--data-dir", type=Path, required=True)
    p.add_argument("--workload", default=_DEFAULTS["workload"])
    p.add_argument("--workload-options", default="{}", help="JSON object")
    p.add_argument("--model", default=None, help="deprecated: gpt size, same as --workload gpt-X")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--global-batch", type=int, default=_DEFAULTS["global_batch"])
    p.add_argument("--ckpt-interval", type=int, default=10)
    p.add_argument("--keep-last", type=int, default=_DURABLE.keep_last)
    p.add_argument("--seed", type=int, default=_DEFAULTS["seed"])
    p.add_argument("--lr", type=float, default=_DEFAULTS["lr"])
    p.add_argument("--weight-decay", type=float, default=_DEFAULTS["weight_decay"])
    p.add_argument(
        "--pg-timeout-s",
        type=float,
        default=InProcessConfig().pg_timeout_s,
        help="process-group timeout (default: ours, InProcessConfig().pg_timeout_s)",
    )
    p.add_argument("--ckpt-timeout-s", type=float, default=_DURABLE.timeout_s)
    p.add_argument("--parallel", choices=("fsdp2", "ddp"), default="fsdp2")
    p.add_argument(
        "--fault", action="append", default=[], help="kind@step=N[,rank=R][,phase=checkpoint]"
    )
    p.add_argument(
        "--ft-sections",
        action="store_true",
        help="bare NVRx in-job restart: run under ft_launcher and report every step, save and "
        "load as a RankMonitorClient section (what a user adopting ft_launcher alone writes)",
    )
    args = p.parse_args(argv)
    if args.model:
        args.workload = f"gpt-{args.model}"
    return args


def step_seed(seed: int, step: int, rank: int) -> int:
    """As ``trainer.session.step_seed`` (not imported: the trainer imports NVRx)."""
    digest = hashlib.sha256(f"{seed}:{step}:{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _fire(spec: FaultSpec) -> None:
    if spec.kind == "exception":
        raise RuntimeError(f"injected fault {spec}")
    if spec.kind == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if spec.kind == "node-loss":
        # This rank's host goes: its torchrun agent and every rank on it (one session per
        # simulated node). torchrun cannot continue without it; the job is re-submitted.
        os.killpg(os.getpgid(0), signal.SIGKILL)
    if spec.kind == "hang":
        # As ours' drill: the process stops dead (a rank wedged in native code).
        os.kill(os.getpid(), signal.SIGSTOP)
    if spec.kind in ("hang", "stall"):
        # Blocks in Python: peers wait in the next collective until the pg timeout.
        while True:
            time.sleep(3600)


# -- checkpoints ----------------------------------------------------------------------------------
def ckpt_root(run_root: Path) -> Path:
    return Path(run_root) / CKPT_DIR


def committed_steps(run_root: Path) -> list[int]:
    """Steps with a complete, committed save (renamed, marker present), oldest first."""
    root = ckpt_root(run_root)
    if not root.is_dir():
        return []
    out = []
    for d in root.iterdir():
        name = d.name
        if name.startswith("step_") and name[5:].isdigit() and (d / COMMITTED).is_file():
            out.append(int(name[5:]))
    return sorted(out)


def step_dir(run_root: Path, step: int) -> Path:
    return ckpt_root(run_root) / f"step_{step:09d}"


def tmp_dir(run_root: Path, step: int) -> Path:
    return ckpt_root(run_root) / f"step_{step:09d}.tmp"


def commit(run_root: Path, step: int, keep_last: int) -> None:
    """Rank 0, after every rank's shards and DCP's ``.metadata`` are written."""
    src, dst = tmp_dir(run_root, step), step_dir(run_root, step)
    marker = src / COMMITTED
    with open(marker, "w") as f:
        f.write(json.dumps({"step": step, "t": time.time()}) + "\n")
        f.flush()
        os.fsync(f.fileno())
    fsync_path(src)
    if dst.exists():  # an older life's save of the same step
        shutil.rmtree(dst)
    os.replace(src, dst)
    fsync_path(dst.parent)
    for old in committed_steps(run_root)[:-keep_last]:
        shutil.rmtree(step_dir(run_root, old), ignore_errors=True)


def _store(rank: int, world: int, *, timeout_s: float) -> dist.TCPStore:
    """Rank 0 hosts it on MASTER_PORT+1; the previous incarnation's rank 0 may still be exiting
    and holding the port for a moment, so rank 0 retries a bind that finds it in use."""
    deadline = time.monotonic() + 15.0
    while True:
        try:
            return dist.TCPStore(
                os.environ["MASTER_ADDR"],
                int(os.environ["MASTER_PORT"]) + 1,
                world,
                is_master=rank == 0,
                timeout=datetime.timedelta(seconds=timeout_s),
            )
        except dist.DistNetworkError as e:
            if rank != 0 or "EADDRINUSE" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    node = int(os.environ.get("GROUP_RANK", "0"))
    events = EventLog(args.run_root)
    if rank == 0:
        events.emit(
            WorkerStart(
                restart_count=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                world_size=world,
                baseline=True,
                process_start_t=process_start_time(),  # the respawn and start-up phases, as ours
            )
        )
    monitor = _Sections(args.ft_sections)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else None
    if device is not None:
        torch.cuda.set_device(device)
    device = device or torch.device("cpu")
    timeout = datetime.timedelta(seconds=args.pg_timeout_s)
    # torchrun's agent keeps its store across restarts, so new workers would read the dead ones'
    # gloo addresses and hang in init (torch 2.13 here); a per-restart key prefix does not work
    # across nodes either (an agent restarted by a peer's failure keeps its restart count). So
    # rank 0 hosts a fresh store for each incarnation, as the trainer does. Joining it may take
    # a peer's whole start-up: a rendezvous timeout, not the collectives' one.
    store = _store(rank, world, timeout_s=max(60.0, args.pg_timeout_s))
    dist.init_process_group(
        "nccl" if cuda else "gloo", store=store, rank=rank, world_size=world, timeout=timeout
    )
    ckpt_group = dist.new_group(
        backend="gloo", timeout=datetime.timedelta(seconds=args.ckpt_timeout_s)
    )
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))

    cfg = TrainConfig(
        run_root=args.run_root,
        data_dir=args.data_dir,
        workload=args.workload,
        workload_options=json.loads(args.workload_options),
        steps=args.steps,
        global_batch=args.global_batch,
        lr=args.lr,
        weight_decay=args.weight_decay,
        seed=args.seed,
        checkpoint=CheckpointConfig(durable=DurableConfig(interval=args.ckpt_interval)),
    )
    wl = cfg.wl
    torch.manual_seed(cfg.seed)  # identical initial weights on every rank and every restart
    model = wl.build_model(device)
    if args.parallel == "fsdp2":
        model = wl.shard(model, device=device, world_size=world)
    else:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
    optim = wl.build_optimizer(model, OptimSettings(lr=cfg.lr, weight_decay=cfg.weight_decay))
    # The trainer's own loader (and vocabulary check), as a plain user's: no dataset
    # verification at every start.
    sampler = workload_data(dataclasses.replace(cfg, verify_data=False))

    # Resume: rank 0 picks the newest committed save (leftover .tmp saves are torn: removed).
    choice: list[Any] = [None]
    if rank == 0:
        root = ckpt_root(cfg.run_root)
        if root.is_dir():
            for d in root.glob("step_*.tmp"):
                shutil.rmtree(d, ignore_errors=True)
        steps = committed_steps(cfg.run_root)
        choice[0] = steps[-1] if steps else None
    dist.broadcast_object_list(choice, src=0, group=ckpt_group)  # also lines the ranks up
    start = 1
    if choice[0] is not None:
        t0 = time.perf_counter()
        with monitor.section(LOAD_SECTION):
            model_sd, optim_sd = get_state_dict(model, optim)
            state = {"model": model_sd, "optim": optim_sd}
            dcp.load(
                state,
                storage_reader=dcp.FileSystemReader(str(step_dir(cfg.run_root, choice[0]))),
                process_group=ckpt_group,
            )
            set_state_dict(model, optim, model_state_dict=model_sd, optim_state_dict=optim_sd)
        start = int(choice[0]) + 1
        if rank == 0:
            events.emit(
                Resume(
                    action="loaded",
                    step=choice[0],
                    load_s=round(time.perf_counter() - t0, 4),
                )
            )

    faults = [parse_fault(s) for s in args.fault]

    def maybe_fire(step: int, phase: str) -> None:
        for spec in faults:
            if spec.kind == "node-loss":
                mine = spec.node in (None, node)
            else:
                mine = spec.rank in (None, rank)
            if (
                spec.step == step
                and spec.phase == phase
                and mine
                and RunDir(cfg.run_root).claim(spec.slug)
            ):
                events.emit(Fault(fault=str(spec), fault_kind=spec.kind, step=step, rank=rank))
                _fire(spec)

    tokens = cfg.global_batch * wl.seq_len
    for step in range(start, cfg.steps + 1):
        monitor.start(STEP_SECTION)
        maybe_fire(step, "step")
        t0 = time.perf_counter()
        torch.manual_seed(step_seed(cfg.seed, step, rank))
        x, y = sampler.batch(step, rank, world)
        loss = wl.loss(model, torch.from_numpy(x).to(device), torch.from_numpy(y).to(device))
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        reduced = loss.detach().float().clone()
        dist.all_reduce(reduced)
        loss_value = float(reduced.item() / world)
        step_s = time.perf_counter() - t0
        monitor.end(STEP_SECTION)
        if rank == 0:
            events.emit(
                Step(
                    step=step,
                    loss=round(loss_value, 4),
                    step_s=round(step_s, 4),
                    tokens_per_s=round(tokens / step_s, 1),
                )
            )
        if cfg.checkpoint.durable.due(step, cfg.steps):
            monitor.start(CHECKPOINT_SECTION)
            t0 = time.perf_counter()
            tmp = tmp_dir(cfg.run_root, step)
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
            dist.barrier(group=ckpt_group)
            model_sd, optim_sd = get_state_dict(model, optim)
            dcp.save(
                {"model": model_sd, "optim": optim_sd},
                storage_writer=dcp.FileSystemWriter(str(tmp), sync_files=True),
                process_group=ckpt_group,
            )
            maybe_fire(step, "checkpoint")  # written, not committed: a torn save
            dist.barrier(group=ckpt_group)  # every rank's shard is on disk
            if rank == 0:
                commit(cfg.run_root, step, args.keep_last)
            dist.barrier(group=ckpt_group)  # everyone waits for the synchronous save
            monitor.end(CHECKPOINT_SECTION)
            if rank == 0:
                blocked = round(time.perf_counter() - t0, 4)
                events.emit(Checkpoint(step=step, blocking_s=blocked, total_s=blocked))
    if rank == 0:
        events.emit(TrainEnd(final_step=cfg.steps))
    dist.barrier(group=ckpt_group)
    dist.destroy_process_group()
    monitor.close()
    return 0


class _Sections:
    """The bare in-job layer's worker side: NVRx's ``RankMonitorClient`` sections, one message
    per call (no-op without ``--ft-sections``)."""

    def __init__(self, enabled: bool) -> None:
        self.client: Any = None
        if enabled:
            from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient

            self.client = RankMonitorClient()
            self.client.init_workload_monitoring()
            self.client.send_heartbeat()

    def start(self, name: str) -> None:
        if self.client is not None:
            self.client.start_section(name)

    def end(self, name: str) -> None:
        if self.client is not None:
            self.client.end_section(name)

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        self.start(name)
        yield
        self.end(name)

    def close(self) -> None:
        if self.client is not None:
            self.client.shutdown_workload_monitoring()


if __name__ == "__main__":
    raise SystemExit(main())


def torchrun_job(
    *, nnodes: int, nproc_per_node: int, max_restarts: int, trainer_args: list[str]
) -> list[list[str]]:
    """One ``torchrun`` command per simulated node (c10d rendezvous on 127.0.0.1), as a user
    would start it on each host of an ``nnodes`` job."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nnodes={nnodes}",
            f"--nproc-per-node={nproc_per_node}",
            f"--max-restarts={max_restarts}",
            "--monitor-interval=0.5",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            "--rdzv-id=baseline",
            str(Path(__file__).resolve()),
            *trainer_args,
        ]
        for _ in range(nnodes)
    ]


def ft_launcher_job(
    *, nnodes: int, nproc_per_node: int, run_root: Path, data_dir: Path, trainer_args: list[str]
) -> list[list[str]]:
    """Bare NVRx: one ``ft_launcher`` per simulated node running this program with
    ``--ft-sections``, with exactly ours' launcher flags (``trainer.launch.ft_launcher_argv`` of
    a default ``TrainConfig``: restarts, monitor interval, stop timeout, heartbeat and section
    timeouts)."""
    import socket

    from trainer.launch import LaunchSpec, ft_launcher_argv

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = TrainConfig(run_root=run_root, data_dir=data_dir)
    spec = LaunchSpec(
        nnodes=nnodes,
        nproc_per_node=nproc_per_node,
        rdzv_endpoint=f"127.0.0.1:{port}",
        rdzv_id="bare-ft",
    )
    argv = ft_launcher_argv(
        cfg, spec, [str(Path(__file__).resolve()), *trainer_args, "--ft-sections"]
    )
    return [list(argv) for _ in range(nnodes)]


def run_job(argvs: list[list[str]], log_dir: Path, *, timeout_s: float) -> list[int]:
    """Start every node's torchrun (each in its own session, as on separate hosts) and wait.
    A node that dies by a signal (a node-loss fault) ends the job: the others are stopped at
    once instead of waiting out torchrun's rendezvous timeout (this favours the baseline)."""
    import subprocess

    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(repo)}
    procs = []
    for i, argv in enumerate(argvs):
        log = open(log_dir / f"launcher-node{i}.log", "a")  # noqa: SIM115
        procs.append(
            subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        )
    deadline = time.monotonic() + timeout_s
    while any(p.poll() is None for p in procs):
        if any((p.returncode or 0) < 0 for p in procs) or time.monotonic() > deadline:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
        time.sleep(0.2)
    return [int(p.returncode) for p in procs]
