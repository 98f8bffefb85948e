"""Summarise a run from its ``events.jsonl``: ``python -m trainer.report RUN_ROOT [--json]``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from trainer.events import read_events


def faults_with_recovery(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every fault with the layer that recovered it and how long it took (``none`` if no
    ``recovered`` event closed it)."""
    recovered: dict[tuple[Any, Any], dict[str, Any]] = {}
    for e in events:
        if e["kind"] == "recovered":
            recovered.setdefault((e.get("fault"), e.get("fault_step")), e)
    out = []
    for f in (e for e in events if e["kind"] == "fault"):
        r = recovered.get((f.get("fault"), f.get("step")))
        out.append(
            {
                "fault": f.get("fault"),
                "kind": f.get("fault_kind"),
                "step": f.get("step"),
                "rank": f.get("rank"),
                "node": f.get("node"),
                "recovered_by": r["layer"] if r else "none",
                "recovery_s": r["recovery_s"] if r else None,
                # A node loss: the path the watcher chose at the loss (tasks.loss_policy) and
                # why; recovered_by is the layer that did recover it.
                "path": f.get("path"),
                "detail": f.get("detail"),
                "t": f["t"],
            }
        )
    return out


def world_changes(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every time an elastic job re-formed on another number of ranks (trainer.elastic)."""
    return [
        {
            "step": e.get("step"),
            "from_world": e.get("from_world"),
            "to_world": e.get("to_world"),
            "nodes": e.get("nodes"),
            "cause": e.get("cause"),
            "t": e["t"],
        }
        for e in events
        if e["kind"] == "world_change"
    ]


def summarize(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Pure: faults with the layer that recovered each and how long it took, checkpoints, steps."""
    steps = [e for e in events if e["kind"] == "step"]
    checkpoints = [e for e in events if e["kind"] == "checkpoint"]
    end = next((e for e in reversed(events) if e["kind"] in ("train_end", "fatal")), None)
    blocking = [c["blocking_s"] for c in checkpoints]
    return {
        "final_step": max((s["step"] for s in steps), default=0),
        "steps_run": len(steps),
        "final_loss": steps[-1]["loss"] if steps else None,
        "faults": faults_with_recovery(events),
        "world_changes": world_changes(events),
        "restarts": [{"layer": e["layer"], "t": e["t"]} for e in events if e["kind"] == "restart"],
        "checkpoints": len(checkpoints),
        "ckpt_blocking_s_max": max(blocking, default=None),
        "ckpt_blocking_s_mean": sum(blocking) / len(blocking) if blocking else None,
        "outcome": None
        if end is None
        else ("completed" if end["kind"] == "train_end" else "failed"),
        "params_sha256": end.get("params_sha256") if end else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer.report")
    p.add_argument("run_root", type=Path)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    events = read_events(args.run_root)
    if not events:
        print(f"error: no events in {args.run_root / 'events.jsonl'}", file=sys.stderr)
        return 2
    s = summarize(events)
    if args.json:
        print(json.dumps(s))
        return 0
    print(f"outcome: {s['outcome']}  final step: {s['final_step']}  loss: {s['final_loss']}")
    print(f"steps run (incl. replays after restarts): {s['steps_run']}")
    mean = s["ckpt_blocking_s_mean"]
    print(
        f"checkpoints committed: {s['checkpoints']}  blocking per save: mean "
        f"{mean if mean is None else round(mean, 4)} s, max {s['ckpt_blocking_s_max']} s"
    )
    for f in s["faults"]:
        print(f"fault {f['fault']}: recovered by {f['recovered_by']} in {f['recovery_s']} s")
    print(f"params_sha256: {s['params_sha256']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
