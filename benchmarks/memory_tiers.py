"""Recovery with the memory tiers vs the durable checkpoint alone, per fault class, in one run.

Issue 29's performance section: per fault class, the load seconds and the replayed steps with
the tiers (the process's own copy and node memory, ``memory_interval`` 1) vs durable only
(``memory_interval`` 0), each sample running both on the same fault (the order alternates); and
what the tiers cost: the blocking time of a memory save (a step's ``ckpt_blocking_s`` where no
durable save was due) vs a durable save's (``checkpoint`` events' ``blocking_s``), and the
fault-free step time with and without them.

The pipeline's train stage on the embedded default (``tasks.train_stage.run_attempt`` with the
local backend: 2 simulated nodes of 1 gloo rank each, the tiny model, checkpoints every
``--ckpt-interval`` steps), as ``benchmarks/recovery_time.py`` runs it; a node loss is answered by
the stage retry (a new attempt: new nodes, no node memory). Faults at a random step (seeded)
after the first checkpoint.

    python benchmarks/memory_tiers.py [--faults exception sigkill hang node-loss]
        [--samples 3] [--seed 0] [--steps 30] [--ckpt-interval 5] [--json] [--out FILE]

At a gigabyte (issue 40): ``--workload gpt-100m --seq-len 64 --modes auto 1 0
--fault-modes auto --min-fault-step 13`` measures the fault-free step time with the memory tiers
at their default (``auto``), forced every step and off, and each fault's recovery with the
default tiers (a hang after the step timeout is learned, 10 sections after a warm-up one).
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

from benchmarks.recovery_time import SPECS as RECOVERY_SPECS  # noqa: E402
from tasks.backends.base import LaunchRequest  # noqa: E402
from tasks.backends.local import LocalBackend  # noqa: E402
from tasks.classify import EndKind  # noqa: E402
from tasks.train_stage import run_attempt  # noqa: E402
from trainer.checkpointing.config import CheckpointConfig, DurableConfig, MemoryConfig  # noqa: E402
from trainer.config import TrainConfig  # noqa: E402
from trainer.data import write_synthetic_dataset  # noqa: E402
from trainer.event_types import Event  # noqa: E402
from trainer.history import RunHistory  # noqa: E402
from trainer.rundir import read_events  # noqa: E402

SPECS = {
    **RECOVERY_SPECS,  # the classes recovery_time.py samples, spelled the same
    # The same loss with a hot spare (a third node) taking the lost node's place in-job: the
    # world keeps its size, and the lost rank's shard comes from its peer copy.
    "node-loss+spare": "node-loss@step={s},node=1",
}
SPARES = {"node-loss+spare": 1}
# memory_interval per mode; the names of issue 29's runs kept for its committed results.
NAMES = {"1": "tiers", "0": "durable", "auto": "auto"}


def _interval(mode: str) -> int | str:
    return mode if mode == "auto" else int(mode)


def run(
    spec: str, memory_interval: int | str, run_root: Path, data: Path, args: Any, spares: int = 0
) -> list:
    options = {"seq_len": args.seq_len} if args.seq_len else {}
    cfg = TrainConfig(
        run_root=run_root,
        data_dir=data,
        workload=args.workload,
        workload_options=options,
        steps=args.steps,
        checkpoint=CheckpointConfig(
            durable=DurableConfig(interval=args.ckpt_interval),
            memory=MemoryConfig(interval=memory_interval),
        ),
        faults=(spec,) if spec else (),
    )
    for attempt in (1, 2):
        report = run_attempt(
            LocalBackend(),
            LaunchRequest(
                run_id=run_root.name, attempt=attempt, cfg=cfg, nodes=2, nproc_per_node=1,
                spares=spares, deadline_s=args.deadline_s,
            ),
        )  # fmt: skip
        if report.outcome.kind != EndKind.NODE_LOSS:
            break
    if report.outcome.kind != EndKind.COMPLETED:
        print(f"{spec} ({memory_interval}): {report.outcome.message} ({run_root})", file=sys.stderr)
    return read_events(run_root)


def recovery(events: list[Event]) -> dict[str, Any] | None:
    records = [r for r in RunHistory.of(events).fault_records() if r.recovered_by != "none"]
    if not records:
        return None
    r = records[0]
    keys = ("resume_source", "resume_step", "replayed_steps", "load_s", "load_bytes", "recovery_s")
    return {k: getattr(r, k) for k in keys} | {"params_sha256": params_digest(events)}


def params_digest(events: list[Event]) -> str | None:
    """The final parameters' digest (train_end), to check a recovery bitwise against the
    fault-free runs: the memory interval does not change what is trained."""
    ends = [e for e in events if e.kind == "train_end"]
    return ends[-1].params_sha256 if ends else None


def costs(events: list[Event], ckpt_interval: int, steps: int) -> dict[str, Any]:
    """Blocking per memory save (steps with no durable save due), per durable save, and the
    median step time, of a fault-free run."""
    step_ev = [e for e in events if e.kind == "step"]
    memory_only = [
        e.ckpt_blocking_s
        for e in step_ev
        if getattr(e, "ckpt_blocking_s", None) is not None
        and e.step % ckpt_interval
        and e.step < steps
    ]
    durable = [e.blocking_s for e in events if e.kind == "checkpoint"]
    chosen = [e for e in events if e.kind == "memory_interval"]
    # After the first durable save: the first steps build, warm up and (auto) measure saves.
    steady = [e.step_s for e in step_ev if e.step > ckpt_interval and e.step < steps]
    return {
        "memory_save_blocking_s": _median(memory_only),
        "durable_save_blocking_s": _median(durable),
        "step_s": _median([e.step_s for e in step_ev]),
        "steady_step_s": _median(steady),
        "memory_saves": sum(1 for e in step_ev if getattr(e, "ckpt_blocking_s", None) is not None),
        "auto_interval": chosen[-1].interval if chosen else None,
        "params_sha256": params_digest(events),
    }


def _median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 4) if xs else None


def _spread(xs: list[float]) -> dict[str, float] | None:
    if not xs:
        return None
    return {"median": round(statistics.median(xs), 4), "min": min(xs), "max": max(xs)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--faults", nargs="*", default=list(SPECS), choices=list(SPECS))
    p.add_argument("--samples", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--ckpt-interval", type=int, default=5)
    p.add_argument("--workload", default="gpt-tiny")
    p.add_argument("--seq-len", type=int, default=None, help="the GPT workload's seq_len option")
    p.add_argument("--modes", nargs="+", default=["1", "0"], help="memory_interval per cost run")
    p.add_argument("--fault-modes", nargs="+", default=["1", "0"])
    p.add_argument("--fault-samples", type=int, default=None, help="default: --samples")
    p.add_argument("--min-fault-step", type=int, default=None)
    p.add_argument("--deadline-s", type=float, default=600.0)
    p.add_argument("--no-costs", action="store_true", help="skip the fault-free cost runs")
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="nvrx-bench-tiers-"))
    data = root / "data"
    vocab = 512  # as the pipeline's hydration writes it for every workload (flows/stages.py)
    write_synthetic_dataset(data, vocab_size=vocab, seed=0)
    t_start = time.monotonic()

    # What the tiers cost, fault-free, each mode --samples times (alternating).
    modes = {NAMES.get(m, m): _interval(m) for m in args.modes}
    cost_runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    for i in range(0 if args.no_costs else args.samples):
        order = list(modes) if i % 2 == 0 else list(reversed(modes))
        for mode in order:
            ev = run("", modes[mode], root / f"clean-{mode}-{i}", data, args)
            cost_runs[mode].append(costs(ev, args.ckpt_interval, args.steps))
            print(f"clean {mode} {i}: {json.dumps(cost_runs[mode][-1])}", file=sys.stderr)
    cost: dict[str, Any] = {
        mode: {
            k: _spread([c[k] for c in runs if isinstance(c[k], float | int)])
            for k in runs[0]
            if k not in ("auto_interval", "params_sha256")
        }
        | {"auto_interval": [c["auto_interval"] for c in runs]}
        | {"params_sha256": sorted({c["params_sha256"] or "none" for c in runs})}
        for mode, runs in cost_runs.items()
        if runs
    }
    if "0" in args.modes and not args.no_costs:
        off = cost[NAMES["0"]]["steady_step_s"]
        for mode in cost:
            on = cost[mode]["steady_step_s"]
            if on and off:
                cost[mode]["steady_step_vs_off"] = round(on["median"] / off["median"], 4)
    print(f"costs: {json.dumps(cost)}", file=sys.stderr, flush=True)

    rows = []
    for kind in args.faults:
        samples = []
        for i in range(args.fault_samples or args.samples):
            step = rng.randint(args.min_fault_step or args.ckpt_interval + 1, args.steps - 3)
            spec = SPECS[kind].format(s=step)
            fmodes = {NAMES.get(m, m): _interval(m) for m in args.fault_modes}
            order = list(fmodes) if i % 2 == 0 else list(reversed(fmodes))
            # Steps the recovery went back: completed before the fault (fault step - 1) less
            # the step resumed from (the history's replayed_steps counts step events, and a
            # killed rank 0 loses its last second of them).
            sample: dict[str, Any] = {"fault": spec}
            for mode in order:
                ev = run(
                    spec, fmodes[mode], root / f"{kind}-{i}-{mode}", data, args, SPARES.get(kind, 0)
                )
                sample[mode] = recovery(ev)
                if sample[mode] is not None:
                    # (Not for a node loss: the watcher kills the node once it saw the step,
                    # and training may have gone on a step or two by then.)
                    node = kind.startswith("node-loss")
                    back = None if node else step - 1 - sample[mode]["resume_step"]
                    sample[mode]["steps_back"] = back
            samples.append(sample)
            print(f"{spec}: {json.dumps({m: sample[m] for m in fmodes})}", file=sys.stderr)
        agg: dict[str, Any] = {"fault": kind, "samples": samples}
        clean = {d for c in cost.values() for d in c["params_sha256"]}
        if clean:
            agg["bitwise_equal_to_fault_free"] = [
                s[m]["params_sha256"] in clean for s in samples for m in fmodes if s[m]
            ]
        for mode in fmodes:
            got = [s[mode] for s in samples if s[mode]]
            agg[mode] = {
                "recovered": len(got),
                "sources": sorted({g["resume_source"] or "fresh" for g in got}),
                **{
                    k: _spread([g[k] for g in got if g[k] is not None])
                    for k in ("load_s", "resume_step", "steps_back", "replayed_steps", "recovery_s")
                },
            }
        rows.append(agg)

    out = {
        "benchmark": "memory_tiers",
        "setup": f"2 simulated nodes x 1 gloo rank, {args.workload}, local backend, 2 cores",
        "args": {k: v for k, v in vars(args).items() if k not in ("json", "out")},
        "costs": cost,
        "faults": rows,
        "wall_s": round(time.monotonic() - t_start, 1),
    }
    text = json.dumps(out, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    if args.json:
        print(text)
    else:
        for r in rows:
            print(
                f"{r['fault']:10} "
                + " | ".join(
                    f"{m} {r[m]['sources']} load {r[m]['load_s']} back {r[m]['steps_back']}"
                    for m in r
                    if isinstance(r[m], dict)
                )
            )
        print(f"costs: {json.dumps(cost)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
