"""Overhead of the layers on a workload's training loop: steps per second with the restart layers
on (ft_launcher heartbeats and sections, the in-process Wrapper: the *loop overhead*), and with
all three (plus async checkpoints every ``--ckpt-interval`` steps), against the same loop with
none (plain ``torchrun``, no heartbeats, no Wrapper, one checkpoint at the very end, outside the
measured window). Target (issue 15): loop overhead <= 1 % after start-up; the checkpoints' cost
is reported beside it (at Young's interval it is the ETTR benchmark's to judge).

    python benchmarks/layer_overhead.py [--workload llama-tiny] [--steps 400] [--repeats 5]
        [--ckpt-interval 100] [--nproc 2] [--json] [--out FILE]

Three variants run in this one invocation, interleaved (none, restart layers, all layers,
none, ...), on the same dataset and config: ``restart-layers`` (heartbeats and the Wrapper, no
checkpoint inside the window) says what the restart layers cost apart from checkpointing.
The rate of a run is measured after start-up: from the ``step`` event of step ``--warmup`` to
the one of the last-but-one step (the last step's save and the final digest are excluded in
every variant), from the events' timestamps, so the hooks, the save's
blocking copy and the commit polls are inside the window. Reported: per-run rates, the median
rate of each variant, and the median and spread (min..max) of the per-pair ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

TARGET_OVERHEAD = 0.01  # of the loop: the restart layers against none


def _env(config: Path) -> dict[str, str]:
    from trainer.launch import worker_env

    env = {**os.environ, **worker_env(config)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_once(cfg, *, layers: bool, nproc: int, warmup: int, log: Path) -> float:
    """One training run; returns steps/s over the measured window."""
    from trainer.config import save_config
    from trainer.launch import LaunchSpec, ft_launcher_argv, trainer_args
    from trainer.rundir import read_events

    shutil.rmtree(cfg.run_root, ignore_errors=True)
    config = save_config(cfg, cfg.run_root.parent / f"{cfg.run_root.name}.json")
    port = _free_port()
    if layers:
        spec = LaunchSpec(
            nnodes=1, nproc_per_node=nproc, rdzv_endpoint=f"127.0.0.1:{port}", rdzv_id="bench"
        )
        argv = ft_launcher_argv(cfg, spec, trainer_args(cfg, config))
    else:
        argv = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            *trainer_args(cfg, config),
        ]
    with open(log, "w") as f:
        rc = subprocess.run(
            argv, stdout=f, stderr=subprocess.STDOUT, env=_env(config), cwd=REPO, timeout=900
        ).returncode
    if rc != 0:
        raise RuntimeError(f"run failed (exit {rc}), see {log}")
    steps = {e.step: e.t for e in read_events(cfg.run_root) if e.kind == "step"}
    return _rate(steps, warmup, cfg.steps - 1)


def _rate(step_times: dict[int, float], first: int, last: int) -> float:
    return (last - first) / (step_times[last] - step_times[first])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload", default="llama-tiny")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--warmup", type=int, default=5, help="steps excluded as start-up")
    # ~ Young's interval of the ETTR benchmark on this machine (96 steps of the tiny model).
    p.add_argument("--ckpt-interval", type=int, default=100)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)

    from trainer.checkpointing.config import CheckpointConfig, DurableConfig
    from trainer.config import InJobConfig, InProcessConfig, TrainConfig
    from trainer.data import write_synthetic_dataset

    work = Path(tempfile.mkdtemp(prefix="nvrx-bench-layers-"))
    data = work / "data"
    write_synthetic_dataset(data, shards=4, tokens_per_shard=65536, vocab_size=512, seed=0)
    base = TrainConfig(
        run_root=work / "run",
        data_dir=data,
        workload=args.workload,
        steps=args.steps,
        global_batch=8,
        checkpoint=CheckpointConfig(durable=DurableConfig(interval=args.ckpt_interval)),
    )
    last_only = CheckpointConfig(durable=DurableConfig(interval=args.steps))
    none = replace(
        base,
        checkpoint=last_only,  # only the last step saves: outside the window
        inprocess=replace(InProcessConfig(), enabled=False),
        injob=replace(InJobConfig(), enabled=False),
    )
    # Which layer costs what: the restart layers alone (heartbeats, Wrapper), then all three.
    variants = (
        ("none", none, False),
        ("restart-layers", replace(base, checkpoint=last_only), True),
        ("layers", base, True),
    )
    runs: list[dict[str, object]] = []
    for i in range(args.repeats):
        for name, cfg, layers in variants:
            t0 = time.monotonic()
            rate = run_once(
                replace(cfg, run_root=work / f"{name}-{i}"),
                layers=layers,
                nproc=args.nproc,
                warmup=args.warmup,
                log=work / f"{name}-{i}.log",
            )
            runs.append(
                {
                    "repeat": i,
                    "variant": name,
                    "steps_per_s": round(rate, 3),
                    "wall_s": round(time.monotonic() - t0, 1),
                }
            )
            print(f"repeat {i} {name:>6}: {rate:.3f} steps/s", file=sys.stderr, flush=True)
    rate = {v: [float(r["steps_per_s"]) for r in runs if r["variant"] == v] for v, _, _ in variants}

    def ratios_of(variant: str) -> list[float]:
        return [a / b for a, b in zip(rate[variant], rate["none"], strict=True)]

    def spread(xs: list[float]) -> dict[str, float]:
        return {
            "median": round(statistics.median(xs), 4),
            "min": round(min(xs), 4),
            "max": round(max(xs), 4),
        }

    loop = [1 - r for r in ratios_of("restart-layers")]
    everything = [1 - r for r in ratios_of("layers")]
    out = {
        "workload": args.workload,
        "steps": args.steps,
        "warmup": args.warmup,
        "ckpt_interval": args.ckpt_interval,
        "nproc": args.nproc,
        "runs": runs,
        "median_steps_per_s": {k: round(statistics.median(v), 3) for k, v in rate.items()},
        "ratio_layers_vs_none": spread(ratios_of("layers")),
        "ratio_restart_layers_vs_none": spread(ratios_of("restart-layers")),
        "loop_overhead": round(statistics.median(loop), 4),
        "overhead_with_checkpoints": round(statistics.median(everything), 4),
        "target_loop_overhead": TARGET_OVERHEAD,
        "met": statistics.median(loop) <= TARGET_OVERHEAD,
    }
    print(
        f"steps/s (median): {out['median_steps_per_s']}; loop overhead (restart layers vs "
        f"none) {out['loop_overhead']:.1%} (ratios {out['ratio_restart_layers_vs_none']}), "
        f"target <= {TARGET_OVERHEAD:.0%}: {'met' if out['met'] else 'MISSED'}; with a "
        f"checkpoint every {args.ckpt_interval} steps: {out['overhead_with_checkpoints']:.1%} "
        f"(ratios {out['ratio_layers_vs_none']})"
    )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    if args.json:
        print(json.dumps(out))
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
