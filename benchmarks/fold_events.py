"""The run's history at a million steps: folding ``events.jsonl``, the fold's live state, and a
worker's start-up with the log beside it (issue 26's performance targets).

Writes a synthetic but realistic log (the trainer's own ``step`` and ``checkpoint`` events through
``EventLog``'s encoding: a step line is ~190 bytes, a commit every 100 steps keeping 2, two stage
attempts, three faults), then measures, each in a fresh interpreter and ``--samples`` times:

- ``fold``: :meth:`trainer.history.RunHistory.read` of the whole file: seconds, and the peak
  resident memory it added (``ru_maxrss`` after minus before). Target <= 10 s, <= 64 MB.
- ``legacy``: the whole-file list of dicts every reader built before the fold (``read_events``
  as it was: ``json.loads`` of every line into one list), for comparison.
- ``state``: the fold's live state (entries held, and its pickled size) after 1 k and after 1 M
  steps. Target: the same.
- ``status``: ``nvrx-pipeline status`` of the run (the whole command in a fresh interpreter):
  its peak resident memory at 1 M steps and at 1 k. Target: within 64 MB, under 10 s.
- ``startup``: what a worker reads of the run at start-up (trainer.rundir.RunDir: the recorded
  commit, the last launch, open faults, the newest retry) beside a 1 M-line log and beside an
  empty one. Target: within 0.1 s of each other.

    python benchmarks/fold_events.py [--steps 1000000] [--samples 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TARGET_FOLD_S = 10.0
TARGET_FOLD_MB = 64.0
TARGET_STARTUP_DELTA_S = 0.1


def write_log(run_root: Path, steps: int) -> int:
    """A run of ``steps`` steps as the trainer writes it; returns the file's size."""
    from trainer.rundir import RunDir

    run_root.mkdir(parents=True, exist_ok=True)
    t = 1.7e9
    lines: list[str] = []

    def add(kind: str, **fields: object) -> None:
        nonlocal t
        t += 0.01
        lines.append(json.dumps({"t": t, "kind": kind, **fields}, sort_keys=True))

    add("stage_attempt", stage="train", attempt=1, nodes=2, nproc_per_node=1, backend="local")
    add("train_start", start_step=1, steps=steps, world_size=2, nodes=[0, 1], job_id="a1")
    with open(run_root / "events.jsonl", "w") as f:
        for n in range(1, steps + 1):
            add("step", step=n, loss=round(2.0 + 1.0 / n, 6), step_s=0.1234,
                ckpt_blocking_s=None, tokens_per_s=16601.3)  # fmt: skip
            if n % 100 == 0:
                add("checkpoint", step=n, path=f"/fsx/runs/r/checkpoints/step_{n:09d}",
                    blocking_s=0.0123, total_s=1.234, commit_s=0.0456,
                    pruned=[n - 200] if n > 200 else [])  # fmt: skip
            if n in (steps // 3, steps // 2):
                add("fault", fault=f"exception@step={n}", fault_kind="exception", step=n, rank=1)
                add("restart", layer="inprocess", iteration=1)
                add("recovered", layer="inprocess", fault=f"exception@step={n}", fault_step=n,
                    rank=1, step=n, recovery_s=2.5)  # fmt: skip
            if len(lines) >= 10_000:
                f.write("\n".join(lines) + "\n")
                lines.clear()
        add("train_end", final_step=steps, final_loss=2.0, params_sha256="0" * 64)
        add("stage_attempt_end", stage="train", attempt=1, outcome="completed", wall_s=1.0)
        f.write("\n".join(lines) + "\n")
    RunDir(run_root).record_commit(steps)
    RunDir(run_root).record_launch(job_id="a1", world_size=2, nodes=[0, 1])
    return (run_root / "events.jsonl").stat().st_size


# Each measurement runs in a fresh interpreter: its peak RSS is its own.
PROBE = r"""
import json, pickle, resource, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[3])
what, root = sys.argv[1], Path(sys.argv[2])
from trainer.history import RunHistory
from trainer.rundir import RunDir
def rss_mb(): return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
before = rss_mb()
t0 = time.perf_counter()
out = {}
if what == "fold":
    h = RunHistory.read(root)
    out["events"] = h.events_seen
elif what == "legacy":
    events = [json.loads(l) for l in (root / "events.jsonl").read_bytes().split(b"\n") if l]
    out["events"] = len(events)
elif what == "state":
    h = RunHistory.read(root)
    sizes = [len(v) if isinstance(v, (list, dict, set)) else 1 for v in vars(h).values()]
    out["entries"] = sum(sizes)
    out["pickled_bytes"] = len(pickle.dumps(h))
elif what == "status":
    import contextlib, io
    from flows.cli import main as cli
    with contextlib.redirect_stdout(io.StringIO()):
        out["rc"] = cli(["status", root.name, "--run-root", str(root)])
    out["peak_mb"] = rss_mb()
elif what == "startup":
    run = RunDir(root)
    run.recorded_commit()
    run.prior_world("a1")
    run.open_faults()
    run.retry_began()
out["s"] = time.perf_counter() - t0
out["added_mb"] = rss_mb() - before
print(json.dumps(out))
"""


def probe(what: str, root: Path) -> dict[str, float]:
    repo = str(Path(__file__).resolve().parents[1])
    out = subprocess.run(
        [sys.executable, "-c", PROBE, what, str(root), repo],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def stats(xs: list[float]) -> dict[str, float]:
    return {
        "median": round(statistics.median(xs), 4),
        "min": round(min(xs), 4),
        "max": round(max(xs), 4),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=1_000_000)
    p.add_argument("--samples", type=int, default=3)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="nvrx-bench-fold-"))
    big, small, empty = tmp / "big", tmp / "small", tmp / "empty"
    t0 = time.monotonic()
    size = write_log(big, args.steps)
    write_log(small, 1000)
    empty.mkdir()
    run_state_dir = empty / "control"
    run_state_dir.mkdir()
    print(f"wrote {args.steps} steps ({size / 2**20:.0f} MiB) in {time.monotonic() - t0:.0f} s")

    samples: dict[str, list[dict[str, float]]] = {}
    for _ in range(args.samples):  # interleaved: each sample of each kind under the same load
        for name, what, root in [
            ("fold", "fold", big),
            ("legacy", "legacy", big),
            ("startup_1m", "startup", big),
            ("startup_empty", "startup", empty),
            ("status_1m", "status", big),
            ("status_1k", "status", small),
        ]:
            samples.setdefault(name, []).append(probe(what, root))
    state_small, state_big = probe("state", small), probe("state", big)

    fold_s = stats([s["s"] for s in samples["fold"]])
    fold_mb = stats([s["added_mb"] for s in samples["fold"]])
    startup_delta = [
        b["s"] - e["s"]
        for b, e in zip(samples["startup_1m"], samples["startup_empty"], strict=True)
    ]
    status_delta = [
        b["peak_mb"] - s["peak_mb"]
        for b, s in zip(samples["status_1m"], samples["status_1k"], strict=True)
    ]
    status_s = stats([s["s"] for s in samples["status_1m"]])
    result = {
        "steps": args.steps,
        "file_mib": round(size / 2**20, 1),
        "samples": args.samples,
        "fold_s": fold_s,
        "fold_added_rss_mb": fold_mb,
        "legacy_read_s": stats([s["s"] for s in samples["legacy"]]),
        "legacy_read_added_rss_mb": stats([s["added_mb"] for s in samples["legacy"]]),
        "state_after_1k": state_small,
        "state_after_1m": state_big,
        "startup_1m_s": stats([s["s"] for s in samples["startup_1m"]]),
        "startup_empty_s": stats([s["s"] for s in samples["startup_empty"]]),
        "startup_delta_s": stats(startup_delta),
        "status_1m_peak_mb": stats([s["peak_mb"] for s in samples["status_1m"]]),
        "status_1k_peak_mb": stats([s["peak_mb"] for s in samples["status_1k"]]),
        "status_peak_delta_mb": stats(status_delta),
        "status_1m_s": status_s,
        "targets": {
            "status": f"1 M steps' peak within {TARGET_FOLD_MB} MB of 1 k's, under "
            f"{TARGET_FOLD_S} s: "
            + (
                "met"
                if statistics.median(status_delta) <= TARGET_FOLD_MB
                and status_s["median"] <= TARGET_FOLD_S
                else "MISSED"
            ),
            "fold_s": f"<= {TARGET_FOLD_S}: "
            + ("met" if fold_s["median"] <= TARGET_FOLD_S else "MISSED"),
            "fold_mb": f"<= {TARGET_FOLD_MB}: "
            + ("met" if fold_mb["median"] <= TARGET_FOLD_MB else "MISSED"),
            "state": "same entries after 1 k and 1 M steps: "
            + ("met" if state_small["entries"] == state_big["entries"] else "MISSED"),
            "startup": f"within {TARGET_STARTUP_DELTA_S} s of an empty log: "
            + ("met" if statistics.median(startup_delta) <= TARGET_STARTUP_DELTA_S else "MISSED"),
        },
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    for d in (big, small, empty):
        subprocess.run(["rm", "-rf", str(d)], check=False)
    os.rmdir(tmp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
