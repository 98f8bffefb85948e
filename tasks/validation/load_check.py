"""Load a checkpoint on CPU in a fresh process, world size 1 (resharding whatever world wrote it),
and report on it as JSON: every tensor finite, the parameters' digest, and optionally the loss on a
held-out batch (the batch of the step *after* the checkpoint, which it has not trained on).

    python -m tasks.validation.load_check CKPT_DIR --model tiny [--data-dir D --global-batch N
        --seed S]

Runs in its own process so that a corrupt checkpoint cannot take the caller down, and so that the
load sees no state of the writer (a fresh interpreter is what a resuming job has).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any


def load_and_inspect(
    path: Path,
    model_name: str,
    *,
    data_dir: Path | None,
    global_batch: int,
    seed: int,
    step: int,
    safetensors_out: Path | None = None,
) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from trainer.config import model_config
    from trainer.digest import tensor_dict_sha256
    from trainer.model import GPT

    torch.set_num_threads(1)
    cfg = model_config(model_name)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        model = GPT(cfg)
        optim = torch.optim.AdamW(model.parameters())
        model_sd, optim_sd = get_state_dict(model, optim)
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))
        model.load_state_dict(model_sd)
        nonfinite = [
            name
            for name, t in _tensors({"model": model_sd, "optim": optim_sd})
            if t.is_floating_point() and not bool(torch.isfinite(t).all())
        ]
        out: dict[str, Any] = {
            "loaded": True,
            "tensors": sum(1 for _ in _tensors({"model": model_sd, "optim": optim_sd})),
            "nonfinite": nonfinite[:20],
            "params_sha256": tensor_dict_sha256(model.state_dict()),
            "heldout_loss": None,
        }
        if safetensors_out is not None:
            out["safetensors"] = _write_safetensors(
                model, safetensors_out, step=step, digest=out["params_sha256"]
            )
        if data_dir is not None:
            from trainer.data import StepSampler

            sampler = StepSampler(
                data_dir, seq_len=cfg.seq_len, global_batch=global_batch, seed=seed, verify=False
            )
            x, y = sampler.batch(step + 1, 0, 1)
            model.eval()
            with torch.no_grad():
                loss = model(torch.from_numpy(x), torch.from_numpy(y))
            out["heldout_loss"] = float(loss) if math.isfinite(float(loss)) else None
        return out
    finally:
        dist.destroy_process_group()


def _write_safetensors(model: Any, out: Path, *, step: int, digest: str) -> dict[str, Any]:
    """The full model weights in one safetensors file, for inference users."""
    from safetensors.torch import save_file

    from trainer.hashing import sha256_file

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, str(tmp), metadata={"step": str(step), "params_sha256": digest})
    os.replace(tmp, out)
    return {"path": str(out), "bytes": out.stat().st_size, "sha256": sha256_file(out)}


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
    p.add_argument("--model", required=True)
    p.add_argument("--step", type=int, required=True)
    p.add_argument("--data-dir", type=Path)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--safetensors", type=Path, help="also write the full weights here")
    args = p.parse_args(argv)
    try:
        out = load_and_inspect(
            args.path,
            args.model,
            data_dir=args.data_dir,
            global_batch=args.global_batch,
            seed=args.seed,
            step=args.step,
            safetensors_out=args.safetensors,
        )
    except Exception as e:
        out = {"loaded": False, "error": f"{type(e).__name__}: {e}"[:2000]}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
