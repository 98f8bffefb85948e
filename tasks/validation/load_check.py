"""Load a checkpoint on CPU in a fresh process, world size 1 (resharding whatever world wrote it),
and report on it as JSON: every tensor finite, the parameters' digest, and optionally the loss on
a held-out batch (the batch of the step *after* the checkpoint, which it has not trained on).

    python -m tasks.validation.load_check CKPT_DIR [--workload REF --workload-options JSON]
        [--data-dir D] [--safetensors FILE] [--pretrained DIR]

Its own process, so a corrupt checkpoint cannot take the caller down and the load sees no state
of the writer (a fresh interpreter is what a resuming job has).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from tasks.validation.load_report import LoadReport, Pretrained, Safetensors, WrittenFile
from trainer.checkpointing.manifest import Manifest, WorkloadRef


def load_and_inspect(
    path: Path,
    *,
    workload: WorkloadRef | None = None,
    data_dir: Path | None = None,
    safetensors_out: Path | None = None,
    pretrained_out: Path | None = None,
) -> LoadReport:
    """``workload``: overrides what the checkpoint's manifest says
    produced it (its workload, optimizer settings, batch and seed come from the manifest)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from trainer import checkpointing
    from trainer.digest import tensor_dict_sha256
    from trainer.untrusted import dcp_load_args
    from trainer.workload import OptimSettings

    torch.set_num_threads(1)
    man = checkpointing.read_manifest(path)
    verify_before_loading(path, man)
    wl = _workload(path, man, workload)
    cfg = man.config
    # Its own port, whatever MASTER_PORT the caller's environment carries (it may be in use).
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1
    )
    try:
        torch.manual_seed(0)
        model = wl.build_model("cpu")
        optim = wl.build_optimizer(
            model,
            OptimSettings(lr=cfg.get("lr", 1e-3), weight_decay=cfg.get("weight_decay", 0.0)),
        )
        model_sd, optim_sd = get_state_dict(model, optim)
        # Restricted: .metadata through an allowlist unpickler, shard entries weights_only.
        dcp.load({"model": model_sd, "optim": optim_sd}, **dcp_load_args(path))
        model.load_state_dict(model_sd)
        nonfinite = [
            name
            for name, t in _tensors({"model": model_sd, "optim": optim_sd})
            if t.is_floating_point() and not bool(torch.isfinite(t).all())
        ]
        digest = tensor_dict_sha256(model.state_dict())
        return LoadReport(
            loaded=True,
            tensors=sum(1 for _ in _tensors({"model": model_sd, "optim": optim_sd})),
            nonfinite=nonfinite[:20],
            params_sha256=digest,
            heldout_loss=(None if data_dir is None else _heldout_loss(wl, model, man, data_dir)),
            safetensors=(
                None
                if safetensors_out is None
                else _write_safetensors(model, safetensors_out, step=man.step, digest=digest)
            ),
            pretrained=(
                None if pretrained_out is None else _write_pretrained(wl, model, pretrained_out)
            ),
        )
    finally:
        dist.destroy_process_group()


def _workload(path: Path, man: Manifest, workload: WorkloadRef | None) -> Any:
    """The workload to rebuild the model with: the one asked for, else the manifest's if a
    file may name it (a file on the shared filesystem does not choose what code runs)."""
    from tasks.validation.files import untrusted_workload_message
    from trainer.workload import load_workload, safe_to_name_from_file

    chosen = workload or man.workload
    if chosen is None:
        raise ValueError(f"{path}: the manifest does not say which workload wrote it; name one")
    if workload is None and not safe_to_name_from_file(chosen.ref):
        raise ValueError(untrusted_workload_message(path, chosen.ref))
    options = dict(chosen.options)
    options.pop("init_weights", None)  # the checkpoint's weights replace them anyway
    return load_workload(chosen.ref, options)


def _heldout_loss(wl: Any, model: Any, man: Manifest, data_dir: Path) -> float | None:
    """The loss on the batch of the step after the checkpoint's, which it has not trained on."""
    import torch

    from trainer.workload import DataSettings

    source = wl.data_source(
        DataSettings(
            data_dir=data_dir,
            seq_len=wl.seq_len,
            global_batch=int(man.config.get("global_batch", 8)),
            seed=int(man.config.get("seed", 1234)),
            verify=False,
        )
    )
    x, y = source.batch(man.step + 1, 0, 1)
    model.eval()
    with torch.no_grad():
        loss = wl.loss(model, torch.from_numpy(x), torch.from_numpy(y))
    return float(loss) if math.isfinite(float(loss)) else None


def verify_before_loading(path: Path, man: Manifest) -> None:
    """Loading unpickles ``.metadata`` and the shards' non-tensor entries: only files whose size
    and digest the manifest vouches for, and only files it lists, are read (arch §6). Raises
    :class:`UnsafeCheckpointError` naming the files. (The manifest is not signed: this stops
    corruption and half-done tampering; the restricted unpickler stops a forged pair.)"""
    from tasks.validation.files import hash_files
    from trainer.untrusted import METADATA, UnsafeCheckpointError, load_dcp_metadata

    listed = {e.name: e for e in man.files}
    if METADATA not in listed:
        raise UnsafeCheckpointError(f"{path}: {METADATA} is not in its manifest: not loaded")
    sizes = {n: e.bytes for n, e in listed.items()}
    got, _ = hash_files(path, sorted(listed), man.digest, limits=sizes)
    bad = sorted(n for n, e in listed.items() if got.get(n) != e)
    if bad:
        raise UnsafeCheckpointError(
            f"{path}: {', '.join(bad)} missing or not matching the manifest (size or "
            f"{man.digest}): not loaded"
        )
    md = load_dcp_metadata(path)
    unlisted = sorted({i.relative_path for i in md.storage_data.values()} - set(listed))
    if unlisted:
        raise UnsafeCheckpointError(
            f"{path / METADATA} reads {unlisted}, which the manifest does not list: not loaded"
        )


def _write_safetensors(model: Any, out: Path, *, step: int, digest: str) -> Safetensors:
    """The full model weights in one safetensors file, for inference users."""
    from safetensors.torch import save_file

    from trainer.hashing import sha256_file
    from trainer.run_files import create_temp

    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = create_temp(out)  # save_file reopens the name: ours, and no one can predict it
    os.close(fd)
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, str(tmp), metadata={"step": str(step), "params_sha256": digest})
    os.replace(tmp, out)
    return Safetensors(path=str(out), bytes=out.stat().st_size, sha256=sha256_file(out))


def _write_pretrained(wl: Any, model: Any, out: Path) -> Pretrained | None:
    """The workload's own self-contained layout (Hugging Face for Llama): every file with its
    size and sha256, or None when the workload has none."""
    import shutil
    import tempfile

    from trainer.hashing import sha256_file

    # A new directory of an unpredictable name: a fixed one was emptied and reused, a link
    # planted there followed.
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp"))
    os.chmod(tmp, 0o755)
    if not wl.export_pretrained(model, tmp):
        shutil.rmtree(tmp)
        return None
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    files = sorted(p for p in out.rglob("*") if p.is_file())
    return Pretrained(
        path=str(out),
        files=[
            WrittenFile(name=str(p.relative_to(out)), bytes=p.stat().st_size, sha256=sha256_file(p))
            for p in files
        ],
    )


def _tensors(obj: Any, prefix: str = "") -> Any:
    import torch

    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{prefix}.{i}")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tasks.validation.load_check")
    p.add_argument("path", type=Path)
    p.add_argument("--workload", help="override the manifest's workload")
    p.add_argument("--workload-options", type=json.loads, default={})
    p.add_argument("--data-dir", type=Path, help="enables the held-out loss")
    p.add_argument("--safetensors", type=Path, help="also write the full weights here")
    p.add_argument("--pretrained", type=Path, help="also write the workload's own layout here")
    args = p.parse_args(argv)
    try:
        out = load_and_inspect(
            args.path,
            workload=None
            if args.workload is None
            else WorkloadRef(args.workload, args.workload_options),
            data_dir=args.data_dir,
            safetensors_out=args.safetensors,
            pretrained_out=args.pretrained,
        )
    except Exception as e:
        out = LoadReport.failed(f"{type(e).__name__}: {e}")
    print(out.model_dump_json())
    return 0


# The arguments line (paths, a workload reference and its options): bounded like any input.
MAX_ARGS_LINE = 1 << 20


def _preload() -> None:
    """What every load imports, before the arguments are known (tasks.validation.load_process):
    the interpreter's start-up is then off the caller's critical path."""
    import torch.distributed.checkpoint
    import torch.distributed.checkpoint.state_dict  # noqa: F401

    import trainer.untrusted
    import trainer.workload  # noqa: F401


def stdin_main() -> int:
    """``--stdin``: import first, then read the arguments as one JSON list of strings on stdin
    (end-of-file, the caller gone: exit without loading)."""
    _preload()
    line = sys.stdin.readline(MAX_ARGS_LINE)
    if not line:
        return 0
    args = json.loads(line)
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        print(LoadReport.failed("arguments: not a JSON list of strings").model_dump_json())
        return 2
    return main(args)


if __name__ == "__main__":
    sys.exit(stdin_main() if sys.argv[1:] == ["--stdin"] else main())
