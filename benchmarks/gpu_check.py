"""One-GPU check of the CUDA path: environment, checkpoint blocking time, fault drills.

Run by ``benchmarks/gpu_check.sh OUT_DIR`` (which makes the venv and gives every part its own
``timeout``); each part is one invocation of this driver and writes its JSON result into
``OUT_DIR`` as soon as it finishes, so a part that times out keeps the earlier ones:

- ``env``    -> ``env.json``: nvidia-smi, torch / CUDA / NVRx versions, /dev/shm, disk, memory.
- ``ckpt``   -> ``ckpt.json`` (rewritten after every model): per model size (``build_model``),
  the memory tier's save (``memory``: ``NodeMemory`` into pinned node-memory buffers on a side
  stream; blocking, copy complete, sealed, the sealing thread's CPU, ``blocking_vs_floor``, a
  bitwise reload) and the seconds training is blocked by
  ``trainer.checkpointing.async_save.AsyncCheckpointer.save`` next to the
  pinned device-to-host floor (``copy_`` of the same bytes into pinned buffers, timed with CUDA
  events) and to a synchronous ``torch.distributed.checkpoint.save``; several samples, median
  and spread, ``ours_vs_floor`` and ``ours_vs_sync_dcp``; and whether the checkpoint written by
  ours loads back bitwise equal (``dcp.load``).
- ``drills`` -> ``drills.json`` (rewritten after every run): the real trainer under ft_launcher
  on 1 GPU, fault-free, with an exception and with a SIGKILL; ``params_sha256`` of each drill
  compared with the fault-free run, recovery times from ``events.jsonl``.
- ``summary`` -> ``summary.json``: the headline numbers and which parts finished.

``--dry-run`` prints the plan (parts, model sizes, commands) as JSON and touches no GPU.

    python benchmarks/gpu_check.py --out OUT --part env|ckpt|drills|summary [--dry-run]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

PARTS = ("env", "ckpt", "drills", "summary")
MODELS = ("gpt-100m", "llama-1b")
GIB = 1 << 30
DRILL_STEPS = 30
DRILL_FAULT_STEP = 12
DRILLS = {
    "baseline": None,
    # a second fault-free run: tells the GPU's own run-to-run noise from a recovery that is off
    "repeat": None,
    "exception": f"exception@step={DRILL_FAULT_STEP},rank=0",
    "sigkill": f"sigkill@step={DRILL_FAULT_STEP},rank=0",
}


# -- the two swappable pieces: what model, what trainer command ----------------------------------
def workload(name: str) -> Any:
    from trainer.workload import load_workload

    if name not in MODELS:
        raise ValueError(f"unknown model {name!r} (known: {', '.join(MODELS)})")
    return load_workload(name)


def param_count(name: str) -> int:
    import torch

    model = workload(name).build_model(torch.device("meta"))
    return sum(p.numel() for p in model.parameters())


def build_model(name: str, device: Any = "cpu") -> tuple[Any, Callable[[int], Any]]:
    """The workload's model on ``device`` (FSDP2-sharded on a 1-GPU mesh) and a function making
    an ``n``-sequence batch, returning its loss (``loss_of(n)``). The one place to swap models."""
    import torch

    wl = workload(name)
    with torch.device(device):
        model = wl.build_model(torch.device(device))
    model = wl.shard(model, device=torch.device(device), world_size=1)

    def loss_of(n: int) -> Any:
        g = torch.Generator().manual_seed(n)
        idx = torch.randint(0, wl.vocab_size, (n, wl.seq_len + 1), generator=g).to(device)
        return wl.loss(model, idx[:, :-1], idx[:, 1:])

    return model, loss_of


def drill_command(
    run_root: Path,
    data_dir: Path,
    port: int,
    inject: str | None,
    *,
    model: str = "100m",
    device: str = "cuda",
    deterministic: bool = False,
) -> list[str]:
    """The trainer under ft_launcher on 1 GPU (the one place to change when the CLI changes)."""
    cmd = [
        sys.executable,
        "-m",
        "trainer.launch",
        "--nproc-per-node",
        "1",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        f"--set=run_root={run_root}",
        f"--set=data_dir={data_dir}",
        f"--set=workload=gpt-{model}",
        f"--set=steps={DRILL_STEPS}",
        "--set=global_batch=8",
        f"--set=device={device}",
    ]
    if deterministic:
        cmd.append("--set=deterministic=true")
    if inject:
        cmd += ["--inject", inject]
    return cmd


def drill_vocab_size(model: str) -> int:
    from trainer.model_config import model_config as trainer_model_config

    return int(trainer_model_config(model).vocab_size)


def data_command(data_dir: Path, vocab_size: int = 16384) -> list[str]:
    return [
        sys.executable,
        "-m",
        "trainer.data",
        "--out",
        str(data_dir),
        "--vocab-size",
        str(vocab_size),
        "--tokens-per-shard",
        "1048576",
    ]


# -- helpers -------------------------------------------------------------------------------------
def write_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")
    tmp.replace(path)


def stats(xs: list[float]) -> dict[str, Any]:
    if not xs:
        return {"n": 0}
    return {
        "n": len(xs),
        "median": statistics.median(xs),
        "min": min(xs),
        "max": max(xs),
        "spread": max(xs) - min(xs),
        "samples": [round(x, 6) for x in xs],
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _scratch(args: argparse.Namespace, part: str) -> Path:
    """Checkpoints and run directories go outside OUT_DIR (which is what comes back)."""
    import tempfile

    base = Path(args.scratch) if args.scratch else Path(tempfile.gettempdir()) / "nvrx-gpu-check"
    root = base / part
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    return root


def _run(cmd: list[str], timeout: float) -> dict[str, Any]:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        return {"rc": p.returncode, "out": (p.stdout + p.stderr)[-4000:]}
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"rc": None, "error": f"{type(e).__name__}: {e}"}


# -- part a: environment -------------------------------------------------------------------------
def part_env(out: Path, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from trainer import nvrx_compat

    info: dict[str, Any] = {
        "python": sys.version,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "nvrx": nvrx_compat.version(),
        "nvidia_smi": _run(
            [
                "nvidia-smi",
                "--query-gpu=name,driver_version,memory.total,pcie.link.gen.current,"
                "pcie.link.width.current,clocks.max.sm",
                "--format=csv",
            ],
            20,
        ),
        "nvidia_smi_topo": _run(["nvidia-smi", "topo", "-m"], 20),
        "dev_shm_free_gib": shutil.disk_usage("/dev/shm").free / GIB
        if Path("/dev/shm").exists()
        else None,
        "out_disk_free_gib": shutil.disk_usage(out).free / GIB,
        "sharing_strategy": torch.multiprocessing.get_sharing_strategy(),
    }
    with contextlib.suppress(ValueError, OSError):
        info["mem_total_gib"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info["device"] = {
            "name": p.name,
            "capability": f"{p.major}.{p.minor}",
            "memory_gib": p.total_memory / GIB,
            "count": torch.cuda.device_count(),
        }
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    write_json(out / "env.json", info)
    return info


# -- part b: checkpoint blocking time ------------------------------------------------------------
def _local(t: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def _tensors(obj: Any) -> list[Any]:
    import torch

    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def _init_dist() -> Any:
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        torch.cuda.set_device(0)
        dist.init_process_group(
            "cpu:gloo,cuda:nccl",
            rank=0,
            world_size=1,
            timeout=datetime.timedelta(seconds=600),
        )
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=600))


def _floor_s(state: dict[str, Any], pinned: list[Any]) -> float:
    """Pinned device-to-host copy of the same bytes, timed with CUDA events (GPU time)."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    srcs = [_local(t) for t in _tensors(state)]
    torch.cuda.synchronize()
    start.record()
    for dst, src in zip(pinned, srcs, strict=True):
        dst.copy_(src, non_blocking=True)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000.0


def bench_model(name: str, root: Path, samples: int, deadline: float) -> dict[str, Any]:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from trainer.checkpointing.async_save import AsyncCheckpointer

    group = _init_dist()
    device = torch.device("cuda", 0)
    res: dict[str, Any] = {"model": name}
    t_build = time.perf_counter()
    torch.manual_seed(0)
    model, loss_of = build_model(name, device)
    res["params"] = param_count(name)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def train_step(seed: int) -> None:
        loss = loss_of(1 + seed % 2)
        loss.backward()
        saver.before_optimizer_step()
        optim.step()
        optim.zero_grad(set_to_none=True)

    saver = AsyncCheckpointer(device=device, timeout_s=600)
    saver.bind(group)
    try:
        train_step(0)
        torch.cuda.synchronize()
        res["build_s"] = time.perf_counter() - t_build

        def state() -> dict[str, Any]:
            msd, osd = get_state_dict(model, optim)
            return {"model": msd, "optim": osd}

        sd = state()
        nbytes = sum(_local(t).numel() * _local(t).element_size() for t in _tensors(sd))
        res["state_gib"] = nbytes / GIB
        res["gpu_mem_max_gib"] = torch.cuda.max_memory_allocated() / GIB

        # floor: pinned buffers allocated once, untimed
        pinned = [torch.empty_like(_local(t), device="cpu").pin_memory() for t in _tensors(sd)]
        _floor_s(sd, pinned)
        floor = [_floor_s(sd, pinned) for _ in range(samples)]
        del pinned

        # ours: the first save allocates, shares and pins the staging buffers (reported apart)
        ours_save, ours_total, ours_incl_deferred, copy_done = [], [], [], []
        kept: Path | None = None  # the last checkpoint written, for the bitwise check
        for i in range(samples + 1):
            if i > 0 and time.monotonic() > deadline:
                res["truncated"] = "deadline"
                break
            d = root / f"ours-{name}-{i}"
            sd = state()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            blocking = saver.save(sd, d, step=i)
            saver.staging.copier.synchronize()  # host-side only, to time the copy itself
            t_copy = time.perf_counter() - t0
            result = saver.wait()
            assert result is not None
            if i == 0:
                res["ours_first_save_s"] = blocking
            else:
                ours_save.append(blocking)
                ours_total.append(result.total_s)
                ours_incl_deferred.append(result.blocking_s)
                copy_done.append(t_copy)
            if kept is not None:
                shutil.rmtree(kept, ignore_errors=True)
            kept = d
        res["ours_save_s"] = stats(ours_save)
        res["ours_save_plus_deferred_s"] = stats(ours_incl_deferred)
        res["ours_copy_complete_s"] = stats(copy_done)
        res["ours_total_s"] = stats(ours_total)

        # bitwise: the last checkpoint of ours against the state it was taken from
        expected = [_local(t).detach().cpu() for t in _tensors(sd)]
        train_step(1)  # change the live state, then load the checkpoint over it
        sd = state()
        assert kept is not None
        dcp.load(sd, checkpoint_id=str(kept))
        got = [_local(t).detach().cpu() for t in _tensors(sd)]
        res["bitwise_equal"] = len(got) == len(expected) and all(
            a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got, expected, strict=True)
        )
        shutil.rmtree(kept, ignore_errors=True)
        del expected, got

        # the memory tier (issue 40, item 3): a node-memory save, blocking against the floor
        if time.monotonic() < deadline:
            try:
                res["memory"] = bench_memory_save(state, train_step, samples, deadline, nbytes)
                mem_med = res["memory"]["blocking_s"].get("median")
                if mem_med is not None:
                    res["memory"]["blocking_vs_floor"] = mem_med / statistics.median(floor)
            except Exception as e:  # keep the durable numbers of this model
                import traceback

                res["memory"] = {"error": repr(e), "trace": traceback.format_exc()[-2000:]}

        # synchronous dcp.save (the stock reference)
        sync = []
        for i in range(max(2, samples - 1)):
            if i > 0 and time.monotonic() > deadline:
                res["truncated"] = "deadline"
                break
            d = root / f"dcp-{name}-{i}"
            sd = state()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(d)), process_group=group)
            sync.append(time.perf_counter() - t0)
            shutil.rmtree(d, ignore_errors=True)
        res["floor_s"] = stats(floor)
        res["sync_dcp_s"] = stats(sync)
        med = res["ours_save_s"].get("median")
        if med is not None:
            res["ours_vs_floor"] = med / statistics.median(floor)
            if sync:
                res["ours_vs_sync_dcp"] = med / statistics.median(sync)
            res["ours_plus_deferred_vs_floor"] = res["ours_save_plus_deferred_s"][
                "median"
            ] / statistics.median(floor)
    finally:
        saver.close()
        torch.cuda.empty_cache()
    return res


def bench_memory_save(
    state: Callable[[], dict[str, Any]],
    train_step: Callable[[int], None],
    samples: int,
    deadline: float,
    nbytes: int,
) -> dict[str, Any]:
    """The memory tier's save of the same state (``NodeMemory``: pinned generation buffers in
    ``/dev/shm``, the copy on a side stream, the digest and header on its thread): the seconds
    training is blocked (the launch), until the copy completed, until sealed, the sealing
    thread's CPU seconds; the first two saves (one per generation: map and pin) apart; and a
    bitwise reload of the last sealed copy over a changed state."""
    import tempfile

    import torch

    from trainer.checkpointing.node_copy import NodeMemory

    res: dict[str, Any] = {}
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    # Node memory is /dev/shm, where it holds two generations (a container's may be small:
    # then a disk directory, said in the result, still times the copy and the seal).
    shm_free = shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else 0
    where = "/dev/shm" if shm_free > 2.2 * nbytes else None
    res["where"] = where or tempfile.gettempdir()
    root = Path(tempfile.mkdtemp(prefix="nvrx-gpu-node-", dir=where))
    node = NodeMemory(root, rank=0, world_size=1, fingerprint="gpu-check", epoch=None)
    blocking, copied, sealed, background, first = [], [], [], [], []
    try:
        for i in range(samples + 2):
            if i >= 2 and time.monotonic() > deadline:
                res["truncated"] = "deadline"
                break
            train_step(i)
            sd = state()
            sync()
            t0 = time.perf_counter()
            b = node.save(i + 1, sd, {"loss": 0.0})
            assert node._device is not None
            node._device.copier.synchronize()  # host-side only, to time the copy itself
            t_copy = time.perf_counter() - t0
            node.wait()
            t_sealed = time.perf_counter() - t0
            failed = node.take_failure()
            if failed:
                raise RuntimeError(failed)
            if i < 2:
                first.append(b)
                continue
            blocking.append(b)
            copied.append(t_copy)
            sealed.append(t_sealed)
            background.append(node.take_background() or 0.0)
        res["first_saves_s"] = first
        res["blocking_s"] = stats(blocking)
        res["copy_complete_s"] = stats(copied)
        res["sealed_s"] = stats(sealed)
        res["background_cpu_s"] = stats(background)
        expected = [_local(t).detach().cpu() for t in _tensors(sd)]
        headers, why = node.headers()
        newest = headers[max(headers)] if headers else None
        train_step(samples + 3)
        sd = state()
        if newest is None:
            res["bitwise_equal"] = False
            res["why"] = why
        else:
            node.load(newest, sd)
            got = [_local(t).detach().cpu() for t in _tensors(sd)]
            res["bitwise_equal"] = len(got) == len(expected) and all(
                a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got, expected, strict=True)
            )
    finally:
        node.close()
        shutil.rmtree(root, ignore_errors=True)
    return res


def part_ckpt(out: Path, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    deadline = time.monotonic() + args.budget_s
    result: dict[str, Any] = {"samples": args.samples, "models": {}}
    root = _scratch(args, "ckpt")
    try:
        for name in args.models:
            if time.monotonic() > deadline:
                result["models"][name] = {"skipped": "deadline"}
                continue
            try:
                result["models"][name] = bench_model(name, root, args.samples, deadline)
            except Exception as e:  # keep the other size's numbers
                import traceback

                result["models"][name] = {"error": repr(e), "trace": traceback.format_exc()[-3000:]}
                torch.cuda.empty_cache()
            write_json(out / "ckpt.json", result)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    write_json(out / "ckpt.json", result)
    return result


# -- part c: fault drills ------------------------------------------------------------------------
def drill_runs(modes: list[str]) -> dict[str, tuple[str, str | None]]:
    """Run name -> (mode, fault): every drill once per mode; deterministic runs are 'det_*'."""
    return {
        (name if mode == "default" else f"det_{name}"): (mode, inject)
        for mode in modes
        for name, inject in DRILLS.items()
    }


def _drill_start(
    name: str, mode: str, inject: str | None, root: Path, data: Path, port: int, args: Any
) -> dict[str, Any]:
    run_root = root / name
    cmd = drill_command(
        run_root,
        data,
        port,
        inject,
        model=args.drill_model,
        device=args.drill_device,
        deterministic=mode == "deterministic",
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    log_path = root / f"{name}.log"
    with open(log_path, "w") as log:
        p = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    return {
        "name": name,
        "mode": mode,
        "cmd": cmd,
        "proc": p,
        "t0": time.perf_counter(),
        "run_root": run_root,
        "log": log_path,
    }


def _drill_wait(started: dict[str, Any], timeout: float) -> dict[str, Any]:
    from trainer.rundir import read_events

    p = started["proc"]
    try:
        rc: int | None = p.wait(timeout=max(timeout, 0.1))
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, 9)  # ft_launcher, its workers and their checkpoint writers
        p.wait()
        rc = None
    wall = time.perf_counter() - started["t0"]
    cmd, run_root, log_path = started["cmd"], started["run_root"], started["log"]
    events = read_events(run_root)
    result_path = run_root / "result.json"
    result = json.loads(result_path.read_text()) if result_path.exists() else None
    ckpt_blocking = [
        e.ckpt_blocking_s for e in events if getattr(e, "ckpt_blocking_s", None) is not None
    ]
    return {
        "mode": started["mode"],
        "cmd": cmd,
        "rc": rc,
        "timed_out": rc is None,
        "wall_s": wall,
        "params_sha256": (result or {}).get("params_sha256"),
        "final_loss": (result or {}).get("final_loss"),
        "faults": [_json(e) for e in events if e.kind == "fault"],
        "restarts": [_json(e) for e in events if e.kind == "restart"],
        "recovered": [_json(e) for e in events if e.kind == "recovered"],
        "recovery_s": [getattr(e, "recovery_s", None) for e in events if e.kind == "recovered"],
        "ckpt_blocking_s": stats(ckpt_blocking),
        "checkpoints": [_json(e) for e in events if e.kind == "checkpoint"][-3:],
        "log_tail": log_path.read_text()[-3000:],
    }


def _json(e: Any) -> dict[str, Any]:
    """An event as the JSON object its line holds."""
    return e.model_dump(mode="json", exclude_unset=True)


def _compare_to_baselines(runs: dict[str, dict[str, Any]]) -> None:
    """Each run's parameters against the fault-free run of its own mode."""
    for run in runs.values():
        if "params_sha256" not in run:
            continue
        base_name = "baseline" if run["mode"] == "default" else "det_baseline"
        base = runs.get(base_name, {}).get("params_sha256")
        run["matches_baseline"] = base is not None and run["params_sha256"] == base


def part_drills(out: Path, args: argparse.Namespace) -> dict[str, Any]:
    deadline = time.monotonic() + args.budget_s
    root = _scratch(args, "drills")
    data = root / "data"
    made = _run(data_command(data, drill_vocab_size(args.drill_model)), 120)
    result: dict[str, Any] = {"data": made, "runs": {}}
    write_json(out / "drills.json", result)
    runs = drill_runs(args.drill_modes)
    result["parallel"] = args.drill_parallel
    ports: set[int] = set()
    while len(ports) < len(runs):  # distinct rendezvous ports for runs that overlap
        ports.add(free_port())
    try:
        pending = list(zip(runs.items(), sorted(ports), strict=True))
        while pending:
            batch = pending if args.drill_parallel else pending[:1]
            pending = pending[len(batch) :]
            started = []
            for (name, (mode, inject)), port in batch:
                if deadline - time.monotonic() < 20:
                    result["runs"][name] = {"mode": mode, "skipped": "deadline"}
                    continue
                started.append(_drill_start(name, mode, inject, root, data, port, args))
            for st in started:
                result["runs"][st["name"]] = _drill_wait(st, deadline - time.monotonic())
            _compare_to_baselines(result["runs"])
            write_json(out / "drills.json", result)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    write_json(out / "drills.json", result)
    return result


# -- summary -------------------------------------------------------------------------------------
def part_summary(out: Path, args: argparse.Namespace) -> dict[str, Any]:
    def load(name: str) -> Any:
        p = out / f"{name}.json"
        return json.loads(p.read_text()) if p.exists() else None

    rcs = {}
    for part in PARTS[:-1]:
        p = out / f"rc_{part}"
        rcs[part] = p.read_text().strip() if p.exists() else None
    env, ckpt, drills = load("env"), load("ckpt"), load("drills")
    summary: dict[str, Any] = {
        "part_rc": rcs,  # 124: killed by its timeout
        "env": None
        if env is None
        else {k: env.get(k) for k in ("torch", "torch_cuda", "nvrx", "device", "cuda_available")},
        "ckpt": None,
        "drills": None,
    }
    if ckpt is not None:
        summary["ckpt"] = {
            name: {
                k: m.get(k)
                for k in (
                    "params",
                    "state_gib",
                    "ours_vs_floor",
                    "ours_vs_sync_dcp",
                    "ours_plus_deferred_vs_floor",
                    "bitwise_equal",
                    "error",
                    "skipped",
                    "truncated",
                )
                if m.get(k) is not None
            }
            | {
                k: m[k].get("median")
                for k in ("ours_save_s", "floor_s", "sync_dcp_s", "ours_total_s")
                if isinstance(m.get(k), dict)
            }
            | {
                f"memory_{k}": (v.get("median") if isinstance(v, dict) else v)
                for k, v in (m.get("memory") or {}).items()
                if k in ("blocking_s", "copy_complete_s", "sealed_s", "background_cpu_s")
                or k in ("blocking_vs_floor", "bitwise_equal", "truncated")
            }
            for name, m in ckpt.get("models", {}).items()
        }
    if drills is not None:
        summary["drills"] = {
            name: {
                k: r.get(k)
                for k in ("rc", "timed_out", "matches_baseline", "recovery_s", "wall_s", "skipped")
                if k in r
            }
            for name, r in drills.get("runs", {}).items()
        }
        summary["drills_final_loss"] = {
            name: r.get("final_loss") for name, r in drills.get("runs", {}).items()
        }
    ok_ckpt = bool(ckpt) and all(
        m.get("bitwise_equal") is True and (m.get("memory") or {}).get("bitwise_equal") is True
        for m in ckpt.get("models", {}).values()
    )
    summary["ok"] = {"ckpt_bitwise": ok_ckpt}
    for mode in ("default", "deterministic"):
        of_mode = [r for r in (drills or {}).get("runs", {}).values() if r.get("mode") == mode]
        if of_mode:
            # bitwise recovery is only promised with deterministic kernels on CUDA
            summary["ok"][f"drills_{mode}_bitwise_and_rc0"] = all(
                r.get("rc") == 0 and r.get("matches_baseline") is True for r in of_mode
            )
    write_json(out / "summary.json", summary)
    return summary


# -- plan / main ---------------------------------------------------------------------------------
def plan(out: Path, args: argparse.Namespace) -> dict[str, Any]:
    models = {}
    for name in args.models:
        n = param_count(name)
        # fp32 parameters + AdamW exp_avg + exp_avg_sq: the bytes one save copies
        models[name] = {"workload": name, "params": n, "state_gib": 12 * n / GIB}
    root = Path(args.scratch or "$TMPDIR/nvrx-gpu-check") / "drills"
    return {
        "out": str(out),
        "parts": {
            "env": {"writes": "env.json"},
            "ckpt": {"writes": "ckpt.json", "models": models, "samples": args.samples},
            "drills": {
                "writes": "drills.json",
                "data": data_command(root / "data", drill_vocab_size(args.drill_model)),
                "parallel": args.drill_parallel,
                "runs": {
                    name: drill_command(
                        root / name,
                        root / "data",
                        0,
                        inject,
                        model=args.drill_model,
                        device=args.drill_device,
                        deterministic=mode == "deterministic",
                    )
                    for name, (mode, inject) in drill_runs(args.drill_modes).items()
                },
            },
            "summary": {"writes": "summary.json"},
        },
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--part", choices=PARTS, action="append", help="default: all, in order")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    p.add_argument("--samples", type=int, default=3)
    p.add_argument("--budget-s", type=float, default=150.0, help="soft deadline of one part")
    p.add_argument("--scratch", help="scratch directory (default: $TMPDIR/nvrx-gpu-check)")
    p.add_argument("--keep", action="store_true", help="keep the drill run directories")
    p.add_argument("--dry-run", action="store_true", help="print the plan as JSON, run nothing")
    # the drills' plumbing on a CPU machine: --drill-device cpu --drill-model tiny
    p.add_argument("--drill-model", default="100m")
    p.add_argument("--drill-device", default="cuda")
    p.add_argument(
        "--drill-modes",
        nargs="+",
        default=["default", "deterministic"],
        choices=["default", "deterministic"],
        help="kernels of the drills: as they come, and deterministic (--deterministic)",
    )
    p.add_argument(
        "--drill-parallel",
        action="store_true",
        help="start every drill at once (one GPU holds them all; timings are then contended)",
    )
    args = p.parse_args(argv)
    if args.dry_run:
        print(json.dumps(plan(args.out, args), indent=2, default=str))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    funcs = {"env": part_env, "ckpt": part_ckpt, "drills": part_drills, "summary": part_summary}
    for part in args.part or PARTS:
        t0 = time.perf_counter()
        res = funcs[part](args.out, args)
        print(f"{part}: done in {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
        if part == "summary":
            print(json.dumps(res, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
