"""Recovery time per fault class, split into phases, ours next to plain torchrun, in one run.

Ours: the pipeline's train stage on the embedded default (``tasks.train_stage.run_attempt`` with
the local backend: 2 simulated nodes, each an ft_launcher agent with 1 gloo rank, the tiny
model, the trainer's default timeouts as the pipeline uses them), a node loss answered by the
stage retry (attempt 2, as the pipeline's task retry does). Baseline: ``torchrun
--max-restarts 3`` on the same 2 simulated nodes (one agent and rank each), DDP and a
synchronous ``torch.save`` checkpoint (``benchmarks/baseline_trainer.py``), same model, data,
steps, checkpoint interval and faults;
it has no hang detection other than its process-group timeout (``--baseline-pg-timeout-s``,
torch's default is 30 min) and no automatic answer to a lost node (torchrun's job fails; a
person re-submits it).

Phases (``trainer.timeline.recovery_phases``): detect (fault until the next incarnation
begins), restart (until the checkpoint load starts), load, first step; total = fault until the
first completed step after resume. Targets here: in-process <= 5 s, sigkill <= 15 s, hang <=
heartbeat timeout + 10 s, node loss <= 45 s, each faster than the baseline.

    python benchmarks/recovery_time.py [--faults exception sigkill hang node-loss]
        [--steps 30] [--fault-step 17] [--json] [--out FILE] [--plot DIR]
"""

from __future__ import annotations

import argparse
import json
import os
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
from trainer.config import InJobConfig, TrainConfig  # noqa: E402
from trainer.data import write_synthetic_dataset  # noqa: E402
from trainer.events import read_events  # noqa: E402
from trainer.timeline import plot_timeline, recovery_phases  # noqa: E402

SPECS = {
    "exception": "exception@step={s},rank=1",
    "sigkill": "sigkill@step={s},rank=1",
    "hang": "hang@step={s},rank=1",
    "node-loss": "node-loss@step={s},node=1",
}
TARGETS = {"exception": 5.0, "sigkill": 15.0, "hang": InJobConfig().heartbeat_timeout_s + 10.0}
TARGETS["node-loss"] = 45.0


def run_ours(kind: str, root: Path, data: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    run_root = root / f"ours-{kind}"
    cfg = TrainConfig(
        run_root=run_root,
        data_dir=data,
        steps=args.steps,
        ckpt_interval=args.ckpt_interval,
        faults=(SPECS[kind].format(s=args.fault_step),),
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
        raise RuntimeError(f"ours/{kind}: {report.outcome.message}")
    return read_events(run_root)


def run_baseline(
    kind: str, root: Path, data: Path, args: argparse.Namespace
) -> list[dict[str, Any]]:
    run_root = root / f"baseline-{kind}"
    run_root.mkdir(parents=True)
    if kind == "node-loss":
        return []  # torchrun has no answer: the job fails and waits for a person
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
                f"--fault={SPECS[kind].format(s=args.fault_step)}",
            ],
        ),
        run_root,
        timeout_s=900,
    )
    if any(rcs):  # reported as not recovered (the phases find no step after the fault)
        print(f"baseline/{kind}: torchrun exited {rcs} (logs in {run_root})", file=sys.stderr)
    return read_events(run_root)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--faults", nargs="+", default=list(SPECS), choices=list(SPECS))
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--fault-step", type=int, default=17)
    p.add_argument("--ckpt-interval", type=int, default=5)
    p.add_argument("--baseline-pg-timeout-s", type=float, default=60.0)
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", type=Path)
    p.add_argument("--plot", type=Path, help="write one timeline PNG per fault class here")
    args = p.parse_args(argv)

    root = Path(tempfile.mkdtemp(prefix="nvrx-bench-recovery-"))
    data = root / "data"
    write_synthetic_dataset(data, vocab_size=512, seed=0)
    rows = []
    for kind in args.faults:
        t0 = time.monotonic()
        ours = run_ours(kind, root, data, args)
        base = run_baseline(kind, root, data, args)
        ph_ours = recovery_phases(ours)
        ph_base = recovery_phases(base)
        row = {
            "fault": kind,
            "ours": ph_ours[0] if ph_ours else None,
            "baseline": ph_base[0] if ph_base else None,
            "target_s": TARGETS[kind],
            "bench_s": round(time.monotonic() - t0, 1),
        }
        o = (row["ours"] or {}).get("total_s")
        b = (row["baseline"] or {}).get("total_s")
        row["ours_vs_baseline"] = round(o / b, 3) if o and b else None
        row["meets_target"] = bool(o is not None and o <= TARGETS[kind])
        rows.append(row)
        print(f"{kind}: ours {o} s, baseline {b} s", file=sys.stderr, flush=True)
        if args.plot:
            plot_timeline(
                ours,
                args.plot / f"recovery-{kind}.png",
                title=f"{kind}: ours vs torchrun baseline",
                compare=("torchrun baseline", base) if base else None,
                align_on_fault=True,
            )

    def fmt(ph: dict[str, Any] | None) -> list[str]:
        if not ph:
            return ["-"] * 5
        if not ph.get("recovered"):
            return ["job failed, not recovered"] + ["-"] * 4
        return [
            f"{ph[k]:.1f}" for k in ("detect_s", "restart_s", "load_s", "first_step_s", "total_s")
        ]

    print(
        "| fault | who | layer | detect s | restart s | load s | first step s | total s | target |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        layer = (r["ours"] or {}).get("layer") or (
            "stage-retry" if r["fault"] == "node-loss" else "injob"
        )
        print(
            f"| {r['fault']} | ours | {layer} | "
            + " | ".join(fmt(r["ours"]))
            + f" | <= {r['target_s']:.0f} s |"
        )
        base = (
            fmt(r["baseline"])
            if r["fault"] != "node-loss"
            else ["job fails; manual re-submit"] + ["-"] * 4
        )
        print(f"| {r['fault']} | torchrun | restart all | " + " | ".join(base) + " | |")
    out = {
        "benchmark": "recovery_time",
        "machine": os.uname().machine,
        "cores": os.cpu_count(),
        "rows": rows,
    }
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
