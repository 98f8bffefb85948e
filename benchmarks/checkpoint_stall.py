"""How long is training *blocked* per checkpoint save? Five methods, same state, side by side.

What is measured
----------------
``world_size`` (2) gloo ranks on CPU each hold a per-rank state of ``--mb-per-rank`` MiB of
float32 tensors (several tensors of varying sizes, a few small ones, and two non-tensor entries
under per-rank keys ``rank{r}.*`` so every rank owns its shard, also in DCP's global namespace).
For each method and size: one warm-up save (not counted: first-time allocations, plan building,
thread/queue start-up), then ``--repeats`` timed saves, each into a fresh directory that is
deleted afterwards (outside the timing). Ranks start each save together (barrier); a save's
number is the **max over ranks** (data-parallel training is stalled by the slowest rank), and the
table reports the **median over repetitions** (rank 0's own medians are in the JSON as well).

- ``torch_save``: ``torch.save`` of the rank's dict to one file, then ``flush`` + ``os.fsync``.
  Blocking = total.
- ``dcp_save``: synchronous ``torch.distributed.checkpoint.save`` with an explicit
  ``FileSystemWriter(path, sync_files=True)`` (``sync_files`` defaults to True: every shard file
  is fsynced). Blocking = total. This is the reference for the "% of sync dcp.save" column.
- ``dcp_async_save``: stock ``torch.distributed.checkpoint.async_save`` (thread executor; the
  ``FileSystemWriter`` doubles as a ``BlockingAsyncStager`` without staged-state caching, so every
  call allocates a fresh CPU copy before returning). Blocking = until ``async_save`` returns;
  total = until the returned future completes.
- ``ours``: ``trainer.async_ckpt.AsyncCheckpointer`` (staging into reused shared-memory buffers,
  cached DCP plan, hand-off to NVRx's persistent writer process, which writes with fsync and
  digests the shard). ``bind`` (which starts the writer process) happens at init and is not
  counted. Blocking = the seconds ``save`` returns; total = ``wait().total_s`` (includes the DCP
  finalize: gather of write results and the ``.metadata`` write). A per-phase breakdown of
  ``save`` (staging copy / DCP plan / hand-off to the writer / rest) is measured by wrapping those
  calls in this process only (trainer code is unchanged).
- ``memcpy``: ``copy_`` of every tensor into preallocated buffers of the same shape: the physical
  floor of taking a consistent snapshot. Blocking = total.

Why fsync
---------
Checkpoints go to a network filesystem (FSx for Lustre) and must survive a node loss: a save that
returns after only filling the local page cache is not durable. Every method that writes files
therefore fsyncs, so that the synchronous methods pay the real cost of durable writes, as they
would on FSx, instead of the cost of a memcpy into the page cache.

Why a dedicated gloo group for the async methods
------------------------------------------------
``dcp.async_save`` runs its collectives (planning gather/scatter, write-result gather) from a
background thread. On the default gloo group those collide with the collectives the training
thread issues concurrently and gloo crashes (mismatched/aborted ops). A separate
``dist.new_group(backend="gloo")`` is used for every DCP-based method (``dcp_save`` too, for
symmetry), exactly as the trainer binds its ``AsyncCheckpointer`` to a dedicated checkpoint group.

Threads: each rank sets ``torch.set_num_threads(--threads)`` (default: CPU cores // world size,
so ranks do not oversubscribe the cores), identical for every method.

Usage (from the repo root)::

    python benchmarks/checkpoint_stall.py                      # 200 MiB/rank, 3 repeats
    python benchmarks/checkpoint_stall.py --mb-per-rank 100 400 --json --out stall.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

METHODS = ("torch_save", "dcp_save", "dcp_async_save", "ours", "memcpy")
TARGETS = {"ours_vs_sync_dcp": 0.10, "ours_vs_memcpy": 1.5}
MIB = 1 << 20
# Share of the state per large tensor (sums to 1); a few small "bias" tensors come on top.
_LARGE_FRACTIONS = (0.30, 0.20, 0.15, 0.12, 0.10, 0.08, 0.05)
_SMALL = 4
_COLS = 1024


# -- state ----------------------------------------------------------------------------------------
def make_state(rank: int, mb: float, step: int = 100) -> dict[str, Any]:
    """A flat per-rank dict of float32 tensors totalling ~``mb`` MiB plus two non-tensor entries.
    Keys carry the rank so that, in DCP's global namespace, every rank owns its tensors."""
    gen = torch.Generator().manual_seed(1234 + rank)
    total = int(mb * MIB / 4)
    state: dict[str, Any] = {}
    for i, frac in enumerate(_LARGE_FRACTIONS):
        rows = max(1, round(frac * total / _COLS))
        state[f"rank{rank}.w{i}"] = torch.randn(rows, _COLS, generator=gen)
    for i in range(_SMALL):
        state[f"rank{rank}.b{i}"] = torch.randn(_COLS, generator=gen)
    state[f"rank{rank}.step"] = step
    state[f"rank{rank}.tag"] = {"lr": 3e-4, "note": "checkpoint_stall benchmark"}
    return state


def tensors_of(state: dict[str, Any]) -> list[torch.Tensor]:
    return [v for v in state.values() if isinstance(v, torch.Tensor)]


def state_mib(state: dict[str, Any]) -> float:
    return sum(t.numel() * t.element_size() for t in tensors_of(state)) / MIB


# -- instrumentation of AsyncCheckpointer.save (benchmark process only) ---------------------------
class OursProbe:
    """Times the phases of ``AsyncCheckpointer.save`` by wrapping the calls it makes."""

    def __init__(self) -> None:
        self.last: dict[str, float] = defaultdict(float)
        self._orig_plan: Callable[..., Any] | None = None

    def _timed(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.last[name] += time.perf_counter() - t0

        wrapper._bench_wrapped = True  # type: ignore[attr-defined]
        return wrapper

    def install(self, saver: Any) -> None:
        """Idempotent; call after every ``bind`` (the queue is replaced if the writer restarts)."""
        from trainer import nvrx_compat

        if self._orig_plan is None:
            self._orig_plan = nvrx_compat.save_state_dict_async_plan
            nvrx_compat.save_state_dict_async_plan = self._timed("plan", self._orig_plan)
        if not getattr(saver.staging.stage, "_bench_wrapped", False):
            saver.staging.stage = self._timed("stage", saver.staging.stage)
        q = saver.queue
        if not getattr(q.schedule_async_request, "_bench_wrapped", False):
            q.schedule_async_request = self._timed("handoff", q.schedule_async_request)

    def reset(self) -> None:
        self.last = defaultdict(float)

    def uninstall(self) -> None:
        from trainer import nvrx_compat

        if self._orig_plan is not None:
            nvrx_compat.save_state_dict_async_plan = self._orig_plan
            self._orig_plan = None


# -- the methods ----------------------------------------------------------------------------------
class Bench:
    def __init__(self, rank: int, world: int, ckpt_group: dist.ProcessGroup, root: Path) -> None:
        self.rank = rank
        self.world = world
        self.group = ckpt_group
        self.root = root
        self.probe = OursProbe()
        self.saver: Any = None
        self.buffers: list[torch.Tensor] = []

    # each returns (blocking_s, total_s, extra)
    def torch_save(self, state: dict[str, Any], d: Path) -> tuple[float, float, dict]:
        path = d / f"rank{self.rank}.pt"
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        dt = time.perf_counter() - t0
        return dt, dt, {}

    def dcp_save(self, state: dict[str, Any], d: Path) -> tuple[float, float, dict]:
        t0 = time.perf_counter()
        writer = dcp.FileSystemWriter(str(d), sync_files=True)
        dcp.save(state, storage_writer=writer, process_group=self.group)
        dt = time.perf_counter() - t0
        return dt, dt, {}

    def dcp_async_save(self, state: dict[str, Any], d: Path) -> tuple[float, float, dict]:
        t0 = time.perf_counter()
        writer = dcp.FileSystemWriter(str(d), sync_files=True)
        resp = dcp.async_save(state, storage_writer=writer, process_group=self.group)
        blocking = time.perf_counter() - t0
        fut = getattr(resp, "upload_completion", resp)  # AsyncSaveResponse or Future
        fut.result()
        return blocking, time.perf_counter() - t0, {}

    def ours(self, state: dict[str, Any], d: Path) -> tuple[float, float, dict]:
        self.probe.reset()
        t0 = time.perf_counter()
        blocking = self.saver.save(state, d, step=0)
        outer = time.perf_counter() - t0
        result = self.saver.wait()
        phases = dict(self.probe.last)
        phases["other"] = max(0.0, blocking - sum(phases.values()))
        phases["outer_blocking"] = outer
        return blocking, result.total_s, phases

    def memcpy(self, state: dict[str, Any], d: Path) -> tuple[float, float, dict]:
        t0 = time.perf_counter()
        for src, dst in zip(tensors_of(state), self.buffers, strict=True):
            dst.copy_(src)
        dt = time.perf_counter() - t0
        return dt, dt, {}

    # -- setup per size -----------------------------------------------------------------------
    def prepare(self, state: dict[str, Any]) -> None:
        from trainer.async_ckpt import AsyncCheckpointer

        self.buffers = [torch.empty_like(t) for t in tensors_of(state)]
        if self.saver is None:
            self.saver = AsyncCheckpointer(device=torch.device("cpu"), timeout_s=600)
        # Bind once per size: a fresh bind starts the persistent writer the first time (not
        # timed) and gives a fresh DCP plan cache (NVRx reuses a validated cached plan without
        # re-checking tensor sizes, so a cache must not outlive a change of the state's shapes).
        self.saver.bind(self.group)
        self.probe.install(self.saver)

    def close(self) -> None:
        if self.saver is not None:
            self.saver.close()
        self.probe.uninstall()


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def run_size(bench: Bench, mb: float, args: argparse.Namespace) -> dict[str, Any]:
    rank, world = bench.rank, bench.world
    state = make_state(rank, mb)
    actual_mib = state_mib(state)
    bench.prepare(state)
    per_method: dict[str, dict[str, Any]] = {}
    for method in METHODS:
        fn = getattr(bench, method)
        reps_max: list[tuple[float, float]] = []
        reps_rank0: list[tuple[float, float]] = []
        extras: list[dict[str, float]] = []
        warm: tuple[float, float] | None = None
        for rep in range(args.warmup + args.repeats):
            d = bench.root / f"mb{mb:g}" / method / f"rep{rep}"
            if rank == 0:
                d.mkdir(parents=True, exist_ok=True)
            dist.barrier()
            blocking, total, extra = fn(state, d)
            dist.barrier()
            gathered: list[Any] = [None] * world
            dist.all_gather_object(gathered, (blocking, total, extra))
            worst = (max(g[0] for g in gathered), max(g[1] for g in gathered))
            if rep < args.warmup:
                warm = worst
            else:
                reps_max.append(worst)
                reps_rank0.append((gathered[0][0], gathered[0][1]))
                # phases of the rank whose blocking was the worst
                extras.append(max(gathered, key=lambda g: g[0])[2])
            if rank == 0:
                shutil.rmtree(d, ignore_errors=True)
            dist.barrier()
        per_method[method] = {
            "blocking": _median([b for b, _ in reps_max]),
            "total": _median([t for _, t in reps_max]),
            "rank0_blocking": _median([b for b, _ in reps_rank0]),
            "rank0_total": _median([t for _, t in reps_rank0]),
            "warmup": warm,
            "all_blocking": [b for b, _ in reps_max],
            "extras": extras,
        }
        if rank == 0:
            m = per_method[method]
            print(
                f"[checkpoint_stall] {mb:g} MiB/rank {method:15s} blocking {m['blocking']:.4f}s "
                f"total {m['total']:.4f}s (reps {[round(b, 4) for b in m['all_blocking']]})",
                file=sys.stderr,
                flush=True,
            )
    del state
    bench.buffers = []

    blocking = {m: round(per_method[m]["blocking"], 6) for m in METHODS}
    total = {m: round(per_method[m]["total"], 6) for m in METHODS}
    ours_extras = per_method["ours"]["extras"]
    breakdown = {
        k: round(_median([e.get(k, 0.0) for e in ours_extras]), 6)
        for k in ("stage", "plan", "handoff", "other", "outer_blocking")
    }
    ratio_dcp = blocking["ours"] / blocking["dcp_save"] if blocking["dcp_save"] else None
    ratio_mem = blocking["ours"] / blocking["memcpy"] if blocking["memcpy"] else None
    return {
        "mb_per_rank": mb,
        "actual_mib_per_rank": round(actual_mib, 3),
        "world_size": world,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "aggregate": "per repetition max over ranks, then median over repetitions",
        "blocking_s": blocking,
        "total_s": total,
        "rank0_blocking_s": {m: round(per_method[m]["rank0_blocking"], 6) for m in METHODS},
        "rank0_total_s": {m: round(per_method[m]["rank0_total"], 6) for m in METHODS},
        "warmup_blocking_s": {
            m: round(per_method[m]["warmup"][0], 6) if per_method[m]["warmup"] else None
            for m in METHODS
        },
        "blocking_reps_s": {
            m: [round(b, 6) for b in per_method[m]["all_blocking"]] for m in METHODS
        },
        "ours_breakdown_s": breakdown,
        "ours_breakdown_reps_s": [{k: round(v, 6) for k, v in e.items()} for e in ours_extras],
        "ours_vs_sync_dcp": round(ratio_dcp, 4) if ratio_dcp is not None else None,
        "ours_vs_memcpy": round(ratio_mem, 4) if ratio_mem is not None else None,
        "targets": dict(TARGETS),
        "meets_targets": {
            "ours_vs_sync_dcp": ratio_dcp is not None and ratio_dcp <= TARGETS["ours_vs_sync_dcp"],
            "ours_vs_memcpy": ratio_mem is not None and ratio_mem <= TARGETS["ours_vs_memcpy"],
        },
    }


# -- process entry --------------------------------------------------------------------------------
def worker(rank: int, world: int, args: argparse.Namespace, root: str, result_path: str) -> None:
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    ckpt_group = dist.new_group(backend="gloo")
    bench = Bench(rank, world, ckpt_group, Path(root))
    results = []
    try:
        for mb in args.mb_per_rank:
            results.append(run_size(bench, mb, args))
    finally:
        bench.close()
        dist.barrier()
        dist.destroy_process_group()
    if rank == 0:
        Path(result_path).write_text(json.dumps(results))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def format_table(res: dict[str, Any]) -> str:
    ref = res["blocking_s"]["dcp_save"]
    lines = [
        f"{'method':<16}{'MiB/rank':>10}{'blocking_s':>13}{'total_s':>11}{'% of dcp.save':>15}",
        "-" * 65,
    ]
    for m in METHODS:
        b, t = res["blocking_s"][m], res["total_s"][m]
        pct = f"{100 * b / ref:.1f}%" if ref else "n/a"
        lines.append(f"{m:<16}{res['actual_mib_per_rank']:>10.1f}{b:>13.4f}{t:>11.4f}{pct:>15}")
    bd = res["ours_breakdown_s"]
    lines.append(
        f"ours blocking breakdown (median, slowest rank): stage {bd['stage']:.4f}s, "
        f"plan {bd['plan']:.4f}s, hand-off {bd['handoff']:.4f}s, other {bd['other']:.4f}s; "
        f"warm-up save (allocates staging) {res['warmup_blocking_s']['ours']:.4f}s"
    )
    t = res["targets"]
    lines.append(
        f"ours / sync dcp.save = {res['ours_vs_sync_dcp']:.3f} (target <= "
        f"{t['ours_vs_sync_dcp']}), ours / memcpy = {res['ours_vs_memcpy']:.2f} "
        f"(target <= {t['ours_vs_memcpy']})"
    )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--mb-per-rank", type=float, nargs="+", default=[200.0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads per rank (default: CPU cores // world size, at least 1)",
    )
    p.add_argument("--dir", default=None, help="parent of the scratch directory (default: tmp)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--out", default=None, help="also write the JSON object to this file")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0 or args.world_size < 1:
        p.error("--repeats >= 1, --warmup >= 0, --world-size >= 1")
    if args.threads is None:
        args.threads = max(1, (os.cpu_count() or 1) // args.world_size)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dir:
        Path(args.dir).mkdir(parents=True, exist_ok=True)
    root = tempfile.mkdtemp(prefix="checkpoint_stall-", dir=args.dir)
    result_path = os.path.join(root, "results.json")
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(_free_port())
    try:
        mp.spawn(
            worker,
            args=(args.world_size, args, os.path.join(root, "ckpt"), result_path),
            nprocs=args.world_size,
            join=True,
        )
        results = json.loads(Path(result_path).read_text())
    finally:
        shutil.rmtree(root, ignore_errors=True)

    import torch as _torch

    from trainer import nvrx_compat

    env = {
        "torch": _torch.__version__,
        "nvrx": nvrx_compat.version(),
        "threads_per_rank": args.threads,
        "cpu_count": os.cpu_count(),
        "dir": args.dir or tempfile.gettempdir(),
        "fsync": True,
    }
    print(
        f"checkpoint stall: world_size {args.world_size}, {args.repeats} repeats after "
        f"{args.warmup} warm-up, torch {env['torch']}, NVRx {env['nvrx']}, "
        f"{args.threads} torch thread(s)/rank, dir {env['dir']}; "
        "blocking/total = max over ranks, median over repeats"
    )
    for res in results:
        print()
        print(format_table(res))

    largest = max(results, key=lambda r: r["mb_per_rank"])
    if len(results) == 1:
        payload: dict[str, Any] = dict(results[0])
    else:
        payload = {
            "results": results,
            "mb_per_rank": largest["mb_per_rank"],
            "world_size": args.world_size,
            "ours_vs_sync_dcp": largest["ours_vs_sync_dcp"],
            "ours_vs_memcpy": largest["ours_vs_memcpy"],
            "targets": dict(TARGETS),
        }
    payload["env"] = env
    text = json.dumps(payload, sort_keys=False)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if args.json:
        print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
