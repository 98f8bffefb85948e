"""A slow node found and replaced (issue 42, items 2 and 3), side by side in one run: the
detection time in steps and seconds, and the step time before the slowdown, while slow, and after
the replacement, against training on at the slow pace (policy ``report``) and a healthy run.

Each case is the train stage on the embedded default (``tasks.train_stage.run_attempt``, the local
backend: ft_launcher agents with one gloo rank each, the tiny model), 2 training nodes:

- ``healthy``: no fault, the detector on (policy ``replace``): it must evict nothing;
- ``replace``: ``slow@step=N,node=1,factor=F`` with a hot spare (node 2): node 1 confirmed slow,
  taken away, the spare trains on;
- ``report``: the same slowdown, policy ``report``: the job trains on at the slow pace.

The judge's rule is the default (``StragglerConfig``: windows of 10 measured steps, confirmed
after 3 windows at >= 1.10x spanning >= 30 s) unless ``--window`` / ``--confirm-s`` say. The cases
alternate within each sample. ``--fault-free-minutes M`` adds one healthy run of about M minutes
with the detector on (policy ``replace``) and counts its verdicts (target: 0 evictions).

    python benchmarks/straggler.py [--samples 2] [--steps 200] [--slow-at 20] [--factor 3]
        [--fault-free-minutes 0] [--out FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
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

from benchmarks.fold_events import stats  # noqa: E402
from tasks.backends.base import LaunchRequest  # noqa: E402
from tasks.backends.local import LocalBackend  # noqa: E402
from tasks.train_stage import run_attempt  # noqa: E402
from trainer.checkpointing.config import CheckpointConfig, DurableConfig  # noqa: E402
from trainer.config import TrainConfig  # noqa: E402
from trainer.data import write_synthetic_dataset  # noqa: E402
from trainer.event_types import Step as StepEvent  # noqa: E402
from trainer.event_types import Straggler, TrainStart  # noqa: E402
from trainer.faults import parse_fault  # noqa: E402
from trainer.rundir import read_events  # noqa: E402
from trainer.straggler_config import StragglerConfig, StragglerPolicy  # noqa: E402

SKIP = 3  # steps after a (re)start left out of a median (the first step's allocations)
CASES = ("healthy", "replace", "report")
KEYS = ("before_s", "slow_s", "after_s", "detect_steps", "detect_s", "wall_s")


def run_case(case: str, root: Path, data: Path, args: argparse.Namespace) -> dict[str, Any]:
    policy = StragglerPolicy.REPORT if case == "report" else StragglerPolicy.REPLACE
    rule = StragglerConfig(policy=policy, window=args.window, confirm_s=args.confirm_s)
    fault = f"slow@step={args.slow_at},node=1,factor={args.factor:g}"
    cfg = TrainConfig(
        run_root=root,
        data_dir=data,
        steps=args.steps,
        checkpoint=CheckpointConfig(durable=DurableConfig(interval=args.ckpt_interval)),
        faults=() if case == "healthy" else (parse_fault(fault),),
        straggler=rule,
    )
    request = LaunchRequest(
        run_id=root.name, attempt=1, cfg=cfg, nodes=2, nproc_per_node=1,
        spares=1 if case == "replace" else 0, deadline_s=1800,
    )  # fmt: skip
    t0 = time.monotonic()
    report = run_attempt(LocalBackend(), request)
    wall = time.monotonic() - t0
    events = read_events(root)
    steps = [e for e in events if isinstance(e, StepEvent)]
    said = [e for e in events if isinstance(e, Straggler)]
    starts = [e for e in events if isinstance(e, TrainStart)]
    row: dict[str, Any] = {
        "outcome": report.outcome.kind.value,
        "wall_s": round(wall, 2),
        "verdicts": [(e.node, e.verdict) for e in said],
        "evictions": sum(1 for e in said if e.verdict == "replaced"),
    }

    def median(sel: list[StepEvent]) -> float | None:
        xs = [e.step_s for e in sel if not (e.ckpt_blocking_s or 0) > 0]
        return round(statistics.median(xs), 4) if xs else None

    first = starts[0].t if starts else 0.0
    row["before_s"] = median([e for e in steps if SKIP < e.step < args.slow_at and e.t > first])
    decided = next((e for e in said if e.verdict in ("replaced", "confirmed")), None)
    if case != "healthy" and decided is not None:
        row["detect_steps"] = decided.steps[1] - args.slow_at + 1
        began = next((e.t for e in steps if e.step == args.slow_at), None)
        row["detect_s"] = round(decided.t - began, 2) if began is not None else None
        row["slow_s"] = median(
            [e for e in steps if args.slow_at + SKIP <= e.step and e.t <= decided.t]
        )
    if case == "replace" and len(starts) > 1:
        after = [e for e in steps if e.t > starts[-1].t][SKIP:]
        row["after_s"] = median(after)
    if case == "report":
        row["after_s"] = median([e for e in steps if e.step >= args.slow_at + SKIP])
    return row


def _with(args: argparse.Namespace, **changes: Any) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), **changes})


def fault_free(minutes: float, root: Path, data: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One healthy run of about ``minutes`` with the detector on (policy replace)."""
    probe = run_case("healthy", root / "probe", data, _with(args, steps=30))
    per_step = probe.get("before_s") or 0.2
    steps = max(60, int(minutes * 60 / per_step))
    row = run_case("healthy", root / "long", data, _with(args, steps=steps))
    return {"steps": steps, **row}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--samples", type=int, default=2)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--slow-at", type=int, default=20)
    p.add_argument("--factor", type=float, default=3.0)
    p.add_argument("--ckpt-interval", type=int, default=25)
    p.add_argument("--window", type=int, default=StragglerConfig().window)
    p.add_argument("--confirm-s", type=float, default=StragglerConfig().confirm_s)
    p.add_argument("--fault-free-minutes", type=float, default=0.0)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="nvrx-bench-straggler-"))
    data = root / "data"
    write_synthetic_dataset(data, vocab_size=512, seed=0)
    t0 = time.monotonic()
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in CASES}
    for i in range(args.samples):
        order = CASES[i % 3 :] + CASES[: i % 3]
        for case in order:
            row = run_case(case, root / f"{case}-{i}", data, args)
            runs[case].append(row)
            print(f"sample {i} {case}: {row}", file=sys.stderr, flush=True)

    def fold(case: str, key: str) -> dict[str, float] | None:
        xs = [float(r[key]) for r in runs[case] if r.get(key) is not None]
        return stats(xs) if xs else None

    healthy = fold("healthy", "before_s")
    summary: dict[str, Any] = {case: {k: fold(case, k) for k in KEYS} for case in CASES}
    h = healthy["median"] if healthy else None
    for case in ("replace", "report"):
        after = summary[case]["after_s"]
        if h and after:
            summary[case]["after_over_healthy"] = round(float(after["median"]) / float(h), 3)
    rep = summary["replace"].get("after_over_healthy")
    result: dict[str, Any] = {
        "bench": "straggler",
        "samples": args.samples,
        "steps": args.steps,
        "slow": f"slow@step={args.slow_at},node=1,factor={args.factor:g}",
        "rule": dataclasses.asdict(StragglerConfig(window=args.window, confirm_s=args.confirm_s)),
        "summary": summary,
        "healthy_evictions": sum(r["evictions"] for r in runs["healthy"]),
        "target_after_within_10pct": rep is not None and rep <= 1.10,
        "raw": runs,
    }
    if args.fault_free_minutes > 0:
        result["fault_free"] = fault_free(args.fault_free_minutes, root, data, args)
    result["bench_s"] = round(time.monotonic() - t0, 1)
    print(json.dumps({k: v for k, v in result.items() if k != "raw"}, indent=1, default=str))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
