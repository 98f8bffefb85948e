"""Where the durable save's background seconds go, next to a synchronous ``dcp.save``.

One rank (gloo, world size 1), a workload's model and AdamW state after one step; per sample,
alternating: a synchronous ``dcp.save`` (``FileSystemWriter``, fsynced) of the same state, and
ours (``AsyncCheckpointer`` as ``trainer/checkpointing/manager.py`` drives it, nothing beside
it) split into: the save call (the staging copy and the hand-off: what blocks training),
until the writer process reports the shards written and fsynced (``SaveResult.total_s``, learned
by a 5 ms poll), and rank 0's commit on the commit thread (DCP ``.metadata``, the manifest with
the streamed digests, fsyncs, the rename). Median and range of ``--samples``.

    python benchmarks/writer_phases.py [--workload gpt-100m] [--seq-len 64] [--samples 3]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")


def _spread(xs: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(xs), 4), "min": min(xs), "max": max(xs)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload", default="gpt-100m")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--samples", type=int, default=3)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from trainer import checkpointing
    from trainer.checkpointing.async_save import AsyncCheckpointer
    from trainer.checkpointing.layout import partial_path
    from trainer.workload import OptimSettings, load_workload

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1, timeout=datetime.timedelta(seconds=600))
    group = dist.new_group(backend="gloo")
    wl = load_workload(args.workload, {"seq_len": args.seq_len} if args.seq_len else {})
    torch.manual_seed(0)
    model = wl.build_model("cpu")
    optim = wl.build_optimizer(model, OptimSettings(lr=1e-4, weight_decay=0.01))
    x = torch.randint(0, wl.vocab_size, (1, wl.seq_len))
    wl.loss(model, x, x).backward()
    optim.step()

    def state() -> dict[str, Any]:
        msd, osd = get_state_dict(model, optim)
        return {"model": msd, "optim": osd}

    root = Path(tempfile.mkdtemp(prefix="nvrx-writer-phases-", dir=os.environ.get("TMPDIR")))
    saver = AsyncCheckpointer(device=torch.device("cpu"), timeout_s=600)
    saver.bind(group, warmup_dir=root / "warmup")
    saver.wait()
    saver.ensure_started(rank=0)
    commit_s: list[float] = []

    def commit_for(result: Any) -> Any:
        def run() -> Path:
            t0 = time.perf_counter()
            out = checkpointing.commit(root / "run", result.step, world_size=1, info={"b": 1})
            commit_s.append(time.perf_counter() - t0)
            return out

        return run

    rows: dict[str, list[float]] = {k: [] for k in ("dcp_save", "save", "written", "committed")}
    nbytes = 0
    try:
        for i in range(args.samples + 1):  # the first of each is a warm-up
            order = ("dcp", "ours") if i % 2 == 0 else ("ours", "dcp")
            for who in order:
                if who == "dcp":
                    d = root / f"dcp-{i}"
                    t0 = time.perf_counter()
                    dcp.save(
                        state(), storage_writer=dcp.FileSystemWriter(str(d)), process_group=group
                    )
                    if i:
                        rows["dcp_save"].append(time.perf_counter() - t0)
                    nbytes = sum(f.stat().st_size for f in d.iterdir())
                    shutil.rmtree(d)
                    continue
                step = 10 + i
                d = partial_path(root / "run", step)
                d.mkdir(parents=True, exist_ok=True)
                t0 = time.perf_counter()
                saver.save(state(), d, step)
                t_save = time.perf_counter() - t0
                result = saver.wait(commit=commit_for)
                t_all = time.perf_counter() - t0
                assert result is not None
                if i:
                    rows["save"].append(t_save)
                    rows["written"].append(result.total_s)
                    rows["committed"].append(t_all)
                shutil.rmtree(root / "run" / "checkpoints", ignore_errors=True)
    finally:
        saver.close()
        shutil.rmtree(root, ignore_errors=True)
    out = {
        "benchmark": "writer_phases",
        "workload": args.workload,
        "seq_len": args.seq_len,
        "checkpoint_bytes": nbytes,
        "seconds": {k: _spread(v) for k, v in rows.items()},
        "commit_thread_commit_s": _spread(commit_s[1:] or commit_s),
    }
    med = {k: v["median"] for k, v in out["seconds"].items()}
    out["ours_committed_vs_dcp_save"] = round(med["committed"] / med["dcp_save"], 3)
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
