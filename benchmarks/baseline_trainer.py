"""The baseline users would otherwise run: plain ``torchrun --max-restarts`` + DDP + synchronous
``torch.save`` checkpoints (rank 0, fsynced, atomic rename), same model, data and faults.

Writes the same ``events.jsonl`` kinds as the trainer (``worker_start``, ``resume``, ``step``,
``checkpoint``, ``fault``, ``train_end``) so one analysis (benchmarks/recovery_time.py,
benchmarks/ettr.py) reads both. No heartbeats and no in-process restart: a hang is only
detected when a collective times out (``--pg-timeout-s``; torch's own default is 30 min for
gloo, far longer than any benchmark here, so the baseline is given a much shorter one), and every
fault restarts all workers through torchrun.

Run under torchrun (from the repo root)::

    torchrun --nproc-per-node 2 --max-restarts 3 benchmarks/baseline_trainer.py \\
        --run-root /tmp/b --data-dir DATA --steps 200 --ckpt-interval 20 \\
        --fault exception@step=50,rank=1
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from trainer.config import model_config
from trainer.data import StepSampler
from trainer.events import EventLog
from trainer.faults import FaultSpec, claim, parse_fault
from trainer.manifest import fsync_path
from trainer.model import GPT


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run-root", type=Path, required=True)
    p.add_argument("--data-dir", type=Path, required=True)
    p.add_argument("--model", default="tiny")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--ckpt-interval", type=int, default=10)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--pg-timeout-s", type=float, default=60.0)
    p.add_argument("--fault", action="append", default=[], help="kind@step=N[,rank=R]")
    return p.parse_args(argv)


def _fire(spec: FaultSpec) -> None:
    if spec.kind == "exception":
        raise RuntimeError(f"injected fault {spec}")
    if spec.kind == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if spec.kind == "node-loss":
        # This rank's host goes: its torchrun agent and every rank on it (one session per
        # simulated node). torchrun cannot continue without it; the job is re-submitted.
        os.killpg(os.getpgid(0), signal.SIGKILL)
    if spec.kind in ("hang", "stall"):
        # Blocks in Python: peers wait in the next all-reduce until the pg timeout.
        while True:
            time.sleep(3600)


def save(path: Path, model: torch.nn.Module, optim: torch.optim.Optimizer, step: int) -> None:
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        torch.save({"model": model.state_dict(), "optim": optim.state_dict(), "step": step}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    node = int(os.environ.get("GROUP_RANK", "0"))
    events = EventLog(args.run_root)
    if rank == 0:
        events.emit(
            "worker_start",
            restart_count=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            world_size=world,
            baseline=True,
        )
    timeout = datetime.timedelta(seconds=args.pg_timeout_s)
    # torchrun's agent keeps its store across restarts, so new workers would read the dead ones'
    # gloo addresses and hang in init (torch 2.13 here); a per-restart key prefix does not work
    # across nodes either (an agent restarted by a peer's failure keeps its restart count). So
    # rank 0 hosts a fresh store for each incarnation, as the trainer does.
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]) + 1,
        world,
        is_master=rank == 0,
        timeout=timeout,
    )
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    cfg = model_config(args.model)
    torch.manual_seed(args.seed)
    model = DistributedDataParallel(GPT(cfg))
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr)
    sampler = StepSampler(
        args.data_dir, seq_len=cfg.seq_len, global_batch=args.global_batch, seed=args.seed
    )
    ckpt = args.run_root / "baseline_ckpt.pt"
    start = 1
    if ckpt.exists():
        t0 = time.perf_counter()
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"])
        optim.load_state_dict(state["optim"])
        start = int(state["step"]) + 1
        if rank == 0:
            events.emit(
                "resume",
                action="loaded",
                step=state["step"],
                load_s=round(time.perf_counter() - t0, 4),
            )
    faults = [parse_fault(s) for s in args.fault]
    tokens = args.global_batch * cfg.seq_len
    for step in range(start, args.steps + 1):
        for spec in faults:
            mine = (
                spec.node in (None, node) if spec.kind == "node-loss" else spec.rank in (None, rank)
            )
            if spec.step == step and mine and claim(args.run_root, spec):
                events.emit("fault", fault=str(spec), fault_kind=spec.kind, step=step, rank=rank)
                _fire(spec)
        t0 = time.perf_counter()
        x, y = sampler.batch(step, rank, world)
        loss = model(torch.from_numpy(x).long(), torch.from_numpy(y).long())
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        step_s = time.perf_counter() - t0
        if rank == 0:
            events.emit(
                "step",
                step=step,
                loss=round(float(loss), 4),
                step_s=round(step_s, 4),
                tokens_per_s=round(tokens / step_s, 1),
            )
        if step % args.ckpt_interval == 0 or step == args.steps:
            t0 = time.perf_counter()
            if rank == 0:
                save(ckpt, model, optim, step)
            dist.barrier()  # everyone waits for the synchronous save
            if rank == 0:
                blocked = round(time.perf_counter() - t0, 4)
                events.emit("checkpoint", step=step, blocking_s=blocked, total_s=blocked)
    if rank == 0:
        events.emit("train_end", final_step=args.steps)
    dist.destroy_process_group()
    return 0


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


def run_job(argvs: list[list[str]], log_dir: Path, *, timeout_s: float) -> list[int]:
    """Start every node's torchrun (each in its own session, as on separate hosts) and wait.
    A node that dies by a signal (a node-loss fault) ends the job: the others are stopped at
    once instead of waiting out torchrun's rendezvous timeout (this favours the baseline)."""
    import subprocess

    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(repo)}
    procs = []
    for i, argv in enumerate(argvs):
        log = open(log_dir / f"torchrun-node{i}.log", "a")  # noqa: SIM115
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
