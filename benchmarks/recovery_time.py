"""Recovery time per fault class, split into phases, ours next to plain torchrun, in one run.

Ours: the pipeline's train stage on the embedded default (``tasks.train_stage.run_attempt`` with
the local backend: 2 simulated nodes, each an ft_launcher agent with 1 gloo rank, the tiny
model, the trainer's default timeouts as the pipeline uses them), a node loss answered by the
stage retry (attempt 2, as the pipeline's task retry does). Baseline: ``torchrun
--max-restarts 3`` on the same 2 simulated nodes (one agent and rank each) running the same
FSDP2 workload with synchronous DCP checkpoints and ours' process-group timeout
(``benchmarks/baseline_trainer.py``), same data, steps, checkpoint interval and fault; it has no
hang detection other than that timeout and no automatic answer to a lost node (torchrun's job
fails; a person re-submits it).

Samples: ``--samples`` (5) per fault class, each with the fault at a random step (seeded by
``--seed``) after the first checkpoint; for ``sigkill`` every other sample kills during a save
(``,phase=checkpoint``: right after the save of a checkpoint step was started, before it is
committed; the baseline's torn save is written, not committed). Each sample runs ours and the
baseline on the same fault, one after the other (the order alternates between samples).

Phases (``trainer.timeline.recovery_phases``; any further ``*_s`` phase it reports is carried
too): detect (fault until the next incarnation begins), restart (until the checkpoint load
starts), load, first step; total = fault until the first completed step after resume. Per class
and phase: the median and the p90 over the recovered samples, for ours and for the baseline, and
the ratio ours / baseline of the medians. Targets here: in-process <= 5 s, sigkill <= 15 s, hang
<= heartbeat timeout + 10 s, node loss <= 45 s (on the median), each faster than the baseline.

    python benchmarks/recovery_time.py [--faults exception sigkill hang node-loss]
        [--samples 5] [--seed 0] [--steps 30] [--ckpt-interval 5] [--json] [--out FILE]
        [--plot DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import random
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
from trainer.config import InProcessConfig, TrainConfig  # noqa: E402
from trainer.data import write_synthetic_dataset  # noqa: E402
from trainer.events import read_events  # noqa: E402
from trainer.timeline import plot_timeline, recovery_phases  # noqa: E402

SPECS = {
    "exception": "exception@step={s},rank=1",
    "sigkill": "sigkill@step={s},rank=1",
    "hang": "hang@step={s},rank=1",
    "node-loss": "node-loss@step={s},node=1",
}
# Issue 15's targets: exception <= 3.0 s; SIGKILL <= bare ft_launcher + 1.0 s (bare: 3.3-3.8 s
# on this kind of machine, ../shared notes; the fair torchrun baseline here is the same order);
# hang <= 9 s (detection <= 5 s + restart); node loss (a stage retry) <= 45 s.
TARGETS = {"exception": 3.0, "sigkill": 5.0, "hang": 9.0, "node-loss": 45.0}
PHASES = ("detect_s", "restart_s", "load_s", "first_step_s", "total_s")


def draw_faults(kind: str, args: argparse.Namespace, rng: random.Random) -> list[str]:
    """``--samples`` fault specs of one class: a random step after the first checkpoint; for a
    sigkill, every other sample during a save (a checkpoint step, ``phase=checkpoint``)."""
    lo = args.ckpt_interval + 1
    hi = max(lo, args.steps - args.tail_steps)
    out = []
    for i in range(args.samples):
        if kind == "sigkill" and i % 2 == 1:
            saves = [s for s in range(lo, hi + 1) if s % args.ckpt_interval == 0]
            out.append(SPECS[kind].format(s=rng.choice(saves)) + ",phase=checkpoint")
        else:
            out.append(SPECS[kind].format(s=rng.randint(lo, hi)))
    return out


def run_ours(spec: str, kind: str, run_root: Path, data: Path, args: argparse.Namespace) -> list:
    cfg = TrainConfig(
        run_root=run_root,
        data_dir=data,
        steps=args.steps,
        ckpt_interval=args.ckpt_interval,
        faults=(spec,),
    )
    for attempt in (1, 2):
        report = run_attempt(
            LocalBackend(),
            LaunchRequest(
                run_id=run_root.name,
                attempt=attempt,
                cfg=cfg,
                nodes=2,
                nproc_per_node=1,
                deadline_s=600,
            ),
        )
        if report.outcome.kind != EndKind.NODE_LOSS:  # only a node loss gets another attempt
            break
    if report.outcome.kind != EndKind.COMPLETED:
        print(f"ours/{spec}: {report.outcome.message} (run in {run_root})", file=sys.stderr)
    return read_events(run_root)


def run_baseline(spec: str, kind: str, run_root: Path, data: Path, args: argparse.Namespace):
    run_root.mkdir(parents=True)
    if kind == "node-loss":
        return None  # torchrun has no answer: the job fails and waits for a person
    # The same topology as ours: 2 simulated nodes, one torchrun agent with 1 rank each.
    rcs = run_job(
        torchrun_job(
            nnodes=2,
            nproc_per_node=1,
            max_restarts=3,
            trainer_args=[
                f"--run-root={run_root}",
                f"--data-dir={data}",
                f"--steps={args.steps}",
                f"--ckpt-interval={args.ckpt_interval}",
                f"--pg-timeout-s={args.baseline_pg_timeout_s}",
                f"--parallel={args.baseline_parallel}",
                f"--fault={spec}",
            ],
        ),
        run_root,
        timeout_s=900,
    )
    if any(rcs):  # reported as not recovered (the phases find no step after the fault)
        print(f"baseline/{spec}: torchrun exited {rcs} (logs in {run_root})", file=sys.stderr)
    return read_events(run_root)


def first_recovery(events: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    """The first fault's phases; a restart that loaded nothing (no commit before the fault)
    comes back with ``from_scratch`` and a zero-second load (the work lost is not a phase)."""
    if events is None:
        return None
    rows = recovery_phases(events)
    return rows[0] if rows else {"recovered": False, "reason": "no fault recorded"}


def phase_keys(rows: list[dict[str, Any]]) -> list[str]:
    """The phases the rows carry: the known ones first, then any new ``*_s`` key."""
    keys = [k for k in PHASES if any(k in r for r in rows)]
    for r in rows:
        for k, v in r.items():
            if k.endswith("_s") and isinstance(v, (int, float)) and k not in keys:
                keys.append(k)
    return keys


def p90(xs: list[float]) -> float:
    if len(xs) == 1:
        return xs[0]
    return statistics.quantiles(xs, n=10, method="inclusive")[8]


def aggregate(samples: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    if all(s is None for s in samples):
        return None
    got = [s for s in samples if s is not None]
    ok = [s for s in got if s.get("recovered")]
    keys = phase_keys(ok)
    med, high = {}, {}
    for k in keys:
        xs = [float(s[k]) for s in ok if isinstance(s.get(k), (int, float))]
        if xs:
            med[k] = round(statistics.median(xs), 3)
            high[k] = round(p90(xs), 3)
    layers = sorted({str(s.get("layer")) for s in ok if s.get("layer")})
    return {
        "samples": len(got),
        "recovered": len(ok),
        "median": med,
        "p90": high,
        "layers": layers,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--faults", nargs="+", default=list(SPECS), choices=list(SPECS))
    p.add_argument("--samples", type=int, default=5, help="per fault class (>= 1)")
    p.add_argument("--seed", type=int, default=0, help="of the fault steps")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--ckpt-interval", type=int, default=5)
    p.add_argument(
        "--tail-steps", type=int, default=3, help="no fault in the last N steps of the run"
    )
    p.add_argument(
        "--baseline-pg-timeout-s",
        type=float,
        default=InProcessConfig().pg_timeout_s,
        help="the baseline's process-group timeout (default: ours)",
    )
    p.add_argument("--baseline-parallel", choices=("fsdp2", "ddp"), default="fsdp2")
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", type=Path)
    p.add_argument("--plot", type=Path, help="write one timeline PNG per fault class here")
    args = p.parse_args(argv)
    if args.samples < 1:
        p.error("--samples must be >= 1")
    if args.steps - args.tail_steps <= args.ckpt_interval:
        p.error("--steps must leave room for a fault after the first checkpoint")

    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="nvrx-bench-recovery-"))
    data = root / "data"
    write_synthetic_dataset(data, vocab_size=512, seed=0)
    rows = []
    t_start = time.monotonic()
    for kind in args.faults:
        t0 = time.monotonic()
        samples = []
        plotted = False
        for i, spec in enumerate(draw_faults(kind, args, rng)):
            slug = f"{kind}-{i}"
            runs: dict[str, Any] = {}
            order = ("ours", "baseline") if i % 2 == 0 else ("baseline", "ours")
            for who in order:
                d = root / f"{who}-{slug}"
                fn = run_ours if who == "ours" else run_baseline
                runs[who] = fn(spec, kind, d, data, args)
            sample = {
                "fault": spec,
                "order": list(order),
                "ours": first_recovery(runs["ours"]),
                "baseline": first_recovery(runs["baseline"]),
            }
            samples.append(sample)
            o = (sample["ours"] or {}).get("total_s")
            b = (sample["baseline"] or {}).get("total_s")
            print(f"{spec}: ours {o} s, baseline {b} s", file=sys.stderr, flush=True)
            if args.plot and not plotted and runs["ours"]:
                plot_timeline(
                    runs["ours"],
                    args.plot / f"recovery-{kind}.png",
                    title=f"{kind} ({spec}): ours vs torchrun baseline",
                    compare=("torchrun baseline", runs["baseline"]) if runs["baseline"] else None,
                    align_on_fault=True,
                )
                plotted = True
        ours = aggregate([s["ours"] for s in samples])
        base = aggregate([s["baseline"] for s in samples])
        ratio = {}
        if ours and base:
            for k, v in ours["median"].items():
                bv = base["median"].get(k)
                ratio[k] = round(v / bv, 3) if bv else None
        o_total = (ours or {}).get("median", {}).get("total_s")
        rows.append(
            {
                "fault": kind,
                "ours": ours,
                "baseline": base,
                "ours_vs_baseline_median": ratio or None,
                "target_s": TARGETS[kind],
                "meets_target": bool(
                    o_total is not None and ours and ours["recovered"] == ours["samples"]
                )
                and o_total <= TARGETS[kind],
                "samples": samples,
                "bench_s": round(time.monotonic() - t0, 1),
            }
        )

    def cell(agg: dict[str, Any] | None, k: str) -> str:
        if not agg or k not in agg["median"]:
            return "-"
        return f"{agg['median'][k]:.1f} ({agg['p90'][k]:.1f})"

    keys = phase_keys([r["ours"]["median"] for r in rows if r["ours"]] + [dict.fromkeys(PHASES)])
    print(
        f"recovery: {args.samples} sample(s) per class, seed {args.seed}; median (p90) seconds "
        f"per phase; baseline pg timeout {args.baseline_pg_timeout_s} s"
    )
    print(
        "| fault | who | layer | recovered | "
        + " | ".join(k.removesuffix("_s").replace("_", " ") + " s" for k in keys)
        + " | ours / baseline (median total) | target |"
    )
    print("| --- " * (len(keys) + 6) + "|")
    for r in rows:
        ours, base = r["ours"], r["baseline"]
        layer = ",".join((ours or {}).get("layers") or []) or (
            "stage-retry" if r["fault"] == "node-loss" else "injob"
        )
        ratio = (r["ours_vs_baseline_median"] or {}).get("total_s")
        rec = f"{ours['recovered']}/{ours['samples']}" if ours else "-"
        print(
            f"| {r['fault']} | ours | {layer} | {rec} | "
            + " | ".join(cell(ours, k) for k in keys)
            + f" | {ratio if ratio is not None else '-'} | <= {r['target_s']:.0f} s |"
        )
        if r["fault"] == "node-loss":
            cells = ["job fails; manual re-submit"] + ["-"] * (len(keys) - 1)
            print(f"| {r['fault']} | torchrun | restart all | - | " + " | ".join(cells) + " | | |")
        else:
            brec = f"{base['recovered']}/{base['samples']}" if base else "-"
            print(
                f"| {r['fault']} | torchrun | restart all | {brec} | "
                + " | ".join(cell(base, k) for k in keys)
                + " | | |"
            )
    out = {
        "benchmark": "recovery_time",
        "methodology": "samples per class at random steps, median and p90 (issue 15)",
        "machine": os.uname().machine,
        "cores": os.cpu_count(),
        "samples": args.samples,
        "seed": args.seed,
        "steps": args.steps,
        "ckpt_interval": args.ckpt_interval,
        "baseline": {
            "pg_timeout_s": args.baseline_pg_timeout_s,
            "parallel": args.baseline_parallel,
            "checkpoint": "synchronous dcp.save, atomic commit",
        },
        "bench_s": round(time.monotonic() - t_start, 1),
        "rows": rows,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
