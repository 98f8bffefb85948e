"""Summarise a run from its ``events.jsonl``: ``python -m trainer.report RUN_ROOT [--json]``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from trainer.history import RunHistory


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer.report")
    p.add_argument("run_root", type=Path)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    history = RunHistory.read(args.run_root)
    if not history.events_seen:
        print(f"error: no events in {args.run_root / 'events.jsonl'}", file=sys.stderr)
        return 2
    s = history.summary()
    if args.json:
        print(s.model_dump_json())
        return 0
    print(f"outcome: {s.outcome}  final step: {s.final_step}  loss: {s.final_loss}")
    print(f"steps run (incl. replays after restarts): {s.steps_run}")
    mean = s.ckpt_blocking_s_mean
    print(
        f"checkpoints committed: {s.checkpoints}  blocking per save: mean "
        f"{mean if mean is None else round(mean, 4)} s, max {s.ckpt_blocking_s_max} s"
    )
    for f in s.faults:
        print(f"fault {f.fault}: recovered by {f.recovered_by} in {f.recovery_s} s")
    print(f"params_sha256: {s.params_sha256}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
