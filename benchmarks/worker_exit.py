"""How long a worker takes to exit after its last event, with and without freezing the GC first.

A 2-rank, 20-step job under the real ft_launcher (the tests' fast config), timed from the
``train_end`` event to each worker's exit and to the launcher's. ``-m trainer`` is the entry
ft_launcher runs (``trainer/__main__.py`` freezes the collector's objects before the interpreter's
last collection); ``-m trainer.train`` is the same worker without the freeze. The two alternate,
so the machine's load falls on both alike.

    python benchmarks/worker_exit.py [--repeats 4] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.fold_events import stats

ENTRIES = {"freeze": "trainer", "no-freeze": "trainer.train"}


def one(root: Path, module: str) -> dict[str, float]:
    import psutil

    from tests.helpers import REPO, _ft_launcher, make_config, worker_env
    from trainer.data import write_synthetic_dataset

    write_synthetic_dataset(root / "data", vocab_size=512, seed=0)
    cfg = make_config(root / "run", root / "data")
    argv, log_path, launch = _ft_launcher(cfg, 2, "")
    at = argv.index("-m", 1)
    argv[at + 1] = module  # the worker's entry (argv[0] is ft_launcher itself)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env={**worker_env(), **launch}, cwd=REPO
        )
    events = root / "run" / "events.jsonl"
    while not (events.exists() and '"train_end"' in events.read_text()):
        if proc.poll() is not None:
            raise RuntimeError(f"the job ended before train_end (exit {proc.returncode})")
        time.sleep(0.02)
    t0 = time.monotonic()
    workers = [
        c
        for c in psutil.Process(proc.pid).children()
        if module in c.cmdline() and "-m" in c.cmdline()
    ]
    gone: dict[int, float] = {}
    while proc.poll() is None:
        for w in workers:
            if w.pid not in gone and (not w.is_running() or w.status() == psutil.STATUS_ZOMBIE):
                gone[w.pid] = time.monotonic() - t0
        time.sleep(0.02)
    launcher = time.monotonic() - t0
    if proc.returncode != 0 or len(gone) != len(workers) or not workers:
        raise RuntimeError(f"exit {proc.returncode}, workers {len(workers)}, seen {len(gone)}")
    return {"last_worker_s": max(gone.values()), "launcher_s": launcher}


def summary(xs: list[float]) -> dict[str, object]:
    return {**stats(xs), "samples": [round(x, 3) for x in xs]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in ENTRIES}
    for i in range(args.repeats):
        for name, module in ENTRIES.items():
            with tempfile.TemporaryDirectory(prefix="worker-exit-") as d:
                runs[name].append(one(Path(d), module))
            print(f"{i + 1}/{args.repeats} {name}: {runs[name][-1]}", flush=True)
    result = {
        "what": "seconds from train_end to the last worker's exit and the launcher's, "
        "2 ranks x 20 steps, real ft_launcher, alternating entries",
        **{
            name: {key: summary([r[key] for r in rs]) for key in ("last_worker_s", "launcher_s")}
            for name, rs in runs.items()
        },
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
