"""ETTR (effective training time ratio) under a fault schedule, ours next to plain torchrun.

ETTR = productive training time / wall time. Productive time is the sum, over steps, of the
last execution of each step (work redone after a fault is not productive); wall time runs from
launching the job to its end, including start-up, every recovery and every re-submission.

1. Calibrate (short fault-free runs): seconds per step and the training-blocking seconds per
   checkpoint, ours (async) and the baseline (synchronous DCP).
2. Checkpoint interval from Young's formula, for each: ``sqrt(2 * MTBF * checkpoint cost)``
   seconds, in steps, where the cost is the measured total per checkpoint (the blocking part,
   the slower steps while an async write overlaps training, and the commit: ``ckpt_cost_s``),
   not the blocking time alone.
3. Run each for ``--minutes`` of expected training with a mixed fault every ``--mtbf-s``
   seconds of progress (cycling exception, sigkill, hang, node-loss), and once without faults
   for ``--clean-minutes``.

Ours: the pipeline's train stage on the embedded default (local backend, 2 simulated nodes, the
pipeline's timeouts), node loss answered by the stage retry. Baseline: torchrun
``--max-restarts`` (the same 2 simulated nodes, one agent and rank each, the same FSDP2
workload, synchronous DCP checkpoints: ``benchmarks/baseline_trainer.py``); a hang is only
noticed at its process-group timeout (``--baseline-pg-timeout-s``, by default ours:
``InProcessConfig().pg_timeout_s``; torch's default is 30 min), and a node loss ends the job,
which this script re-submits at once (a person would take longer: this favours the baseline).

    python benchmarks/ettr.py [--minutes 10] [--clean-minutes 3] [--mtbf-s 120]
        [--durable-only] [--memory-interval N] [--skip WHO_OR_MODE ...] [--json] [--out FILE]
        [--plot DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

from benchmarks.baseline_trainer import run_job, torchrun_job  # noqa: E402
from tasks.backends.base import LaunchRequest  # noqa: E402
from tasks.backends.local import LocalBackend  # noqa: E402
from tasks.classify import EndKind  # noqa: E402
from tasks.train_stage import run_attempt  # noqa: E402
from trainer.checkpointing.config import CheckpointConfig, DurableConfig, MemoryConfig  # noqa: E402
from trainer.config import InProcessConfig, TrainConfig  # noqa: E402
from trainer.data import write_synthetic_dataset  # noqa: E402
from trainer.event_types import Event  # noqa: E402
from trainer.history import RunHistory  # noqa: E402
from trainer.rundir import read_events  # noqa: E402
from trainer.timeline import plot_timeline, recovery_phases  # noqa: E402

CYCLE = ("exception@step={s},rank=1", "sigkill@step={s},rank=1", "hang@step={s},rank=1")
CYCLE += ("node-loss@step={s},node=1",)


def young_interval_s(mtbf_s: float, cost_s: float) -> float:
    return math.sqrt(2.0 * mtbf_s * cost_s)


def schedule(steps: int, step_s: float, mtbf_s: float) -> list[str]:
    every = max(2, round(mtbf_s / step_s))
    return [CYCLE[i % len(CYCLE)].format(s=s) for i, s in enumerate(range(every, steps, every))]


def run_ours(
    root: Path,
    data: Path,
    *,
    steps: int,
    interval: int,
    faults: list[str],
    memory_interval: int | str = "auto",
) -> dict[str, Any]:
    cfg = TrainConfig(
        run_root=root,
        data_dir=data,
        steps=steps,
        faults=tuple(faults),
        # 1: the memory tiers on; 0: the durable checkpoint alone (issue 29).
        checkpoint=CheckpointConfig(
            durable=DurableConfig(interval=interval), memory=MemoryConfig(interval=memory_interval)
        ),
    )
    t0 = time.monotonic()
    attempts = 0
    while True:
        attempts += 1
        report = run_attempt(
            LocalBackend(),
            LaunchRequest(
                run_id=root.name,
                attempt=attempts,
                cfg=cfg,
                nodes=2,
                nproc_per_node=1,
                deadline_s=7200,
            ),
        )
        if report.outcome.kind != EndKind.NODE_LOSS or attempts > len(faults):
            break
    if report.outcome.kind != EndKind.COMPLETED:
        raise RuntimeError(f"ours: {report.outcome.message}")
    return {"wall_s": time.monotonic() - t0, "attempts": attempts, "events": read_events(root)}


def run_baseline(
    root: Path, data: Path, *, steps: int, interval: int, faults: list[str], pg_timeout_s: float
) -> dict[str, Any]:
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    submissions = 0
    while submissions <= len(faults):
        submissions += 1
        run_job(
            torchrun_job(
                nnodes=2,
                nproc_per_node=1,
                max_restarts=len(faults) + 1,
                trainer_args=[
                    f"--run-root={root}",
                    f"--data-dir={data}",
                    f"--steps={steps}",
                    f"--ckpt-interval={interval}",
                    f"--pg-timeout-s={pg_timeout_s}",
                    *[f"--fault={f}" for f in faults],
                ],
            ),
            root,
            timeout_s=7200,
        )
        if any(e.kind == "train_end" for e in read_events(root)):
            break
    else:
        raise RuntimeError("baseline did not finish")
    return {"wall_s": time.monotonic() - t0, "attempts": submissions, "events": read_events(root)}


def summarize(run: dict[str, Any]) -> dict[str, Any]:
    evs = run["events"]
    prod = RunHistory.of(evs).productive_s()
    steps = sorted((e for e in evs if e.kind == "step"), key=lambda e: e.t)
    first = steps[0].t if steps else None
    end = steps[-1].t if steps else None
    phases = recovery_phases(evs)
    return {
        "wall_s": round(run["wall_s"], 1),
        "productive_s": round(prod, 1),
        "ettr": round(prod / run["wall_s"], 4),
        # Without the one-time start-up (launch to first step): what a days-long job converges to.
        "ettr_after_startup": round(prod / (end - first), 4)
        if first and end and end > first
        else None,
        "faults": len([e for e in evs if e.kind == "fault"]),
        "recovered": sum(1 for p in phases if p.get("recovered")),
        "recovery_s_mean": round(
            statistics.fmean(p["total_s"] for p in phases if p.get("recovered")), 2
        )
        if any(p.get("recovered") for p in phases)
        else None,
        "checkpoints": len([e for e in evs if e.kind == "checkpoint"]),
        "attempts": run["attempts"],
    }


def calibrate(root: Path, data: Path, pg_timeout_s: float) -> dict[str, float]:
    ours = run_ours(root / "cal-ours", data, steps=40, interval=5, faults=[])["events"]
    base = run_baseline(
        root / "cal-base", data, steps=40, interval=5, faults=[], pg_timeout_s=pg_timeout_s
    )["events"]

    def med(evs: list[Event], kind: str, key: str) -> float:
        return statistics.median(
            getattr(e, key) for e in evs if e.kind == kind and getattr(e, "step", 0) > 5
        )

    return {
        "ours_step_s": med(ours, "step", "step_s"),
        "ours_ckpt_block_s": med(ours, "checkpoint", "blocking_s"),
        "ours_ckpt_cost_s": ckpt_cost_s(ours),
        "base_step_s": med(base, "step", "step_s"),
        "base_ckpt_block_s": med(base, "checkpoint", "blocking_s"),
        "base_ckpt_cost_s": ckpt_cost_s(base),
    }


def ckpt_cost_s(events: list[Event], *, skip: int = 5) -> float:
    """What one checkpoint costs the run (median over its checkpoints): the wall time of the
    steps from the save's step until its commit, beyond the median wall time of the steps with
    no save in flight. It counts the blocking part, the slower steps while the write overlaps
    training, and the commit; a step's wall time is the time between consecutive step events."""
    steps = sorted((e for e in events if e.kind == "step"), key=lambda e: e.step)
    t = {e.step: e.t for e in steps}
    dt = {s: t[s] - t[s - 1] for s in t if s - 1 in t and s > skip}
    ckpts = [
        (e.step, e.t)
        for e in events
        if e.kind == "checkpoint" and isinstance(getattr(e, "step", None), int) and e.step > skip
    ]
    windows = {k: [s for s in dt if s >= k and t[s - 1] <= tc] for k, tc in ckpts}
    dirty = {s for w in windows.values() for s in w}
    clean = [v for s, v in dt.items() if s not in dirty]
    if not clean:
        return statistics.median(e.blocking_s for e in events if e.kind == "checkpoint")
    base = statistics.median(clean)
    last = max(t) if t else 0
    costs = [sum(dt[s] - base for s in w) for k, w in windows.items() if k < last]
    return max(0.0, statistics.median(costs)) if costs else 0.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--clean-minutes", type=float, default=3.0)
    p.add_argument("--mtbf-s", type=float, default=120.0)
    p.add_argument("--baseline-pg-timeout-s", type=float, default=InProcessConfig().pg_timeout_s)
    p.add_argument(
        "--skip",
        nargs="*",
        default=[],
        choices=["ours", "ours-durable", "baseline", "faults", "clean"],
        help="runs to leave out: by who (ours-durable: with --durable-only) or by mode",
    )
    p.add_argument(
        "--durable-only",
        action="store_true",
        help="also run ours without the memory tiers (memory_interval 0), side by side",
    )
    p.add_argument(
        "--memory-interval",
        type=lambda v: v if v == "auto" else int(v),
        default="auto",
        help="ours: a memory save every N steps, or auto (the default; ours-durable: 0)",
    )
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", type=Path)
    p.add_argument("--plot", type=Path, help="write the timelines (PNG) here")
    args = p.parse_args(argv)

    root = Path(tempfile.mkdtemp(prefix="nvrx-bench-ettr-"))
    data = root / "data"
    write_synthetic_dataset(data, vocab_size=512, seed=0)
    cal = calibrate(root, data, args.baseline_pg_timeout_s)
    print(f"calibration: {cal}", file=sys.stderr, flush=True)
    out: dict[str, Any] = {
        "benchmark": "ettr",
        "calibration": cal,
        "mtbf_s": args.mtbf_s,
        "memory_interval": args.memory_interval,
    }
    runs: dict[str, Any] = {}
    for who in ("ours", *(["ours-durable"] if args.durable_only else []), "baseline"):
        mine = who.startswith("ours")
        step_s = cal[f"{'ours' if mine else 'base'}_step_s"]
        cost = cal[f"{'ours' if mine else 'base'}_ckpt_cost_s"]
        interval = max(1, round(young_interval_s(args.mtbf_s, cost) / step_s))
        for mode, minutes in (("faults", args.minutes), ("clean", args.clean_minutes)):
            if who in args.skip or mode in args.skip:
                continue
            steps = max(20, round(minutes * 60 / step_s))
            faults = schedule(steps, step_s, args.mtbf_s) if mode == "faults" else []
            print(
                f"{who}/{mode}: {steps} steps, ckpt every {interval}, {len(faults)} faults",
                file=sys.stderr,
                flush=True,
            )
            d = root / f"{who}-{mode}"
            if mine:
                run = run_ours(
                    d,
                    data,
                    steps=steps,
                    interval=interval,
                    faults=faults,
                    memory_interval=0 if who == "ours-durable" else args.memory_interval,
                )
            else:
                run = run_baseline(
                    d,
                    data,
                    steps=steps,
                    interval=interval,
                    faults=faults,
                    pg_timeout_s=args.baseline_pg_timeout_s,
                )
            runs[f"{who}-{mode}"] = run
            out[f"{who}-{mode}"] = {
                **summarize(run),
                "steps": steps,
                "ckpt_interval_steps": interval,
                "young_interval_s": round(young_interval_s(args.mtbf_s, cost), 2),
                "fault_schedule": faults,
            }
            print(f"{who}/{mode}: {out[f'{who}-{mode}']}", file=sys.stderr, flush=True)
    if args.plot and "ours-faults" in runs:
        base = runs.get("baseline-faults")
        plot_timeline(
            runs["ours-faults"]["events"],
            args.plot / "ettr-timeline.png",
            title=f"ETTR run: a fault every ~{args.mtbf_s:.0f} s",
            compare=("torchrun baseline", base["events"]) if base else None,
            label="ours (nvrx-pipeline)",
        )
    print(
        "| run | wall s | productive s | ETTR | ETTR after start-up | faults (recovered) "
        "| mean recovery s | ckpt every (steps) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for key in (
        "ours-faults",
        "ours-durable-faults",
        "baseline-faults",
        "ours-clean",
        "ours-durable-clean",
        "baseline-clean",
    ):
        if key in out:
            r = out[key]
            print(
                f"| {key} | {r['wall_s']} | {r['productive_s']} | {r['ettr']} | "
                f"{r['ettr_after_startup']} | {r['faults']} ({r['recovered']}) | "
                f"{r['recovery_s_mean']} | {r['ckpt_interval_steps']} |"
            )
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
