"""Node loss to the first productive step, by the path the loss takes: a hot spare, an elastic
shrink and today's stage retry, next to the SIGKILL in-job recovery, in one run.

Each path is the pipeline's train stage on the embedded default (``tasks.train_stage.run_attempt``
with the local backend, as the train stage drives it: simulated nodes are ft_launcher agents with
1 gloo rank each, the tiny model, the trainer's default timeouts):

- ``sigkill``: 2 nodes, rank 1 SIGKILLs itself; ft_launcher respawns every worker (in-job). The
  reference the spare path's target is set against, measured in the same run;
- ``spare``: 2 nodes and 1 hot spare (node 2); node 1's whole process tree is killed and the
  spare takes its place in-job (``tasks.loss_policy``: ``spare``);
- ``elastic``: ``nodes=1:2``; node 1 is lost and the job re-forms on node 0 alone, resuming from
  the checkpoint the 2-rank world wrote (DCP reshards it);
- ``stage-retry``: 2 nodes, node 1 lost: fewer than the minimum remain, the attempt is stopped
  and attempt 2 starts from the newest checkpoint (as the pipeline's task retry does).

Samples: ``--samples`` (3) fault steps, seeded random after the first checkpoint; each sample
runs every path on the same step, the order rotating between samples. The measure is
``trainer.timeline.recovery_phases``' total: fault event until the first step completed after the
resume, split into detect / restart / load / first step. Per path: median, min and max of the
total and the median of each phase over the recovered samples, and each path's median over the
SIGKILL one's. Target (issue 17): the spare path's median within 2 s of the SIGKILL median.
Issue 42's gray nodes (``freeze-spare``, ``evict-spare``) add ``noticed_s`` (a freeze: from the
drill's request to the watcher's verdict; target <= 10 s) and ``steps_replayed``; an eviction
(``evict-spare``, ``evict-fixed``) ``handoff_s``, from the eviction to its step's commit.

    python benchmarks/node_loss.py [--paths sigkill spare elastic stage-retry] [--samples 3]
        [--seed 0] [--steps 20] [--ckpt-interval 5] [--json] [--out FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

from tasks.backends.base import LaunchRequest  # noqa: E402
from tasks.backends.local import LocalBackend  # noqa: E402
from tasks.classify import EndKind  # noqa: E402
from tasks.train_stage import run_attempt  # noqa: E402
from trainer.checkpointing.config import CheckpointConfig, DurableConfig  # noqa: E402
from trainer.config import TrainConfig  # noqa: E402
from trainer.data import write_synthetic_dataset  # noqa: E402
from trainer.rundir import RunDir, read_events  # noqa: E402
from trainer.timeline import recovery_phases  # noqa: E402


@dataclass(frozen=True)
class LossPath:
    name: str
    fault: str  # with {s}: the fault step
    min_nodes: int = 2
    spares: int = 0


PATHS = {
    p.name: p
    for p in (
        LossPath("sigkill", "sigkill@step={s},rank=1"),
        LossPath("spare", "node-loss@step={s},node=1", spares=1),
        LossPath("elastic", "node-loss@step={s},node=1", min_nodes=1),
        LossPath("stage-retry", "node-loss@step={s},node=1"),
        # Issue 42: gray nodes beside a hot spare. A freeze is noticed by its agent's beat
        # stopping (noticed_s: the drill's request to the fault event); an eviction is told.
        LossPath("freeze-spare", "node-freeze@step={s},node=1", spares=1),
        LossPath("evict-spare", "node-evict@step={s},node=1", spares=1),
        # An eviction on a fixed job: its hand-off (trainer.notice) is the stage retry's resume.
        LossPath("evict-fixed", "node-evict@step={s},node=1"),
    )
}
SPARE_TARGET_S = 2.0  # issue 17: the spare path within 2 s of the SIGKILL in-job recovery
PHASES = ("detect_s", "restart_s", "load_s", "first_step_s", "total_s")


def run_path(path: LossPath, step: int, run_root: Path, data: Path, args: argparse.Namespace):
    """One sample of one path; the first fault's recovery row (``recovery_phases``)."""
    cfg = TrainConfig(
        run_root=run_root,
        data_dir=data,
        steps=args.steps,
        checkpoint=CheckpointConfig(durable=DurableConfig(interval=args.ckpt_interval)),
        faults=(path.fault.format(s=step),),
        # An elastic job splits every global batch into the full world's micro-batches.
        micro_batches=2 if path.min_nodes < 2 else None,
    )
    request = LaunchRequest(
        run_id=run_root.name,
        attempt=1,
        cfg=cfg,
        nodes=2,
        nproc_per_node=1,
        min_nodes=path.min_nodes,
        spares=path.spares,
        deadline_s=600,
    )
    for attempt in (1, 2):
        report = run_attempt(LocalBackend(), dataclasses.replace(request, attempt=attempt))
        if report.outcome.kind != EndKind.NODE_LOSS:  # only a node loss gets another attempt
            break
    if report.outcome.kind != EndKind.COMPLETED:
        print(f"{path.name}@{step}: {report.outcome.message} ({run_root})", file=sys.stderr)
    events = read_events(run_root)
    rows = recovery_phases(events)
    row = rows[0] if rows else {"recovered": False, "reason": "no fault recorded"}
    # The layer the trainer attributed the recovery to (trainer.process.Origin.layer).
    row["layer"] = next((getattr(e, "layer", None) for e in events if e.kind == "recovered"), None)
    row["attempts"] = attempt
    row["completed"] = report.outcome.kind == EndKind.COMPLETED
    fault = next((e for e in events if e.kind == "fault"), None)
    if fault is not None:
        freeze = RunDir(run_root, 1).freeze_file(1)
        if freeze.exists():  # a freeze drill: from the request to the watcher's verdict
            row["noticed_s"] = round(fault.t - freeze.stat().st_mtime, 3)
        # Steps trained before the fault and trained again after it (the step in flight
        # excluded): what the recovery lost.
        before = max((e.step for e in events if e.kind == "step" and e.t < fault.t), default=0)
        resumed = next(
            (
                e
                for e in events
                if e.kind == "resume" and e.t > fault.t and getattr(e, "action", "") == "loaded"
            ),
            None,
        )  # the tier it resumed from (not one it passed over for a newer commit)
        if resumed is not None and getattr(resumed, "step", None) is not None:
            row["steps_replayed"] = max(0, before - resumed.step)
        handoff = next((e for e in events if e.kind == "handoff"), None)
        if handoff is not None:  # an eviction's: its step saved before the node left
            row["handoff_s"] = round(handoff.t - fault.t, 3)
            row["handoff_step_minus_before"] = handoff.step - before
    return row


def aggregate(rows: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in rows if r.get("recovered") and r.get("completed")]
    out: dict[str, Any] = {"samples": len(rows), "recovered": len(ok)}
    totals = [float(r["total_s"]) for r in ok]
    if totals:
        out.update(min_s=min(totals), max_s=max(totals))
    out["median"] = {
        k: round(statistics.median([float(r[k]) for r in ok if k in r]), 3)
        for k in PHASES
        if any(k in r for r in ok)
    }
    for extra in ("noticed_s", "steps_replayed", "handoff_s", "handoff_step_minus_before"):
        values = [float(r[extra]) for r in ok if extra in r]
        if values:
            out[extra] = {"median": statistics.median(values), "min": min(values),
                          "max": max(values)}  # fmt: skip
    out["layers"] = sorted({str(r.get("layer")) for r in ok if r.get("layer")})
    out["attempts"] = sorted({int(r["attempts"]) for r in rows})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--paths", nargs="+", default=list(PATHS), choices=list(PATHS))
    p.add_argument("--samples", type=int, default=3)
    p.add_argument("--seed", type=int, default=0, help="of the fault steps")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--ckpt-interval", type=int, default=5)
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if args.samples < 1:
        p.error("--samples must be >= 1")
    if args.steps - 3 <= args.ckpt_interval:
        p.error("--steps must leave room for a fault after the first checkpoint")
    rng = random.Random(args.seed)
    steps = [rng.randint(args.ckpt_interval + 1, args.steps - 3) for _ in range(args.samples)]
    root = Path(tempfile.mkdtemp(prefix="nvrx-bench-node-loss-"))
    data = root / "data"
    write_synthetic_dataset(data, vocab_size=512, seed=0)
    names = list(args.paths)
    samples: list[dict[str, Any]] = []
    t0 = time.monotonic()
    for i, step in enumerate(steps):
        order = names[i % len(names) :] + names[: i % len(names)]
        sample: dict[str, Any] = {"step": step, "order": order}
        for name in order:
            sample[name] = run_path(PATHS[name], step, root / f"{name}-{i}", data, args)
        samples.append(sample)
        print(
            f"fault at step {step}: "
            + ", ".join(f"{n} {sample[n].get('total_s')} s" for n in names),
            file=sys.stderr,
            flush=True,
        )
    paths = {n: aggregate([s[n] for s in samples]) for n in names}
    ref = paths.get("sigkill", {}).get("median", {}).get("total_s")
    for agg in paths.values():
        total = agg["median"].get("total_s")
        agg["vs_sigkill_median"] = round(total / ref, 2) if ref and total is not None else None
    spare = paths.get("spare", {}).get("median", {}).get("total_s")
    target = round(ref + SPARE_TARGET_S, 3) if ref is not None else None
    result = {
        "bench": "node_loss",
        "samples": args.samples,
        "seed": args.seed,
        "fault_steps": steps,
        "paths": paths,
        "spare_target_s": target,
        "spare_meets_target": bool(
            target is not None
            and spare is not None
            and paths["spare"]["recovered"] == args.samples
            and spare <= target
        ),
        "bench_s": round(time.monotonic() - t0, 1),
        "raw": samples,
    }
    print(
        f"node loss to first productive step: {args.samples} sample(s), fault steps {steps}; "
        "median seconds per phase, total min-max"
    )
    print(
        "| path | layer | attempts | recovered | detect | restart | load | first step | total "
        "(min-max) | / sigkill |"
    )
    print("| --- " * 10 + "|")
    for n, a in paths.items():
        m = a["median"]
        cells = [f"{m[k]:.1f}" if k in m else "-" for k in PHASES[:-1]]
        total = f"{m['total_s']:.1f} ({a['min_s']:.1f}-{a['max_s']:.1f})" if "total_s" in m else "-"
        print(
            f"| {n} | {','.join(a['layers']) or '-'} | {','.join(map(str, a['attempts']))} | "
            f"{a['recovered']}/{a['samples']} | "
            + " | ".join(cells)
            + f" | {total} | {a['vs_sigkill_median']} |"
        )
    if target is not None:
        verdict = "met" if result["spare_meets_target"] else "MISSED"
        print(
            f"target: spare median <= sigkill median + {SPARE_TARGET_S} s = {target} s: {verdict}"
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
