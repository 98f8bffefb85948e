"""What does a checkpoint cost a training run? Five methods on a real FSDP2 model + AdamW state.

What is measured
----------------
``--world-size`` (2) ranks train an FSDP2-sharded model with AdamW (built through
``trainer.workload``: ``build_model``, ``shard``, ``build_optimizer``, ``loss``, as the trainer's
loop does) and save ``get_state_dict(model, optim)`` (DTensor shards of the parameters and both
AdamW moments) every ``--save-every`` steps while training goes on. The default workload,
``bench-gpt``, is the trainer's GPT (``trainer.model.GPT``) with its depth chosen so that the
per-rank state is about ``--mb-per-rank`` MiB (parameters + 2 moments, fp32) and a short
sequence (``--seq-len`` 16: CPU steps short enough that several overlap each write); any
built-in workload can be named instead (``--workload gpt-100m``). Methods, each in its own
phase of the same run (the order rotates between ``--rounds``):

- ``dcp_save``: synchronous ``torch.distributed.checkpoint.save`` with
  ``FileSystemWriter(sync_files=True)`` (every shard fsynced). Blocking = commit latency. The
  reference of the "blocking / sync DCP" ratio.
- ``dcp_async_thread``: stock ``dcp.async_save`` as it comes (thread executor; the
  ``FileSystemWriter`` is its own stager: a fresh CPU copy per save).
- ``dcp_async_process``: ``dcp.async_save(async_checkpointer_type=AsyncCheckpointerType.PROCESS,
  async_stager=DefaultStager(StagingOptions(use_pinned_memory=<cuda>, use_shared_memory=True,
  use_async_staging=<cuda>, use_non_blocking_copy=<cuda>)))``: torch's best stock path; the
  stager caches its shared-memory (and on CUDA pinned) buffers across saves, and a persistent
  daemon process writes. With async staging (CUDA) the loop waits for the staging to finish
  before the next ``optimizer.step()`` (counted as blocking).
- ``ours``: ``trainer.checkpointing.async_save.AsyncCheckpointer`` driven as
  ``trainer/checkpointing/manager.py`` drives it: bound (writer started and warmed up) at the
  start, ``save()`` after the optimizer step, ``before_optimizer_step()`` before each step's
  ``optimizer.step()``, ``poll()`` every step, then rank 0 commits
  (``trainer.checkpointing.commit``: manifest, fsyncs, rename) and broadcasts the outcome, on
  the training thread, as the trainer does today.
- ``ours_idle``: ours, waiting for its commit right after the save (no training beside the
  write): the durable writer's own pace, the fair comparison with ``dcp_save``'s seconds.
- ``memcpy``: ``copy_`` of every local shard into preallocated buffers: the floor of taking a
  consistent snapshot. Blocking only.

Every save starts after a barrier of the checkpoint group (rank 0 makes the directory first, as
the trainer does); a save waits for the previous one to be complete (that wait counts as
blocking). The first save of each phase is a warm-up (plans, buffers, the PROCESS daemon's
start) and is not counted: training waits for it to complete before going on.

Per method (every number is the worst rank's, then the median over the timed saves):

- ``blocking_s``: seconds the training thread is held per save;
- ``commit_latency_s``: save start until the checkpoint is durable and complete (DCP's
  ``.metadata`` written after every rank's fsynced shards; for ours, also committed: the
  manifest written and the directory renamed). Work done after a save starts is lost if a fault
  comes before this;
- ``overlap_slowdown``: median step time of the steps that overlap the write (from the save's
  return until it is complete) / median step time of the steps with no save in flight;
- ``overlap_cost_s``: the seconds those overlapping steps took beyond the clean median, per save;
- ``total_cost_s`` = ``blocking_s`` + ``overlap_cost_s``: what one checkpoint costs the run;
- ``young_interval_s`` = sqrt(2 x ``--mtbf-s`` x ``total_cost_s``), and in steps.

Step times include everything the loop does per step for that method (ours: ``poll()`` and, on
the step it completes, rank 0's commit), except the save call itself (``blocking_s``).

Checkpoints are fsynced (``sync_files=True``; ours' writer fsyncs): they go to a network
filesystem and must survive a node loss. Async DCP methods use a dedicated gloo group (DCP's
background collectives would otherwise collide with FSDP's on the default group), as the trainer
binds its checkpointer to a dedicated checkpoint group; ``dcp_save`` uses it too, for symmetry.

Usage (from the repo root)::

    python benchmarks/checkpoint_stall.py                          # ~200 MiB/rank, 2 rounds
    python benchmarks/checkpoint_stall.py --mb-per-rank 100 400 --json \\
        --out benchmarks/results/checkpoint_stall.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from pydantic import BaseModel, ConfigDict, Field  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict  # noqa: E402

from trainer.checkpointing.staging import local_tensors  # noqa: E402

METHODS = ("dcp_save", "dcp_async_thread", "dcp_async_process", "ours", "ours_idle", "memcpy")
ASYNC = ("dcp_async_thread", "dcp_async_process", "ours")
TARGETS = {"ours_blocking_vs_sync_dcp": 0.10}
MIB = 1 << 20


# -- the workload ---------------------------------------------------------------------------------
class BenchGptOptions(BaseModel):
    """The trainer's GPT at a chosen shape (``trainer.workloads.gpt`` has named sizes only)."""

    model_config = ConfigDict(extra="forbid")
    vocab_size: int = Field(8192, ge=8)
    seq_len: int = Field(64, ge=8)
    d_model: int = Field(512, ge=8)
    n_layers: int = Field(8, ge=1)
    n_heads: int = Field(8, ge=1)
    d_ff: int = Field(2048, ge=8)


def _model_config(o: BenchGptOptions) -> Any:
    from trainer.model_config import ModelConfig

    return ModelConfig(name="bench", **o.model_dump())


def _build_gpt(o: BenchGptOptions, device: torch.device) -> nn.Module:
    from trainer.model import GPT

    with device:
        return GPT(_model_config(o))


def _gpt_blocks(o: BenchGptOptions) -> tuple[type[nn.Module], ...]:
    from trainer.model import Block

    return (Block,)


def bench_gpt_spec() -> Any:
    from trainer.workload import WorkloadSpec
    from trainer.workloads.gpt import loss

    return WorkloadSpec(
        name="bench-gpt",
        options=BenchGptOptions,
        build_model=_build_gpt,
        block_classes=_gpt_blocks,
        loss=loss,
        vocab_size=lambda o: o.vocab_size,
        seq_len=lambda o: o.seq_len,
        description="trainer.model.GPT at a shape sized for the checkpoint benchmark",
    )


def sized_options(mb_per_rank: float, world: int, seq_len: int = 16) -> BenchGptOptions:
    """Depth for ~``mb_per_rank`` MiB of fp32 parameters + 2 AdamW moments per rank (width 512;
    narrower when even two blocks of that width are too much, as in a smoke run)."""
    want = mb_per_rank * MIB * world / 12  # 4 bytes x (param + exp_avg + exp_avg_sq)
    for width in (512, 256, 128):
        base = BenchGptOptions(
            n_layers=1, d_model=width, d_ff=4 * width, vocab_size=16 * width, seq_len=seq_len
        )
        one = _model_config(base).num_params()
        per_block = _model_config(base.model_copy(update={"n_layers": 2})).num_params() - one
        layers = round((want - (one - per_block)) / per_block)
        if layers >= 2:
            break
    return base.model_copy(update={"n_layers": max(1, layers)})


def load_bench_workload(args: argparse.Namespace, mb: float) -> Any:
    from trainer.workload import Workload, load_workload

    if args.workload == "bench-gpt":
        options = sized_options(mb, args.world_size, args.seq_len)
        return Workload("bench-gpt", bench_gpt_spec(), options)
    return load_workload(args.workload, json.loads(args.workload_options))


# -- helpers --------------------------------------------------------------------------------------
def _median(xs: list[float]) -> float | None:
    return float(statistics.median(xs)) if xs else None


class Save:
    """One save's timeline on this rank (``time.perf_counter`` seconds)."""

    def __init__(self, index: int, step: int, start: float) -> None:
        self.index = index
        self.step = step
        self.start = start
        self.returned: float | None = None
        self.done: float | None = None
        self.waited_previous_s = 0.0

    @property
    def blocking_s(self) -> float:
        assert self.returned is not None
        return self.returned - self.start + self.waited_previous_s

    def mark_done(self, _f: Any = None) -> None:
        if self.done is None:
            self.done = time.perf_counter()


# -- one rank -------------------------------------------------------------------------------------
class Rank:
    def __init__(
        self, rank: int, world: int, args: argparse.Namespace, root: Path, device: torch.device
    ) -> None:
        self.rank, self.world, self.args, self.root, self.device = rank, world, args, root, device
        self.group = dist.new_group(backend="gloo")
        self.saver: Any = None
        self.stager: Any = None

    # -- per method: start a save (returns when training may go on), and hooks ---------------
    def make_method(self, method: str, state_fn: Callable[[], dict[str, Any]]) -> Any:
        return getattr(self, f"_m_{method}")(state_fn)

    def _m_dcp_save(self, state_fn: Callable[[], dict[str, Any]]) -> Any:
        group = self.group

        class M:
            def start(self, d: Path, save: Save) -> None:
                writer = dcp.FileSystemWriter(str(d), sync_files=True)
                dcp.save(state_fn(), storage_writer=writer, process_group=group)
                save.mark_done()

            def poll(self, save: Save | None) -> None: ...
            def wait(self, save: Save) -> None: ...
            def before_optimizer_step(self) -> None: ...

        return M()

    def _m_dcp_async_thread(self, state_fn: Callable[[], dict[str, Any]]) -> Any:
        group = self.group

        class M:
            fut: Future | None = None

            def start(self, d: Path, save: Save) -> None:
                writer = dcp.FileSystemWriter(str(d), sync_files=True)
                resp = dcp.async_save(state_fn(), storage_writer=writer, process_group=group)
                self.fut = getattr(resp, "upload_completion", resp)
                self.fut.add_done_callback(save.mark_done)

            def poll(self, save: Save | None) -> None: ...

            def wait(self, save: Save) -> None:
                if self.fut is not None:
                    self.fut.result()
                    save.mark_done()

            def before_optimizer_step(self) -> None: ...

        return M()

    def _m_dcp_async_process(self, state_fn: Callable[[], dict[str, Any]]) -> Any:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        cuda = self.device.type == "cuda"
        if self.stager is None:  # one per run: its cached buffers outlive a phase
            self.stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=cuda,
                    use_shared_memory=True,
                    use_async_staging=cuda,
                    use_non_blocking_copy=cuda,
                )
            )
        stager, group = self.stager, self.group

        class M:
            fut: Future | None = None
            staging: Future | None = None

            def start(self, d: Path, save: Save) -> None:
                writer = dcp.FileSystemWriter(str(d), sync_files=True)
                resp = dcp.async_save(
                    state_fn(),
                    storage_writer=writer,
                    process_group=group,
                    async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                    async_stager=stager,
                )
                self.staging = getattr(resp, "staging_completion", None)
                self.fut = getattr(resp, "upload_completion", resp)
                self.fut.add_done_callback(save.mark_done)

            def poll(self, save: Save | None) -> None: ...

            def wait(self, save: Save) -> None:
                self.before_optimizer_step()
                if self.fut is not None:
                    self.fut.result()
                    save.mark_done()

            def before_optimizer_step(self) -> float:
                """The staging copy must be complete before the state changes (async staging)."""
                if self.staging is None:
                    return 0.0
                t0 = time.perf_counter()
                self.staging.result()
                self.staging = None
                return time.perf_counter() - t0

        return M()

    def _m_ours(self, state_fn: Callable[[], dict[str, Any]]) -> Any:
        from trainer import checkpointing
        from trainer.checkpointing.async_save import AsyncCheckpointer

        if self.saver is None:
            self.saver = AsyncCheckpointer(device=self.device, timeout_s=600)
        saver, group, world = self.saver, self.group, self.world
        saver.bind(group, warmup_dir=self.root / "ours-warmup")
        saver.wait()  # the warm-up write: done before the phase, as at a run's start

        class M:
            run_root: Path | None = None

            def start(self, d: Path, save: Save) -> None:
                saver.save(state_fn(), d, save.step)

            def _commit_task(self, result: Any) -> Callable[[], Any]:
                # Rank 0's commit, on the saver's commit thread (as the manager does).
                run_root = self.run_root
                assert run_root is not None

                def run() -> Path:
                    return checkpointing.commit(
                        run_root,
                        result.step,
                        world_size=world,
                        info={"config_hash": "bench", "benchmark": "checkpoint_stall"},
                    )

                return run

            def poll(self, save: Save | None) -> None:
                result = saver.poll(commit=self._commit_task)
                if result is not None and save is not None:
                    save.mark_done()  # committed: every rank learns it at the same poll

            def wait(self, save: Save) -> None:
                if saver.wait(commit=self._commit_task) is not None:
                    save.mark_done()

            def before_optimizer_step(self) -> None:
                saver.before_optimizer_step()

        return M()

    def _m_ours_idle(self, state_fn: Callable[[], dict[str, Any]]) -> Any:
        """Ours with nothing beside it: the save, then waiting for its commit at once (all of
        it counted as blocking). The writer's own pace, next to a synchronous ``dcp.save``
        that also has the cores to itself, without the training steps it competes with for
        the CPU or the step granularity at which a training rank learns of the commit."""
        inner = self._m_ours(state_fn)

        class M:
            run_root: Path | None = None

            def start(self, d: Path, save: Save) -> None:
                inner.run_root = self.run_root
                inner.start(d, save)
                inner.wait(save)

            def poll(self, save: Save | None) -> None: ...
            def wait(self, save: Save) -> None: ...

            def before_optimizer_step(self) -> None:
                inner.before_optimizer_step()

        return M()

    def _m_memcpy(self, state_fn: Callable[[], dict[str, Any]]) -> Any:
        device = self.device
        pin = device.type == "cuda"

        class M:
            buffers: list[torch.Tensor] | None = None

            def start(self, d: Path, save: Save) -> None:
                src = local_tensors(state_fn())
                if self.buffers is None:
                    self.buffers = [
                        torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
                        for t in src
                    ]
                for s, b in zip(src, self.buffers, strict=True):
                    b.copy_(s, non_blocking=pin)
                if pin:
                    torch.cuda.synchronize(device)
                save.mark_done()

            def poll(self, save: Save | None) -> None: ...
            def wait(self, save: Save) -> None: ...
            def before_optimizer_step(self) -> None: ...

        return M()

    # -- one phase: train, saving every --save-every steps --------------------------------------
    def phase(self, wl: Any, model: nn.Module, optim: Any, method: str, tag: str) -> dict:
        args = self.args
        mdir = self.root / tag / method
        run_root = mdir / "run"  # ours: trainer.checkpointing.layout (checkpoints/step_N.partial)
        m = self.make_method(method, lambda: _state(model, optim))
        if method.startswith("ours"):
            m.run_root = run_root
        g = torch.Generator().manual_seed(1000 + self.rank)
        per_rank = max(1, args.global_batch // self.world)
        saves: list[Save] = []
        steps: list[tuple[float, float]] = []
        current: Save | None = None
        n_saves = args.saves + 1  # + the warm-up
        total_steps = args.save_every * n_saves + args.tail_steps
        extra_block: dict[int, float] = {}
        for i in range(1, total_steps + 1):
            t0 = time.perf_counter()
            x = torch.randint(0, wl.vocab_size, (per_rank, wl.seq_len), generator=g)
            y = torch.randint(0, wl.vocab_size, (per_rank, wl.seq_len), generator=g)
            loss = wl.loss(model, x.to(self.device), y.to(self.device))
            loss.backward()
            t_wait = m.before_optimizer_step()
            optim.step()
            optim.zero_grad(set_to_none=True)
            reduced = loss.detach().float().clone()
            dist.all_reduce(reduced)
            reduced.item()
            if current is not None and current.done is None:
                m.poll(current)
            t1 = time.perf_counter()
            if t_wait and current is not None:
                extra_block[current.index] = extra_block.get(current.index, 0.0) + t_wait
                t1 -= t_wait  # counted as that save's blocking, not as step time
            steps.append((t0, t1))
            if i % args.save_every == 0 and len(saves) < n_saves:
                ours = method.startswith("ours")
                step_dir = _ours_partial(run_root, i) if ours else mdir / f"step{i}"
                if self.rank == 0:
                    step_dir.mkdir(parents=True, exist_ok=True)
                dist.barrier(group=self.group)
                save = Save(len(saves), i, time.perf_counter())
                if current is not None and current.done is None:
                    m.wait(current)
                    save.waited_previous_s = time.perf_counter() - save.start
                    save.start = time.perf_counter()
                m.start(step_dir, save)
                save.returned = time.perf_counter()
                saves.append(save)
                current = save
                if save.index == 0:  # the warm-up: complete before anything is timed
                    m.wait(save)
        if current is not None and current.done is None:
            m.wait(current)
        dist.barrier(group=self.group)
        if self.rank == 0:
            shutil.rmtree(mdir, ignore_errors=True)
        return summarize_rank(steps, saves, extra_block, warmup_saves=1, skip=args.skip_steps)

    def close(self) -> None:
        if self.saver is not None:
            self.saver.close()
        if self.stager is not None:
            self.stager.close()


def _ours_partial(run_root: Path, step: int) -> Path:
    from trainer import checkpointing

    return checkpointing.partial_path(run_root, step)


def _state(model: nn.Module, optim: Any) -> dict[str, Any]:
    model_sd, optim_sd = get_state_dict(model, optim)
    return {"model": model_sd, "optim": optim_sd}


def summarize_rank(
    steps: list[tuple[float, float]],
    saves: list[Save],
    extra_block: dict[int, float],
    *,
    warmup_saves: int,
    skip: int,
) -> dict[str, Any]:
    """This rank's numbers for one phase (steps: (start, end) of each step's own work)."""
    windows = [(s.start, s.done if s.done is not None else math.inf) for s in saves]
    writes = [(s.returned, s.done if s.done is not None else math.inf) for s in saves]

    def overlaps(a: float, b: float, w: tuple[float | None, float]) -> bool:
        return w[0] is not None and a < w[1] and b > w[0]

    clean, by_save = [], {s.index: [] for s in saves}
    for k, (a, b) in enumerate(steps):
        if k < skip:
            continue
        if not any(overlaps(a, b, w) for w in windows):
            clean.append(b - a)
        for s, w in zip(saves, writes, strict=True):
            if overlaps(a, b, w):
                by_save[s.index].append(b - a)
    clean_med = _median(clean)
    timed = saves[warmup_saves:]
    overlap_steps = [x for s in timed for x in by_save[s.index]]
    costs = [
        sum(x - clean_med for x in by_save[s.index]) if clean_med is not None else None
        for s in timed
    ]
    return {
        "blocking_s": [s.blocking_s + extra_block.get(s.index, 0.0) for s in timed],
        "commit_latency_s": [
            (s.done - s.start + s.waited_previous_s) if s.done is not None else None for s in timed
        ],
        "waited_previous_s": [s.waited_previous_s for s in timed],
        "overlap_steps": [len(by_save[s.index]) for s in timed],
        "overlap_cost_s": costs,
        "clean_step_s": clean_med,
        "overlap_step_s": _median(overlap_steps),
        "clean_steps": len(clean),
        "warmup_blocking_s": saves[0].blocking_s if saves and warmup_saves else None,
        "warmup_commit_latency_s": (saves[0].done - saves[0].start)
        if saves and saves[0].done is not None
        else None,
    }


def combine(per_rank: list[dict[str, Any]], mtbf_s: float) -> dict[str, Any]:
    """Worst rank per save, then the median over saves."""

    def worst(key: str) -> list[float | None]:
        cols = list(zip(*(r[key] for r in per_rank), strict=True))
        return [None if any(v is None for v in c) else max(c) for c in cols]

    blocking = worst("blocking_s")
    latency = worst("commit_latency_s")
    cost = [max(0.0, c) if c is not None else None for c in worst("overlap_cost_s")]
    clean = max((r["clean_step_s"] for r in per_rank if r["clean_step_s"]), default=None)
    overlap = max((r["overlap_step_s"] for r in per_rank if r["overlap_step_s"]), default=None)
    b = _median([x for x in blocking if x is not None])
    c = _median([x for x in cost if x is not None]) or 0.0
    total = (b or 0.0) + c
    young_s = math.sqrt(2.0 * mtbf_s * total) if total > 0 else None
    return {
        "blocking_s": b,
        "commit_latency_s": _median([x for x in latency if x is not None]),
        "overlap_slowdown": overlap / clean if overlap and clean else None,
        "overlap_cost_s": c,
        "total_cost_s": total,
        "young_interval_s": young_s,
        "young_interval_steps": round(young_s / clean) if young_s and clean else None,
        "clean_step_s": clean,
        "overlap_step_s": overlap,
        "overlap_steps_per_save": _median([float(n) for n in per_rank[0]["overlap_steps"]]),
        "waited_previous_s": _median([x for x in worst("waited_previous_s") if x is not None]),
        "reps": {"blocking_s": blocking, "commit_latency_s": latency, "overlap_cost_s": cost},
        "warmup": {
            "blocking_s": max((r["warmup_blocking_s"] or 0.0) for r in per_rank),
            "commit_latency_s": max((r["warmup_commit_latency_s"] or 0.0) for r in per_rank),
        },
    }


def run_size(r: Rank, mb: float) -> dict[str, Any]:
    args = r.args
    wl = load_bench_workload(args, mb)
    torch.manual_seed(args.seed)
    model = wl.shard(wl.build_model(r.device), device=r.device, world_size=r.world)
    from trainer.workload import OptimSettings

    optim = wl.build_optimizer(model, OptimSettings(lr=1e-4, weight_decay=0.01))
    # One step first, so AdamW's moments exist (they are part of every checkpoint).
    x = torch.randint(0, wl.vocab_size, (1, wl.seq_len))
    wl.loss(model, x.to(r.device), x.to(r.device)).backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    tensors = local_tensors(_state(model, optim))
    mib = sum(t.numel() * t.element_size() for t in tensors) / MIB
    per_method: dict[str, list[dict[str, Any]]] = {m: [] for m in args.methods}
    for rnd in range(args.rounds):
        order = list(args.methods)
        order = order[rnd % len(order) :] + order[: rnd % len(order)]
        for method in order:
            res = r.phase(wl, model, optim, method, f"mb{mb:g}-r{rnd}")
            gathered: list[Any] = [None] * r.world
            dist.all_gather_object(gathered, res, group=r.group)
            per_method[method].append(combine(gathered, args.mtbf_s))
            if r.rank == 0:
                c = per_method[method][-1]
                print(
                    f"[checkpoint_stall] {mb:g} MiB/rank round {rnd} {method:18s} "
                    f"blocking {_fmt(c['blocking_s'])}s commit {_fmt(c['commit_latency_s'])}s "
                    f"slowdown {_fmt(c['overlap_slowdown'], 2)} cost {_fmt(c['total_cost_s'])}s",
                    file=sys.stderr,
                    flush=True,
                )
    methods: dict[str, Any] = {}
    for method, rounds in per_method.items():
        keys = (
            "blocking_s",
            "commit_latency_s",
            "overlap_slowdown",
            "overlap_cost_s",
            "total_cost_s",
            "clean_step_s",
        )
        out = {k: _median([x[k] for x in rounds if x[k] is not None]) for k in keys}
        young = math.sqrt(2.0 * args.mtbf_s * out["total_cost_s"]) if out["total_cost_s"] else None
        out["young_interval_s"] = young
        out["young_interval_steps"] = (
            round(young / out["clean_step_s"]) if young and out["clean_step_s"] else None
        )
        out["young_interval_s_from_blocking_only"] = (
            math.sqrt(2.0 * args.mtbf_s * out["blocking_s"]) if out["blocking_s"] else None
        )
        out["rounds"] = rounds
        methods[method] = out
    ref = (methods.get("dcp_save") or {}).get("blocking_s")
    ours = methods.get("ours") or {}
    ratio = ours["blocking_s"] / ref if ref and ours.get("blocking_s") is not None else None
    return {
        "mb_per_rank": mb,
        "state_mib_per_rank": round(mib, 2),
        "workload": wl.describe(),
        "world_size": r.world,
        "saves_per_round": args.saves,
        "rounds": args.rounds,
        "save_every": args.save_every,
        "mtbf_s": args.mtbf_s,
        "aggregate": "per save the worst rank; median over saves; median over rounds",
        "methods": methods,
        "ours_blocking_vs_sync_dcp": round(ratio, 4) if ratio is not None else None,
        "ours_commit_latency_vs_interval": round(
            ours["commit_latency_s"] / (ours["young_interval_s"]), 4
        )
        if ours.get("commit_latency_s") and ours.get("young_interval_s")
        else None,
        "targets": dict(TARGETS),
    }


def _fmt(x: float | None, nd: int = 4) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


# -- process entry --------------------------------------------------------------------------------
def worker(rank: int, world: int, args: argparse.Namespace, root: str, result_path: str) -> None:
    torch.set_num_threads(args.threads)
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo", rank=rank, world_size=world)
    r = Rank(rank, world, args, Path(root), device)
    results = []
    try:
        for mb in args.mb_per_rank:
            results.append(run_size(r, mb))
    finally:
        r.close()
        dist.barrier()
        dist.destroy_process_group()
    if rank == 0:
        Path(result_path).write_text(json.dumps(results))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def format_table(res: dict[str, Any]) -> str:
    ref = res["methods"].get("dcp_save", {}).get("blocking_s")
    clean = _median([v["clean_step_s"] for v in res["methods"].values() if v["clean_step_s"]])
    head = (
        f"{'method':<19}{'blocking s':>11}{'/ dcp.save':>11}{'commit s':>10}{'slowdown':>10}"
        f"{'overlap s':>10}{'total s':>9}{'young s':>9}{'steps':>7}"
    )
    lines = [
        f"{res['state_mib_per_rank']:.0f} MiB/rank ({res['workload']['ref']} "
        f"{res['workload']['options']}), {res['world_size']} ranks, clean step "
        f"{_fmt(clean, 3)} s (median over methods)",
        head,
        "-" * len(head),
    ]
    for m, v in res["methods"].items():
        b = v["blocking_s"]
        pct = f"{b / ref:.3f}" if ref and b is not None else "-"
        lines.append(
            f"{m:<19}{_fmt(b):>11}{pct:>11}{_fmt(v['commit_latency_s'], 3):>10}"
            f"{_fmt(v['overlap_slowdown'], 2):>10}{_fmt(v['overlap_cost_s'], 3):>10}"
            f"{_fmt(v['total_cost_s'], 3):>9}{_fmt(v['young_interval_s'], 1):>9}"
            f"{v['young_interval_steps'] if v['young_interval_steps'] is not None else '-':>7}"
        )
    lines.append(
        f"ours blocking / sync dcp.save = {_fmt(res['ours_blocking_vs_sync_dcp'], 3)} (target <= "
        f"{TARGETS['ours_blocking_vs_sync_dcp']}); Young's interval for MTBF {res['mtbf_s']:.0f} s "
        "from the total cost (blocking + overlap)"
    )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--mb-per-rank", type=float, nargs="+", default=[200.0])
    p.add_argument(
        "--workload",
        default="bench-gpt",
        help="bench-gpt (sized by --mb-per-rank) or a trainer workload (gpt-100m, ...)",
    )
    p.add_argument("--workload-options", default="{}", help="JSON, for a named workload")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--saves", type=int, default=3, help="timed saves per phase (+1 warm-up)")
    p.add_argument("--save-every", type=int, default=8, help="steps between saves")
    p.add_argument("--tail-steps", type=int, default=4, help="steps after the last save")
    p.add_argument("--skip-steps", type=int, default=2, help="first steps of a phase not timed")
    p.add_argument("--rounds", type=int, default=2, help="phases per method (order rotates)")
    p.add_argument("--global-batch", type=int, default=2)
    p.add_argument(
        "--seq-len",
        type=int,
        default=16,
        help="bench-gpt's sequence length: short CPU steps, so that several overlap a write",
    )
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--mtbf-s", type=float, default=120.0, help="for Young's interval")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
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
    if args.saves < 1 or args.save_every < 2 or args.rounds < 1 or args.world_size < 1:
        p.error("--saves >= 1, --save-every >= 2, --rounds >= 1, --world-size >= 1")
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

    from trainer import nvrx_compat

    env = {
        "torch": torch.__version__,
        "nvrx": nvrx_compat.version(),
        "threads_per_rank": args.threads,
        "cpu_count": os.cpu_count(),
        "cuda": torch.cuda.is_available() and args.device != "cpu",
        "dir": args.dir or tempfile.gettempdir(),
        "fsync": True,
        "argv": sys.argv[1:] if argv is None else argv,
    }
    print(
        f"checkpoint stall: torch {env['torch']}, NVRx {env['nvrx']}, "
        f"{args.threads} torch thread(s)/rank, dir {env['dir']}; {args.rounds} round(s) x "
        f"{args.saves} saves (+1 warm-up) per method, a save every {args.save_every} steps"
    )
    for res in results:
        print()
        print(format_table(res))
    largest = max(results, key=lambda r: r["mb_per_rank"])
    payload: dict[str, Any] = {
        "benchmark": "checkpoint_stall",
        "methodology": "fsdp2+adamw, overlap slowdown, commit latency (issue 15)",
        "results": results,
        "mb_per_rank": largest["mb_per_rank"],
        "world_size": args.world_size,
        "ours_blocking_vs_sync_dcp": largest["ours_blocking_vs_sync_dcp"],
        "targets": dict(TARGETS),
        "env": env,
    }
    text = json.dumps(payload)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(payload, indent=1) + "\n")
    if args.json:
        print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
