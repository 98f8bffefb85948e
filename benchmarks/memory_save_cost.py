"""What one memory save costs per GB of shard, xxh3-128 (issue 40) against sha256 (before), in one
run: its blocking copy on the training thread, and its background work (the checksum, the
header, the peer send, and the receiver's checksum of the arriving copy) in CPU seconds.

Two gloo processes on this machine, each a rank of its own "node" (node memory in a directory of
/dev/shm of its own), each holding a shard of ``--mb`` MB of float32 tensors (100 tensors, the
shape of a model's state): rank 0's copy goes to rank 1 and rank 1's to rank 0, as
``tiers.peer_ring`` pairs them. Per sample and algorithm (the order alternates), each rank makes a
save and waits for its sealing thread (its peer copy out, the peer's in and checked); measured:

- blocking_s: ``NodeMemory.save``'s return (the copy into node memory, the training thread's);
- background_cpu_s: the process's CPU seconds from the save's return until its sealing thread
  is done (its checksum, header, peer send, and the receiving of the peer's copy with its
  checksum, gloo's own threads included: ``resource.getrusage``), per GB of shard;
- memcpy_floor_s: a plain ``copy_`` of the shard's bytes into a preallocated buffer (the floor
  a save's blocking is held against).

The process's CPU seconds count gloo's loopback copies too (they are the same for both
algorithms); the checksum is the only part that differs. Medians and spread over ``--samples``.

    python benchmarks/memory_save_cost.py [--mb 670] [--samples 5] [--json] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from trainer.checkpointing import node_format  # noqa: E402
from trainer.checkpointing.node_copy import NodeMemory  # noqa: E402

ALGORITHMS = ("xxh3_128", "sha256")


def _sha256(buf: Any) -> str:
    """Before issue 40: the node copy's digest, at the length the header field holds."""
    return hashlib.sha256(buf).hexdigest()[:32]


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _worker(rank: int, port: int, args: argparse.Namespace, root: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=600)
    )
    group = dist.new_group(backend="gloo")
    n = args.mb * (1 << 20) // 4 // 100
    state = {"model": {f"w{i}": torch.randn(n) for i in range(100)}}
    node = NodeMemory(
        Path(root) / f"node{rank}", rank=rank, world_size=2, fingerprint="bench", epoch=None
    )
    node.bind_peers(group, 1 - rank, (1 - rank,))
    flat = torch.cat([t.reshape(-1) for t in state["model"].values()])
    floor_dst = torch.empty_like(flat)
    rows: list[dict[str, Any]] = []
    step = 0
    for sample in range(args.samples + 1):  # the first: warm-up (allocation, page faults)
        order = ALGORITHMS if sample % 2 == 0 else ALGORITHMS[::-1]
        for algo in order:
            node_format.checksum = (  # type: ignore[assignment]
                _sha256 if algo == "sha256" else ORIGINAL
            )
            step += 1
            dist.barrier(group=group)
            t0 = time.perf_counter()
            node.save(step, state, {"loss": 0.0})
            blocking = time.perf_counter() - t0
            cpu0 = _cpu()
            node.wait()  # its checksum, header, peer copy out and the peer's in
            background = _cpu() - cpu0
            t0 = time.perf_counter()
            floor_dst.copy_(flat)
            floor = time.perf_counter() - t0
            if sample:
                rows.append(
                    {"algo": algo, "blocking_s": blocking, "background_cpu_s": background,
                     "memcpy_floor_s": floor}
                )  # fmt: skip
    node_format.checksum = ORIGINAL  # type: ignore[assignment]
    node.close()
    Path(out).joinpath(f"rank{rank}.json").write_text(json.dumps(rows))
    dist.destroy_process_group()


ORIGINAL = node_format.checksum


def _stats(values: list[float]) -> dict[str, float]:
    return {
        "median": round(statistics.median(values), 4),
        "min": round(min(values), 4),
        "max": round(max(values), 4),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mb", type=int, default=670, help="MB of shard per rank (gpt-100m's)")
    p.add_argument("--samples", type=int, default=5)
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    root = tempfile.mkdtemp(prefix="nvrx-bench-cost-", dir="/dev/shm")
    out = tempfile.mkdtemp(prefix="nvrx-bench-cost-out-")
    try:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        mp.spawn(_worker, args=(port, args, root, out), nprocs=2, join=True)
        rows = [r for k in (0, 1) for r in json.loads(Path(out, f"rank{k}.json").read_text())]
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)
    gb = args.mb * (1 << 20) / 1e9
    result: dict[str, Any] = {
        "shard_mb": args.mb,
        "samples_per_rank": args.samples,
        "machine": {"cpus": os.cpu_count()},
        "by_algorithm": {},
    }
    for algo in ALGORITHMS:
        mine = [r for r in rows if r["algo"] == algo]
        result["by_algorithm"][algo] = {
            "blocking_s": _stats([r["blocking_s"] for r in mine]),
            "background_cpu_s_per_gb": _stats([r["background_cpu_s"] / gb for r in mine]),
            "memcpy_floor_s": _stats([r["memcpy_floor_s"] for r in mine]),
        }
    x, s = (result["by_algorithm"][a] for a in ALGORITHMS)
    result["ratios"] = {
        "background_xxh3_over_sha256": round(
            x["background_cpu_s_per_gb"]["median"] / s["background_cpu_s_per_gb"]["median"], 3
        ),
        "blocking_over_memcpy_floor": round(
            x["blocking_s"]["median"] / x["memcpy_floor_s"]["median"], 3
        ),
    }
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text if args.json or not args.out else f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
